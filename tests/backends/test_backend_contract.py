"""One contract, every backend: the primitives and shared members behave the same everywhere.

Each test runs on every backend that executes -- placement in graph and eager mode, SIMD on
emulated replicas (one virtual CPU each, a non-identity logical-to-physical map) -- and compares
per-processor results with NumPy. The shape-only backend of `mtf.dry_run` joins the conformance
checks. A new backend adds a runner here.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._backends.collective import CollectiveMeshImpl
from mesh_tensorflow._backends.shape_only import ShapeOnlyMeshImpl
from mesh_tensorflow._backends.simd import SimdMeshImpl
from mesh_tensorflow._core.layout import processor_groups
from mesh_tensorflow._lowering import random_bits
from mesh_tensorflow._lowering.backend import BACKEND_PRIMITIVES, Backend, LaidOutVariableLike
from mesh_tensorflow._lowering.mesh_impl import MeshImpl
from tests.backends.test_simd_mesh_impl import _run_emulated
from tests.harness import cpu_devices, session_config

MESH = "rows:2;cols:4"
SIZE = 8


def _placement(layout):
  return mtf.placement_mesh_impl.PlacementMeshImpl(MESH, layout, cpu_devices(SIZE))


def _collective(**kwargs):
  return lambda layout: CollectiveMeshImpl(MESH, layout, cpu_devices(SIZE), **kwargs)


def _placement_runner(mode, make_impl=_placement):
  def run(layout, fn):
    """fn(impl, laid_out) -> LaidOutTensor (or a tuple); returns numpy values per logical pnum."""
    impl = make_impl(layout)

    def laid_out(arrays):
      return impl.LaidOutTensor([tf.identity(a) for a in
                                 mtf.parallel(impl.devices, tf.constant, list(arrays))])

    def build():
      out = fn(impl, laid_out)
      return [x.tensor_list for x in out] if isinstance(out, tuple) else out.tensor_list
    if mode == "eager":
      return tf.nest.map_structure(lambda t: np.asarray(t), build())
    with tf.Graph().as_default():
      fetches = build()
      with tf.Session(config=session_config()) as sess:
        return sess.run(fetches)
  return run


def _simd_runner(layout, fn):
  l2p = [5, 2, 7, 0, 3, 6, 1, 4]

  def per_replica(replica):
    impl = SimdMeshImpl(MESH, layout, logical_to_physical=l2p)
    pnum = impl.p2l(replica)
    out = fn(impl, lambda arrays: impl.LaidOutTensor([tf.constant(arrays[pnum])]))
    return [x.one_slice for x in out] if isinstance(out, tuple) else out.one_slice

  with tf.Graph().as_default():
    by_physical = _run_emulated(MESH, per_replica)
  by_logical = [by_physical[l2p[p]] for p in range(SIZE)]
  if isinstance(by_logical[0], list):
    return [[v[i] for v in by_logical] for i in range(len(by_logical[0]))]
  return by_logical


RUNNERS = {"placement_graph": _placement_runner("graph"), "placement_eager": _placement_runner("eager"),
           "simd": _simd_runner,
           "collective_graph": _placement_runner("graph", _collective()),
           "collective_eager": _placement_runner("eager", _collective()),
           # TF collective ops between the devices of this process, as between processes.
           "collective_tf_ops": _placement_runner("graph", _collective(in_process_fast_path=False,
                                                                       timeout_seconds=120))}


@pytest.fixture(params=sorted(RUNNERS))
def run(request):
  return RUNNERS[request.param]


def _inputs(seed=0, shape=(4, 8)):
  return list(np.random.RandomState(seed).randint(-8, 8, size=[SIZE, *shape]).astype(np.float32))


def _groups(mesh_axes):
  return processor_groups(mtf.convert_to_shape(MESH), mesh_axes)


@pytest.mark.parametrize("reduction,np_fn", [("SUM", np.sum), ("MAX", np.max), ("MIN", np.min)])
@pytest.mark.parametrize("mesh_axes", [[0], [1], [0, 1]])
def test_allreduce_reduces_within_each_group(run, reduction, np_fn, mesh_axes):
  xs = _inputs()
  got = run("", lambda impl, lo: impl.allreduce(lo(xs), mesh_axes, reduction))
  for group in _groups(mesh_axes):
    for pnum in group:
      np.testing.assert_array_equal(got[pnum], np_fn([xs[p] for p in group], axis=0))


@pytest.mark.parametrize("mesh_axis,concat_axis", [(0, 0), (1, 1), (1, 0)])
def test_allconcat_concatenates_the_group_in_coordinate_order(run, mesh_axis, concat_axis):
  xs = _inputs(1)
  got = run("", lambda impl, lo: impl.allconcat(lo(xs), mesh_axis, concat_axis))
  for group in _groups([mesh_axis]):
    for pnum in group:
      np.testing.assert_array_equal(got[pnum], np.concatenate([xs[p] for p in group], concat_axis))


@pytest.mark.parametrize("mesh_axis,split_axis,concat_axis", [(1, 1, 0), (0, 0, 1), (1, 0, 0)])
def test_alltoall_sends_the_jth_piece_to_the_jth_member(run, mesh_axis, split_axis, concat_axis):
  xs = _inputs(2)
  got = run("", lambda impl, lo: impl.alltoall(lo(xs), mesh_axis, split_axis, concat_axis))
  for group in _groups([mesh_axis]):
    n = len(group)
    for j, pnum in enumerate(group):
      expected = np.concatenate([np.split(xs[p], n, split_axis)[j] for p in group], concat_axis)
      np.testing.assert_array_equal(got[pnum], expected)


@pytest.mark.parametrize("mesh_axis", [0, 1])
def test_simd_allconcat_stacks_the_group_when_asked(mesh_axis):
  xs = _inputs(6)
  got = _simd_runner("", lambda impl, lo: impl.allconcat(lo(xs), mesh_axis, 1, stack=True))
  for group in _groups([mesh_axis]):
    for pnum in group:
      np.testing.assert_array_equal(got[pnum], np.stack([xs[p] for p in group], 1))


@pytest.mark.parametrize("offset,wrap", [(1, False), (-1, True), (3, True), (2, False)])
def test_shift_by_n_processors_receives_from_the_processor_offset_before(run, offset, wrap):
  xs = _inputs(3)
  got = run("", lambda impl, lo: impl.shift_by_n_processors(lo(xs), 1, offset, wrap))
  for group in _groups([1]):
    for k, pnum in enumerate(group):
      source = k - offset
      if wrap:
        source %= len(group)
      expected = xs[group[source]] if 0 <= source < len(group) else np.zeros_like(xs[0])
      np.testing.assert_array_equal(got[pnum], expected)


def test_pcoord_slicewise_tuples_and_allsplit(run):
  xs = _inputs(4)

  def fn(impl, lo):
    pcoord = impl.laid_out_pcoord(1)
    halves = impl.slicewise(lambda x: tuple(tf.split(x, 2, 1)), lo(xs))
    return (impl.slicewise(lambda c: tf.cast(c, tf.float32), pcoord), halves[1],
            impl.allsplit(lo(xs), 1, 1))
  pcoords, right_halves, pieces = run("", fn)
  for pnum in range(SIZE):
    assert pcoords[pnum] == pnum % 4
    np.testing.assert_array_equal(right_halves[pnum], xs[pnum][:, 4:])
    np.testing.assert_array_equal(pieces[pnum], xs[pnum][:, 2 * (pnum % 4):2 * (pnum % 4) + 2])


def _draw(impl, lo):
  """impl's slices of one random tensor of shape a:4;b:8 under a fixed stream key."""
  del lo
  shape = mtf.convert_to_shape("a:4;b:8")
  return impl.random(shape, tf.random.uniform, {"maxval": 10.0}, key=random_bits.stream_key(42, [7]))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["", "a:rows", "b:cols", "a:cols;b:rows"])
