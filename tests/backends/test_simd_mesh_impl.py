"""SimdMeshImpl and ReplicatedVariable, checked without a TPU.

Three tiers:
* pure: construction, logical/physical numbering, group assignments, gin;
* graph construction inside `tf.compat.v1.tpu.replicate` (the ops and inputs a TPU would run);
* emulated execution: each replica's copy of the SPMD program runs on its own virtual CPU, with
  the TPU collectives replaced by TF collective ops, and results compared against the
  placement backend and NumPy.
"""

from __future__ import annotations

import itertools

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorflow.python.tpu import device_assignment as device_assignment_lib
from tensorflow.python.tpu import topology as topology_lib

import mesh_tensorflow as mtf
from mesh_tensorflow import tpu_variables
from mesh_tensorflow._backends import simd
from tests.harness import MAX_EXAMPLES, MESH_SHAPES, mesh_and_layout, session_config

SimdMeshImpl = mtf.simd_mesh_impl.SimdMeshImpl


def _device_assignment(num_replicas: int):
  """A one-chip-row topology with num_replicas cores, one replica per core (no TPU needed)."""
  coords = np.array([[[0, 0, 0, c] for c in range(num_replicas)]])
  topology = topology_lib.Topology(mesh_shape=[1, 1, 1, num_replicas], device_coordinates=coords)
  return device_assignment_lib.DeviceAssignment(
      topology, core_assignment=np.array([[[0, 0, 0, c]] for c in range(num_replicas)]))


@st.composite
def _mesh_layout_and_permutation(draw, dims):
  mesh_shape, layout = draw(mesh_and_layout(dims))
  size = mtf.convert_to_shape(mesh_shape).size
  return mesh_shape, layout, draw(st.permutations(range(size)))


# ---- pure: construction and numbering ----

def test_default_logical_to_physical_is_the_identity():
  impl = SimdMeshImpl("rows:2;cols:4", "batch:rows")
  assert [impl.l2p(p) for p in range(8)] == list(range(8))
  assert impl.shape == mtf.convert_to_shape("rows:2;cols:4")
  assert impl.layout_rules == mtf.convert_to_layout_rules("batch:rows")


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(st.permutations(range(8)))
def test_p2l_inverts_l2p(l2p):
  impl = SimdMeshImpl("x:2;y:2;z:2", "", logical_to_physical=l2p)
  assert [impl.p2l(impl.l2p(p)) for p in range(8)] == list(range(8))
  assert [impl.l2p(p) for p in range(8)] == list(l2p)


@pytest.mark.parametrize("l2p", [[0, 1, 2], [0, 1, 2, 2], [1, 2, 3, 4]])
def test_logical_to_physical_must_be_a_permutation(l2p):
  with pytest.raises(ValueError, match=r"must be a permutation of range\(4\)"):
    SimdMeshImpl("all:4", "", logical_to_physical=l2p)


def test_devices_argument_is_ignored_with_a_warning(caplog):
  impl = SimdMeshImpl("all:2", "", devices=["cpu:0", "cpu:1"])
  assert "ignores devices" in caplog.text
  assert impl.devices == ["", ""]


def test_devices_follow_the_device_assignment_in_logical_order():
  assignment = _device_assignment(4)
  impl = SimdMeshImpl("all:4", "", device_assignment=assignment, logical_to_physical=[2, 0, 3, 1])
  assert impl.device_assignment is assignment
  assert impl.devices == [assignment.tpu_device(replica=p) for p in [2, 0, 3, 1]]


def test_gin_configures_allreduce_in_bfloat16_max_group_size():
  # A scoped binding: it cannot leak into other tests.
  with gin.unlock_config():
    gin.bind_parameter("simd_test/mesh_tensorflow.simd_mesh_impl.SimdMeshImpl."
                       "allreduce_in_bfloat16_max_group_size", 2)
  with gin.config_scope("simd_test"):
    assert SimdMeshImpl("all:2", "")._allreduce_in_bfloat16_max_group_size == 2
  assert SimdMeshImpl("all:2", "")._allreduce_in_bfloat16_max_group_size == 8


