"""mtf.dry_run at pod scale: its results per processor and its cost do not depend on the processor count.

A Transformer's training step laid out "batch:batch;d_ff:model;heads:model;vocab:model" on 2 x 4
processors with batch 4 does, per processor, the same work as on 128 x 4 with batch 256: the
slice shapes, the bytes of variables and activations, the FLOPs and the model-parallel
collectives are the same; only the data-parallel allreduces change, as their group does. The fast
shape-only lowering also records exactly what a real lowering on 8 CPU devices records.
"""

from __future__ import annotations

import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._backends.shape_only import ShapeOnlyMeshImpl
from mesh_tensorflow._cost import flops as flops_lib
from mesh_tensorflow._explain.transformer_graph import build_transformer_graph
from mesh_tensorflow._lowering import dry_run as dry_run_lib
from tests.harness import cpu_devices

LAYOUT = "batch:batch;d_ff:model;heads:model;vocab:model"
MODEL = ["num_layers = 2", "d_model = 32", "d_ff = 64", "d_kv = 4", "num_heads = 4"]


def _graph(batch: int, num_layers: int = 2, tf_graph=None):
  bindings = MODEL + [f"num_layers = {num_layers}"]
  return build_transformer_graph(["models/lm_base.gin"], bindings, batch=batch, length=8, vocab_size=32,
                                 tf_graph=tf_graph)


def _tf_ops_built(graph, mesh_shape) -> int:
  """TF ops the shape-only lowering builds (its cost: the Python around them is per mtf op)."""
  impl = ShapeOnlyMeshImpl(mtf.convert_to_shape(mesh_shape), mtf.convert_to_layout_rules(LAYOUT))
  with tf.Graph().as_default() as tf_graph:
    dry_run_lib._shape_only_lowering_class()(graph, {graph.operations[0].mesh: impl}, autostack=False)
  return len(tf_graph.get_operations())


def test_per_processor_results_at_512_processors_equal_those_at_8():
  small_graph, _ = _graph(batch=4)
  small = mtf.dry_run(small_graph, "batch:2;model:4", LAYOUT)
  large_graph, _ = _graph(batch=256)
  large = mtf.dry_run(large_graph, "batch:128;model:4", LAYOUT)

  assert (large.variable_bytes, large.slot_bytes, large.activation_bytes) == (
      small.variable_bytes, small.slot_bytes, small.activation_bytes)
  assert small.variable_bytes > 0 and small.activation_bytes > 0
  small_impl, large_impl = (ShapeOnlyMeshImpl(m, LAYOUT) for m in ("batch:2;model:4", "batch:128;model:4"))
  small_slices = [small_impl.slice_shape(t.shape) for op in small_graph.operations for t in op.outputs]
  large_slices = [large_impl.slice_shape(t.shape) for op in large_graph.operations for t in op.outputs]
  assert large_slices == small_slices and [2, 8, 32] in small_slices  # [batch, length, d_model]
  small_flops = [flops_lib.op_flops(op, mtf.convert_to_shape("batch:2;model:4"),
                                    mtf.convert_to_layout_rules(LAYOUT)) for op in small_graph.operations]
  large_flops = [flops_lib.op_flops(op, mtf.convert_to_shape("batch:128;model:4"),
                                    mtf.convert_to_layout_rules(LAYOUT)) for op in large_graph.operations]
  assert large_flops == small_flops and sum(small_flops) > 0

  assert len(large.events) == len(small.events) > 0
  model_parallel = data_parallel = 0
  for s, g in zip(small.events, large.events):
    assert (g.kind, g.mesh_axes, g.slice_shape, g.dtype, g.op_name, g.reason) == (
        s.kind, s.mesh_axes, s.slice_shape, s.dtype, s.op_name, s.reason)
    assert g.num_processors == 512 and s.num_processors == 8
    if 0 in s.mesh_axes:  # over "batch": the group grows from 2 to 128 processors
      assert s.kind == "allreduce" and (s.group_size, g.group_size) == (2 * 4 ** (len(s.mesh_axes) - 1),
                                                                         128 * 4 ** (len(s.mesh_axes) - 1))
      slice_bytes = s.bytes_per_processor * s.group_size / (2 * (s.group_size - 1))
      assert g.bytes_per_processor == pytest.approx(2 * (g.group_size - 1) / g.group_size * slice_bytes)
      data_parallel += 1
    else:  # over "model" only: the same group, the same bytes per processor
      assert g.group_size == s.group_size == 4
      assert g.bytes_per_processor == s.bytes_per_processor
      model_parallel += 1
  assert model_parallel and data_parallel


def test_the_tf_ops_a_dry_run_builds_do_not_grow_with_processors_or_repeated_layers():
  # 3 examples per processor row at every size (a size no other dimension has).
  at_8 = _tf_ops_built(_graph(batch=3 * 2)[0], "batch:2;model:4")
  assert at_8 > 0
  assert _tf_ops_built(_graph(batch=3 * 128)[0], "batch:128;model:4") == at_8
  assert _tf_ops_built(_graph(batch=3 * 1024)[0], "batch:1024;model:4") == at_8
  deeper = _graph(batch=3 * 1024, num_layers=6)[0]  # 4 more layers: nothing new to build
  assert _tf_ops_built(deeper, "batch:1024;model:4") == at_8


def test_the_dry_run_records_what_a_real_lowering_on_8_cpus_records():
  mesh_shape = "batch:2;model:4"
  tf_graph = tf.Graph()
  graph, _ = _graph(batch=4, tf_graph=tf_graph)
  with tf_graph.as_default():
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, LAYOUT, cpu_devices(8))
    lowering = mtf.Lowering(graph, {graph.operations[0].mesh: impl}, autostack=False)
  result = mtf.dry_run(graph, mesh_shape, LAYOUT)
  assert list(result.events) == lowering.communication_events
  assert list(result.counters) == lowering.counters
  variables = graph.trainable_variables
  assert result.variable_bytes == sum(impl.slice_size(v.shape) * tf.as_dtype(v.slice_dtype).size
                                      for v in variables)
