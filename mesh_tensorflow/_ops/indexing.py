"""Indexing and selection: one_hot, gather, top_k and the reductions built on them, cumsum.

Selection along a split dimension works shard by shard: one_hot shifts indices by the shard
offset, top_k takes a local top-k per shard and merges the candidates with an allconcat.
"""

from __future__ import annotations

from typing import Optional, Union

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, convert_to_dimension, convert_to_shape
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._ops import _checks as checks
from mesh_tensorflow._ops import binary as binary_ops
from mesh_tensorflow._ops import einsum as einsum_ops
from mesh_tensorflow._ops import elementwise as elementwise_ops
from mesh_tensorflow._ops import gather as gather_ops
from mesh_tensorflow._ops import io as io_ops
from mesh_tensorflow._ops import random as random_ops
from mesh_tensorflow._ops import reduce as reduce_ops
from mesh_tensorflow._ops import reshape as reshape_ops
from mesh_tensorflow._ops import slicing as slicing_ops

__all__ = [
    "OneHotOperation", "one_hot", "gather", "TopKOperation", "top_k", "top_1", "argmax",
    "nth_largest_element", "nth_smallest_element", "reduce_first", "sample_with_temperature",
    "cumsum",
]

# top_k with 1 < k < _ITERATIVE_TOP_K_LIMIT repeats top_1 instead of sorting whole shards.
_ITERATIVE_TOP_K_LIMIT = 5



