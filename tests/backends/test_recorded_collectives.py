"""Collectives a backend runs for the lowering are recorded as events, like every other one.

SIMD's allreduce only sums, so a MAX or MIN reduction runs as allconcats, recorded as such; a
CollectiveMeshImpl spanning processes gathers slices with allconcats to export a tensor or copy
slices to a master, recorded as events of the tensor's op or the variable.
"""

from __future__ import annotations

import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._lowering import comm as comm_lib
from mesh_tensorflow.collective_mesh_impl import Cluster, CollectiveMeshImpl
from tests.lowering.test_communication import simd_events

B, I = mtf.Dimension("b", 8), mtf.Dimension("i", 12)


def test_simd_max_and_min_are_recorded_as_the_allconcats_that_run():
  def build(mesh):
    x = mtf.zeros(mesh, mtf.Shape([B, I]))
    return [mtf.reduce_max(x, reduced_dim=B), mtf.reduce_min(x, output_shape=[])]

  events = simd_events(build, "x:2;y:4", "b:x;i:y")
  # MAX over b (mesh axis x, n = 2): slices [1, 3] (12 B) stacked; (n - 1) S P = 1 * 12 * 8.
  # MIN of everything: the local minimum (4 B), then one allconcat per mesh axis (n = 2, then 4).
  assert [(e.kind, e.mesh_axes, e.slice_shape, e.op_name, e.reason, e.bytes_sent) for e in events] == [
      ("allconcat", (0,), (1, 3), "reduce", "reduce_op", 1 * 12 * 8),
      ("allconcat", (0,), (1,), "reduce_1", "reduce_op", 1 * 4 * 8),
      ("allconcat", (1,), (1,), "reduce_1", "reduce_op", 3 * 4 * 8)]
  assert not any(e.kind == "allreduce" for e in events)


def _multi_process_lowering():
  """Task 1 of 2 (processors 4-7 of b:2;m:4), graph mode: nothing runs, the graph is built."""
  cluster = Cluster(["h0:1", "h1:2"], 1, devices_per_task=4)
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  w = mtf.get_variable(mesh, "w", mtf.Shape([B, I]), initializer=tf.zeros_initializer())
  y = mtf.exp(w)
  impl = CollectiveMeshImpl("b:2;m:4", "b:b;i:m", cluster=cluster)
  assert impl.is_multi_process
  return mtf.Lowering(graph, {mesh: impl}, autostack=False), w, y, impl


def test_gathers_across_processes_are_events_of_the_export_and_the_master_copy():
  with tf.Graph().as_default():
    lowering, w, y, _ = _multi_process_lowering()
    assert lowering.communication_events == []
    lowering.export_to_tf_tensor(y)
    lowering.copy_slices_to_masters()
  # Slices [4, 3] (48 B): gathered over b (n = 2), then the [8, 3] halves (96 B) over m (n = 4).
  # Bytes count every processor of the mesh (each process builds its own part of the same graph).
  per_gather = [("allconcat", (0,), (4, 3), "combine_slices", 1 * 48 * 8),
                ("allconcat", (1,), (8, 3), "combine_slices", 3 * 96 * 8)]
  got = [(e.op_name, e.kind, e.mesh_axes, e.slice_shape, e.reason, e.bytes_sent)
         for e in lowering.communication_events]
  assert got == [(op, *event) for op in (y.operation.name, w.operation.name) for event in per_gather]
  assert ("allconcat/1/combine_slices", 3 * 24 * 8) in lowering.counters  # elements sent


def test_outside_a_lowering_a_backends_own_collectives_record_nothing():
  with tf.Graph().as_default():
    _, _, _, impl = _multi_process_lowering()
    charged = comm_lib.Communicator(impl, [].append, "op")
    assert comm_lib.for_backend(impl).op_name == ""
    with comm_lib.charged_to(charged):
      assert comm_lib.for_backend(impl) is charged
    assert comm_lib.for_backend(impl) is not charged