def test_control_dependencies_are_not_supported():
  impl = SimdMeshImpl("all:2", "")
  assert impl.supports_control_dependencies is False
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    x = mtf.zeros(mesh, "a:2")
    mtf.depend(x, [mtf.ones(mesh, "a:2")])
    with pytest.raises(ValueError, match="control dependencies"):
      mtf.Lowering(graph, {mesh: impl})


def test_slice_shape_and_begin_follow_the_layout_in_logical_numbering():
  impl = SimdMeshImpl("rows:2;cols:4", "batch:rows;d:cols", logical_to_physical=list(range(8))[::-1])
  shape = mtf.convert_to_shape("batch:6;d:8;e:3")
  assert impl.slice_shape(shape) == [3, 2, 3]
  assert impl.slice_begin(shape, 6) == [3, 4, 0]
  assert impl.laid_out_size(shape) == 144
  with pytest.raises(ValueError, match="'batch' .*does not divide it"):
    impl.slice_shape(mtf.convert_to_shape("batch:5"))


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(st.sampled_from(MESH_SHAPES).flatmap(
    lambda s: st.tuples(st.just(s), st.permutations(range(mtf.convert_to_shape(s).size)),
                        st.sets(st.integers(0, len(mtf.convert_to_shape(s)) - 1)))))
def test_group_assignment_lists_replicas_that_differ_only_along_the_mesh_axes(case):
  mesh_shape, l2p, axes = case
  impl = SimdMeshImpl(mesh_shape, "", logical_to_physical=l2p)
  groups = impl._create_group_assignment(sorted(axes))
  assert sorted(p for g in groups for p in g) == list(range(impl.size))
  for group in groups:
    coords = [mtf.pnum_to_processor_coordinates(impl.shape, impl.p2l(p)) for p in group]
    rest = {tuple(c[i] for i in range(impl.ndims) if i not in axes) for c in coords}
    assert len(rest) == 1
    assert coords == sorted(coords)  # members in increasing logical coordinate


def test_export_of_a_split_tensor_is_not_implemented():
  impl = SimdMeshImpl("all:2", "a:all")
  graph = mtf.Graph()
  x = mtf.zeros(mtf.Mesh(graph, "mesh"), "a:4")
  with pytest.raises(NotImplementedError, match="only export fully replicated tensors"):
    impl.export_to_tf_tensor(x, impl.LaidOutTensor([tf.zeros([2])]))


def test_laid_out_tensor_holds_one_slice():
  t = tf.zeros([2, 3])
  laid_out = SimdMeshImpl.LaidOutTensor.from_tensor_list([t])
  assert laid_out.one_slice is t and laid_out.all_slices == [t] == laid_out.tensor_list
  assert laid_out.slice_shape == [2, 3] and laid_out.to_laid_out_tensor() is laid_out
  with pytest.raises(AssertionError):
    SimdMeshImpl.LaidOutTensor((t,))


# ---- graph construction inside tpu.replicate ----

def _replicate(fn, num_replicas, assignment):
  return tf.tpu.replicate(fn, inputs=[[]] * num_replicas, device_assignment=assignment)


def _const_value(t):
  return tf.make_ndarray(t.op.get_attr("value")).tolist()


