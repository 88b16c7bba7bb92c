"""Row gathers and their adjoint, scatter-add: embedding lookups without a one-hot matmul.

`GatherOperation` picks rows of `weights` along one dimension with `tf.gather`, so a lookup costs
a copy of the rows instead of an einsum with a [indices..., vocab] one-hot tensor (on the
benchmark Transformer that matmul and its gradient were 8% of a step). Its gradient,
`ScatterAddOperation`, sums the incoming rows into a zero table with `unsorted_segment_sum`.

Both keep the one-hot semantics exactly: an index outside [0, dim.size) selects a row of zeros
and receives no gradient. When `dim` is split over a mesh dimension each shard looks up the
indices that fall in its part (the others give zeros) and the partial rows are allreduce-summed,
as the one-hot einsum's contraction over the split dim would be.
"""

from __future__ import annotations

from typing import Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, Shape
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering.tf_helpers import transpose_unless_identity

__all__ = ["GatherOperation", "ScatterAddOperation"]


def can_gather_rows(weights: Tensor, indices: Tensor, dim: Dimension, output_shape) -> bool:
  """Whether GatherOperation computes this gather: indices share no dim with weights, and the
  output is a reordering of indices' dims followed by weights' other dims."""
  if not indices.dtype.is_integer or set(indices.shape.dims) & set(weights.shape.dims):
    return False
  default = indices.shape + (weights.shape - dim)
  return output_shape is None or set(output_shape.dims) == set(default.dims)


