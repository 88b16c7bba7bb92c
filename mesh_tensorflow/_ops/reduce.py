"""Reductions over named dimensions (sum, mean, max, min, all, any) and their adjoint, broadcast.

Reducing a dimension that is split over a mesh dimension leaves one partial result per processor
along it; SUM combines them with a lazy allreduce (so consecutive partial sums share one), MAX and
MIN with an immediate allreduce.
"""

from __future__ import annotations

from typing import Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, Shape, convert_to_dimension, convert_to_shape
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering.tf_helpers import reduction_fn
from mesh_tensorflow._ops import _checks as checks
from mesh_tensorflow._ops import elementwise as elementwise_ops

__all__ = [
    "ReduceOperation", "reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_all",
    "reduce_any", "BroadcastOperation", "broadcast",
]

_REDUCTIONS = ("SUM", "MAX", "MIN")


class ReduceOperation(Operation):
  """Reduces x to `output_shape` (a subset of its dims) with "SUM", "MAX" or "MIN" (any case)."""

  def __init__(self, x: Tensor, output_shape, reduction_fn_string: str, name: Optional[str] = None):
    output_shape = convert_to_shape(output_shape)
    op_name = x.graph.unique_name(name or "reduce", mark_as_used=False)
    reduction = _check_reduction(reduction_fn_string, op_name)
    _check_output_dims_in_input(x, output_shape, op_name)
    super().__init__([x], name=name or "reduce")
    self._outputs = [Tensor(self, output_shape, x.dtype)]
    self._reduction_fn_string = reduction
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  @property
  def reduction_fn_string(self) -> str:
    return self._reduction_fn_string

  def gradient(self, grad_ys):
    dy = grad_ys[0]
    x, y = self.inputs[0], self.outputs[0]
    if self._reduction_fn_string == "SUM":
      return [broadcast(dy, x.shape)]
    # MAX / MIN: the gradient flows to every position equal to the result (ties all get it).
    is_extremum = elementwise_ops.slicewise(
        lambda a, b: tf.cast(tf.equal(a, b), a.dtype), [x, broadcast(y, x.shape)],
        splittable_dims=x.shape.dims, grad_function=0, name="is_extremum")
    return [is_extremum * dy]

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    x, y = self.inputs[0], self.outputs[0]
    slice_fn, reduced_mesh_axes = reduce_slice_fn_and_mesh_axes(
        x.shape, y.shape, mesh_impl.tensor_layout(x.shape), self._reduction_fn_string)
    result = mesh_impl.slicewise(slice_fn, lowering.tensors[x])
    if reduced_mesh_axes:
      comm = lowering.comm(self)
      if self._reduction_fn_string == "SUM":
        result = comm.lazy_allreduce_sum(result, reduced_mesh_axes, "reduce_op")
      else:
        result = comm.allreduce(result, reduced_mesh_axes, self._reduction_fn_string, "reduce_op")
    lowering.set_tensor_lowering(y, result)


def reduce_slice_fn_and_mesh_axes(input_shape: Shape, output_shape: Shape, input_layout,
                                  reduction_fn_string: str):
  """(fn reducing one slice of input_shape to output_shape's dim order, mesh axes of reduced dims).

  The mesh axes are those the reduced dimensions are split over: the per-slice results are partial
  and still need an allreduce over them.
  """
  reduced_axes = [i for i, d in enumerate(input_shape) if d not in output_shape.dims]
  kept_shape = Shape([d for d in input_shape if d in output_shape.dims])
  perm = [kept_shape.dims.index(d) for d in output_shape]
  tf_reduce = reduction_fn(reduction_fn_string)

  def slice_fn(x):
    if reduced_axes:
      x = tf_reduce(x, reduced_axes)
    if perm != sorted(perm):
      x = tf.transpose(x, perm)
    return x
  mesh_axes = [input_layout[i] for i in reduced_axes if input_layout[i] is not None]
  return slice_fn, mesh_axes


def _reduction_output_shape(x: Tensor, output_shape, reduced_dim, fn_name: str) -> Shape:
  """Output of reducing x: x minus reduced_dim, else output_shape, else a scalar."""
  output_shape = convert_to_shape(output_shape)
  if reduced_dim is None:
    return output_shape if output_shape is not None else Shape([])
  reduced_dim = convert_to_dimension(reduced_dim)
  _check_reduced_dim_in(x, reduced_dim, fn_name)
  if output_shape is not None and output_shape != x.shape - reduced_dim:
    raise ValueError(
        f"{fn_name}: reduced_dim={reduced_dim} contradicts output_shape={output_shape} for x "
        f"{x.shape}; removing reduced_dim gives {x.shape - reduced_dim}. Pass only one of them.")
  return x.shape - reduced_dim


def _reduce(x: Tensor, disable_positional_args, output_shape, reduced_dim, name,
            reduction: str, fn_name: str) -> Tensor:
  _check_no_positional_args(disable_positional_args, fn_name)
  output_shape = _reduction_output_shape(x, output_shape, reduced_dim, fn_name)
  if output_shape == x.shape:
    return x
  return ReduceOperation(x, output_shape, reduction, name=name).outputs[0]


