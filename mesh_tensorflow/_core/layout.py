"""Layout rules (tensor dim -> mesh dim), tensor layouts and processor numbering.

Everything here is pure arithmetic on names and sizes: no TensorFlow, no devices.
Processors are numbered row-major over the mesh (last mesh axis fastest).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from mesh_tensorflow._core.dims import Dimension, Shape, convert_to_shape, list_product
from mesh_tensorflow._core.parsing import _parse_string_to_list_of_pairs


class LayoutRules:
  """A set of (tensor_dimension_name, mesh_dimension_name) pairs, e.g. "batch:rows;d_ff:cols"."""

  def __init__(self, pairs: Iterable):
    self._pairs = set(tuple(p) for p in pairs)

  def __repr__(self):
    return "LayoutRules%s" % self._pairs

  def __eq__(self, other):
    return isinstance(other, LayoutRules) and self._pairs == other._pairs

  def __hash__(self):
    return hash(frozenset(self._pairs))

  def __iter__(self):
    return iter(sorted(self._pairs))

  def tensor_dimension_to_mesh_axis(self, tensor_dimension: Dimension, mesh_shape) -> Optional[int]:
    """Index of the mesh dimension `tensor_dimension` is split over, or None if replicated."""
    mesh_shape = convert_to_shape(mesh_shape)
    axes = [i for i, mesh_dim in enumerate(mesh_shape)
            if (tensor_dimension.name, mesh_dim.name) in self._pairs]
    if len(axes) > 1:
      names = [mesh_shape[i].name for i in axes]
      raise ValueError(
          f"Layout rules map tensor dimension {tensor_dimension.name!r} to several mesh "
          f"dimensions {names}; keep at most one rule per tensor dimension.")
    return axes[0] if axes else None

  def tensor_layout(self, tensor_shape, mesh_shape) -> TensorLayout:
    """The TensorLayout of a tensor of `tensor_shape` on a mesh of `mesh_shape`."""
    tensor_shape = convert_to_shape(tensor_shape)
    mesh_shape = convert_to_shape(mesh_shape)
    axes = [self.tensor_dimension_to_mesh_axis(d, mesh_shape) for d in tensor_shape]
    _check_no_mesh_axis_used_twice(tensor_shape, mesh_shape, axes)
    return TensorLayout(axes)

  def mesh_dimension_name_to_tensor_dimension_names(self, mesh_dimension_name: str) -> list:
    return [t for t, m in self._pairs if m == mesh_dimension_name]


def _check_no_mesh_axis_used_twice(tensor_shape: Shape, mesh_shape: Shape, axes) -> None:
  seen = {}
  for dim, axis in zip(tensor_shape, axes):
    if axis is None:
      continue
    if axis in seen:
      fix = (f"The tensor holds {dim.name!r} with two sizes (a kernel mapping one to the other), "
             f"so its rule splits both: leave {dim.name!r} unsplit, or give one of them another "
             f"name." if seen[axis] == dim.name else
             "Remove one of the two layout rules, or rename one dimension.")
      raise ValueError(
          f"Layout maps tensor dimensions {seen[axis]!r} and {dim.name!r} of {tensor_shape} onto "
          f"the same mesh dimension {mesh_shape[axis].name!r}; a tensor may use each mesh "
          f"dimension once. {fix}")
    seen[axis] = dim.name


def convert_to_layout_rules(x) -> LayoutRules:
  """Accepts LayoutRules, a "tensor_dim:mesh_dim;..." string, or any iterable of pairs."""
  if isinstance(x, LayoutRules):
    return x
  if isinstance(x, str):
    x = _parse_string_to_list_of_pairs(x)
  return LayoutRules(x)


class TensorLayout:
  """For each tensor axis, the mesh axis it is split over (or None): TensorLayout(0, None)."""

  def __init__(self, tensor_axis_to_mesh_axis: Sequence[Optional[int]]):
    self._tensor_axis_to_mesh_axis = tuple(tensor_axis_to_mesh_axis)

  def __eq__(self, other):
    return (isinstance(other, TensorLayout)
            and self.tensor_axis_to_mesh_axis == other.tensor_axis_to_mesh_axis)

  def __ne__(self, other):
    return not self.__eq__(other)

  def __hash__(self):
    return hash(self._tensor_axis_to_mesh_axis)

  def __repr__(self):
    return "TensorLayout%s" % (self._tensor_axis_to_mesh_axis,)

  def __len__(self):
    return len(self._tensor_axis_to_mesh_axis)

  def __getitem__(self, key):
    return self._tensor_axis_to_mesh_axis[key]

  def __iter__(self):
    return iter(self._tensor_axis_to_mesh_axis)

  @property
  def tensor_axis_to_mesh_axis(self) -> tuple:
    return self._tensor_axis_to_mesh_axis

  @property
  def is_fully_replicated(self) -> bool:
    return all(a is None for a in self._tensor_axis_to_mesh_axis)

  def mesh_axis_to_tensor_axis(self, mesh_ndims: int) -> tuple:
    """For mesh axes 0..mesh_ndims-1, the tensor axis split over it (or None)."""
    axes = self._tensor_axis_to_mesh_axis
    return tuple(axes.index(m) if m in axes else None for m in range(mesh_ndims))




def _mesh_sizes(mesh_shape) -> list:
  if isinstance(mesh_shape, Shape):
    return mesh_shape.to_integer_list
  if isinstance(mesh_shape, list):
    return mesh_shape
  raise ValueError(f"mesh_shape must be a Shape or a list of ints, got {mesh_shape!r}.")


def pnum_to_processor_coordinates(mesh_shape, pnum: int) -> list:
  """Processor number -> its coordinate on the mesh (row-major, last axis fastest)."""
  sizes = _mesh_sizes(mesh_shape)
  coords = []
  for size in reversed(sizes):
    coords.append(pnum % size)
    pnum //= size
  return coords[::-1]


def processor_coordinates_to_pnum(mesh_shape, coord) -> int:
  sizes = _mesh_sizes(mesh_shape)
  pnum = 0
  for c, size in zip(coord, sizes):
    pnum = pnum * size + c
  return pnum


def pnum_to_group(mesh_shape, group_dims, pnum: int) -> int:
  """Id of the group of `pnum` among processors that differ only along `group_dims` (mesh axes)."""
  sizes = _mesh_sizes(mesh_shape)
  coord = pnum_to_processor_coordinates(sizes, pnum)
  rest = [i for i in range(len(sizes)) if i not in group_dims]
  return processor_coordinates_to_pnum([sizes[i] for i in rest], [coord[i] for i in rest])


def processor_groups(mesh_shape, group_dims) -> list:
  """Lists of pnums differing only along mesh axes `group_dims`, by group id, pnums ascending."""
  sizes = _mesh_sizes(mesh_shape)
  groups = {}
  for pnum in range(list_product(sizes)):
    groups.setdefault(pnum_to_group(sizes, group_dims, pnum), []).append(pnum)
  return [groups[k] for k in sorted(groups)]


def _mesh_axis_of(layout, mesh_shape, tensor_dim):
  layout = convert_to_layout_rules(layout)
  mesh_shape = convert_to_shape(mesh_shape)
  if isinstance(tensor_dim, str):
    tensor_dim = Dimension(tensor_dim, 0)
  return layout.tensor_dimension_to_mesh_axis(tensor_dim, mesh_shape), mesh_shape


def tensor_dim_to_mesh_dim_size(layout, mesh_shape, tensor_dim) -> int:
  """How many ways `tensor_dim` is split under `layout` (1 if replicated)."""
  axis, mesh_shape = _mesh_axis_of(layout, mesh_shape, tensor_dim)
  return 1 if axis is None else mesh_shape[axis].size


def tensor_dim_to_size_per_split(layout, mesh_shape, tensor_dim) -> int:
  """Size of one shard of `tensor_dim`; ValueError if the split does not divide it."""
  mesh_dim_size = tensor_dim_to_mesh_dim_size(layout, mesh_shape, tensor_dim)
  if tensor_dim.size % mesh_dim_size:
    raise ValueError(
        f"Tensor dimension {tensor_dim.name!r} of size {tensor_dim.size} is split {mesh_dim_size} "
        f"ways, which does not divide it; change the layout rule or the dimension size.")
  return tensor_dim.size // mesh_dim_size


def slice_shape(tensor_shape, mesh_shape, layout_rules) -> list:
  """Per-processor shape of a tensor under `layout_rules` on a mesh of `mesh_shape` (pure arithmetic).

  ValueError if the layout maps two tensor dims to one mesh dim, one tensor dim to two mesh dims,
  or splits a dimension over a mesh dimension whose size does not divide it.
  """
  tensor_shape = convert_to_shape(tensor_shape)
  mesh_shape = convert_to_shape(mesh_shape)
  layout = convert_to_layout_rules(layout_rules).tensor_layout(tensor_shape, mesh_shape)
  ret = []
  for dim, mesh_axis in zip(tensor_shape, layout):
    if mesh_axis is None:
      ret.append(dim.size)
      continue
    mesh_dim = mesh_shape[mesh_axis]
    _check_divides(tensor_shape, dim, mesh_dim)
    ret.append(dim.size // mesh_dim.size)
  return ret


def _check_divides(tensor_shape: Shape, dim: Dimension, mesh_dim: Dimension) -> None:
  if dim.size % mesh_dim.size:
    raise ValueError(
        f"Tensor dimension {dim.name!r} (size {dim.size}) of {tensor_shape} is split over mesh "
        f"dimension {mesh_dim.name!r} (size {mesh_dim.size}), which does not divide it. "
        f"Change the layout rule {dim.name}:{mesh_dim.name}, or make {dim.name!r} a "
        f"multiple of {mesh_dim.size}.")
