"""Shifts along a dimension (static and data-dependent) and 1-D pooling/striding by reshaping."""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, Shape
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._ops import _checks as checks
from mesh_tensorflow._ops import binary as binary_ops
from mesh_tensorflow._ops import einsum as einsum_ops
from mesh_tensorflow._ops import elementwise as elementwise_ops
from mesh_tensorflow._ops import indexing as indexing_ops
from mesh_tensorflow._ops import io as io_ops
from mesh_tensorflow._ops import reduce as reduce_ops
from mesh_tensorflow._ops import reshape as reshape_ops

__all__ = ["ShiftOperation", "shift", "dynamic_shift", "pool_tensor_1d", "stride_tensor_1d"]


class ShiftOperation(Operation):
  """y[..., i, ...] = x[..., i - offset, ...] along `dim`, wrapping around or filling with zeros.

  When `dim` is split into blocks of size b over a mesh dimension, an offset o = q*b + r moves
  whole blocks q processors along that mesh dimension, plus (if r > 0) the last r entries of each
  block one processor further:

      | output block k, positions | come from                                  |
      | [0, r)                    | block k - q - 1, positions [b - r, b)      |
      | [r, b)                    | block k - q,     positions [0, b - r)      |
  """

  def __init__(self, x: Tensor, offset: int, dim: Dimension, wrap: bool, name: Optional[str] = None):
    checks.check_dim_in(f"shift {x.graph.unique_name(name or 'shift', mark_as_used=False)!r}", "dim",
                        dim, x)
    super().__init__([x], name=name or "shift")
    self._dim = dim
    self._axis = x.shape.dims.index(dim)
    self._offset = offset
    self._wrap = wrap
    self._outputs = [Tensor(self, x.shape, x.dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def gradient(self, grad_ys):
    return [shift(grad_ys[0], -self._offset, self._dim, self._wrap)]

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    x = lowering.tensors[self.inputs[0]].to_laid_out_tensor()
    size = self._dim.size
    if not self._wrap and abs(self._offset) >= size:
      y = mesh_impl.slicewise(tf.zeros_like, x)
    elif mesh_impl.tensor_dimension_to_mesh_axis(self._dim) is None:
      y = mesh_impl.slicewise(lambda t: self._shift_slice(t, size), x)
    else:
      y = self._lower_split(lowering, mesh_impl, x)
    lowering.set_tensor_lowering(self.outputs[0], y)

  def _slice(self, t, begin: int, size: int):
    """t[..., begin:begin + size, ...] along this op's axis."""
    ndims = t.shape.ndims
    return tf.slice(t, [0] * self._axis + [begin] + [0] * (ndims - self._axis - 1),
                    [-1] * self._axis + [size] + [-1] * (ndims - self._axis - 1))

  def _shift_slice(self, t, size: int):
    """The whole shift on one processor (dim not split)."""
    if self._wrap:
      o = self._offset % size
      return tf.concat([self._slice(t, size - o, o), self._slice(t, 0, size - o)], axis=self._axis)
    o = self._offset
    paddings = [[0, 0]] * t.shape.ndims
    paddings[self._axis] = [max(o, 0), max(-o, 0)]
    return tf.pad(self._slice(t, max(-o, 0), size - abs(o)), paddings)

  def _lower_split(self, lowering, mesh_impl, x):
    """Shift across processors: whole blocks via shift_by_n_processors, in two parts if needed."""
    mesh_axis = mesh_impl.tensor_dimension_to_mesh_axis(self._dim)
    block = self._dim.size // mesh_impl.shape[mesh_axis].size
    q, r = divmod(self._offset, block)
    comm = lowering.comm(self)
    if r == 0:
      return comm.shift_by_n_processors(x, mesh_axis, q, self._wrap, "shift_op")
    tail = mesh_impl.slicewise(lambda t: self._slice(t, block - r, r), x)
    head = mesh_impl.slicewise(lambda t: self._slice(t, 0, block - r), x)
    first = comm.shift_by_n_processors(tail, mesh_axis, q + 1, self._wrap, "shift_op")
    second = comm.shift_by_n_processors(head, mesh_axis, q, self._wrap, "shift_op")
    return mesh_impl.slicewise(lambda a, b: tf.concat([a, b], axis=self._axis), first, second)


def shift(x: Tensor, offset: int, dim: Dimension, wrap: bool, name: Optional[str] = None) -> Tensor:
  """Shifts x by a static `offset` along `dim` (positive: toward higher indices).

  Entries shifted past an end wrap around if `wrap`, else are dropped and zeros shift in.
  """
  return ShiftOperation(x, offset, dim, wrap, name=name).outputs[0]


def dynamic_shift(x: Tensor, offset: Tensor, dim: Dimension, wrap: bool) -> Tensor:
  """Shifts x along `dim` by an integer Tensor `offset` (one offset per index of its dims).

  `offset`'s dims must be dims of x other than `dim`. Implemented as an einsum with a 0/1
  permutation matrix over [dim, dynamic_shift_tmp], so it is differentiable and layout-agnostic.
  """
  checks.check_dim_in("dynamic_shift", "dim", dim, x)
  if dim in offset.shape.dims:
    raise ValueError(f"dynamic_shift: the shifted {dim} may not be a dimension of offset "
                     f"({offset.shape}); one offset applies to the whole of {dim.name!r}.")
  extra = [d for d in offset.shape.dims if d not in x.shape.dims]
  if extra:
    raise ValueError(f"dynamic_shift: offset dims {extra} are not in x's {x.shape}; offset.shape must "
                     f"be a subset of x.shape.")
  tmp_dim = Dimension("dynamic_shift_tmp", dim.size)
  x_tmp = reshape_ops.replace_dimensions(x, dim, tmp_dim)
  # [offset dims..., tmp, dim]: when x is [others..., dim] (a decoded batch), x_tmp broadcasts to
  # this order and the sum over tmp leaves x's order, so no slice is transposed
  source = offset + io_ops.mtf_range(x.mesh, tmp_dim, dtype=tf.int32)
  if wrap:
    source = binary_ops.mod(source, dim.size)
  perm = elementwise_ops.cast(
      binary_ops.equal(source, io_ops.mtf_range(x.mesh, dim, dtype=tf.int32)), x.dtype)
  return einsum_ops.einsum([x_tmp, perm], output_shape=x.shape)


def _split_for_pooling(tensor: Tensor, pool_dim: Dimension, pool_size: int, what: str):
  """Reshapes pool_dim into [pool_dim/pool_size, _low=pool_size]; returns (tensor, _low dim)."""
  checks.check_dim_in(what, "pool_dim", pool_dim, tensor)
  if pool_size <= 0 or pool_dim.size % pool_size:
    raise ValueError(f"{what}: pool_size {pool_size} does not divide {pool_dim}; pick a divisor.")
  axis = tensor.shape.dims.index(pool_dim)
  low = Dimension("_low", pool_size)
  dims = tensor.shape.dims
  new_shape = Shape(dims[:axis] + [Dimension(pool_dim.name, pool_dim.size // pool_size), low]
                    + dims[axis + 1:])
  return reshape_ops.reshape(tensor, new_shape), low


def pool_tensor_1d(tensor: Tensor, pool_dim: Dimension, reduce_fn: Optional[Callable] = None,
                   pool_size: int = 2) -> Tensor:
  """Pools non-overlapping windows of `pool_size` along pool_dim with reduce_fn (default reduce_mean).

  reduce_fn is called as reduce_fn(t, reduced_dim=...), e.g. mtf.reduce_max.
  """
  reduce_fn = reduce_fn or reduce_ops.reduce_mean
  reshaped, low = _split_for_pooling(tensor, pool_dim, pool_size, "pool_tensor_1d")
  return reduce_fn(reshaped, reduced_dim=low)


def stride_tensor_1d(tensor: Tensor, pool_dim: Dimension, pool_size: int = 2) -> Tensor:
  """Keeps every `pool_size`-th entry along pool_dim (the first of each window)."""
  reshaped, low = _split_for_pooling(tensor, pool_dim, pool_size, "stride_tensor_1d")
  return indexing_ops.reduce_first(reshaped, reduced_dim=low)
