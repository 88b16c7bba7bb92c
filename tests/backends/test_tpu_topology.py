"""Logical-to-physical TPU processor maps (pure Python: no TPU, no TensorFlow ops)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from mesh_tensorflow import simd_mesh_impl
from tests.harness import MAX_EXAMPLES

HierarchicalTiling = simd_mesh_impl.HierarchicalTiling


def _adjacent(a, b) -> bool:
  return sum(abs(x - y) for x, y in zip(a, b)) == 1


def _chip(coord):
  return tuple(coord[:2])


# ---- _ring_2d ----

def test_ring_2d_matches_the_documented_4x4_ring():
  assert simd_mesh_impl._ring_2d(4, 4) == [
      (0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (1, 2), (1, 1), (2, 1),
      (2, 2), (2, 3), (3, 3), (3, 2), (3, 1), (3, 0), (2, 0), (1, 0)]


@settings(max_examples=MAX_EXAMPLES * 4, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9))
def test_ring_2d_visits_each_cell_once_stepping_to_neighbours(m, n):
  ring = simd_mesh_impl._ring_2d(m, n)
  assert sorted(ring) == [(i, j) for i in range(m) for j in range(n)]
  assert all(_adjacent(a, b) for a, b in zip(ring, ring[1:]))


@settings(max_examples=MAX_EXAMPLES * 4, deadline=None)
@given(st.integers(2, 9), st.integers(2, 9))
def test_ring_2d_closes_into_a_ring_when_a_side_is_even(m, n):
  ring = simd_mesh_impl._ring_2d(m, n)
  assert _adjacent(ring[-1], ring[0]) == (m % 2 == 0 or n % 2 == 0)


# ---- 1-D subspaces and _logical_to_physical_v1 ----

@st.composite
def _subspace(draw):
  """(sizes_and_strides, physical_shape) with each strided sub-grid fitting its physical axis."""
  ndims = draw(st.integers(1, 3))
  sizes_and_strides, physical_shape = [], []
  for _ in range(ndims):
    size, stride = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    sizes_and_strides.append((size, stride))
    physical_shape.append(size * stride + draw(st.integers(0, 2)))
  return sizes_and_strides, physical_shape


@settings(max_examples=MAX_EXAMPLES * 4, deadline=None)
@given(_subspace())
def test_logical_1d_subspace_covers_the_strided_subgrid_stepping_to_neighbours(case):
  sizes_and_strides, physical_shape = case
  coords = simd_mesh_impl._logical_1d_to_physical_subspace_auto(sizes_and_strides, physical_shape)
  expected = sorted(
      tuple(c) for c in _grid([range(0, size * stride, stride) for size, stride in sizes_and_strides]))
  assert sorted(tuple(c) for c in coords) == expected
  assert coords[0] == [0] * len(physical_shape)
  steps = [[(a - b) // stride for a, b, (_, stride) in zip(x, y, sizes_and_strides)]
           for x, y in zip(coords[1:], coords)]
  assert all(sum(abs(s) for s in step) == 1 for step in steps)


def _grid(ranges):
  if not ranges:
    return [[]]
  return [[x] + rest for x in ranges[0] for rest in _grid(ranges[1:])]


def test_logical_1d_subspace_needs_one_pair_per_physical_axis():
  with pytest.raises(ValueError, match="one .size, stride. pair per physical axis"):
    simd_mesh_impl._logical_1d_to_physical_subspace_auto([(2, 1)], [2, 2])


def test_logical_to_physical_v1_combines_subspaces_into_a_bijection():
  # Logical [2, 4] on physical [4, 2]: axis 0 strides by 2 along physical axis 0, axis 1 is the
  # compact 2x2 block.
  coords = simd_mesh_impl._logical_to_physical_v1([[(2, 2), (1, 1)], [(2, 1), (2, 1)]], [4, 2])
  assert len(coords) == 8
  assert sorted(map(tuple, coords)) == [(i, j) for i in range(4) for j in range(2)]
  assert {tuple(c) for c in coords[:4]} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_logical_to_physical_v1_size_mismatch_raises():
  with pytest.raises(ValueError, match="has 4 processors but physical_shape=.2, 4. has 8"):
    simd_mesh_impl._logical_to_physical_v1([[(2, 1), (1, 1)], [(1, 1), (2, 1)]], [2, 4])


def test_logical_to_physical_v1_overlapping_subspaces_raise():
  # Both logical axes claim physical stride 1: processors collide.
  with pytest.raises(ValueError, match="does not map the processors one-to-one"):
    simd_mesh_impl._logical_to_physical_v1([[(2, 1)], [(2, 1)]], [4])


# ---- physical_shape_3d_from_topology_proto_4d ----

def test_physical_shape_3d_from_topology_proto_4d_merges_y_and_z():
  assert simd_mesh_impl.physical_shape_3d_from_topology_proto_4d([8, 4, 2, 2]) == [8, 8, 2]


def test_physical_shape_3d_from_topology_proto_4d_rejects_other_ranks():
  with pytest.raises(ValueError, match="4-D TPU topology shape"):
    simd_mesh_impl.physical_shape_3d_from_topology_proto_4d([8, 8, 2])


# ---- auto_logical_to_physical_tpu ----

def _is_permutation(l2p, n):
  return sorted(l2p) == list(range(n))


@pytest.mark.parametrize("first, second", [
    ([128], [8, 8, 2]), ([8, 16], [8, 8, 2]), ([32, 4], [8, 8, 2]), ([2, 32, 4], [256]),
    ([4, 4, 8], [8, 8, 2]), ([16, 8], [8, 8, 1, 2]), ([2, 2, 2], [2, 2, 2]), ([1, 8, 1], [2, 2, 2]),
])
def test_auto_logical_to_physical_tpu_returns_a_permutation(first, second):
  # Upstream's tests pass (physical, logical) into the (logical, physical) parameters; the
  # function only needs the two products to agree.
  for logical, physical in [(first, second), (second, first)]:
    assert _is_permutation(simd_mesh_impl.auto_logical_to_physical_tpu(logical, physical),
                           mtf.list_product(physical))


@st.composite
def _tpu_case(draw):
  """A [2^a, 2^b, 2] slice and a logical shape of powers of 2 with the same processor count."""
  p0, p1 = 2 ** draw(st.integers(0, 3)), 2 ** draw(st.integers(0, 3))
  lg = (p0 * p1 * 2).bit_length() - 1
  cuts = sorted(draw(st.lists(st.integers(0, lg), max_size=3)))
  bounds = [0] + cuts + [lg]
  logical = [2 ** (b - a) for a, b in zip(bounds, bounds[1:])]
  return logical, [p0, p1, 2]


@settings(max_examples=MAX_EXAMPLES * 4, deadline=None)
@given(_tpu_case())
def test_auto_logical_to_physical_tpu_is_a_permutation_with_matching_coordinates(case):
  logical, physical = case
  l2p = simd_mesh_impl.auto_logical_to_physical_tpu(logical, physical)
  coords = simd_mesh_impl.auto_logical_to_physical_tpu(logical, physical, return_coordinates=True)
  assert _is_permutation(l2p, mtf.list_product(physical))
  assert l2p == [mtf.processor_coordinates_to_pnum(physical, c) for c in coords]


@settings(max_examples=MAX_EXAMPLES * 4, deadline=None)
@given(_tpu_case())
def test_auto_logical_to_physical_tpu_1d_mesh_is_a_ring_of_chips(case):
  _, physical = case
  n = mtf.list_product(physical)
  coords = simd_mesh_impl.auto_logical_to_physical_tpu([n], physical, return_coordinates=True)
  chips = [_chip(c) for c in coords[::2]]
  assert all(_adjacent(a, b) for a, b in zip(chips, chips[1:]))
  assert all(_chip(a) == _chip(b) for a, b in zip(coords[::2], coords[1::2]))  # both cores of a chip


@pytest.mark.parametrize("logical, physical, tile_chips", [
    ([16, 8], [8, 8, 2], (2, 2)), ([8, 16], [8, 8, 2], (8, 1)), ([4, 32], [8, 8, 2], (4, 4)),
])
def test_auto_logical_to_physical_tpu_puts_each_last_axis_group_in_a_rectangle_of_chips(
    logical, physical, tile_chips):
  coords = simd_mesh_impl.auto_logical_to_physical_tpu(logical, physical, return_coordinates=True)
  group = logical[-1]
  for start in range(0, len(coords), group):
    chips = {_chip(c) for c in coords[start:start + group]}
    rows = {i for i, _ in chips}
    cols = {j for _, j in chips}
    assert (len(rows), len(cols)) == tile_chips
    assert len(chips) == len(rows) * len(cols) == group // 2


@pytest.mark.parametrize("physical", [[256], [4, 4, 1], [3, 2, 2], [2, 2, 4, 2]])
def test_auto_logical_to_physical_tpu_unrecognised_physical_shape_gives_identity(physical):
  n = mtf.list_product(physical)
  assert simd_mesh_impl.auto_logical_to_physical_tpu([n], physical) == list(range(n))


def test_auto_logical_to_physical_tpu_size_mismatch_raises():
  with pytest.raises(ValueError, match="must have the same number of processors"):
    simd_mesh_impl.auto_logical_to_physical_tpu([64], [8, 8, 2])


# ---- HierarchicalTiling ----

@st.composite
def _tiling_case(draw):
  """A spec with 1-3 logical axes over a 1-3 axis physical mesh (first projection maybe None)."""
  num_logical, num_physical = draw(st.integers(1, 3)), draw(st.integers(1, 3))
  factors = [[draw(st.integers(1, 3)) for _ in range(num_physical)] for _ in range(num_logical)]
  physical = [mtf.list_product(f[d] for f in factors) for d in range(num_physical)]
  spec = [("axis%d" % i, f) for i, f in enumerate(factors)]
  if draw(st.booleans()):
    spec[0] = (spec[0][0], None)
  return spec, physical


@settings(max_examples=MAX_EXAMPLES * 4, deadline=None)
@given(_tiling_case())
def test_hierarchical_tiling_is_a_permutation_with_the_spec_mesh_shape(case):
  spec, physical = case
  tiling = HierarchicalTiling(spec, physical)
  n = mtf.list_product(physical)
  assert _is_permutation(tiling.logical_to_physical, n)
  assert tiling.mesh_shape == HierarchicalTiling.spec_to_mesh_shape(spec, n)


@pytest.mark.parametrize("spec", [
    [("dp", None)], [("dp", None), ("mp", [1, 1, 2])], [("dp", [8, 8, 1]), ("mp", [1, 1, 2])],
    [("dp", None), ("mp", [2, 8, 1])], [("dp", None), ("mp", [2, 2, 2])],
    [("dp", None), ("mp", [4, 1, 2])], [("dp", None), ("mp", [2, 2, 1]), ("mp2", [2, 2, 1])],
])
def test_hierarchical_tiling_of_an_8x8x2_slice(spec):
  tiling = HierarchicalTiling(spec, [8, 8, 2])
  assert _is_permutation(tiling.logical_to_physical, 128)
  assert tiling.mesh_shape == HierarchicalTiling.spec_to_mesh_shape(spec, 128)


def test_hierarchical_tiling_last_axis_takes_compact_tiles():
  tiling = HierarchicalTiling([("batch", None), ("model", [2, 2, 1])], [4, 4, 2])
  assert tiling.mesh_shape == mtf.Shape([mtf.Dimension("batch", 8), mtf.Dimension("model", 4)])
  for start in range(0, 32, 4):
    coords = [mtf.pnum_to_processor_coordinates([4, 4, 2], p)
              for p in tiling.logical_to_physical[start:start + 4]]
    i0, j0, core = coords[0]
    assert i0 % 2 == 0 and j0 % 2 == 0
    assert sorted(map(tuple, coords)) == [(i0 + a, j0 + b, core) for a in (0, 1) for b in (0, 1)]
    assert all(_adjacent(a, b) for a, b in zip(coords, coords[1:] + coords[:1]))  # a ring


@pytest.mark.parametrize("spec, physical, match", [
    ([("a", [2, 2]), ("b", [2, 1])], [4, 4], "multiplies to .4, 2. along the physical axes"),
    ([("a", [2, 2]), ("b", None)], [4, 4], "only the first axis may have projected shape None"),
    ([("a", None), ("b", [2, 2, 1])], [4, 4], "needs one entry per physical axis"),
])
def test_hierarchical_tiling_bad_spec_raises(spec, physical, match):
  with pytest.raises(ValueError, match=match):
    HierarchicalTiling(spec, physical)


def test_spec_to_mesh_shape_infers_the_first_axis():
  shape = HierarchicalTiling.spec_to_mesh_shape([("batch", None), ("model", [2, 4])], 64)
  assert shape == mtf.convert_to_shape("batch:8;model:8")


def test_spec_to_mesh_shape_wrong_processor_count_raises():
  with pytest.raises(ValueError, match="not num_processors=64"):
    HierarchicalTiling.spec_to_mesh_shape([("batch", [4]), ("model", [2, 4])], 64)


class _FakeDeviceAssignment:
  """The part of tf.tpu.experimental.DeviceAssignment the *_nd maps read: replica -> (x, y, z)."""

  def __init__(self, topology_shape, replica_coordinates):
    self.topology = type("Topology", (), {"mesh_shape": np.array(topology_shape)})()
    self._coordinates = replica_coordinates
    self.num_replicas = len(replica_coordinates)

  def coordinates(self, replica, logical_core):
    assert logical_core == 0
    return np.array(self._coordinates[replica])


# A 2x2 slice of one-core chips whose replicas are numbered out of physical order.
_ASSIGNMENT = _FakeDeviceAssignment([2, 2, 1, 1], [[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 1, 0]])


def test_pnum_to_processor_coordinates_nd_reads_the_device_assignment():
  assert [mtf.pnum_to_processor_coordinates_nd([4], p, _ASSIGNMENT) for p in range(4)] == [
      [1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 1, 0]]


def test_processor_coordinates_to_pnum_map_nd_inverts_it():
  coords = [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]
  assert mtf.processor_coordinates_to_pnum_map_nd([2, 2, 1], coords, _ASSIGNMENT) == [1, 2, 3, 0]
  with pytest.raises(ValueError, match=r"no replica .* at physical coordinate \[2, 0, 0\]"):
    mtf.processor_coordinates_to_pnum_map_nd([2, 2, 1], [[2, 0, 0]], _ASSIGNMENT)


def test_auto_logical_to_physical_tpu_one_core_chips_maps_the_ring_through_the_device_assignment():
  ring = simd_mesh_impl.auto_logical_to_physical_tpu([4], [2, 2, 1], return_coordinates=True)
  assert [tuple(c[:2]) for c in ring] == simd_mesh_impl._ring_2d(2, 2)
  replicas = simd_mesh_impl.auto_logical_to_physical_tpu([4], [2, 2, 1], device_assignment=_ASSIGNMENT)
  assert [_ASSIGNMENT.coordinates(r, 0).tolist()[:2] for r in replicas] == [c[:2] for c in ring]
  assert replicas == [1, 3, 0, 2]
  # two-core chips ignore the assignment (their pnums are row-major), as in 0.1.21
  assert (simd_mesh_impl.auto_logical_to_physical_tpu([8], [2, 2, 2], device_assignment=_ASSIGNMENT)
          == simd_mesh_impl.auto_logical_to_physical_tpu([8], [2, 2, 2]))
