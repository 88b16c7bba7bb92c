"""Fused slicewise computations: one traced program per device, the same results as per-device ops."""

import collections

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import (
    MAX_EXAMPLES, assert_allclose, cpu_devices, lower_and_evaluate, mesh_and_layout, session_config)

DIMS = {"batch": 8, "d": 4, "h": 8}


def _mlp(mesh, seed=0):
  """A two-layer MLP's output and its gradients: einsums, elementwise ops, reductions."""
  rng = np.random.RandomState(seed)
  batch, d, h = (mtf.Dimension(n, s) for n, s in DIMS.items())
  x = mtf.import_tf_tensor(mesh, tf.constant(rng.randn(8, 4).astype(np.float32)), [batch, d])
  w1 = mtf.get_variable(mesh, "w1", [d, h], initializer=tf.random_normal_initializer(seed=1))
  w2 = mtf.get_variable(mesh, "w2", [h, d], initializer=tf.random_normal_initializer(seed=2))
  hidden = mtf.relu(mtf.einsum([x, w1], [batch, h])) * 0.5 + 1.0
  y = mtf.einsum([mtf.tanh(hidden), w2], [batch, d])
  loss = mtf.reduce_sum(mtf.square(y - mtf.reduce_mean(y, reduced_dim=batch)))
  return [y, loss] + mtf.gradients([loss], [x, w1, w2])


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(mesh_and_layout(DIMS), st.integers(0, 100))
def test_fused_lowering_equals_per_device_ops_in_values_and_gradients(mesh_layout, seed):
  fused = lower_and_evaluate(lambda m: _mlp(m, seed), *mesh_layout, backend="placement")
  unfused = lower_and_evaluate(lambda m: _mlp(m, seed), *mesh_layout, backend="placement_unfused")
  unshared = lower_and_evaluate(lambda m: _mlp(m, seed), *mesh_layout, backend="placement_unshared")
  for a, b, c in zip(fused, unfused, unshared):
    assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert_allclose(c, b, rtol=1e-6, atol=1e-6)


def _chain(mesh, length):
  x = mtf.import_tf_tensor(mesh, tf.ones([8, 4]), [mtf.Dimension("batch", 8), mtf.Dimension("d", 4)])
  for i in range(length):
    x = mtf.relu(x * float(i + 1) - 0.5)
  return x


def _ops_of_lowering(num_devices, length=40, fuse=True, mesh_shape=None, layout="batch:all",
                     **impl_kwargs):
  """TF ops in the outer graph after lowering and exporting a chain of elementwise ops."""
  with tf.Graph().as_default() as graph:
    mtf_graph = mtf.Graph()
    mesh = mtf.Mesh(mtf_graph, "mesh")
    y = _chain(mesh, length)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(
        mesh_shape or f"all:{num_devices}", layout, cpu_devices(num_devices), fuse_slicewise=fuse,
        **impl_kwargs)
    mtf.Lowering(mtf_graph, {mesh: impl}).export_to_tf_tensor(y)
    return graph.get_operations()


def _call_devices(ops):
  return sorted(op.device for op in ops if op.type == "PartitionedCall")


def test_one_device_builds_its_ops_directly_unless_compiled():
  assert not [op for op in _ops_of_lowering(1) if op.type == "PartitionedCall"]


def test_program_grows_by_one_call_per_device_not_by_a_copy_of_every_op():
  sizes = {n: len(_ops_of_lowering(n)) for n in (2, 4, 8)}
  calls = [op for op in _ops_of_lowering(8) if op.type == "PartitionedCall"]
  assert len(calls) == 8  # one segment: the whole chain, called on each device
  assert sizes[8] - sizes[2] < 6 * 5, sizes  # a call, its inputs and the export's slices per device
  assert len(_ops_of_lowering(8, fuse=False)) > 8 * 40 * 2  # per-device ops: every op, 8 times


def test_each_device_runs_its_call_on_its_own_device():
  assert _call_devices(_ops_of_lowering(4)) == [f"/device:CPU:{i}" for i in range(4)]


def test_a_replicated_computation_is_one_call_whose_results_every_device_shares():
  assert _call_devices(_ops_of_lowering(8, layout="")) == ["/device:CPU:0"]


def test_a_partly_replicated_computation_is_one_call_per_distinct_slice():
  ops = _ops_of_lowering(8, mesh_shape="b:2;m:4", layout="batch:b")
  assert _call_devices(ops) == ["/device:CPU:0", "/device:CPU:4"]


def test_without_shared_replicas_every_device_computes_its_own_replica():
  ops = _ops_of_lowering(8, layout="", share_replicas=False)
  assert _call_devices(ops) == [f"/device:CPU:{i}" for i in range(8)]


