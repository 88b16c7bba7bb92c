"""Non-overlapping 2-D / 3-D max and average pooling (ksize == strides, VALID), and its gradient.

"..._2D" pools the two dims before the channel dim, "..._3D" the three; leading dims are batch.
Pooled dims keep their names and shrink to size // stride; they must stay whole on each processor
(declared unsplittable, so the layout check rejects a layout splitting them).
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, Shape, list_product
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering.tf_helpers import pool_fn

__all__ = ["PoolOperation", "PoolBackPropOperation", "pool_backprop"]

_POOL_FN_STRINGS = ("AVG_2D", "MAX_2D", "AVG_3D", "MAX_3D")


class PoolArgumentError(ValueError, AssertionError):
  """Bad pooling arguments. Also an AssertionError, which is what upstream's asserts raised."""


def _spatial_rank(op_name: str, x: Tensor, ksize, strides, pool_fn_string: str) -> int:
  """Validates the arguments of a pool op; returns its number of pooled dims (2 or 3)."""
  if pool_fn_string not in _POOL_FN_STRINGS:
    raise PoolArgumentError(
        f"{op_name!r}: pool_fn_string must be one of {_POOL_FN_STRINGS}, got {pool_fn_string!r}.")
  rank = 2 if pool_fn_string.endswith("2D") else 3
  if list(ksize) != list(strides):
    raise PoolArgumentError(
        f"{op_name!r}: only non-overlapping pooling is supported, so ksize must equal strides; "
        f"got ksize={list(ksize)}, strides={list(strides)}.")
  if len(ksize) != rank or not all(isinstance(k, int) and k > 0 for k in ksize):
    raise PoolArgumentError(
        f"{op_name!r}: {pool_fn_string} needs ksize of {rank} positive ints, got {list(ksize)}.")
  if x.shape.ndims < rank + 1:
    raise PoolArgumentError(
        f"{op_name!r}: {pool_fn_string} pools the {rank} dims before the channel dim, so the input "
        f"needs at least {rank + 1} dims; got {x.shape}.")
  if not x.dtype.is_floating:
    raise PoolArgumentError(
        f"{op_name!r}: pooling needs a floating-point input, got {x.name!r} of dtype {x.dtype.name}.")
  return rank


class _PoolingOperation(Operation):
  """A pool op or its gradient: the pooled (spatial) dims are unsplittable."""

  def _declare_spatial_dims_unsplittable(self, spatial_dims) -> None:
    self._splittable_dims, self._unsplittable_dims = self._initialize_splittable_and_unsplittable_dims(
        "splittable", [d.name for d in spatial_dims])

  def unsplittable_reason(self, dim_name: str) -> str:
    return (f"pooling needs the pooled dim {dim_name!r} whole on every processor; pool within blocks "
            f"of a blocks dim instead")


class PoolOperation(_PoolingOperation):
  """Max or average pooling with ksize == strides and VALID padding.

  Example: `PoolOperation(x, [2, 2], [2, 2], "MAX_2D")` on [b, h=8, w=8, c] gives [b, h=4, w=4, c].
  """

  def __init__(self, x: Tensor, ksize: Sequence[int], strides: Sequence[int], pool_fn_string: str,
               name: Optional[str] = None):
    super().__init__([x], name=name or "pool")
    rank = _spatial_rank(self.name, x, ksize, strides, pool_fn_string)
    self._ksize = list(ksize)
    self._strides = list(strides)
    self._pool_fn_string = pool_fn_string
    dims = x.shape.dims
    spatial_dims = dims[-(rank + 1):-1]
    out_spatial = [Dimension(d.name, d.size // s) for d, s in zip(spatial_dims, self._strides)]
    self._outputs = [Tensor(self, Shape(dims[:-(rank + 1)] + out_spatial + dims[-1:]), x.dtype)]
    self._declare_spatial_dims_unsplittable(spatial_dims)

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    fn = pool_fn(self._pool_fn_string)
    y = mesh_impl.slicewise(lambda x: fn(x, self._ksize, self._strides), lowering.tensors[self.inputs[0]])
    lowering.set_tensor_lowering(self.outputs[0], y)

  def gradient(self, grad_ys):
    return [pool_backprop(self.inputs[0], self.outputs[0], grad_ys[0], self._ksize, self._strides,
                          self._pool_fn_string)]


def _upsample(t, ksize: list, full_shape: list):
  """Repeats each pooled cell over its window, then zero-pads to the unpooled (VALID-cropped) size."""
  rank = len(ksize)
  first_axis = len(full_shape) - rank - 1
  for i, k in enumerate(ksize):
    t = tf.repeat(t, k, axis=first_axis + i)
  paddings = [[0, full - now] for full, now in zip(full_shape, t.shape.as_list())]
  return tf.pad(t, paddings)


class PoolBackPropOperation(_PoolingOperation):
  """Gradient of a PoolOperation: MAX routes dy to every position equal to the window's max;
  AVG spreads dy / window size over the window. Positions cropped by VALID pooling get zero."""

  def __init__(self, x: Tensor, y: Tensor, dy: Tensor, ksize: Sequence[int], strides: Sequence[int],
               pool_fn_string: str, name: Optional[str] = None):
    super().__init__([x, y, dy], name=name or "pool_backprop")
    rank = _spatial_rank(self.name, x, ksize, strides, pool_fn_string)
    self._ksize = list(ksize)
    self._pool_fn_string = pool_fn_string
    self._outputs = [Tensor(self, x.shape, dy.dtype)]
    self._declare_spatial_dims_unsplittable(x.shape.dims[-(rank + 1):-1])

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    ksize = self._ksize
    is_max = self._pool_fn_string.startswith("MAX")

    def tf_fn(x, y, dy):
      full_shape = x.shape.as_list()
      dy = _upsample(dy, ksize, full_shape)
      if is_max:
        return tf.where(tf.equal(x, _upsample(y, ksize, full_shape)), dy, tf.zeros_like(dy))
      return dy / list_product(ksize)
    x, y, dy = (lowering.tensors[t] for t in self.inputs)
    lowering.set_tensor_lowering(self.outputs[0], mesh_impl.slicewise(tf_fn, x, y, dy))


def pool_backprop(x: Tensor, y: Tensor, dy: Tensor, ksize: Sequence[int], strides: Sequence[int],
                  pool_fn_string: str, name: Optional[str] = None) -> Tensor:
  """d(loss)/dx for y = PoolOperation(x, ksize, strides, pool_fn_string), given dy = d(loss)/dy."""
  return PoolBackPropOperation(x, y, dy, ksize, strides, pool_fn_string, name=name).outputs[0]