def test_lowering_in_tpu_replicate_builds_xla_collectives_over_physical_groups():
  assignment = _device_assignment(4)
  with tf.Graph().as_default() as g:
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    impl = SimdMeshImpl("rows:2;cols:2", "x:rows;y:cols", device_assignment=assignment,
                        logical_to_physical=[2, 0, 3, 1])
    w = mtf.get_variable(mesh, "w", "x:4;y:6", initializer=tf.zeros_initializer())
    y_sum = mtf.reduce_sum(w, output_shape="y:6")                            # allreduce over rows
    moved = mtf.reshape(w, "x:4;z:6")                                        # allconcat over cols
    shifted = mtf.shift(w, offset=1, dim=w.shape.dims[0], wrap=True)         # collective permute
    out = mtf.reduce_sum(y_sum) + mtf.reduce_sum(moved) + mtf.reduce_sum(shifted)
    mtf.assign(w, w * 2.0)

    def computation():
      lowering = mtf.Lowering(graph, {mesh: impl})
      return [lowering.export_to_tf_tensor(out)]
    _replicate(computation, 4, assignment)
    ops = g.get_operations()

  sums = [op for op in ops if op.type == "CrossReplicaSum"]
  group_assignments = [_const_value(op.inputs[1]) for op in sums]
  assert [[2, 3], [0, 1]] in group_assignments  # over rows: logical {0, 2}, {1, 3}
  assert [[2, 0], [3, 1]] in group_assignments  # over cols: logical {0, 1}, {2, 3}
  permutes = [op for op in ops if op.type == "CollectivePermute"]
  assert sorted(map(tuple, _const_value(permutes[0].inputs[1]))) == sorted(
      [(2, 3), (3, 2), (0, 1), (1, 0)])  # logical 0<->2 and 1<->3, in physical numbers
  (pnums,) = [op for op in ops if op.name.endswith("pnum_constants")]
  assert pnums.type == "TPUReplicatedInput"
  assert [_const_value(t) for t in pnums.inputs] == [1, 3, 0, 2]  # physical_to_logical
  with g.as_default():
    slices = tf.get_collection("TPU_VAR")
    global_names = [v.op.name for v in tf.global_variables()]
  assert [v.device for v in slices] == [assignment.tpu_device(replica=p) for p in range(4)]
  assert [v.shape.as_list() for v in slices] == [[2, 3]] * 4
  assert global_names == ["w"]  # only the master is checkpointed
  handle_inputs = [op for op in ops if op.type == "TPUReplicatedInput"
                   and op.inputs[0].dtype == tf.resource]
  assert [t.op for t in handle_inputs[0].inputs] == [v.handle.op for v in slices]
  assert any(op.type == "AssignVariableOp" and op.inputs[0].op is handle_inputs[0] for op in ops)


@pytest.mark.parametrize("dtype, max_group_size, wire_dtype", [
    (tf.float32, 8, tf.float32), (tf.bfloat16, 8, tf.bfloat16), (tf.bfloat16, 1, tf.float32),
    (tf.int32, 8, tf.float32),
])
def test_allreduce_sums_in_float32_unless_float32_or_small_bfloat16_groups(
    dtype, max_group_size, wire_dtype):
  with tf.Graph().as_default() as g:
    impl = SimdMeshImpl("all:2", "", allreduce_in_bfloat16_max_group_size=max_group_size)
    out = impl.allreduce(impl.LaidOutTensor([tf.zeros([3], dtype)]), [0], "SUM").one_slice
    (op,) = [op for op in g.get_operations() if op.type == "CrossReplicaSum"]
  assert op.inputs[0].dtype == wire_dtype
  assert out.dtype == dtype


# ---- ReplicatedVariable ----

def _resource_vars(values, devices=None):
  devices = devices or [""] * len(values)
  ret = []
  for i, (value, device) in enumerate(zip(values, devices)):
    with tf.device(device):
      ret.append(tf.Variable(value, name="v_%d" % i, use_resource=True))
  return ret