class _RowIndexing(Operation):
  """What a gather and its scatter-add share: the indexed dim, and each shard's part of it."""

  def __init__(self, inputs, indices: Tensor, dim: Dimension, output_shape: Shape, dtype, name):
    super().__init__(inputs, name=name)
    assert inputs[1] is indices  # read through self.inputs, which a recomputation's clone remaps
    self._dim = dim
    self._outputs = [Tensor(self, output_shape, dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  @property
  def _indices(self) -> Tensor:
    return self.inputs[1]

  def _adjoint(self) -> type:
    raise NotImplementedError

  def gradient(self, grad_ys):
    """Both ops are linear in their first input: the gradient is the adjoint op (gather <->
    scatter-add) of the incoming gradient, shaped as that input. Indices get none."""
    dy = grad_ys[0]
    if dy is None:
      return [None, None]
    return [self._adjoint()(dy, self._indices, self._dim, self.inputs[0].shape).outputs[0], None]

  def _check_layout(self, mesh_impl, weights_shape: Shape) -> None:
    """The einsum this op stands for needs one layout for indices' and weights' dims together;
    tensor_layout raises, naming the dims, when two of them want the same mesh dimension."""
    mesh_impl.tensor_layout(self._indices.shape + weights_shape)

  def _local_rows(self, mesh_impl, lowering):
    """(laid-out indices, laid-out offset of each shard's first row or None, rows per shard)."""
    return (lowering.tensors[self._indices],) + shard_offset_and_size(mesh_impl, self._dim)


def shard_offset_and_size(mesh_impl, dim: Dimension) -> tuple:
  """(each processor's first position along `dim`, laid out, or None if dim is whole; its size)."""
  mesh_axis = mesh_impl.tensor_dimension_to_mesh_axis(dim)
  if mesh_axis is None:
    return None, dim.size
  depth = dim.size // mesh_impl.shape[mesh_axis].size
  return mesh_impl.slicewise(lambda pcoord: pcoord * depth, mesh_impl.laid_out_pcoord(mesh_axis)), depth


def _shift_and_mask(ids, offset, depth):
  """(ids - offset, whether that is a row of this shard) for one slice."""
  if offset is not None:
    ids -= tf.cast(offset, ids.dtype)
  return ids, tf.logical_and(ids >= 0, ids < depth)


class GatherOperation(_RowIndexing):
  """weights[..., indices, ...] along `dim`, transposed to `output_shape`; see the module doc."""

  def __init__(self, weights: Tensor, indices: Tensor, dim: Dimension,
               output_shape: Optional[Shape] = None, name: Optional[str] = None):
    """output_shape None: indices' dims followed by weights' dims without `dim`."""
    output_shape = output_shape or indices.shape + (weights.shape - dim)
    super().__init__([weights, indices], indices, dim, output_shape, weights.dtype, name or "gather")

  def _adjoint(self) -> type:
    return ScatterAddOperation

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    weights = self.inputs[0]
    self._check_layout(mesh_impl, weights.shape)
    indices, offset, depth = self._local_rows(mesh_impl, lowering)
    axis = weights.shape.dims.index(self._dim)
    gathered = Shape(weights.shape.dims[:axis] + self._indices.shape.dims + weights.shape.dims[axis + 1:])
    perm = [gathered.dims.index(d) for d in self.outputs[0].shape]

    def slice_fn(w, ids, offset=None):
      ids, found = _shift_and_mask(ids, offset, depth)
      rows = tf.gather(w, tf.where(found, ids, tf.zeros_like(ids)), axis=axis)
      rows *= tf.reshape(tf.cast(found, w.dtype),
                         [1] * axis + ids.shape.as_list() + [1] * (w.shape.ndims - axis - 1))
      return transpose_unless_identity(rows, perm)

    args = [lowering.tensors[weights], indices] + ([] if offset is None else [offset])
    y = mesh_impl.slicewise(slice_fn, *args)
    if offset is not None:  # each shard holds only the rows of its part; the others gave zeros
      y = lowering.comm(self).lazy_allreduce_sum(y, [mesh_impl.tensor_dimension_to_mesh_axis(self._dim)],
                                                 "gather_op")
    lowering.set_tensor_lowering(self.outputs[0], y)


class ScatterAddOperation(_RowIndexing):
  """A zero tensor of `weights_shape` with each row of `updates` added at its index along `dim`.

  `updates` has the dims of `indices` and of `weights_shape` without `dim` (in any order): the
  gradient of GatherOperation. Out-of-range indices add nothing.
  """

  def __init__(self, updates: Tensor, indices: Tensor, dim: Dimension, weights_shape: Shape,
               name: Optional[str] = None):
    super().__init__([updates, indices], indices, dim, weights_shape, updates.dtype,
                     name or "scatter_add")

  def _adjoint(self) -> type:
    return GatherOperation

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    updates, weights_shape = self.inputs[0], self.outputs[0].shape
    self._check_layout(mesh_impl, weights_shape)
    indices, offset, depth = self._local_rows(mesh_impl, lowering)
    rest = [d for d in weights_shape.dims if d != self._dim]
    to_rows = [updates.shape.dims.index(d) for d in self._indices.shape.dims + rest]
    scattered = [self._dim] + rest
    to_weights = [scattered.index(d) for d in weights_shape.dims]

    def slice_fn(u, ids, offset=None):
      ids, found = _shift_and_mask(ids, offset, depth)
      if to_rows != sorted(to_rows):
        u = tf.transpose(u, to_rows)
      # unsorted_segment_sum drops rows whose segment id is negative.
      table = tf.math.unsorted_segment_sum(u, tf.where(found, ids, -tf.ones_like(ids)), depth)
      return table if to_weights == sorted(to_weights) else tf.transpose(table, to_weights)

    args = [lowering.tensors[updates], indices] + ([] if offset is None else [offset])
    y = mesh_impl.slicewise(slice_fn, *args)
    index_layout = mesh_impl.tensor_layout(self._indices.shape)
    summed_axes = [a for a in index_layout if a is not None]
    if summed_axes:  # each processor summed only its share of the indices
      y = lowering.comm(self).lazy_allreduce_sum(y, summed_axes, "scatter_add_op")
    lowering.set_tensor_lowering(self.outputs[0], y)