def test_the_replicated_part_of_a_computation_stays_out_of_the_split_parts_calls():
  rng = np.random.RandomState(0)
  x_value, w_value = rng.randn(8, 4).astype(np.float32), rng.randn(4, 16).astype(np.float32)
  with tf.Graph().as_default() as graph:
    mtf_graph = mtf.Graph()
    mesh = mtf.Mesh(mtf_graph, "mesh")
    batch, d, h = mtf.Dimension("batch", 8), mtf.Dimension("d", 4), mtf.Dimension("h", 16)
    x = mtf.import_tf_tensor(mesh, tf.constant(x_value), [batch, d])
    w = mtf.import_tf_tensor(mesh, tf.constant(w_value), [d, h])
    normed = mtf.tanh(x * 2.0 + 1.0)  # replicated: [batch, d] is not split
    y = mtf.relu(mtf.einsum([normed, w], [batch, h]))  # split along h
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:8", "h:all", cpu_devices(8))
    tf_y = mtf.Lowering(mtf_graph, {mesh: impl}).export_to_tf_tensor(y)
    called = collections.Counter(op.get_attr("f").name for op in graph.get_operations()
                                 if op.type == "PartitionedCall")
    bodies = {f.signature.name: {node.op for node in f.node_def}
              for f in graph.as_graph_def().library.function}
    with tf.Session(config=session_config()) as sess:
      got = sess.run(tf_y)
  assert sorted(called.values()) == [1, 8]  # the replicated segment once, the split one per device
  replicated, split = sorted(called, key=called.get)
  assert "Tanh" in bodies[replicated] and "Tanh" not in bodies[split] and "Relu" in bodies[split]
  np.testing.assert_allclose(got, np.maximum(np.tanh(x_value * 2 + 1) @ w_value, 0), rtol=1e-5, atol=1e-5)


def _pending_after(fn):
  """fn(impl, x) inside a fusing placement backend on 4 devices: (result, numpy value of it)."""
  with tf.Graph().as_default():
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", "", cpu_devices(4))
    xs = []
    for i, device in enumerate(cpu_devices(4)):
      with tf.device(device):
        xs.append(tf.fill([2, 3], float(i)))
    with impl.fusing():
      result = fn(impl, impl.LaidOutTensor(xs))
      pending = result.is_pending
      shape, dtype = result.slice_shape, result.dtype
      slices = result.tensor_list
    with tf.Session(config=session_config()) as sess:
      return pending, shape, dtype, sess.run(slices)


def test_a_pending_value_knows_its_slice_shape_and_dtype_and_builds_when_its_tensors_are_read():
  pending, shape, dtype, slices = _pending_after(
      lambda impl, x: impl.slicewise(lambda t: tf.cast(t[:, :2] * 2.0, tf.int32), x))
  assert pending and shape == [2, 2] and dtype == tf.int32
  for i, s in enumerate(slices):
    np.testing.assert_array_equal(s, np.full([2, 2], 2 * i))


def test_processor_numbers_reach_the_traced_program_as_each_devices_own_value():
  _, _, _, slices = _pending_after(
      lambda impl, x: impl.slicewise(lambda t, p: t + tf.cast(p, tf.float32) * 10.0, x,
                                     impl.laid_out_pnum()))
  for i, s in enumerate(slices):
    np.testing.assert_array_equal(s, np.full([2, 3], 11.0 * i))


def test_a_computation_that_cannot_be_traced_is_built_per_device():
  # Indexing a Python list with the processor number needs a Python int, not a traced tensor.
  table = [3.0, 5.0, 7.0, 9.0]
  pending, _, _, slices = _pending_after(
      lambda impl, x: impl.slicewise(lambda t, p: t + table[p], x, impl.laid_out_pnum()))
  assert not pending
  for i, s in enumerate(slices):
    np.testing.assert_array_equal(s, np.full([2, 3], i + table[i]))


def test_stateful_random_ops_are_built_per_device_so_devices_draw_different_values():
  def draw(impl, x):
    tf.set_random_seed(7)  # a graph seed: each per-device op gets its own op seed, one traced op would not
    return impl.slicewise(lambda t: t * 0.0 + tf.random.uniform([2, 3]), x)
  pending, _, _, slices = _pending_after(draw)
  assert not pending
  assert len({s.tobytes() for s in slices}) == 4


def test_errors_in_a_slicewise_computation_are_raised_as_without_fusion():
  def bad(impl, x):
    return impl.slicewise(lambda t: tf.matmul(t, t), x)  # [2, 3] x [2, 3]
  with pytest.raises(ValueError, match="Dimensions must be equal"):
    _pending_after(bad)


