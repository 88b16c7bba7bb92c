"""The communication layer: one event per collective, the same in a dry run and on every backend.

For each op family: the events a placement lowering records equal those of `mtf.dry_run` and of a
SIMD lowering (built with emulated TPU collectives), and -- checked independently, on the lowered
TF graph -- the bytes the events report equal the bytes of the tensors that cross devices.
"""

from __future__ import annotations

import pytest
import tensorflow.compat.v1 as tf
from tensorflow.python.ops import control_flow_util

import mesh_tensorflow as mtf
from mesh_tensorflow._backends import simd
from tests.backends.test_simd_mesh_impl import _EmulatedTpuOps
from tests.harness import cpu_devices

B, I, J, K = (mtf.Dimension(n, s) for n, s in (("b", 8), ("i", 8), ("j", 4), ("k", 4)))


def _x(mesh, dims=(B, I)):
  return mtf.random_uniform(mesh, list(dims), minval=-1.0, maxval=1.0)


def _einsum(mesh):
  x, w = _x(mesh), _x(mesh, (I, J))
  y = mtf.einsum([x, w], output_shape=[B, J])
  return [y] + mtf.gradients([mtf.reduce_sum(y)], [x, w])


def _reduce(mesh):
  x = _x(mesh, (B, I, J))
  return [mtf.reduce_sum(x, output_shape=[J]), mtf.reduce_max(x, reduced_dim=I),
          mtf.reduce_min(x, output_shape=[B])]


def _reshape(mesh):
  x = _x(mesh, (B, I, J))
  merged = mtf.reshape(x, [B, mtf.Dimension("ij", 32)])
  split = mtf.reshape(merged, [mtf.Dimension("b1", 2), mtf.Dimension("b2", 4), I, J])
  renamed = mtf.rename_dimension(x, "b", "b_new")
  return [merged, split, renamed, mtf.rename_dimension(renamed, "b_new", "b")]


def _shift(mesh):
  x = _x(mesh, (B, I, J))
  return [mtf.shift(x, 3, B, wrap=True), mtf.shift(x, -5, B, wrap=False), mtf.shift(x, 4, B, wrap=True),
          mtf.halo_exchange(x, B, I, 2)]


def _top_k(mesh):
  x = _x(mesh)
  values, indices = mtf.top_k(x, I, mtf.Dimension("top", 6))
  v1, i1 = mtf.top_1(x, I)
  return [values, indices, v1, i1, mtf.argmax(x, B)]


def _gather(mesh):
  table = _x(mesh, (I, J))
  ids = mtf.cast(mtf.random_uniform(mesh, [B], minval=0.0, maxval=8.0), tf.int32)
  out = mtf.gather(table, ids, I)
  return [out] + mtf.gradients([mtf.reduce_sum(out)], [table])


def _conv(mesh):
  h, w, c, o = (mtf.Dimension(n, s) for n, s in (("h", 4), ("w", 4), ("c", 4), ("o", 4)))
  x = mtf.random_uniform(mesh, [B, h, w, c])
  f = mtf.random_uniform(mesh, [mtf.Dimension("fh", 3), mtf.Dimension("fw", 3), c, o])
  y = mtf.Conv2dOperation(x, f, [1, 1, 1, 1], "SAME").outputs[0]
  return [y] + mtf.gradients([mtf.reduce_sum(y)], [x, f])


def _while_loop(mesh):
  i2 = mtf.Dimension("i2", 8)
  x, w = _x(mesh), _x(mesh, (I, i2))

  def body(i, y):
    y = mtf.rename_dimension(mtf.einsum([y, w], output_shape=[B, i2]), "i2", "i")
    return i + 1, y, mtf.reduce_sum(y, output_shape=[I])

  three = mtf.constant(mesh, 3, dtype=tf.int32)  # laid out: each processor compares with its own copy
  i, y, total = mtf.while_loop(lambda i, y: mtf.less(i, three), body,
                               [mtf.constant(mesh, 0, dtype=tf.int32), x], has_accumulators=True)
  return [i, y, total]


def _slicing(mesh):
  x = _x(mesh, (B, I, J))
  part = mtf.slice(x, 1, 2, "j")
  joined = mtf.concat([part, mtf.pad(part, [1, 1], "j")], "j")
  a, b = mtf.split(x, J, [1, 3])
  return [joined, a, b, mtf.stack([a, a], "s", 0), mtf.exp(mtf.reduce_sum(joined))]


def _dense_training(mesh):
  x = _x(mesh, (B, I))
  y = mtf.layers.dense(x, J, name="dense")
  loss = mtf.reduce_mean(mtf.square(y))
  var_grads = mtf.gradients([loss], [v.outputs[0] for v in mesh.graph.trainable_variables])
  updates = mtf.optimize.AdamWeightDecayOptimizer(0.01).apply_grads(var_grads,
                                                                     mesh.graph.trainable_variables)
  assert updates
  return [loss, mtf.dropout(y, keep_prob=0.5)]


