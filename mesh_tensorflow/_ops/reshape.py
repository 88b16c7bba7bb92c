"""Shape manipulation: reshape (which is also how a tensor changes layout), transpose and renames.

Layouts key on dimension names, so renaming a dimension can move it between split and replicated.
The lowering asks the pure planner (_lowering/plan.py) for the collectives that take the old layout
to the new one, runs them, and finishes with a per-slice tf.reshape.
"""

from __future__ import annotations

from typing import Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import (
    Dimension, Shape, anonymous_shape, check_rename_target_is_free, convert_to_shape)
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering import plan as plan_lib
from mesh_tensorflow._ops import einsum as einsum_ops
from mesh_tensorflow._ops import io as io_ops

__all__ = [
    "ReshapeOperation", "reshape", "transpose", "rename_dimension", "replace_dimensions", "anonymize",
    "import_fully_replicated",
]

class ReshapeOperation(Operation):
  """Same values, new shape (equal total size); the layout follows the new dimension names."""

  def __init__(self, x: Tensor, new_shape, name: Optional[str] = None):
    new_shape = convert_to_shape(new_shape)
    _check_same_size(x, new_shape, x.graph.unique_name(name or "reshape", mark_as_used=False))
    super().__init__([x], name=name or "reshape")
    self._outputs = [Tensor(self, new_shape, x.dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def gradient(self, grad_ys):
    return [reshape(grad_ys[0], self.inputs[0].shape)]

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    x, y = self.inputs[0], self.outputs[0]
    steps = plan_lib.plan_reshape(x.shape, y.shape, mesh_impl.shape, mesh_impl.layout_rules)
    slices = lowering.tensors[x]
    comm = lowering.comm(self)
    for step in steps[:-1]:
      slices = comm.run_layout_step(slices, step, "reshape_op")
    new_slice_shape = list(steps[-1].slice_shape_after)
    slices = mesh_impl.slicewise_delay_allreduce(lambda t: tf.reshape(t, new_slice_shape), slices)
    lowering.set_tensor_lowering(y, slices)


def reshape(x: Tensor, new_shape, name: Optional[str] = "reshape") -> Tensor:
  """x with shape `new_shape` (same total size, row-major order); may change its layout.

  Example: reshape(x, [batch, Dimension("heads", 8), Dimension("d_head", 64)]) for x [batch, d=512].
  """
  return ReshapeOperation(x, convert_to_shape(new_shape), name=name).outputs[0]


def transpose(x: Tensor, new_shape, name: Optional[str] = "transpose") -> Tensor:
  """x with its dimensions reordered as in `new_shape` (an einsum with one input)."""
  new_shape = convert_to_shape(new_shape)
  _check_same_dims(x, new_shape)
  return einsum_ops.einsum([x], output_shape=new_shape, name=name)


def rename_dimension(x: Tensor, old_name: str, new_name: str) -> Tensor:
  """x with dimension `old_name` called `new_name` (its layout follows the new name).

  `new_name` must not already be a dimension of x (that would give one name two sizes).
  """
  check_rename_target_is_free(x.shape, old_name, new_name, f"rename_dimension of {x.name!r}")
  return reshape(x, x.shape.rename_dimension(old_name, new_name))


def replace_dimensions(tensor_or_shape, old_dim_or_dims, new_dim_or_dims):
  """Replaces consecutive dims `old_dim_or_dims` by `new_dim_or_dims` in a Shape, or reshapes a Tensor.

  Example: replace_dimensions(Shape[b=2, h=4, d=8], [h, d], Dimension("hd", 32)) -> Shape[b=2, hd=32].
  """
  if isinstance(tensor_or_shape, Tensor):
    return reshape(tensor_or_shape, replace_dimensions(
        tensor_or_shape.shape, old_dim_or_dims, new_dim_or_dims))
  if not isinstance(tensor_or_shape, Shape):
    raise ValueError(
        f"replace_dimensions: tensor_or_shape must be an mtf.Tensor or mtf.Shape, got {tensor_or_shape!r}.")
  old_dims = _as_dimension_list(old_dim_or_dims, "old_dim_or_dims")
  new_dims = _as_dimension_list(new_dim_or_dims, "new_dim_or_dims")
  dims = tensor_or_shape.dims
  pos = _check_consecutive_subsequence(dims, old_dims, tensor_or_shape)
  return Shape(dims[:pos] + new_dims + dims[pos + len(old_dims):])


def import_fully_replicated(mesh, tf_tensor, shape, name: Optional[str] = None) -> Tensor:
  """Imports without splitting (anonymous dims), then lays out inside mtf with a reshape."""
  shape = convert_to_shape(shape)
  return reshape(io_ops.import_tf_tensor(mesh, tf_tensor, anonymous_shape(shape), name), shape)


def anonymize(x: Tensor) -> Tensor:
  """x with dimensions renamed _anonymous_0, ... : no layout rule matches them, so x is replicated."""
  return reshape(x, anonymous_shape(x.shape))


def _as_dimension_list(dim_or_dims, arg_name: str) -> list:
  dims = [dim_or_dims] if isinstance(dim_or_dims, Dimension) else dim_or_dims
  if not isinstance(dims, list) or not dims or not all(isinstance(d, Dimension) for d in dims):
    raise ValueError(
        f"replace_dimensions: {arg_name} must be a Dimension or a non-empty list of Dimensions, "
        f"got {dim_or_dims!r}.")
  return dims


# ---- checks (one rule each) ----

def _check_same_size(x: Tensor, new_shape: Shape, op_name: str) -> None:
  if x.shape.size != new_shape.size:
    raise ValueError(
        f"reshape {op_name!r}: cannot reshape {x.name!r} {x.shape} (size {x.shape.size}) to "
        f"{new_shape} (size {new_shape.size}); the total sizes must be equal.")


def _check_same_dims(x: Tensor, new_shape: Shape) -> None:
  if set(x.shape.dims) != set(new_shape.dims):
    raise ValueError(
        f"transpose: {x.name!r} {x.shape} and new_shape {new_shape} must have the same dimensions "
        f"(in any order); use mtf.reshape to change dimensions.")


def _check_consecutive_subsequence(dims: list, old_dims: list, shape: Shape) -> int:
  """Position of old_dims in dims; ValueError unless they appear there consecutively and in order."""
  positions = [dims.index(d) if d in dims else None for d in old_dims]
  pos = positions[0]
  if pos is None or positions != list(range(pos, pos + len(old_dims))):
    raise ValueError(
        f"replace_dimensions: old dims {old_dims} must appear consecutively and in order in {shape}.")
  return pos