def reduce_sum(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None,
               name: Optional[str] = None) -> Tensor:
  """Sum of x over the dims not in output_shape (or over reduced_dim; or all, giving a scalar).

  Keyword-only by convention: reduce_sum(x, reduced_dim=d) or reduce_sum(x, output_shape=s).
  """
  return _reduce(x, disable_positional_args, output_shape, reduced_dim, name, "SUM", "reduce_sum")


def reduce_mean(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None,
                name: Optional[str] = None) -> Tensor:
  """Mean of x over the reduced dims (a sum scaled by output size / input size)."""
  _check_no_positional_args(disable_positional_args, "reduce_mean")
  output_shape = _reduction_output_shape(x, output_shape, reduced_dim, "reduce_mean")
  with tf.variable_scope(name, default_name="reduce_mean"):
    if output_shape == x.shape:
      return x
    return reduce_sum(x, output_shape=output_shape) * (output_shape.size / x.shape.size)


def reduce_max(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None,
               name: Optional[str] = None) -> Tensor:
  """Maximum of x over the reduced dims."""
  return _reduce(x, disable_positional_args, output_shape, reduced_dim, name, "MAX", "reduce_max")


def reduce_min(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None,
               name: Optional[str] = None) -> Tensor:
  """Minimum of x over the reduced dims."""
  return _reduce(x, disable_positional_args, output_shape, reduced_dim, name, "MIN", "reduce_min")


def reduce_all(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None,
               name: Optional[str] = None) -> Tensor:
  """Logical AND of boolean x over the reduced dims (a float min, cast back to bool)."""
  _check_no_positional_args(disable_positional_args, "reduce_all")
  return elementwise_ops.cast(
      reduce_min(elementwise_ops.to_float(x), output_shape=output_shape, reduced_dim=reduced_dim,
                 name=name), tf.bool)


def reduce_any(x: Tensor, disable_positional_args=None, output_shape=None, reduced_dim=None,
               name: Optional[str] = None) -> Tensor:
  """Logical OR of boolean x over the reduced dims (a float max, cast back to bool)."""
  _check_no_positional_args(disable_positional_args, "reduce_any")
  return elementwise_ops.cast(
      reduce_max(elementwise_ops.to_float(x), output_shape=output_shape, reduced_dim=reduced_dim,
                 name=name), tf.bool)


class BroadcastOperation(Operation):
  """x broadcast to `output_shape`, a superset of its dimensions in any order."""

  def __init__(self, x: Tensor, output_shape: Shape, name: Optional[str] = None):
    checks.check_output_has_input_dims(name or "broadcast", [x], output_shape)
    super().__init__([x], name=name or "broadcast")
    self._outputs = [Tensor(self, output_shape, x.dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def gradient(self, grad_ys):
    return [reduce_sum(grad_ys[0], output_shape=self.inputs[0].shape)]

  def lower(self, lowering):
    x, y = self.inputs[0], self.outputs[0]
    lowering.set_tensor_lowering(y, lowering.mesh_impl(self).broadcast_impl(
        lowering.tensors[x], x.shape, y.shape))


def broadcast(x: Tensor, new_shape) -> Tensor:
  """x with the dimensions of `new_shape` (x itself if the shapes are equal)."""
  new_shape = convert_to_shape(new_shape)
  if x.shape == new_shape:
    return x
  return BroadcastOperation(x, new_shape).outputs[0]


# ---- checks (one rule each) ----

def _check_no_positional_args(disable_positional_args, fn_name: str) -> None:
  if disable_positional_args is not None:
    raise TypeError(
        f"{fn_name} takes its options by keyword only; got a second positional argument "
        f"{disable_positional_args!r}. Write {fn_name}(x, reduced_dim=...) or "
        f"{fn_name}(x, output_shape=...).")


def _check_reduced_dim_in(x: Tensor, reduced_dim: Dimension, fn_name: str) -> None:
  checks.check_dim_in(fn_name, "reduced_dim", reduced_dim, x)


def _check_reduction(reduction_fn_string: str, op_name: str) -> str:
  reduction = str(reduction_fn_string).upper()
  if reduction not in _REDUCTIONS:
    raise ValueError(
        f"ReduceOperation {op_name!r}: unknown reduction {reduction_fn_string!r}; use one of "
        f"{list(_REDUCTIONS)} (any case).")
  return reduction


def _check_output_dims_in_input(x: Tensor, output_shape: Shape, op_name: str) -> None:
  extra = [d for d in output_shape if d not in x.shape.dims]
  if extra:
    raise ValueError(
        f"reduce {op_name!r}: output_shape {output_shape} has dimensions {extra} that are not in "
        f"the input {x.name!r} {x.shape}; a reduction can only drop dimensions (use mtf.broadcast "
        f"to add some).")