FAMILIES = {
    "einsum": (_einsum, "x:2;y:4", "i:x;j:y"),
    "reduce": (_reduce, "x:2;y:2;z:2", "b:x;i:y;j:z"),
    "reshape": (_reshape, "x:2;y:4", "b:x;ij:y;b_new:y"),
    "shift": (_shift, "x:4;y:2", "b:x;j:y"),
    "top_k": (_top_k, "x:2;y:4", "b:x;i:y"),
    "gather": (_gather, "x:2;y:4", "b:x;i:y"),
    "conv": (_conv, "x:2;y:4", "b:x;c:y"),
    "while_loop": (_while_loop, "x:2;y:4", "b:x;i:y"),
    "slicing": (_slicing, "x:2;y:4", "b:x;i:y"),
    "dense_training": (_dense_training, "x:2;y:4", "b:x;i:y"),
}


def _build(build_fn):
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  return graph, mesh, build_fn(mesh)


def placement_events(build_fn, mesh_shape, layout, **impl_kwargs):
  """(events, lowering, TF graph) of a graph-mode placement lowering on 8 virtual CPUs."""
  tf_graph = tf.Graph()
  with tf_graph.as_default():
    tf.set_random_seed(1)
    graph, mesh, _ = _build(build_fn)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(
        mesh_shape, layout, cpu_devices(mtf.convert_to_shape(mesh_shape).size), **impl_kwargs)
    lowering = mtf.Lowering(graph, {mesh: impl}, autostack=False)
  return lowering.communication_events, lowering, tf_graph


def simd_events(build_fn, mesh_shape, layout):
  """Events of a SIMD lowering (replica 0's program, built with emulated TPU collectives)."""
  with tf.Graph().as_default(), pytest.MonkeyPatch.context() as patch:
    patch.setattr(simd, "_tpu_ops", lambda: _EmulatedTpuOps(mtf.convert_to_shape(mesh_shape).size))
    graph, mesh, _ = _build(build_fn)
    lowering = mtf.Lowering(graph, {mesh: simd.SimdMeshImpl(mesh_shape, layout)}, autostack=False)
    return lowering.communication_events


def dry_run_events(build_fn, mesh_shape, layout):
  with tf.Graph().as_default():
    graph, _, _ = _build(build_fn)
    return list(mtf.dry_run(graph, mesh_shape, layout).events)


def cross_device_bytes(tf_graph) -> int:
  """Bytes of the tensors that feed an op on another device (data edges between placed ops)."""
  total = 0
  for op in tf_graph.get_operations():
    for t in op.inputs:
      if op.device and t.op.device and t.op.device != op.device:
        total += t.shape.num_elements() * t.dtype.size
  return total


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dry_run_and_every_backend_record_the_same_events(family):
  build_fn, mesh_shape, layout = FAMILIES[family]
  events, _, _ = placement_events(build_fn, mesh_shape, layout)
  assert events, "each family's layout is chosen to communicate"
  assert dry_run_events(build_fn, mesh_shape, layout) == events
  # SIMD's allreduce only sums: its MAX/MIN are allconcats, recorded as such, as they would be on
  # a placement mesh whose allreduce only summed.
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(mtf.placement_mesh_impl.PlacementMeshImpl, "allreduce_reductions", ("SUM",))
    summing_only, _, _ = placement_events(build_fn, mesh_shape, layout)
  assert (summing_only == events) == (family != "reduce")  # the one family reducing by MAX/MIN
  assert simd_events(build_fn, mesh_shape, layout) == summing_only


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"dense_training"}))
def test_event_bytes_equal_the_bytes_crossing_devices_in_the_lowered_graph(family, monkeypatch):
  build_fn, mesh_shape, layout = FAMILIES[family]  # no variables: only collectives cross devices
  # v1 control flow keeps a while_loop body's ops in the graph itself, where this check can see them.
  monkeypatch.setattr(control_flow_util, "ENABLE_CONTROL_FLOW_V2", False)
  # Each device its own replicas, as on GPUs: shared replicas (CPUs of one process) are read
  # across devices by design, where that is no copy and no communication.
  events, _, tf_graph = placement_events(build_fn, mesh_shape, layout, share_replicas=False)
  assert sum(e.bytes_sent for e in events) == cross_device_bytes(tf_graph) > 0