def test_random_draws_are_slices_of_one_tensor_whatever_the_layout_and_backend(run, layout):
  got = run(layout, _draw)
  # One algorithm: every backend and layout draws the slices of the tensor the placement backend
  # draws whole (the empty layout gives every processor all of it).
  whole = RUNNERS["placement_graph"]("", _draw)[0]
  assert len(np.unique(whole)) == whole.size  # independent draws
  impl = MeshImpl(MESH, layout)
  shape = mtf.convert_to_shape("a:4;b:8")
  for pnum in range(SIZE):
    (a, b), (size_a, size_b) = impl.slice_begin(shape, pnum), impl.slice_shape(shape)
    np.testing.assert_array_equal(got[pnum], whole[a:a + size_a, b:b + size_b])


def test_control_inputs_replicated_value_and_loop_vars_round_trip(run):
  xs = _inputs(5)

  def fn(impl, lo):
    x = lo(xs)
    assert len(impl.control_inputs(x)) == len(x.all_slices)
    assert impl.replicated_value(x) is x.all_slices[0]
    return impl.from_loop_vars(impl.loop_vars(x))
  got = run("", fn)
  for pnum in range(SIZE):
    np.testing.assert_array_equal(got[pnum], xs[pnum])


@pytest.mark.parametrize("impl", [
    mtf.placement_mesh_impl.PlacementMeshImpl(MESH, "", [""] * SIZE), SimdMeshImpl(MESH, ""),
    ShapeOnlyMeshImpl(MESH, ""), CollectiveMeshImpl(MESH, "", cpu_devices(SIZE))],
    ids=["placement", "simd", "shape_only", "collective"])
def test_every_backend_implements_the_primitives_and_the_protocol(impl):
  assert isinstance(impl, Backend)
  for name in BACKEND_PRIMITIVES:
    assert getattr(type(impl), name) is not getattr(MeshImpl, name, None), name
  for member in ("read", "assign_to_slices", "laid_out_tensor", "copy_master_to_slices",
                 "copy_slices_to_master"):
    assert hasattr(impl.LaidOutVariable, member), member


