"""Named dimensions and shapes: the vocabulary every other module speaks."""

from __future__ import annotations

import collections
import functools
import numbers
import operator
from collections import abc
from typing import Iterable, Optional, Union

from mesh_tensorflow._core.errors import DimensionSpecError
from mesh_tensorflow._core.parsing import _parse_string_to_list_of_pairs

Dimension = collections.namedtuple("Dimension", ["name", "size"])
Dimension.__doc__ = "A named tensor dimension, e.g. Dimension('batch', 8). Equality compares name and size."


def convert_to_dimension(d) -> Optional[Dimension]:
  """Converts a Dimension or a (name, size) pair to a Dimension; None stays None.

  Raises DimensionSpecError (a TypeError and a ValueError) for a bare size such as `5`, a bare
  name such as `"batch"`, or a pair that is not (str, int); ValueError for a negative size.
  """
  if d is None:
    return None
  _check_not_bare(d)
  if not isinstance(d, Dimension):
    _check_is_pair(d)
  name, size = d
  _check_name_and_size(d, name, size)
  return d if isinstance(d, Dimension) else Dimension(name, size)


def _check_not_bare(d) -> None:
  if isinstance(d, str):
    raise DimensionSpecError(
        f"Dimension name {d!r} has no size: write mtf.Dimension({d!r}, size), or give the whole "
        f"shape as a string such as '{d}:8'.")
  if isinstance(d, numbers.Integral):
    raise DimensionSpecError(
        f"Bare size {d!r} where a Dimension is expected: mtf dimensions are named (layouts refer to "
        f"them by name), so write mtf.Dimension('name', {d}), or 'name:{d}' in a shape string.")


def _check_is_pair(d) -> None:
  if not isinstance(d, abc.Sized) or not isinstance(d, abc.Iterable) or len(d) != 2:
    raise DimensionSpecError(
        f"Bad dimension {d!r}: expected mtf.Dimension(name, size) or a (name, size) pair, "
        f"e.g. mtf.Dimension('batch', 8).")


def _check_name_and_size(d, name, size) -> None:
  if not isinstance(name, str) or not isinstance(size, int) or isinstance(size, bool):
    raise DimensionSpecError(
        f"Bad dimension {d!r}: expected (name: str, size: int), got name of type "
        f"{type(name).__name__} and size of type {type(size).__name__}; e.g. mtf.Dimension('batch', 8).")
  if size < 0:
    raise ValueError(f"Dimension {name!r} has negative size {size}; sizes must be >= 0.")


def list_product(l: Iterable[int]) -> int:
  return functools.reduce(operator.mul, l, 1)


def names_with_two_sizes(shape) -> set:
  """The names that `shape` holds twice, with two sizes (a kernel [d_model=6, d_model=2])."""
  names = [d.name for d in shape]
  return {n for n in names if names.count(n) > 1}