def test_replicated_variable_outside_tpu_acts_as_its_first_copy_in_graph_mode():
  with tf.Graph().as_default():
    copies = _resource_vars([[1.0, 2.0], [3.0, 4.0]])
    rv = tpu_variables.ReplicatedVariable("v", copies)
    assert (rv.name, rv.dtype, rv.shape.as_list(), rv.get_shape().as_list()) == (
        "v", tf.float32, [2], [2])
    assert rv.get() is copies[0] and rv.variables == copies and rv.op is copies[0].op
    doubled = tf.convert_to_tensor(rv) * 2
    assign = rv.assign([5.0, 6.0])
    added = rv.assign_add([1.0, 1.0])
    with tf.Session() as sess:
      sess.run(rv.initializer)
      np.testing.assert_allclose(sess.run(rv), [1.0, 2.0])  # session fetch of the wrapper
      np.testing.assert_allclose(sess.run(doubled), [2.0, 4.0])
      sess.run(assign)
      np.testing.assert_allclose(sess.run(added), [6.0, 7.0])
      np.testing.assert_allclose(sess.run(rv.assign_sub([6.0, 7.0])), [0.0, 0.0])
      np.testing.assert_allclose(sess.run(copies[1]), [3.0, 4.0])  # other copies untouched


def test_replicated_variable_converts_and_assigns_in_eager_mode():
  copies = _resource_vars([[1.0], [2.0]])
  rv = tpu_variables.ReplicatedVariable("v", copies)
  np.testing.assert_allclose(tf.cast(rv, tf.float64).numpy(), [1.0])
  rv.assign([7.0])
  np.testing.assert_allclose(rv.read_value().numpy(), [7.0])
  np.testing.assert_allclose(copies[1].numpy(), [2.0])


def test_replicated_variable_needs_copies():
  with pytest.raises(ValueError, match="at least one per-replica variable"):
    tpu_variables.ReplicatedVariable("v", [])


def test_replicated_variable_in_tpu_replicate_reads_and_assigns_the_replicated_handle():
  assignment = _device_assignment(2)
  with tf.Graph().as_default() as g:
    copies = _resource_vars([[1.0], [2.0]], [assignment.tpu_device(replica=p) for p in range(2)])
    rv = tpu_variables.ReplicatedVariable("v", copies)

    def computation():
      read = tf.identity(rv)
      with tf.control_dependencies([rv.assign(read + 1.0)]):
        return [tf.identity(read)]
    _replicate(computation, 2, assignment)
    ops = g.get_operations()
  (handle_op,) = [op for op in ops if op.type == "TPUReplicatedInput"]
  assert [t.op for t in handle_op.inputs] == [v.handle.op for v in copies]
  for op_type in ("ReadVariableOp", "AssignVariableOp"):
    assert any(op.type == op_type and op.inputs[0].op is handle_op for op in ops), op_type


# ---- master <-> slice copies (no TPU ops involved) ----

def _lower_variable(mesh_shape, layout, l2p, dtype=tf.float32, value=None):
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  initializer = tf.constant_initializer(value) if value is not None else tf.zeros_initializer()
  w = mtf.get_variable(mesh, "w", "r:4;c:6", dtype=dtype, initializer=initializer)
  impl = SimdMeshImpl(mesh_shape, layout, logical_to_physical=l2p)
  lowering = mtf.Lowering(graph, {mesh: impl})
  laid_out_variable = lowering.variables[w.operation]
  return impl, w, lowering, laid_out_variable.laid_out_tensor.one_slice.variables


def _logical_part(impl, shape, value, logical_pnum):
  begin = impl.slice_begin(shape, logical_pnum)
  return value[tuple(slice(b, b + s) for b, s in zip(begin, impl.slice_shape(shape)))]