def test_ops_inside_control_dependencies_keep_them():
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.ones([8]), [mtf.Dimension("batch", 8)])
    counter = mtf.get_variable(mesh, "counter", [], initializer=tf.zeros_initializer())
    bump = mtf.assign_add(counter, mtf.ones(mesh, []))
    return [mtf.depend(x * 2.0, [bump]), counter]

  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    y, counter = build(mesh)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", "batch:all", cpu_devices(4))
    lowering = mtf.Lowering(graph, {mesh: impl})
    tf_y, tf_counter = lowering.export_to_tf_tensor(y), lowering.export_to_tf_tensor(counter)
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      np.testing.assert_array_equal(sess.run(tf_y), np.full([8], 2.0))
      assert sess.run(tf_counter) == 1.0  # the increment ran before y


def test_intermediates_are_no_outputs_of_the_program_and_are_computed_again_when_read():
  with tf.Graph().as_default() as tf_graph:
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    x = mtf.import_tf_tensor(mesh, tf.range(8.0), [mtf.Dimension("batch", 8)])
    hidden = mtf.exp(x * 0.5)
    y = mtf.reduce_sum(mtf.square(hidden) + hidden, reduced_dim=x.shape.dims[0])
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", "batch:all", cpu_devices(4))
    lowering = mtf.Lowering(graph, {mesh: impl})
    calls = lambda: sum(op.type == "PartitionedCall" for op in tf_graph.get_operations())
    built = calls()
    assert lowering.tensors[hidden].is_pending  # read by no op after the segment was built
    tf_y, tf_hidden = lowering.export_to_tf_tensor(y), lowering.export_to_tf_tensor(hidden)
    assert calls() == built + 4  # hidden, computed again on each device
    with tf.Session(config=session_config()) as sess:
      got_y, got_hidden = sess.run([tf_y, tf_hidden])
  want_hidden = np.exp(np.arange(8.0) * 0.5)
  np.testing.assert_allclose(got_hidden, want_hidden, rtol=1e-6)
  np.testing.assert_allclose(got_y, np.sum(want_hidden ** 2 + want_hidden), rtol=1e-6)


@pytest.mark.parametrize("backend", ["placement", "collective"])
def test_eager_mode_builds_per_device_and_agrees_with_graph_mode(backend):
  graph_values = lower_and_evaluate(_mlp, "b:2;d:2", "batch:b;h:d", "graph", backend=backend)
  eager_values = lower_and_evaluate(_mlp, "b:2;d:2", "batch:b;h:d", "eager", backend=backend)
  for a, b in zip(graph_values, eager_values):
    assert_allclose(a, b)


def test_jit_compiled_programs_equal_per_device_ops_and_are_marked_for_xla():
  def lower_and_run(**kwargs):
    with tf.Graph().as_default() as graph:
      mtf_graph = mtf.Graph()
      mesh = mtf.Mesh(mtf_graph, "mesh")
      outputs = _mlp(mesh)
      impl = mtf.placement_mesh_impl.PlacementMeshImpl("b:2;d:2", "batch:b;h:d", cpu_devices(4), **kwargs)
      lowering = mtf.Lowering(mtf_graph, {mesh: impl})
      tf_outputs = [lowering.export_to_tf_tensor(t) for t in outputs]
      compiled = [op for op in graph.get_operations()
                  if op.type == "PartitionedCall" and "_XlaMustCompile" in op.node_def.attr]
      with tf.Session(config=session_config()) as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(lowering.copy_masters_to_slices())
        return sess.run(tf_outputs), compiled

  jitted, compiled = lower_and_run(jit_compile=True)
  assert len(compiled) >= 4 and compiled[0].device  # at least one segment, compiled on each device
  for a, b in zip(jitted, lower_and_run(fuse_slicewise=False)[0]):
    assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_lowering_inside_a_tf_function_fuses_and_matches_numpy():
  values = np.random.RandomState(0).randn(8, 4).astype(np.float32)

  @tf.function
  def lowered(x_value):
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    x = mtf.import_tf_tensor(mesh, x_value, [mtf.Dimension("batch", 8), mtf.Dimension("d", 4)])
    y = mtf.reduce_sum(mtf.relu(x * 2.0 - 1.0), reduced_dim=x.shape.dims[0])
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", "batch:all", cpu_devices(4))
    return mtf.Lowering(graph, {mesh: impl}).export_to_tf_tensor(y)

  graph_def = lowered.get_concrete_function(tf.TensorSpec([8, 4])).graph.as_graph_def()
  assert sum(node.op == "PartitionedCall" for node in graph_def.node) == 4
  np.testing.assert_allclose(lowered(tf.constant(values)).numpy(),
                             np.maximum(values * 2 - 1, 0).sum(0), rtol=1e-6)