class OneHotOperation(Operation):
  """indices -> indices.shape + [output_dim]: on_value where the index matches, else off_value."""

  def __init__(self, indices: Tensor, output_dim, on_value, off_value, dtype: tf.DType,
               name: Optional[str] = None):
    name = name or "one_hot"
    if not indices.dtype.is_integer:  # checked before the op joins the graph
      raise ValueError(
          f"one_hot {name!r}: indices {indices.name!r} have dtype {indices.dtype.name}; "
          f"they must be integers (use mtf.to_int32 or mtf.cast first).")
    super().__init__([indices], name=name)
    self._output_dim = convert_to_dimension(output_dim)
    self._on_value = on_value
    self._off_value = off_value
    self._dtype = dtype
    self._outputs = [Tensor(self, indices.shape + self._output_dim, dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    indices = lowering.tensors[self.inputs[0]].to_laid_out_tensor()
    # this shard holds output positions [offset, offset + depth)
    offset, depth = gather_ops.shard_offset_and_size(mesh_impl, self._output_dim)

    def slicewise_fn(indices_slice, offset=None):
      if offset is not None:
        indices_slice -= tf.cast(offset, indices_slice.dtype)
      return tf.one_hot(indices_slice, depth,
                        on_value=tf.cast(self._on_value, self._dtype),
                        off_value=tf.cast(self._off_value, self._dtype), dtype=self._dtype)
    args = [indices] + ([] if offset is None else [offset])
    lowering.set_tensor_lowering(self.outputs[0], mesh_impl.slicewise(slicewise_fn, *args))


def one_hot(indices: Tensor, output_dim, on_value=1.0, off_value=0.0, dtype: tf.DType = tf.float32,
            name: Optional[str] = None) -> Tensor:
  """One-hot encoding along `output_dim`, appended as the last dimension.

  Example: `one_hot(ids[batch], vocab)` has shape [batch, vocab]. Indices outside
  [0, output_dim.size) give a row of off_value. No gradient (indices are integers).
  """
  return OneHotOperation(indices, output_dim, on_value, off_value, dtype, name=name).outputs[0]


def gather(weights: Tensor, indices: Union[Tensor, int], dim, output_shape=None) -> Tensor:
  """weights[..., indices, ...] along `dim`: an einsum with one_hot(indices, dim), in effect.

  The default output shape is indices.shape followed by weights.shape without `dim`.
  A python int index selects one slice (`dim` disappears). The gradient reaches `weights`.
  An index outside [0, dim.size) selects zeros. When indices share no dim with weights (an
  embedding lookup) the rows are gathered (GatherOperation) instead of multiplied out.
  """
  dim = convert_to_dimension(dim)
  output_shape = convert_to_shape(output_shape)
  checks.check_dim_in("gather", "dim", dim, weights)
  if not isinstance(indices, Tensor):
    indices = io_ops.constant(weights.mesh, indices, dtype=tf.int32)
  if weights.dtype == tf.bool:
    return elementwise_ops.cast(
        gather(elementwise_ops.to_float(weights), indices, dim, output_shape), tf.bool)
  if gather_ops.can_gather_rows(weights, indices, dim, output_shape):
    return gather_ops.GatherOperation(weights, indices, dim, output_shape).outputs[0]
  return einsum_ops.einsum([one_hot(indices, dim, dtype=weights.dtype), weights],
                           reduced_dims=[dim], output_shape=output_shape)


def _check_top_k_args(op_name: str, x: Tensor, reduced_dim: Dimension, k_dim: Dimension) -> None:
  checks.check_dim_in(op_name, "reduced_dim", reduced_dim, x)
  if k_dim.size > reduced_dim.size:
    raise ValueError(
        f"{op_name}: k_dim {k_dim} asks for more values than reduced_dim {reduced_dim} of "
        f"{x.name!r} holds; use k_dim.size <= {reduced_dim.size}.")
  if k_dim.name in x.shape.dimension_names:
    raise ValueError(
        f"{op_name}: k_dim name {k_dim.name!r} is already a dimension of {x.name!r} {x.shape}; "
        f"give k_dim a new name.")


class TopKOperation(Operation):
  """(values, int32 indices) of the k_dim.size largest entries along reduced_dim.

  Output shape: x.shape - reduced_dim + k_dim (k_dim last), values in descending order, ties
  by lower index. reduced_dim may be split: each shard contributes its local top k, the
  candidates are allconcatenated along the mesh dimension and reduced again. k_dim can't be split.
  """

  def __init__(self, x: Tensor, reduced_dim, k_dim, name: Optional[str] = None):
    name = name or "top_k"
    self._reduced_dim = convert_to_dimension(reduced_dim)
    self._k_dim = convert_to_dimension(k_dim)
    _check_top_k_args(f"top_k {name!r}", x, self._reduced_dim, self._k_dim)
    super().__init__([x], name=name)
    output_shape = x.shape - self._reduced_dim + self._k_dim
    self._outputs = [Tensor(self, output_shape, x.dtype, index=0),
                     Tensor(self, output_shape, tf.int32, index=1)]
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_splittable_and_unsplittable_dims("splittable", [self._k_dim.name]))

  def unsplittable_reason(self, dim_name: str) -> str:
    return f"top_k builds its k_dim {dim_name!r} whole on every processor"

  def gradient(self, grad_ys):
    dvalues = grad_ys[0]
    if dvalues is None:
      return [None]
    x = self.inputs[0]
    mapping = one_hot(self.outputs[1], self._reduced_dim, dtype=dvalues.dtype)
    return [einsum_ops.einsum([dvalues, mapping], output_shape=x.shape)]

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    x = self.inputs[0]
    k = self._k_dim.size
    reduced_axis = x.shape.dims.index(self._reduced_dim)
    last_axis = x.shape.ndims - 1
    perm = [i for i in range(x.shape.ndims) if i != reduced_axis] + [reduced_axis]
    local_size = mesh_impl.slice_shape(x.shape)[reduced_axis]

    def local_top_k(x_slice):
      return tuple(tf.math.top_k(tf.transpose(x_slice, perm), min(k, local_size)))
    values, indices = mesh_impl.slicewise(
        local_top_k, lowering.tensors[x].to_laid_out_tensor())
    mesh_axis = mesh_impl.tensor_dimension_to_mesh_axis(self._reduced_dim)
    if mesh_axis is not None:
      offset = mesh_impl.slicewise(lambda pcoord: pcoord * local_size,
                                   mesh_impl.laid_out_pcoord(mesh_axis))
      indices = mesh_impl.slicewise(tf.add, indices, offset)
      comm = lowering.comm(self)
      values = comm.allconcat(values, mesh_axis, last_axis, "top_k_op")
      indices = comm.allconcat(indices, mesh_axis, last_axis, "top_k_op")

      def merge_top_k(values_slice, indices_slice):
        values_slice, positions = tf.math.top_k(values_slice, k)
        return values_slice, tf.gather(indices_slice, positions, batch_dims=last_axis)
      values, indices = mesh_impl.slicewise(merge_top_k, values, indices)
    lowering.set_tensor_lowering(self.outputs[0], values)
    lowering.set_tensor_lowering(self.outputs[1], indices)


def top_k(x: Tensor, reduced_dim, k_dim, name: Optional[str] = None) -> tuple:
  """Like tf.math.top_k along reduced_dim: returns (values, int32 indices) with k_dim last.

  Example: `top_k(logits[batch, vocab], vocab, Dimension("k", 3))` -> two [batch, k] tensors.
  Gradients flow through the values. Raises ValueError if reduced_dim is not in x or
  k_dim.size > reduced_dim.size.
  """
  reduced_dim = convert_to_dimension(reduced_dim)
  k_dim = convert_to_dimension(k_dim)
  _check_top_k_args("top_k", x, reduced_dim, k_dim)
  if 1 < k_dim.size < _ITERATIVE_TOP_K_LIMIT:
    return _iterative_top_k(x, reduced_dim, k_dim, name)
  op = TopKOperation(x, reduced_dim, k_dim, name=name)
  return op.outputs[0], op.outputs[1]


def _iterative_top_k(x: Tensor, reduced_dim: Dimension, k_dim: Dimension, name) -> tuple:
  """k rounds of top_1, each masking the previous winner with -1e9 (cheap for small k)."""
  values, indices = [], []
  for i in range(k_dim.size):
    value, index = top_1(x, reduced_dim, name=name)
    values.append(value)
    indices.append(index)
    if i + 1 < k_dim.size:
      x += one_hot(index, reduced_dim, on_value=-1e9, dtype=x.dtype)
  axis = values[0].shape.ndims
  return (slicing_ops.stack(values, k_dim.name, axis=axis),
          slicing_ops.stack(indices, k_dim.name, axis=axis))


def top_1(x: Tensor, reduced_dim, name: Optional[str] = None, *, dtype: tf.DType = tf.int32) -> tuple:
  """(max, argmax) along reduced_dim; ties pick the lowest index."""
  one_dim = Dimension("_one", 1)
  values, indices = top_k(x, reduced_dim, one_dim, name=name)
  values = reshape_ops.reshape(values, values.shape - one_dim)
  indices = reshape_ops.reshape(indices, indices.shape - one_dim)
  return values, elementwise_ops.cast(indices, dtype)


def argmax(x: Tensor, reduced_dim, name: Optional[str] = None, *, dtype: tf.DType = tf.int32) -> Tensor:
  """Index of the maximum along reduced_dim (lowest index on ties)."""
  return top_1(x, reduced_dim, name=name, dtype=dtype)[1]


def nth_largest_element(x: Tensor, n: int, reduced_dim, name: Optional[str] = None) -> Tensor:
  """The n-th largest value along reduced_dim, n counted from 0 (n=0 is the max)."""
  k_dim = Dimension("_top_k_", n + 1)
  values, _ = top_k(x, reduced_dim=reduced_dim, k_dim=k_dim, name=name)
  return gather(values, n, k_dim)


def nth_smallest_element(x: Tensor, n: int, reduced_dim, name: Optional[str] = None) -> Tensor:
  """The n-th smallest value along reduced_dim, n counted from 0 (n=0 is the min)."""
  return -nth_largest_element(-x, n, reduced_dim, name=name)


def reduce_first(tensor: Tensor, reduced_dim) -> Tensor:
  """The entry at position 0 of reduced_dim (that dimension removed)."""
  reduced_dim = convert_to_dimension(reduced_dim)
  checks.check_dim_in("reduce_first", "reduced_dim", reduced_dim, tensor)
  position = io_ops.mtf_range(tensor.mesh, reduced_dim, tf.float32)
  first_mask = elementwise_ops.cast(binary_ops.equal(position, 0.0), tensor.dtype)
  return reduce_ops.reduce_sum(tensor * first_mask, reduced_dim=reduced_dim)


def sample_with_temperature(logits: Tensor, dim, temperature=1.0, name: Optional[str] = None) -> Tensor:
  """Samples int32 indices along dim from softmax(logits / temperature) by the Gumbel-max trick.

  temperature 0 gives argmax. The noise is drawn in float32 (stable for bfloat16 logits).
  """
  dim = convert_to_dimension(dim)
  if isinstance(temperature, Tensor) or temperature != 0.0:
    logits = elementwise_ops.cast(logits, tf.float32)
    # Uniform in [1e-9, 1): -log(-log(u)) stays finite.
    uniform = random_ops.random_uniform(logits.mesh, logits.shape, minval=1e-9, maxval=1.0,
                                        dtype=tf.float32)
    gumbel = -elementwise_ops.log(-elementwise_ops.log(uniform))
    logits += gumbel * temperature
  return argmax(logits, dim, name=name)


def cumsum(x: Tensor, dim, exclusive: bool = False) -> Tensor:
  """Cumulative sum along dim (exclusive: sum of the strictly earlier entries).

  Computed as an einsum with a triangular 0/1 matrix over [dim, tmp_dim_cumsum], so it works
  with dim split and its gradient comes from einsum.
  """
  dim = convert_to_dimension(dim)
  checks.check_dim_in("cumsum", "dim", dim, x)
  with tf.variable_scope("cumsum"):
    tmp_dim = Dimension("tmp_dim_cumsum", dim.size)
    comparator = binary_ops.less if exclusive else binary_ops.less_equal
    mask = elementwise_ops.cast(
        comparator(io_ops.mtf_range(x.mesh, dim, dtype=tf.float32),
                   io_ops.mtf_range(x.mesh, tmp_dim, dtype=tf.float32)), x.dtype)
    ret = einsum_ops.einsum([x, mask], output_shape=x.shape.rename_dimension(dim.name, tmp_dim.name))
    return reshape_ops.reshape(ret, x.shape)