@pytest.mark.parametrize("mesh_shape, layout, l2p", [
    ("a:2;b:2", "r:a;c:b", [3, 1, 0, 2]), ("a:2;b:2", "c:b", [1, 2, 3, 0]), ("all:4", "", None),
])
@pytest.mark.parametrize("slice_dtype", [tf.float32, tf.bfloat16])
def test_copies_between_master_and_slices_follow_logical_to_physical(mesh_shape, layout, l2p,
                                                                     slice_dtype):
  value = np.arange(24, dtype=np.float32).reshape(4, 6)
  with tf.Graph().as_default():
    impl, w, lowering, slices = _lower_variable(
        mesh_shape, layout, l2p, mtf.VariableDType(tf.float32, slice_dtype, tf.float32), value)
    assert all(s.dtype == slice_dtype for s in slices)
    new_values = [-1.0 - _logical_part(impl, w.shape, value, impl.p2l(p)) for p in range(4)]
    assign_new = tf.group([s.assign(tf.cast(v, slice_dtype)) for s, v in zip(slices, new_values)])
    master = w.operation.get_master()
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.variables_initializer(tf.get_collection("TPU_VAR")))
      sess.run(lowering.copy_masters_to_slices())
      for p, s in enumerate(slices):
        np.testing.assert_allclose(sess.run(s).astype(np.float32),
                                   _logical_part(impl, w.shape, value, impl.p2l(p)))
      sess.run(assign_new)
      sess.run(lowering.copy_slices_to_masters())
      np.testing.assert_allclose(sess.run(master), -1.0 - value)


def test_slices_hold_their_parts_in_eager_mode():
  value = np.arange(24, dtype=np.float32).reshape(4, 6)
  impl, w, _, slices = _lower_variable("a:2;b:2", "r:b", [3, 2, 1, 0], value=value)
  for p, s in enumerate(slices):
    np.testing.assert_allclose(s.numpy(), _logical_part(impl, w.shape, value, impl.p2l(p)))


def test_lowering_again_under_auto_reuse_reuses_the_slices():
  with tf.Graph().as_default(), tf.variable_scope("model", reuse=tf.AUTO_REUSE):
    _, _, _, slices = _lower_variable("all:2", "r:all", None)
    _, _, _, slices_again = _lower_variable("all:2", "r:all", None)
    assert all(a is b for a, b in zip(slices_again, slices))
    assert len(tf.get_collection("TPU_VAR")) == 2


def test_sequence_mode_chains_the_copies_to_slices(monkeypatch):
  monkeypatch.setenv("MTF_SEQUENCE_MODE", "1")
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    for name in ("u", "v"):
      mtf.get_variable(mesh, name, "r:4", initializer=tf.zeros_initializer())
    impl = SimdMeshImpl("all:2", "r:all")
    lowering = mtf.Lowering(graph, {mesh: impl}, autostack=False)
    first, second = impl.copy_master_to_slice_ops
    assert first in second.control_inputs
    assert lowering.copy_masters_to_slices() is second


# ---- emulated execution on virtual CPUs ----

_KEYS = itertools.count(1000)  # collective group/instance keys, unique within the process


class _EmulatedTpuOps:
  """Stands in for tpu_ops while replica `replica`'s copy of the program is being built.

  Every collective is an all-gather (TF CollectiveGatherV2 across the replicas' CPU devices)
  followed by local selection, so the emulation is simple enough to trust.
  """

  def __init__(self, num_replicas: int):
    self.num_replicas = num_replicas
    self.replica = 0
    self._num_calls = [0] * num_replicas
    self._instance_keys = []
    self._group_keys = {}

  def _gather(self, t, group):
    """[len(group), *t.shape]: the members' t in group order (transported as float64)."""
    call = self._num_calls[self.replica]
    self._num_calls[self.replica] += 1
    while len(self._instance_keys) <= call:
      self._instance_keys.append(next(_KEYS))
    x = tf.expand_dims(tf.cast(t, tf.float64), 0)
    if len(group) > 1:
      key = tuple(sorted(group))
      group_key = self._group_keys.setdefault(key, next(_KEYS))
      x = tf.raw_ops.CollectiveGatherV2(input=x, group_size=len(group), group_key=group_key,
                                        instance_key=self._instance_keys[call], ordering_token=[])
      x = tf.gather(x, [key.index(p) for p in group])  # gathered in device (= replica) order
    return tf.cast(x, t.dtype)

  def _my_group(self, group_assignment):
    (group,) = [g for g in group_assignment if self.replica in g]
    return list(group)

  def tpu_replicated_input(self, inputs, name=None):
    return tf.constant(inputs[self.replica], name=name)

  def cross_replica_sum(self, x, group_assignment):
    return tf.reduce_sum(self._gather(x, self._my_group(group_assignment)), 0)

  def all_to_all(self, x, concat_dimension, split_dimension, split_count, group_assignment):
    group = self._my_group(group_assignment)
    assert split_count == len(group)
    gathered = self._gather(x, group)
    k = group.index(self.replica)
    return tf.concat([tf.split(gathered[j], split_count, axis=split_dimension)[k]
                      for j in range(len(group))], axis=concat_dimension)

  def collective_permute(self, x, source_target_pairs):
    gathered = self._gather(x, list(range(self.num_replicas)))
    sources = [s for s, t in source_target_pairs if t == self.replica]
    if sources:
      return gathered[sources[0]]
    with tf.control_dependencies([gathered]):  # an unfetched gather would leave its peers waiting
      return tf.zeros_like(x)


