"""Transformer-test helpers: tiny models from transformer_layers, ids import, a training loop on a mesh."""

from __future__ import annotations

import contextlib
from typing import Callable

import gin
import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer, transformer_layers
from tests.harness import cpu_devices, session_config

HEADS, D_KV, D_FF = 4, 4, 16
# 2x4 mesh: data parallel over rows, heads / d_ff / vocab split over cols.
MESH_2X4 = "rows:2;cols:4"
LAYOUT_2X4 = "batch:rows;heads:cols;d_ff:cols;vocab:cols"

SELF_ATTENTION = (transformer_layers.SelfAttention, {"num_heads": HEADS, "key_value_size": D_KV})
ENC_DEC_ATTENTION = (transformer_layers.EncDecAttention, {"num_heads": HEADS, "key_value_size": D_KV})
FEED_FORWARD = (transformer_layers.DenseReluDense, {"hidden_size": D_FF})


def lm(vocab=12, max_length=8, num_layers=2, d_model=8, **kwargs) -> transformer.Unitransformer:
  """A tiny autoregressive Unitransformer (no dropout)."""
  stack = transformer.make_layer_stack([SELF_ATTENTION, FEED_FORWARD], num_layers=num_layers)
  return transformer.Unitransformer(layer_stack=stack, d_model=d_model, input_vocab_size=vocab,
                                    output_vocab_size=vocab, autoregressive=True, max_length=max_length,
                                    vocab_divisor=4, **kwargs)


def bitransformer(vocab=12, max_length=8, d_model=8, **kwargs) -> transformer.Bitransformer:
  encoder = transformer.Unitransformer(
      layer_stack=transformer.make_layer_stack([SELF_ATTENTION, FEED_FORWARD], num_layers=1),
      d_model=d_model, input_vocab_size=vocab, output_vocab_size=None, autoregressive=False,
      max_length=max_length, vocab_divisor=4, name="encoder")
  decoder = transformer.Unitransformer(
      layer_stack=transformer.make_layer_stack([SELF_ATTENTION, ENC_DEC_ATTENTION, FEED_FORWARD],
                                               num_layers=1),
      d_model=d_model, input_vocab_size=vocab, output_vocab_size=vocab, autoregressive=True,
      max_length=max_length, vocab_divisor=4, name="decoder")
  return transformer.Bitransformer(encoder, decoder, **kwargs)


@contextlib.contextmanager
def gin_config(bindings):
  """Gin bindings (a string or a list of lines) on a clean config for the body, cleared after it."""
  gin.clear_config()
  with gin.unlock_config():
    gin.parse_config(bindings)
  try:
    yield
  finally:
    gin.clear_config()


def named_layer_stack(layers: list) -> transformer.LayerStack:
  """A LayerStack of these layer instances, named layer_000, layer_001, ... as make_layer_stack names them."""
  for i, layer in enumerate(layers):
    layer.set_name("layer_%03d" % i)
  return transformer.LayerStack(layers)


def greedy_decode_and_argmax(model: transformer.Unitransformer, partial: mtf.Tensor, variable_dtype,
                             **sample_kwargs) -> list:
  """[greedy decode from `partial`, argmax of a full eval pass over that decode].

  Where incremental decoding agrees with the full pass, each decoded position is the argmax the
  full pass gives at the position before it.
  """
  decoded = model.sample_autoregressive(partial, temperature=0.0, variable_dtype=variable_dtype,
                                        **sample_kwargs)
  logits, _ = model.call_simple(transformer.autoregressive_inputs(decoded), None, False, mode="eval",
                                variable_dtype=variable_dtype)
  return [decoded, mtf.argmax(logits, logits.shape.dims[-1])]


def import_ids(mesh, ids: np.ndarray, dim_names=("batch", "length")) -> mtf.Tensor:
  dims = [mtf.Dimension(n, s) for n, s in zip(dim_names, ids.shape)]
  return mtf.import_tf_tensor(mesh, tf.constant(ids.astype(np.int32)), dims)


def train_losses(build_loss: Callable, steps: int, mesh_shape=MESH_2X4, layout=LAYOUT_2X4,
                 learning_rate=1.0) -> np.ndarray:
  """Graph mode: `steps` SGD steps on `build_loss(mesh) -> scalar loss`; the loss per step.

  (SGD keeps the lowered graph small: Adafactor's extra ops triple the lowering time.)
  """
  mesh_shape = mtf.convert_to_shape(mesh_shape)
  with tf.Graph().as_default():
    tf.set_random_seed(0)
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    loss = build_loss(mesh)
    variables = graph.trainable_variables
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    update_ops = mtf.optimize.SgdOptimizer(learning_rate).apply_grads(grads, variables)
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
