"""Placement backend collectives on processor groups of 1-D, 2-D and 3-D meshes, graph and eager."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import MODES, cpu_devices, run_tf

MESHES_AND_AXES = [
    ([8], [0]), ([2, 4], [0]), ([2, 4], [1]), ([2, 4], [0, 1]),
    ([2, 2, 2], [1]), ([2, 2, 2], [0, 2]), ([2, 2, 2], [0, 1, 2]), ([1, 2, 4], [2]),
]


def _impl(sizes):
  shape = [("m%d" % i, s) for i, s in enumerate(sizes)]
  return mtf.placement_mesh_impl.PlacementMeshImpl(shape, "", cpu_devices(int(np.prod(sizes))))


def _inputs(n, shape=(8, 16), seed=0):
  rng = np.random.RandomState(seed)
  return [rng.randint(-50, 50, size=shape).astype(np.float32) for _ in range(n)]


def _laid_out(impl, arrays):
  tensors = []
  for device, a in zip(impl.devices, arrays):
    with tf.device(device):
      tensors.append(tf.constant(a))
  return impl.LaidOutTensor(tensors)


def _group_of(sizes, axes, pnum):
  return next(g for g in mtf.processor_groups(sizes, axes) if pnum in g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes,axes", MESHES_AND_AXES)
@pytest.mark.parametrize("reduction", ["SUM", "MAX", "MIN"])
def test_allreduce_reduces_within_each_group(mode, sizes, axes, reduction):
  impl = _impl(sizes)
  xs = _inputs(impl.size)
  # A large shard (>= 1024 elements) exercises the chunked ring as well.
  big = _inputs(impl.size, shape=(32, 64), seed=1)
  got = run_tf(mode, lambda: impl.allreduce(_laid_out(impl, xs), axes, reduction).tensor_list
             + impl.allreduce(_laid_out(impl, big), axes, reduction).tensor_list)
  np_fn = {"SUM": np.sum, "MAX": np.max, "MIN": np.min}[reduction]
  for pnum in range(impl.size):
    group = _group_of(sizes, axes, pnum)
    np.testing.assert_allclose(got[pnum], np_fn([xs[q] for q in group], axis=0))
    np.testing.assert_allclose(got[impl.size + pnum], np_fn([big[q] for q in group], axis=0))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes,axes", [m for m in MESHES_AND_AXES if len(m[1]) == 1])
@pytest.mark.parametrize("concat_axis", [0, 1])
def test_allconcat_concatenates_in_group_order(mode, sizes, axes, concat_axis):
  impl = _impl(sizes)
  xs = _inputs(impl.size)
  got = run_tf(mode, lambda: impl.allconcat(_laid_out(impl, xs), axes[0], concat_axis).tensor_list)
  for pnum in range(impl.size):
    group = _group_of(sizes, axes, pnum)
    np.testing.assert_array_equal(got[pnum], np.concatenate([xs[q] for q in group], concat_axis))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes,axes", [m for m in MESHES_AND_AXES if len(m[1]) == 1])
@pytest.mark.parametrize("split_axis,concat_axis", [(0, 1), (1, 0), (1, 1)])
def test_alltoall_sends_jth_piece_to_jth_member(mode, sizes, axes, split_axis, concat_axis):
  impl = _impl(sizes)
  xs = _inputs(impl.size)
  got = run_tf(mode, lambda: impl.alltoall(
      _laid_out(impl, xs), axes[0], split_axis, concat_axis).tensor_list)
  for pnum in range(impl.size):
    group = _group_of(sizes, axes, pnum)
    j = group.index(pnum)
    pieces = [np.split(xs[q], len(group), axis=split_axis)[j] for q in group]
    np.testing.assert_array_equal(got[pnum], np.concatenate(pieces, concat_axis))


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_ring_equals_pointwise(mode):
  devices = cpu_devices(4)
  xs = _inputs(4)

  def build():
    ts = []
    for d, a in zip(devices, xs):
      with tf.device(d):
        ts.append(tf.constant(a))
    return (mtf.placement_mesh_impl.alltoall_ring(ts, devices, 1, 0)
            + mtf.placement_mesh_impl.alltoall_pointtwise(ts, devices, 1, 0))
  got = run_tf(mode, build)
  for a, b in zip(got[:4], got[4:]):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes,axes", [([2, 4], [1]), ([2, 2, 2], [0]), ([8], [0])])
@pytest.mark.parametrize("offset,wrap", [(1, True), (-1, False), (3, False), (2, True)])
def test_shift_by_n_processors_receives_from_offset_neighbour(mode, sizes, axes, offset, wrap):
  impl = _impl(sizes)
  xs = _inputs(impl.size)
  got = run_tf(mode, lambda: impl.shift_by_n_processors(
      _laid_out(impl, xs), axes[0], offset, wrap).tensor_list)
  n = sizes[axes[0]]
  for pnum in range(impl.size):
    group = _group_of(sizes, axes, pnum)
    source = group.index(pnum) - offset
    if wrap:
      source %= n
    expected = xs[group[source]] if 0 <= source < n else np.zeros_like(xs[0])
    np.testing.assert_array_equal(got[pnum], expected)


@pytest.mark.parametrize("mode", MODES)
def test_allsplit_and_pcoord_on_a_3d_mesh(mode):
  sizes = [2, 2, 2]
  impl = _impl(sizes)
  xs = _inputs(impl.size)
  got = run_tf(mode, lambda: impl.allsplit(_laid_out(impl, xs), 1, 1).tensor_list
             + [tf.convert_to_tensor(t) for t in impl.laid_out_pcoord(2).tensor_list])
  for pnum in range(impl.size):
    coord = mtf.pnum_to_processor_coordinates(sizes, pnum)
    np.testing.assert_array_equal(got[pnum], np.split(xs[pnum], 2, axis=1)[coord[1]])
    assert got[impl.size + pnum] == coord[2]


@pytest.mark.parametrize("mode", MODES)
def test_make_and_combine_slices_round_trip(mode):
  impl = mtf.placement_mesh_impl.PlacementMeshImpl("r:2;c:2;d:2", "a:d;b:r", cpu_devices(8))
  shape = mtf.convert_to_shape("a:4;b:6;e:3")
  full = np.arange(72, dtype=np.float32).reshape(4, 6, 3)

  def build():
    slices = impl.make_slices(tf.constant(full), shape)
    return [impl.combine_slices(slices, shape)] + slices
  got = run_tf(mode, build)
  np.testing.assert_array_equal(got[0], full)
  for pnum in range(8):
    begin = impl.slice_begin(shape, pnum)
    np.testing.assert_array_equal(got[1 + pnum], full[begin[0]:begin[0] + 2, begin[1]:begin[1] + 3])