def _run_emulated(mesh_shape, per_replica_fn):
  """Builds per_replica_fn(impl, replica) for every replica on its own CPU; returns the values.

  Returns:
    a list indexed by physical pnum of the evaluated results.
  """
  size = mtf.convert_to_shape(mesh_shape).size
  emulator = _EmulatedTpuOps(size)
  fetches = []
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(simd, "_tpu_ops", lambda: emulator)
    for replica in range(size):
      emulator.replica = replica
      with tf.device("/cpu:%d" % replica):
        fetches.append(per_replica_fn(replica))
  with tf.Session(config=session_config()) as sess:
    # Mismatched collectives wait for absent peers: fail fast instead of hanging.
    return sess.run(fetches, options=tf.RunOptions(timeout_in_ms=180_000))


def _assemble(impl, shape, values_by_physical):
  """The whole array from per-replica slices; replicas holding the same part must agree."""
  full = np.zeros(shape.to_integer_list, dtype=np.asarray(values_by_physical[0]).dtype)
  parts = {}
  for logical in range(impl.size):
    value = values_by_physical[impl.l2p(logical)]
    begin = tuple(impl.slice_begin(shape, logical))
    if begin in parts:
      np.testing.assert_array_equal(value, parts[begin])
    parts[begin] = value
    full[tuple(slice(b, b + s) for b, s in zip(begin, np.shape(value)))] = value
  return full


_COLLECTIVES = {
    "allreduce_sum": lambda impl, x, axes: impl.allreduce(x, axes, "SUM"),
    "allreduce_max": lambda impl, x, axes: impl.allreduce(x, axes, "MAX"),
    "allreduce_min": lambda impl, x, axes: impl.allreduce(x, axes, "MIN"),
    "allconcat": lambda impl, x, axes: impl.allconcat(x, axes[0], 1),
    "alltoall": lambda impl, x, axes: impl.alltoall(x, axes[0], 0, 1),
    "shift": lambda impl, x, axes: impl.shift_by_n_processors(x, axes[0], 1, wrap=False),
    "shift_wrap": lambda impl, x, axes: impl.shift_by_n_processors(x, axes[0], -1, wrap=True),
    "pcoord": lambda impl, x, axes: impl.laid_out_pcoord(axes[0]),
}


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(st.sampled_from(sorted(_COLLECTIVES)), st.sampled_from([tf.float32, tf.int32, tf.bfloat16]),
       st.sampled_from(MESH_SHAPES).flatmap(
           lambda s: st.tuples(st.just(s), st.permutations(range(mtf.convert_to_shape(s).size)),
                               st.sets(st.integers(0, len(mtf.convert_to_shape(s)) - 1),
                                       min_size=1))),
       st.integers(0, 2 ** 16))
