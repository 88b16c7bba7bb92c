"""Transformer-test helpers: tiny test-local layers, tiny models, and a training loop on a mesh.

The layers are minimal but complete: ToySelfAttention masks by the context's read/write
priorities and sequence ids and records key/value states in "first_part"/"incremental" modes
the way decoding expects, so stacks, models and decoding can be tested on their own.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import attention, transformer
from tests.harness import cpu_devices, session_config

HEADS, D_KV, D_FF = 4, 4, 16
# 2x4 mesh: data parallel over rows, heads / d_ff / vocab split over cols.
MESH_2X4 = "rows:2;cols:4"
LAYOUT_2X4 = "batch:rows;heads:cols;d_ff:cols;vocab:cols"


def _visibility_bias(visible, context):
  return attention.visibility_mask_to_attention_bias(visible, context.activation_dtype)


class ToySelfAttention(transformer.TransformerLayer):
  """Multi-head self-attention with q/k/v/o from attention.attention_params_simple."""

  def call(self, context, x):
    heads, kv = mtf.Dimension("heads", HEADS), mtf.Dimension("d_kv", D_KV)
    params = attention.attention_params_simple(context.mesh, context.model.model_dim, kv, heads,
                                               context.variable_dtype)
    memory_length = mtf.Dimension("memory_length", context.length_dim.size)
    q, k, v = params.compute_q(x), params.compute_k(x), params.compute_v(x)
    if context.mode == "incremental":
      one_hot = mtf.one_hot(context.position, memory_length, dtype=x.dtype)
      k, v = [old * (1. - one_hot) + new * one_hot for old, new in zip(context.get_states(2), [k, v])]
      memory_position = mtf.range(context.mesh, memory_length, tf.int32)
    else:
      k, v = [mtf.rename_dimension(t, "length", "memory_length") for t in (k, v)]
      memory_position = mtf.rename_dimension(context.position, "length", "memory_length")
    if context.mode in ("incremental", "first_part"):
      context.record_new_states([k, v])
    bias = None
    if context.read_priority is not None:
      write = (memory_position if context.mode == "incremental"
               else mtf.rename_dimension(context.write_priority, "length", "memory_length"))
      bias = _visibility_bias(mtf.greater_equal(context.read_priority, write), context)
    if isinstance(context.sequence_id, mtf.Tensor):
      memory_id = mtf.rename_dimension(context.sequence_id, "length", "memory_length")
      same = mtf.equal(context.sequence_id, memory_id)
      bias = _visibility_bias(same, context) if bias is None else bias + _visibility_bias(same, context)
    o = attention.attention(q, k, v, memory_length, kv, kv, bias=bias, context=context)
    return params.compute_output(o, x.shape)


class ToyEncDecAttention(transformer.TransformerLayer):
  """Attention of the decoder to context.encoder_output, masked by encoder_sequence_id."""

  def call(self, context, x):
    heads, kv = mtf.Dimension("heads", HEADS), mtf.Dimension("d_kv", D_KV)
    params = attention.attention_params_simple(context.mesh, context.model.model_dim, kv, heads,
                                               context.variable_dtype)
    memory = context.encoder_output
    bias = None
    if isinstance(context.encoder_sequence_id, mtf.Tensor):
      bias = _visibility_bias(mtf.not_equal(context.encoder_sequence_id, 0), context)
    o = attention.attention(params.compute_q(x), params.compute_k(memory), params.compute_v(memory),
                            context.encoder_length_dim, kv, kv, bias=bias, context=context)
    return params.compute_output(o, x.shape)


class ToyFeedForward(transformer.TransformerLayer):
  """relu(x wi) wo with a d_ff hidden dimension."""

  def call(self, context, x):
    d_ff = mtf.Dimension("d_ff", D_FF)
    h = mtf.layers.dense(x, d_ff, reduced_dims=x.shape.dims[-1:], activation=mtf.relu, use_bias=False,
                         variable_dtype=context.variable_dtype, name="wi")
    return mtf.layers.dense(h, x.shape.dims[-1], reduced_dims=[d_ff], use_bias=False,
                            variable_dtype=context.variable_dtype, name="wo")


def lm(vocab=12, max_length=8, num_layers=2, d_model=8, **kwargs) -> transformer.Unitransformer:
  """A tiny autoregressive Unitransformer (no dropout)."""
  stack = transformer.make_layer_stack([ToySelfAttention, ToyFeedForward], num_layers=num_layers)
  return transformer.Unitransformer(layer_stack=stack, d_model=d_model, input_vocab_size=vocab,
                                    output_vocab_size=vocab, autoregressive=True, max_length=max_length,
                                    vocab_divisor=4, **kwargs)


def bitransformer(vocab=12, max_length=8, d_model=8, **kwargs) -> transformer.Bitransformer:
  encoder = transformer.Unitransformer(
      layer_stack=transformer.make_layer_stack([ToySelfAttention, ToyFeedForward], num_layers=1),
      d_model=d_model, input_vocab_size=vocab, output_vocab_size=None, autoregressive=False,
      max_length=max_length, vocab_divisor=4, name="encoder")
  decoder = transformer.Unitransformer(
      layer_stack=transformer.make_layer_stack([ToySelfAttention, ToyEncDecAttention, ToyFeedForward],
                                               num_layers=1),
      d_model=d_model, input_vocab_size=vocab, output_vocab_size=vocab, autoregressive=True,
      max_length=max_length, vocab_divisor=4, name="decoder")
  return transformer.Bitransformer(encoder, decoder, **kwargs)


def import_ids(mesh, ids: np.ndarray, dim_names=("batch", "length")) -> mtf.Tensor:
  dims = [mtf.Dimension(n, s) for n, s in zip(dim_names, ids.shape)]
  return mtf.import_tf_tensor(mesh, tf.constant(ids.astype(np.int32)), dims)


def train_losses(build_loss: Callable, steps: int, mesh_shape=MESH_2X4, layout=LAYOUT_2X4,
                 learning_rate=0.1) -> np.ndarray:
  """Graph mode: `steps` Adafactor steps on `build_loss(mesh) -> scalar loss`; the loss per step."""
  mesh_shape = mtf.convert_to_shape(mesh_shape)
  with tf.Graph().as_default():
    tf.set_random_seed(0)
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    loss = build_loss(mesh)
    variables = graph.trainable_variables
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    optimizer = mtf.optimize.AdafactorOptimizer(learning_rate=learning_rate)
    update_ops = optimizer.apply_grads(grads, variables)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, cpu_devices(mesh_shape.size))
    lowering = mtf.Lowering(graph, {mesh: impl})
    tf_loss = lowering.export_to_tf_tensor(loss)
    global_step = tf.train.get_or_create_global_step()
    with tf.control_dependencies([lowering.lowered_operation(op) for op in update_ops]):
      train_op = tf.assign_add(global_step, 1)
    init_ops = [tf.global_variables_initializer(), lowering.copy_masters_to_slices()]
    config = session_config()
    config.graph_options.rewrite_options.disable_meta_optimizer = True  # grappler: slow, no gain here
    with tf.Session(config=config) as sess:
      for op in init_ops:
        sess.run(op)
      return np.array([sess.run([tf_loss, train_op])[0] for _ in range(steps)])
