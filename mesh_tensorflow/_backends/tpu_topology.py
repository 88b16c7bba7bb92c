"""Logical-to-physical processor maps for TPU meshes: pure Python, no TensorFlow, no devices.

A TPU slice is a physical grid of chips (usually [rows, cols, cores_per_chip]). The mtf mesh is a
logical grid. Collectives along a logical mesh axis are fastest when the processors of each group
are physical neighbours, ideally on a ring, so these helpers choose a permutation
`logical_to_physical[logical_pnum] = physical_pnum` (both row-major numberings).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from absl import logging

from mesh_tensorflow._core.dims import Dimension, Shape, list_product
from mesh_tensorflow._core.layout import pnum_to_processor_coordinates, processor_coordinates_to_pnum


def _ring_2d(m: int, n: int) -> list:
  """Visiting order of the cells of an m x n grid, each cell adjacent to the previous one.

  When m or n is even (and both exceed 1) the last cell is also adjacent to the first, so the
  order is a ring. For m = n = 4:

      0 -- 1 -- 2 -- 3
      |              |
      15   6 -- 5 -- 4
      |    |
      14   7 -- 8 -- 9
      |              |
      13-- 12-- 11-- 10

  Returns:
    a list of m * n (row, col) pairs.
  """
  if m == 1:
    return [(0, j) for j in range(n)]
  if n == 1:
    return [(i, 0) for i in range(m)]
  if m % 2 == 0:
    ret = [(0, 0)]
    for i in range(m):  # snake through columns 1..n-1, two rows at a time...
      cols = range(1, n) if i % 2 == 0 else range(n - 1, 0, -1)
      ret.extend((i, j) for j in cols)
    ret.extend((i, 0) for i in range(m - 1, 0, -1))  # ...then back up column 0
    return ret
  if n % 2 == 0:
    return [(i, j) for j, i in _ring_2d(n, m)]
  logging.warning("_ring_2d(%d, %d): both sides odd, so no ring exists; using a snake path.", m, n)
  return _snake([m, n])


def _snake(sizes: Sequence[int]) -> list:
  """Boustrophedon order of an n-d grid: consecutive coordinate tuples differ by 1 in one axis."""
  if not sizes:
    return [()]
  inner = _snake(sizes[1:])
  ret = []
  for i in range(sizes[0]):
    ret.extend((i,) + c for c in (inner if i % 2 == 0 else reversed(inner)))
  return ret


def _check_same_rank(sizes_and_strides, physical_shape) -> None:
  if len(sizes_and_strides) != len(physical_shape):
    raise ValueError(
        f"sizes_and_strides {sizes_and_strides} needs one (size, stride) pair per physical axis "
        f"of physical_shape {physical_shape}.")


def _logical_1d_to_physical_subspace_auto(sizes_and_strides, physical_shape) -> list:
  """Maps a 1-D logical mesh onto a strided sub-grid (containing the origin) of the physical mesh.

  `sizes_and_strides[d] = (size, stride)` says the sub-grid takes `size` positions spaced `stride`
  apart along physical axis d; the logical mesh has prod(sizes) processors. Consecutive logical
  processors land on sub-grid neighbours, and on a ring when the sub-grid allows one.

  Args:
    sizes_and_strides: a list of n (size, stride) pairs.
    physical_shape: a list of n integers.
  Returns:
    for each logical processor, its physical coordinates (a list of n integers).
  """
  _check_same_rank(sizes_and_strides, physical_shape)
  sizes = [size for size, _ in sizes_and_strides]
  strides = [stride for _, stride in sizes_and_strides]
  active = [d for d, size in enumerate(sizes) if size > 1]
  if not active:
    orders = [()]
  elif len(active) == 1:
    orders = [(i,) for i in range(sizes[active[0]])]
  else:
    # A ring over (first active axis) x (snake over the other active axes).
    rest = _snake([sizes[d] for d in active[1:]])
    orders = [(i,) + rest[j] for i, j in _ring_2d(sizes[active[0]], len(rest))]
  ret = []
  for order in orders:
    coord = [0] * len(physical_shape)
    for d, c in zip(active, order):
      coord[d] = c * strides[d]
    ret.append(coord)
  return ret


def _logical_to_physical_v1(sizes_and_strides, physical_shape,
                            fn_1d: Callable = _logical_1d_to_physical_subspace_auto) -> list:
  """Maps an m-D logical mesh onto an n-D physical mesh, one strided sub-grid per logical axis.

  `sizes_and_strides[i]` is the list of n (size, stride) pairs for logical axis i (see
  `_logical_1d_to_physical_subspace_auto`); logical axis i has size prod(sizes). A processor's
  physical coordinates are the sum of the sub-grid coordinates of its logical coordinates.

  Returns:
    for each logical pnum (row-major), its physical coordinates.
  Raises:
    ValueError: if the sizes do not multiply to the physical size, or the map is not a bijection.
  """
  logical_shape = [list_product(size for size, _ in axis) for axis in sizes_and_strides]
  n = list_product(physical_shape)
  if n != list_product(logical_shape):
    raise ValueError(
        f"Logical mesh {logical_shape} (from sizes_and_strides={sizes_and_strides}) has "
        f"{list_product(logical_shape)} processors but physical_shape={physical_shape} has {n}.")
  axis_layouts = [fn_1d(axis, physical_shape) for axis in sizes_and_strides]
  ret = []
  for logical_pnum in range(n):
    logical_coord = pnum_to_processor_coordinates(logical_shape, logical_pnum)
    physical_coord = [0] * len(physical_shape)
    for axis_layout, c in zip(axis_layouts, logical_coord):
      physical_coord = [p + q for p, q in zip(physical_coord, axis_layout[c])]
    ret.append(physical_coord)
  _check_is_permutation(
      [processor_coordinates_to_pnum(physical_shape, c) for c in ret], n,
      f"sizes_and_strides={sizes_and_strides} on physical_shape={physical_shape}")
  return ret


def _check_is_permutation(pnums, n: int, what: str) -> None:
  if any(not 0 <= p < n for p in pnums) or sorted(pnums) != list(range(n)):
    raise ValueError(f"{what} does not map the processors one-to-one onto range({n}): {pnums}.")


def physical_shape_3d_from_topology_proto_4d(mesh_shape: Sequence[int]) -> list:
  """TPU topology mesh shape [x, y, z, cores_per_chip] -> [y * z, x, cores_per_chip]."""
  if len(mesh_shape) != 4:
    raise ValueError(f"Expected a 4-D TPU topology shape [x, y, z, core], got {list(mesh_shape)}.")
  return [mesh_shape[1] * mesh_shape[2], mesh_shape[0], mesh_shape[3]]


def _is_power_of_2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def pnum_to_processor_coordinates_nd(mesh_shape, pnum: int, device_assignment) -> list:
  """Physical coordinates of replica `pnum` (core 0 of it) under a TPU device assignment.

  Args:
    mesh_shape: unused (kept for 0.1.21's signature): the coordinates come from the assignment.
    pnum: a replica number.
    device_assignment: a tf.tpu.experimental.DeviceAssignment (or any object with
      coordinates(replica, logical_core)).
  """
  del mesh_shape
  return list(device_assignment.coordinates(pnum, 0))


def processor_coordinates_to_pnum_map_nd(mesh_shape, logical_to_physical, device_assignment) -> list:
  """The replica number at each physical coordinate of `logical_to_physical`.

  The inverse of pnum_to_processor_coordinates_nd for a one-core-per-chip slice: a coordinate
  (x, y[, z]) of `mesh_shape` (the physical [x, y, cores] grid) is looked up among the replicas'
  coordinates in the device assignment's topology.

  Args:
    mesh_shape: the physical grid, [x, y, ...] (a list of integers or a Shape).
    logical_to_physical: physical coordinates, one per logical processor.
    device_assignment: a tf.tpu.experimental.DeviceAssignment.

  Returns:
    the replica numbers, one per entry of logical_to_physical.

  Raises:
    ValueError: if a coordinate holds no replica of the assignment.
  """
  sizes = mesh_shape.to_integer_list if isinstance(mesh_shape, Shape) else list(mesh_shape)
  hardware = [int(size) for size in device_assignment.topology.mesh_shape]

  def linear(coord, grid) -> int:
    return coord[0] + coord[1] * grid[0] + (coord[2] * grid[0] * grid[1] if len(coord) > 2 else 0)

  replica_at = {linear(device_assignment.coordinates(replica, 0), hardware): replica
                for replica in range(device_assignment.num_replicas)}
  out = []
  for coord in logical_to_physical:
    key = linear(list(coord)[:2], sizes)
    if not all(0 <= c < size for c, size in zip(list(coord)[:2], sizes)) or key not in replica_at:
      raise ValueError(f"processor_coordinates_to_pnum_map_nd: no replica of the device assignment "
                       f"sits at physical coordinate {list(coord)}; the assignment covers "
                       f"{device_assignment.num_replicas} replicas of topology {hardware}.")
    out.append(replica_at[key])
  return out


def auto_logical_to_physical_tpu(logical_shape: Sequence[int], physical_shape: Sequence[int],
                                 return_coordinates: bool = False, device_assignment=None) -> list:
  """A logical-to-physical map for a TPU slice that keeps later logical axes physically compact.

  For [rows, cols, 2] slices (or their 4-D topology form [x, y, 1, 2]) with power-of-2 rows and
  cols: a 1-D mesh is a ring of chips; otherwise the first logical axis counts rectangular tiles
  of chips, laid on a ring, and the remaining axes are mapped recursively inside each tile.
  Slices of one core per chip ([rows, cols, 1]) are laid out the same way when `device_assignment`
  is given, which then names the replica at each chosen chip. Other physical shapes (and one-core
  slices without a device assignment) get the identity map.

  Example: auto_logical_to_physical_tpu([16, 8], [8, 8, 2]) puts each group of 8 along the second
  logical axis on a 2x2 block of chips (2 cores each), and the 16 blocks on a ring.

  Args:
    logical_shape: the mesh shape, a list of integers.
    physical_shape: e.g. [8, 8, 2] or a topology shape [8, 8, 1, 2].
    return_coordinates: return physical coordinates instead of physical pnums.
    device_assignment: a tf.tpu.experimental.DeviceAssignment; used (and needed) for
      [rows, cols, 1] slices, whose physical pnums are its replica numbers.
  Returns:
    logical_to_physical: a permutation of range(prod(physical_shape)) (or coordinate lists).
  Raises:
    ValueError: if the two shapes have different numbers of processors.
  """
  logical_shape = list(logical_shape)
  physical_shape = list(physical_shape)
  if list_product(logical_shape) != list_product(physical_shape):
    raise ValueError(
        f"auto_logical_to_physical_tpu: logical_shape={logical_shape} and "
        f"physical_shape={physical_shape} must have the same number of processors.")
  logical_shape = [size for size in logical_shape if size != 1]
  num_cores = list_product(logical_shape)
  if len(physical_shape) == 4 and physical_shape[2] == 1:
    physical_shape = physical_shape_3d_from_topology_proto_4d(physical_shape)
  cores_per_chip = 1 if device_assignment is not None or return_coordinates else 2
  if (len(physical_shape) != 3 or physical_shape[2] not in (cores_per_chip, 2)
      or not all(_is_power_of_2(p) for p in physical_shape[:2])):
    logging.warning("auto_logical_to_physical_tpu: unrecognised physical shape %s; using the "
                    "identity map.", physical_shape)
    identity = list(range(num_cores))
    if return_coordinates:
      return [pnum_to_processor_coordinates(physical_shape, p) for p in identity]
    return identity
  p0, p1, p2 = physical_shape
  if len(logical_shape) == 1:
    ring = _ring_2d(p0, p1)
    coords = [ring[pnum // p2] + (pnum % p2,) for pnum in range(num_cores)]
  else:
    t0, t1 = _tile_shape(logical_shape, p0, p1, p2)
    tile_size = t0 * t1 * p2
    in_tile = auto_logical_to_physical_tpu(logical_shape[1:], [t0, t1, p2], return_coordinates=True)
    tiles_ring = _ring_2d(p0 // t0, p1 // t1)
    coords = []
    for pnum in range(num_cores):
      tile_i, tile_j = tiles_ring[pnum // tile_size]
      i, j, core = in_tile[pnum % tile_size]
      coords.append((tile_i * t0 + i, tile_j * t1 + j, core))
  if return_coordinates:
    return [list(c) for c in coords]
  if p2 == 1:
    return processor_coordinates_to_pnum_map_nd(physical_shape, coords, device_assignment)
  return [processor_coordinates_to_pnum(physical_shape, list(c)) for c in coords]


def _tile_shape(logical_shape, p0: int, p1: int, p2: int) -> tuple:
  """Chips per tile (t0, t1) when logical_shape[0] tiles cover a p0 x p1 grid of p2-core chips."""
  tile_chips = list_product(logical_shape[1:]) // p2
  if len(logical_shape) == 2 and tile_chips == p0:
    return tile_chips, 1  # one column of chips per tile
  if len(logical_shape) == 2 and tile_chips == p1:
    return 1, tile_chips  # one row of chips per tile
  t0 = 2 ** ((tile_chips.bit_length() - 1) // 2)  # roughly square, but must fit in p0 x p1
  t0 = max(min(t0, p0), tile_chips // p1)
  return t0, tile_chips // t0


class HierarchicalTiling:
  """A mesh whose logical axes tile the physical mesh hierarchically (outer axes most strided).

  `spec` lists the logical axes as (name, projected_shape): projected_shape is the logical axis'
  extent along each physical axis. The last axis takes a compact tile, each earlier axis strides
  over the tiles of the later ones. Only the first projected_shape may be None (inferred).

  Example: HierarchicalTiling([("batch", None), ("model", [2, 2, 1])], [4, 4, 2]) gives
  mesh_shape Shape[batch=8, model=4]: each "model" group is a 2x2 block of chips (one core each),
  and the 8 blocks x 2 cores are the "batch" axis.
  """

  def __init__(self, spec, physical_shape: Sequence[int]):
    physical_shape = list(physical_shape)
    self._names = [name for name, _ in spec]
    projected = [None if s is None else list(s) for _, s in spec]
    _check_spec_shapes(spec, projected, physical_shape)
    if projected and projected[0] is None:
      projected[0] = list(physical_shape)
      for s in projected[1:]:
        projected[0] = [p // x for p, x in zip(projected[0], s)]
    strides = [1] * len(physical_shape)
    sizes_and_strides = []
    for s in reversed(projected):
      sizes_and_strides.append(list(zip(s, strides)))
      strides = [stride * x for stride, x in zip(strides, s)]
    if strides != physical_shape:
      raise ValueError(
          f"HierarchicalTiling spec {spec} multiplies to {strides} along the physical axes, "
          f"not physical_shape={physical_shape}; fix the projected shapes.")
    sizes_and_strides.reverse()
    self._physical_coordinates = _logical_to_physical_v1(sizes_and_strides, physical_shape)
    self._logical_to_physical = [processor_coordinates_to_pnum(physical_shape, c)
                                 for c in self._physical_coordinates]
    self._mesh_shape = Shape([Dimension(name, list_product(s))
                              for name, s in zip(self._names, projected)])

  @property
  def logical_to_physical(self) -> list:
    return self._logical_to_physical

  @property
  def mesh_shape(self) -> Shape:
    return self._mesh_shape

  @classmethod
  def spec_to_mesh_shape(cls, spec, num_processors: int) -> Shape:
    """The mesh shape of `spec` on num_processors cores, before the physical shape is known."""
    names = [name for name, _ in spec]
    sizes: list[Optional[int]] = [None if s is None else list_product(s) for _, s in spec]
    if sizes and sizes[0] is None:
      sizes[0] = num_processors // list_product(sizes[1:])
    if None in sizes or list_product(sizes) != num_processors:
      raise ValueError(
          f"HierarchicalTiling spec {spec} gives mesh sizes {sizes}, whose product is not "
          f"num_processors={num_processors}; only the first projected shape may be None.")
    return Shape([Dimension(name, size) for name, size in zip(names, sizes)])


def _check_spec_shapes(spec, projected, physical_shape) -> None:
  for i, s in enumerate(projected):
    if s is None and i > 0:
      raise ValueError(f"HierarchicalTiling spec {spec}: only the first axis may have projected "
                       f"shape None, but axis {i} ({spec[i][0]!r}) has None.")
    if s is not None and len(s) != len(physical_shape):
      raise ValueError(
          f"HierarchicalTiling spec {spec}: axis {spec[i][0]!r} has projected shape {s} of "
          f"rank {len(s)}; it needs one entry per physical axis of {physical_shape}.")