def test_collectives_match_the_placement_backend(name, dtype, case, seed):
  mesh_shape, l2p, axes = case
  axes = sorted(axes)
  collective = _COLLECTIVES[name]
  size = mtf.convert_to_shape(mesh_shape).size
  # Small integers: exact in every dtype (alltoall moves float32 as bfloat16).
  inputs = np.random.RandomState(seed).randint(-8, 8, size=[size, 8, 8])

  with tf.Graph().as_default():
    placement = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, "", [""] * size)
    expected = placement.LaidOutTensor([tf.constant(x, dtype) for x in inputs])
    expected_values = tf.Session().run(collective(placement, expected, axes).tensor_list)

    def per_replica(replica):
      impl = SimdMeshImpl(mesh_shape, "", logical_to_physical=l2p)
      x = impl.LaidOutTensor([tf.constant(inputs[impl.p2l(replica)], dtype)])
      return collective(impl, x, axes).one_slice
    actual = _run_emulated(mesh_shape, per_replica)

  impl = SimdMeshImpl(mesh_shape, "", logical_to_physical=l2p)
  for logical in range(size):
    np.testing.assert_array_equal(np.asarray(actual[impl.l2p(logical)], np.float64),
                                  np.asarray(expected_values[logical], np.float64))


def _lower_on_replicas(build_fn, mesh_shape, layout, l2p):
  """Builds build_fn(mesh) once, lowers it once per emulated replica; returns whole arrays."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  outputs = build_fn(mesh)

  def per_replica(replica):
    impl = SimdMeshImpl(mesh_shape, layout, logical_to_physical=l2p)
    lowering = mtf.Lowering(graph, {mesh: impl}, autostack=False)
    return [lowering.tensors[t].to_laid_out_tensor().one_slice for t in outputs]

  values = _run_emulated(mesh_shape, per_replica)
  impl = SimdMeshImpl(mesh_shape, layout, logical_to_physical=l2p)
  return [_assemble(impl, t.shape, [v[i] for v in values]) for i, t in enumerate(outputs)]


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(_mesh_layout_and_permutation({"b": 4, "i": 8, "j": 4, "k": 2}), st.integers(0, 2 ** 16))
def test_lowered_mtf_ops_match_numpy_on_emulated_replicas(case, seed):
  mesh_shape, layout, l2p = case
  rng = np.random.RandomState(seed)
  x = rng.randint(-4, 5, size=[4, 8, 2]).astype(np.float32)
  y = rng.randint(-4, 5, size=[8, 4]).astype(np.float32)

  def build(mesh):
    xm = mtf.import_tf_tensor(mesh, tf.constant(x), "b:4;i:8;k:2")
    ym = mtf.import_tf_tensor(mesh, tf.constant(y), "i:8;j:4")
    product = mtf.einsum([xm, ym], output_shape="b:4;k:2;j:4")             # sum over split i
    renamed = mtf.reshape(xm, "b:4;i2:8;k:2")                              # re-layout
    shifted = mtf.shift(ym, offset=3, dim=ym.shape.dims[0], wrap=True)
    col_max = mtf.reduce_max(ym, reduced_dim=ym.shape.dims[0])
    return [product, renamed, shifted, col_max, mtf.reduce_sum(product)]

  with tf.Graph().as_default():
    product, renamed, shifted, col_max, total = _lower_on_replicas(
        build, mesh_shape, layout, l2p)
  expected_product = np.einsum("bik,ij->bkj", x, y)
  np.testing.assert_allclose(product, expected_product)
  np.testing.assert_allclose(renamed, x)
  np.testing.assert_allclose(shifted, np.roll(y, 3, axis=0))
  np.testing.assert_allclose(col_max, y.max(0))
  np.testing.assert_allclose(total, expected_product.sum())


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(_mesh_layout_and_permutation({"b": 4, "i": 8}))
def test_random_values_agree_between_replicas_holding_the_same_slice(case):
  mesh_shape, layout, l2p = case

  def build(mesh):
    return [mtf.random_uniform(mesh, "b:4;i:8")]

  with tf.Graph().as_default():
    (value,) = _lower_on_replicas(build, mesh_shape, layout, l2p)  # checks agreement
  assert len(np.unique(value)) == value.size  # and distinct slices got distinct draws
  assert np.all((0 <= value) & (value < 1))  # one replica's draw, not a sum of several