class Shape:
  """An ordered list of distinct Dimensions, e.g. Shape[batch=8, d_model=512].

  `dims` is a list of Dimensions or (name, size) pairs, or a string "batch:8;d_model:512".
  As in 0.1.21, a list of Dimensions may hold a name with two sizes: a kernel [d_model=6,
  d_model=2] maps d_model=6 to d_model=2, and the two are different Dimensions (a layout splits
  both or neither). A string may not ("heads:4;heads:8" is a typo far more often than a kernel).
  """

  def __init__(self, dims: Union[Iterable, str] = ()):
    spec = dims if isinstance(dims, str) else None
    if spec is not None:
      dims = _parse_string_to_list_of_pairs(spec, seconds_to_int=True)
    self._dims = [convert_to_dimension(d) for d in tuple(dims)]
    if spec is not None:
      _check_string_names_once(spec, self._dims)
    if len(set(self._dims)) != len(self._dims):
      repeated = sorted({d.name for d in self._dims if self._dims.count(d) > 1})
      raise ValueError(
          f"Shape {self._dims} repeats dimension name(s) {repeated} with the same size; each "
          f"dimension of a tensor must be distinct (rename one, e.g. with mtf.rename_dimension).")

  @property
  def dims(self) -> list:
    return list(self._dims)

  @property
  def ndims(self) -> int:
    return len(self._dims)

  def __repr__(self):
    return self.to_string

  def __str__(self):
    return self.to_string

  def __eq__(self, other):
    return isinstance(other, Shape) and self.dims == other.dims

  def __ne__(self, other):
    return not self.__eq__(other)

  def __hash__(self):
    return hash(tuple(self._dims))

  def __len__(self):
    return len(self._dims)

  def __getitem__(self, key):
    return self._dims[key]

  def __iter__(self):
    return iter(self._dims)

  def __add__(self, other):
    if isinstance(other, Shape):
      other = other.dims
    if isinstance(other, Dimension):
      other = [other]
    return Shape(self.dims + list(other))

  def __sub__(self, other):
    if other is None:
      return self
    if isinstance(other, Shape):
      other = other.dims
    if isinstance(other, Dimension):
      if other not in self._dims:
        raise ValueError(f"Subtracting {other} from {self}: that dimension is not in the shape.")
      other = [other]
    return Shape([d for d in self._dims if d not in other])

  @property
  def to_integer_list(self) -> list:
    return [d.size for d in self._dims]

  @property
  def size(self) -> int:
    return list_product(self.to_integer_list)

  @property
  def to_string(self) -> str:
    return "Shape[%s]" % ", ".join(f"{d.name}={d.size}" for d in self._dims)

  @property
  def cumprod(self) -> list:
    """Exclusive cumulative product of sizes, e.g. [1, 8, 4096] for [8, 512, ...]."""
    ret, acc = [], 1
    for d in self._dims:
      ret.append(acc)
      acc *= d.size
    return ret

  def cumprod_to_tensor_axis(self, cumprod: int) -> Optional[int]:
    """The largest tensor axis whose exclusive cumprod equals `cumprod`, else None."""
    matches = [i for i, c in enumerate(self.cumprod) if c == cumprod]
    return matches[-1] if matches else None

  @property
  def dimension_names(self) -> list:
    return [d.name for d in self._dims]

  def _index_of(self, name: str) -> int:
    for i, d in enumerate(self._dims):
      if d.name == name:
        return i
    raise ValueError(f"No dimension named {name!r} in {self}; available: {self.dimension_names}.")

  def rename_dimension(self, old_name: str, new_name: str) -> Shape:
    """This shape with dimension `old_name` called `new_name`, which it must not already hold."""
    i = self._index_of(old_name)
    check_rename_target_is_free(self, old_name, new_name, f"rename_dimension of {self}")
    dims = self.dims
    dims[i] = Dimension(new_name, dims[i].size)
    return Shape(dims)

  def resize_dimension(self, name: str, new_size: int) -> Shape:
    i = self._index_of(name)
    dims = self.dims
    dims[i] = Dimension(name, new_size)
    return Shape(dims)

  def get_dim_by_name(self, name: str) -> Dimension:
    return self._dims[self._index_of(name)]


def _check_string_names_once(spec: str, dims: list) -> None:
  repeated = sorted(names_with_two_sizes(dims))
  if repeated:
    sizes = {n: [d.size for d in dims if d.name == n] for n in repeated}
    raise ValueError(
        f"Shape string {spec!r} names {repeated} more than once (sizes {sizes}); each name may "
        f"appear once in a shape string. Fix the typo, or, for a kernel that maps a dim to a "
        f"resized one, pass a list of Dimensions, e.g. [mtf.Dimension('d', 6), mtf.Dimension('d', 2)].")


def check_rename_target_is_free(shape: Shape, old_name: str, new_name: str, what: str) -> None:
  """Renaming `old_name` onto a name the shape already holds would give one name two sizes."""
  if new_name == old_name or new_name not in shape.dimension_names:
    return
  held = shape.get_dim_by_name(new_name)
  raise ValueError(
      f"{what}: cannot rename {old_name!r} (size {shape.get_dim_by_name(old_name).size}) to "
      f"{new_name!r}: the shape already has {held}. Pick a name the shape does not hold.")


ShapeLike = Union[Shape, str, Iterable, None]


def convert_to_shape(x: ShapeLike) -> Optional[Shape]:
  """Accepts a Shape, a "name:size;..." string or a list of Dimensions / (name, size) pairs."""
  if x is None:
    return None
  if isinstance(x, Shape):
    return x
  return Shape(x)


def combined_dimension(dims, name: Optional[str] = None) -> Dimension:
  """One Dimension whose size is the product of `dims` (named `name` or after the first)."""
  if not dims:
    raise ValueError("combined_dimension needs at least one dimension.")
  return Dimension(name or dims[0].name, list_product(d.size for d in dims))


def anonymous_shape(shape: ShapeLike) -> Shape:
  """Same sizes, dimensions renamed _anonymous_0, _anonymous_1, ... (names no layout rule matches)."""
  shape = convert_to_shape(shape)
  return Shape([Dimension("_anonymous_%i" % i, d.size) for i, d in enumerate(shape)])


def is_subsequence(short_seq, long_seq) -> bool:
  """True iff `short_seq` appears in order (not necessarily contiguous) in `long_seq`."""
  if not short_seq:
    return True
  pos = 0
  for x in long_seq:
    if pos < len(short_seq) and short_seq[pos] == x:
      pos += 1
  return pos == len(short_seq)
