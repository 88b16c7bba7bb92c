"""The memory estimate's variable bytes equal what a real lowering allocates on each of 8 CPUs."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow import cost_model
from mesh_tensorflow._cost.flops import per_processor_elements
from mesh_tensorflow._explain.transformer_graph import build_transformer_graph
from tests.harness import cpu_devices

LAYOUTS = [  # data parallel, model parallel, two 2-D layouts, and weights split on both mesh axes
  ("all:8", "batch:all"),
  ("all:8", "d_ff:all"),
  ("b:2;m:4", "batch:b;d_ff:m"),
  ("b:4;m:2", "batch:b;d_model:m"),
  ("b:2;m:4", "vocab:b;d_ff:m"),
]


def _adafactor():  # factors every matrix: a row and a column slot instead of a full one
  return mtf.optimize.AdafactorOptimizer(learning_rate=0.01, decay_rate=0.8, min_dim_size_to_factor=4)


def _adam():  # two full float32 slots per variable
  return mtf.optimize.AdamWeightDecayOptimizer(learning_rate=0.01)


def _training_graph(make_optimizer, slice_dtype=tf.float32):
  """An embedding, a norm scale and a two-layer MLP with their optimizer's updates, in a fresh TF graph."""
  tf_graph = tf.Graph()
  with tf_graph.as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    dtype = mtf.VariableDType(tf.float32, slice_dtype, tf.float32)
    batch, vocab = mtf.Dimension("batch", 8), mtf.Dimension("vocab", 32)
    d_model, d_ff = mtf.Dimension("d_model", 16), mtf.Dimension("d_ff", 32)
    ids = mtf.import_tf_tensor(mesh, tf.constant(np.arange(8, dtype=np.int32)), [batch])
    x = mtf.gather(mtf.get_variable(mesh, "embedding", [vocab, d_model], dtype=dtype), ids, vocab)
    x *= mtf.get_variable(mesh, "scale", [d_model], initializer=tf.ones_initializer(), dtype=dtype)
    h = mtf.layers.dense(
      x, d_ff, reduced_dims=[d_model], activation=mtf.relu, name="wi", variable_dtype=dtype
    )
    y = mtf.layers.dense(h, vocab, reduced_dims=[d_ff], name="wo", variable_dtype=dtype)
    loss = mtf.reduce_mean(mtf.square(y))
    variables = graph.trainable_variables
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    make_optimizer().apply_grads(grads, variables)
  return tf_graph, graph, loss


def _lowered_variable_bytes(tf_graph, graph, mesh_shape, layout) -> list:
  """Bytes of the TF slice variables each processor's device holds after a real placement lowering.

  The whole master variables (what checkpoints hold) live on the master device, the host, which
  here is also processor 0's CPU; they are not on an accelerator and are left out.
  """
  devices = cpu_devices(8)
  with tf_graph.as_default():  # the graph's inputs are constants of this TF graph
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, devices, share_replicas=False)
    mtf.Lowering(graph, {graph.operations[0].mesh: impl})
    per_device = collections.Counter()
    for op in tf_graph.get_operations():
      if op.type in ("VarHandleOp", "VariableV2") and "_slice_" in op.name:
        shape = tf.TensorShape(op.get_attr("shape")).as_list()
        per_device[op.device] += int(np.prod(shape)) * tf.as_dtype(op.get_attr("dtype")).size
  return [per_device[tf.DeviceSpec.from_string(d).to_string()] for d in devices]


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_variable_and_slot_bytes_equal_the_real_lowerings_on_every_processor(mesh_shape, layout):
  tf_graph, graph, loss = _training_graph(_adafactor)
  slots = {v.name for v in graph.all_variables if not v.trainable}
  assert {"wi/kernel_slot_vr", "wi/kernel_slot_vc"} <= slots and "wi/kernel_slot_v" not in slots
  memory = cost_model.estimate_memory(graph, mesh_shape, layout, [loss])
  # The lowering stacks variables (autostack), so it runs after the estimate.
  real = _lowered_variable_bytes(tf_graph, graph, mesh_shape, layout)
  assert real == [memory.variable_bytes + memory.slot_bytes] * 8


def test_adam_keeps_two_full_float32_slots_and_bfloat16_slices_take_two_bytes():
  tf_graph, graph, loss = _training_graph(_adam, slice_dtype=tf.bfloat16)
  memory = cost_model.estimate_memory(graph, "b:2;m:4", "batch:b;d_ff:m", [loss])
  assert (
    _lowered_variable_bytes(tf_graph, graph, "b:2;m:4", "batch:b;d_ff:m")
    == [memory.variable_bytes + memory.slot_bytes] * 8
  )
  mesh, rules = mtf.convert_to_shape("b:2;m:4"), mtf.convert_to_layout_rules("batch:b;d_ff:m")
  parameters = sum(
    per_processor_elements(v.outputs[0].shape.dims, mesh, rules) for v in graph.trainable_variables
  )
  assert memory.variable_bytes == 2 * parameters
  assert memory.slot_bytes == 2 * 4 * parameters  # adam_m and adam_v, float32


def test_rematerialisation_lowers_the_activation_peak_and_nothing_else():
  def memory(remat: bool):
    with tf.Graph().as_default():
      graph, loss = build_transformer_graph(
        ["models/lm_base.gin"],
        ["num_layers = 3", "d_model = 16", "d_ff = 64", "d_kv = 8", "num_heads = 2"]
        + ([f"LayerStack.recompute_grads = {remat}"]),
        batch=8,
        length=16,
        vocab_size=32,
      )
    return cost_model.estimate_memory(graph, "b:2;m:4", "batch:b;d_ff:m", [loss])

  kept, recomputed = memory(False), memory(True)
  assert recomputed.remat and not kept.remat
  assert recomputed.variable_bytes == kept.variable_bytes and recomputed.slot_bytes == kept.slot_bytes
  assert recomputed.activation_peak_bytes < kept.activation_peak_bytes