def test_an_event_records_kind_axes_group_slice_dtype_bytes_op_and_reason():
  def build(mesh):
    return [mtf.reduce_sum(mtf.ones(mesh, [B, I], dtype=tf.bfloat16), output_shape=[I])]
  events, lowering, tf_graph = placement_events(build, "x:2;y:4", "b:y")
  assert events == []  # a pending sum: nothing is sent until it is used
  with tf_graph.as_default():
    lowering.export_to_tf_tensor(lowering.graph.operations[-1].outputs[0])
  (event,) = lowering.communication_events
  assert (event.kind, event.mesh_axes, event.group_size, event.num_processors) == ("allreduce", (1,), 4, 8)
  assert (event.slice_shape, event.dtype, event.op_name, event.reason) == ((8,), "bfloat16", "reduce",
                                                                           "reduce_op")
  assert event.bytes_sent == 2 * 2 * 3 * 16  # 2 groups, each ring sends 2 * (4 - 1) slices of 16 bytes
  assert event.bytes_per_processor == event.bytes_sent / 8
  assert ("allreduce/[1]/reduce_op", event.bytes_sent // 2) in lowering.counters


def test_reshape_counters_count_elements_moved_not_output_size():
  def build(mesh):
    return [mtf.rename_dimension(mtf.ones(mesh, [B, I]), "b", "b2")]  # b moves from x to y
  _, lowering, _ = placement_events(build, "x:2;y:4", "b:x;b2:y")
  counters = dict(lowering.counters)
  # allconcat along x (each processor sends its 4x8 slice to 1 other), then allsplit along y (free).
  assert counters["allconcat/0/reshape_op"] == 8 * 4 * 8
  assert counters["allsplit/1/reshape_op"] == 0


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_while_loop_body_events_are_recorded_once_and_tagged_with_the_loop(mode):
  build_fn, mesh_shape, layout = FAMILIES["while_loop"]

  def run():
    graph, mesh, _ = _build(build_fn)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, cpu_devices(8))
    return mtf.Lowering(graph, {mesh: impl}, autostack=False).communication_events
  if mode == "graph":
    with tf.Graph().as_default():
      events = run()
  else:
    events = run()  # eager runs the body three times
  in_loop = [(e.kind, e.op_name, e.in_loop) for e in events if e.in_loop]
  assert in_loop == [("allreduce", "einsum", "while_loop"), ("allsplit", "reshape", "while_loop")]
  assert [e.reason for e in events if not e.in_loop] == []  # the accumulated sum is still pending


def test_lazy_allreduce_is_charged_to_the_op_that_made_the_partial_sums():
  def build(mesh):
    x = mtf.einsum([_x(mesh), _x(mesh, (I, J))], output_shape=[B, J], name="matmul")
    return [mtf.tanh(x, name="later_use")]
  events, _, _ = placement_events(build, "x:2;y:4", "i:y")
  assert [(e.op_name, e.reason) for e in events] == [("matmul", "einsum_op")]


def test_dry_run_reports_per_processor_bytes_of_variables_slots_and_activations():
  with tf.Graph().as_default():
    graph, mesh, _ = _build(FAMILIES["dense_training"][0])
    result = mtf.dry_run(graph, "x:2;y:4", "b:x;i:y")
    replicated = mtf.dry_run(graph, "x:2;y:4", "")
  # kernel [i=8, j=4] split 4 ways on i: 2 * 4 floats per processor; bias [j=4] whole.
  assert result.variable_bytes == (2 * 4 + 4) * 4
  assert result.slot_bytes == 2 * result.variable_bytes  # Adam's m and v
  # Activations split over b (2 ways) and i (4 ways) take a processor at most half the bytes of
  # the replicated ones (those along j are split over b only).
  assert 0 < result.activation_bytes <= replicated.activation_bytes / 2
  assert result.bytes_sent == sum(e.bytes_sent for e in result.events)


def test_dry_run_needs_one_mesh():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mtf.ones(mtf.Mesh(graph, "a"), [B]), mtf.ones(mtf.Mesh(graph, "b"), [B])
    with pytest.raises(ValueError, match="exactly one mesh"):
      mtf.dry_run(graph, "x:2", "")


def test_dry_run_builds_nothing_in_the_callers_graph():
  build_fn, mesh_shape, layout = FAMILIES["einsum"]
  with tf.Graph().as_default() as tf_graph:
    graph, _, _ = _build(build_fn)
    num_ops = len(tf_graph.get_operations())
    mtf.dry_run(graph, mesh_shape, layout)
    assert len(tf_graph.get_operations()) == num_ops


def test_a_gradient_reads_a_sum_already_reduced_for_the_forward_pass_without_another_allreduce():
  """out = h . w sums over j (split): the loss reduces it, and the square's gradient, an einsum
  linear in out, must read that reduced value, not redo the partial sums and allreduce again."""
  def build(mesh):
    h, w = _x(mesh, (B, J)), _x(mesh, (J, I))
    out = mtf.einsum([h, w], output_shape=[B, I])
    return mtf.gradients([mtf.reduce_sum(mtf.square(out))], [w])
  events, lowering, tf_graph = placement_events(build, "x:2;y:4", "b:x;j:y")
  with tf_graph.as_default():
    lowering.export_to_tf_tensor(lowering.graph.operations[-1].outputs[0])
  reduced = [(e.op_name, e.mesh_axes) for e in lowering.communication_events if e.kind == "allreduce"]
  # out over y, w's gradient over x (the loss itself is not asked for: its sum stays pending).
  assert reduced == [("einsum", (1,)), ("einsum/gradients/einsum_1", (0,))], reduced