def _signature_mismatches(protocol, impl) -> list:
  """Where impl's methods cannot be called as the Protocol's are: one line per problem.

  Every Protocol parameter must exist in the implementation under the same name and at the same
  position (callers pass them positionally), keep a default where the Protocol has one, and
  *args / **kwargs where the Protocol takes them; the implementation's extra parameters need
  defaults. Attributes and properties must exist.
  """
  problems, cls = [], type(impl)
  for name in sorted(set(protocol.__annotations__) | {n for n in vars(protocol) if not n.startswith("_")}):
    if not hasattr(impl, name):
      problems.append(f"{cls.__name__} lacks {name}")
      continue
    wanted = vars(protocol).get(name)
    if not inspect.isfunction(wanted):
      continue
    got = getattr(cls, name)
    if not inspect.isfunction(got):
      problems.append(f"{cls.__name__}.{name} is not a method")
      continue
    want_params = list(inspect.signature(wanted).parameters.values())
    got_params = list(inspect.signature(got).parameters.values())
    got_by_name = {p.name: (i, p) for i, p in enumerate(got_params)}
    got_kinds = {p.kind for p in got_params}
    for i, p in enumerate(want_params):
      if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
        if p.kind not in got_kinds:
          problems.append(f"{cls.__name__}.{name} does not take {p}")
        continue
      if p.name not in got_by_name:
        problems.append(f"{cls.__name__}.{name} lacks parameter {p.name!r}")
        continue
      j, q = got_by_name[p.name]
      if j != i or q.kind != p.kind:
        problems.append(f"{cls.__name__}.{name}: {p.name!r} is not parameter {i} ({p.kind.description})")
      if p.default is not p.empty and q.default is q.empty:
        problems.append(f"{cls.__name__}.{name}: {p.name!r} has no default")
    for q in got_params:
      if (q.name not in {p.name for p in want_params} and q.default is q.empty
          and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)):
        problems.append(f"{cls.__name__}.{name}: extra parameter {q.name!r} without a default")
  return problems


@pytest.mark.parametrize("impl", [
    mtf.placement_mesh_impl.PlacementMeshImpl(MESH, "", [""] * SIZE), SimdMeshImpl(MESH, ""),
    ShapeOnlyMeshImpl(MESH, ""), CollectiveMeshImpl(MESH, "", cpu_devices(SIZE))],
    ids=["placement", "simd", "shape_only", "collective"])
def test_every_backend_method_takes_the_protocol_parameters(impl):
  assert _signature_mismatches(Backend, impl) == []


def test_the_signature_check_finds_a_backend_that_deviates():
  class Deviating(mtf.placement_mesh_impl.PlacementMeshImpl):
    def allconcat(self, x, concat_axis, mesh_axis):  # swapped
      raise AssertionError("not called")

    def allsplit(self, x, mesh_axis, split_axis, which):  # lost its default
      raise AssertionError("not called")

    def fusing(self, is_needed=None, *, budget):  # a required extra parameter
      raise AssertionError("not called")

  assert sorted(_signature_mismatches(Backend, Deviating(MESH, "", [""] * SIZE))) == [
      "Deviating.allconcat: 'concat_axis' is not parameter 3 (positional or keyword)",
      "Deviating.allconcat: 'mesh_axis' is not parameter 2 (positional or keyword)",
      "Deviating.allsplit: 'which' has no default",
      "Deviating.fusing: extra parameter 'budget' without a default"]


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_placement_variables_copy_assign_and_copy_back(mode):
  """LaidOutVariable: master -> slices, assign_to_slices(assign_fn, LaidOutTensor), slices -> master."""
  def body():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    v = mtf.get_variable(mesh, "v", "a:4;b:2", initializer=tf.constant_initializer(2.0))
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(MESH, "a:cols", cpu_devices(SIZE))
    lowering = mtf.Lowering(graph, {mesh: impl}, autostack=False)
    laid_out_variable = lowering.variables[v.operation]
    assert isinstance(laid_out_variable, LaidOutVariableLike)
    new_values = impl.slicewise(lambda x: x * 3.0, laid_out_variable.read())
    return lowering, laid_out_variable, v, new_values

  if mode == "eager":
    lowering, lov, v, new_values = body()
    lov.assign_to_slices(mtf.assign_slice, new_values)
    lowering.copy_slices_to_masters()  # eager: runs the copies now
    value = v.operation.get_master().numpy()
  else:
    with tf.Graph().as_default():
      lowering, lov, v, new_values = body()
      assign = lov.assign_to_slices(mtf.assign_slice, new_values)
      with tf.Session(config=session_config()) as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(lowering.copy_masters_to_slices())
        sess.run(assign)
        sess.run(lowering.copy_slices_to_masters())
        value = sess.run(v.operation.get_master())
  np.testing.assert_array_equal(value, np.full([4, 2], 6.0))
