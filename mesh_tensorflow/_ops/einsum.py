"""Einsum: multiply named tensors (broadcast to the union of their dims) and sum to an output shape.

This is the contraction workhorse: matmul, elementwise multiply, transpose, gather and many
reductions are einsums. Dimensions are matched by name; a reduced dimension that is split over
a mesh dimension leaves partial sums, which are summed by a (lazy) allreduce.
"""

from __future__ import annotations

import collections
import functools
import os
import string
import sys
import warnings
from typing import Optional, Sequence

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, Shape, convert_to_shape
from mesh_tensorflow._core.errors import BroadcastWarning
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering.lazy import LazyAllreduceSum
from mesh_tensorflow._lowering.mesh_impl import expand_dims_to
from mesh_tensorflow._ops import _checks as checks
from mesh_tensorflow._ops import reduce as reduce_ops

__all__ = ["EinsumOperation", "einsum", "matmul"]


class EinsumOperation(Operation):
  """Broadcasts all inputs to the union of their dimensions, multiplies, and sums to `output_shape`.

  Output dimensions present in no input are filled by broadcasting the result; a BroadcastWarning
  says so unless they are listed in `broadcast_dims`.
  """

  def __init__(self, inputs: Sequence[Tensor], output_shape, name: Optional[str] = None,
               broadcast_dims=None):
    inputs = list(inputs)
    output_shape = convert_to_shape(output_shape)
    _check_has_inputs(inputs, name)
    _check_are_tensors(inputs, name)
    op_name = inputs[0].graph.unique_name(name or "einsum", mark_as_used=False)
    checks.check_same_dtype(f"einsum {op_name!r}", inputs)
    checks.check_same_dimension_sizes(f"einsum {op_name!r}", inputs, output_shape)
    _check_output_dims_are_broadcastable(inputs, output_shape, op_name)
    broadcast_dims = convert_to_shape(broadcast_dims) or Shape([])
    _check_broadcast_dims_are_new(inputs, output_shape, broadcast_dims, op_name)
    _warn_unrequested_broadcast(inputs, output_shape, broadcast_dims, op_name)
    super().__init__(inputs, name=name or "einsum")
    self._outputs = [Tensor(self, output_shape, inputs[0].dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def gradient(self, grad_ys):
    dy = grad_ys[0]
    xs = self.inputs
    grads = []
    for i, x in enumerate(xs):
      others = [dy] + xs[:i] + xs[i + 1:]
      grads.append(einsum(others, output_shape=x.shape, broadcast_dims=new_dims(others, x.shape)))
    return grads

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    input_shapes = [x.shape for x in self.inputs]
    output_shape = self.outputs[0].shape
    input_dims = _dims_in_order_of_appearance(input_shapes)
    computed_shape = Shape([d for d in output_shape if d in input_dims])
    union_shape = Shape(input_dims)
    slice_fn, reduced_mesh_axes = _einsum_slice_fn(
        input_shapes, computed_shape, union_shape, self.outputs[0].dtype, mesh_impl)
    laid_out = [lowering.tensors[x] for x in self.inputs]
    pending_axes = _pending_sum_axes(self.inputs, laid_out, output_shape, mesh_impl)
    if pending_axes:  # linear in that input: sum its partial sums after the einsum, with its own
      laid_out = [v.laid_out_input if isinstance(v, LazyAllreduceSum) else v for v in laid_out]
    y = mesh_impl.slicewise(slice_fn, *laid_out)
    reduced_mesh_axes = list(reduced_mesh_axes) + [a for a in pending_axes if a not in reduced_mesh_axes]
    if reduced_mesh_axes:
      y = lowering.comm(self).lazy_allreduce_sum(y, reduced_mesh_axes, "einsum_op")
    if computed_shape != output_shape:
      y = mesh_impl.broadcast_impl(y, computed_shape, output_shape)
    lowering.set_tensor_lowering(self.outputs[0], y)
    lowering.add_counter("einsum", mesh_impl.laid_out_size(union_shape))
    lowering.add_counter("einsum_unique", union_shape.size)


def _pending_sum_axes(inputs: Sequence[Tensor], laid_out: list, output_shape: Shape, mesh_impl) -> list:
  """The mesh axes of the one input that is a pending allreduce sum, when the einsum may take its
  partial sums instead (no other input and not the output split over those axes), else [].

  Those other inputs are replicated over the pending axes (selectors, masks), and what follows
  often adds more partial sums (a pipeline's ticks): one allreduce then serves them all. A sum
  another op already reduced (the forward value a gradient reads) is used as it is: its partial
  sums would cost an einsum per processor and one more allreduce.
  """
  lazy = [(x, v) for x, v in zip(inputs, laid_out) if isinstance(v, LazyAllreduceSum)]
  if len(lazy) != 1 or lazy[0][1].mesh_impl is not mesh_impl or lazy[0][1].is_reduced:
    return []
  axes = set(lazy[0][1].mesh_axes)
  others = [x.shape for x in inputs if x is not lazy[0][0]] + [output_shape]
  if any(axes & set(mesh_impl.tensor_layout(shape).tensor_axis_to_mesh_axis) for shape in others):
    return []
  return sorted(axes)


def einsum(xs: Sequence[Tensor], output_shape=None, reduced_dims=None,
           name: Optional[str] = None, broadcast_dims=None) -> Tensor:
  """Einstein summation over named dimensions.

  Output shape when not given: with neither argument, the dims that appear in exactly one input
  (in order of first appearance), so einsum([a, b]) contracts shared dims like a matmul; with only
  `reduced_dims`, every input dim except those.

  Example: einsum([x, w], reduced_dims=[d_model]) with x [batch, d_model], w [d_model, d_ff]
  gives [batch, d_ff].

  An output dim that is in no input is filled by copying the result along it (as in 0.1.21).
  That is usually a mistake (a misnamed dim), so it warns (mtf.BroadcastWarning, once per op,
  naming the dim and the op) unless the dim is listed in `broadcast_dims`:
  einsum([x], output_shape=[batch, beam], broadcast_dims=[beam]) copies x [batch] over beam.

  Args:
    xs: the input mtf Tensors (one or more), all of one dtype.
    output_shape: the output's dims (mtf.Shape, list of Dimensions or string); dims of the inputs
      absent from it are summed over.
    reduced_dims: the dims to sum over, instead of output_shape.
    name: an optional op name.
    broadcast_dims: output dims in no input that are meant to be broadcast (a Shape, list of
      Dimensions or string); each must be in output_shape and in no input.

  Returns:
    An mtf Tensor.

  Raises:
    ValueError: reduced_dims holds a non-Dimension, or contradicts output_shape; inputs differ in
      dtype or in the size of a same-named dimension; no inputs; broadcast_dims names a dim that
      is not in output_shape or is in an input.
    TypeError: an input is not an mtf Tensor.
  """
  xs = list(xs)
  _check_are_tensors(xs, name)
  output_shape = convert_to_shape(output_shape)
  if reduced_dims is not None:
    reduced_dims = list(reduced_dims)
    _check_reduced_dims_are_dimensions(reduced_dims, name)
  # Before a default output Shape repeats a name:
  checks.check_same_dimension_sizes(f"einsum {name or 'einsum'!r}", xs, output_shape)
  counts = collections.Counter(d for x in xs for d in x.shape.dims)
  input_dims = list(counts)  # Counter keeps first-appearance order
  if output_shape is None:
    if reduced_dims is None:
      output_shape = Shape([d for d in input_dims if counts[d] == 1])
    else:
      output_shape = Shape([d for d in input_dims if d not in reduced_dims])
  elif reduced_dims is not None:
    _check_reduced_dims_match_output(input_dims, output_shape, reduced_dims, name)
  return EinsumOperation(xs, output_shape, name=name, broadcast_dims=broadcast_dims).outputs[0]


def new_dims(inputs: Sequence[Tensor], output_shape) -> list:
  """The dims of `output_shape` that no input has: an einsum broadcasts the result along them."""
  present = {d for x in inputs for d in x.shape}
  return [d for d in convert_to_shape(output_shape) if d not in present]


def matmul(a: Tensor, b: Tensor, output_shape=None, reduced_dims=None,
           name: Optional[str] = None) -> Tensor:
  """einsum([a, b], ...): by default contracts the dimensions a and b share."""
  return einsum([a, b], output_shape=output_shape, reduced_dims=reduced_dims, name=name)


def _dims_in_order_of_appearance(shapes) -> list:
  return list(dict.fromkeys(d for s in shapes for d in s.dims))


def _einsum_equation(input_shapes, output_shape: Shape) -> str:
  """E.g. "ab,bc->ac": one letter per dimension, assigned in order of first appearance."""
  letters = {}
  for d in _dims_in_order_of_appearance(list(input_shapes) + [output_shape]):
    if len(letters) == len(string.ascii_letters):
      raise ValueError(
          f"einsum over more than {len(string.ascii_letters)} distinct dimensions is not supported "
          f"(shapes {list(input_shapes)} -> {output_shape}); split it into several einsums.")
    letters[d] = string.ascii_letters[len(letters)]
  return "%s->%s" % (",".join("".join(letters[d] for d in s) for s in input_shapes),
                     "".join(letters[d] for d in output_shape))


def _einsum_slice_fn(input_shapes, output_shape: Shape, union_shape: Shape, dtype, mesh_impl):
  """(per-slice fn, mesh axes of split reduced dims) computing `output_shape` (dims of the inputs).

  If some shape already holds every dimension, broadcasting everything to it costs no extra memory,
  so multiply-then-reduce is used (it avoids slow einsum kernels); integer dtypes always use it
  (tf.einsum is float-only on some devices). Otherwise the backend's einsum is called.
  """
  full_shape = next((s for s in list(input_shapes) + [output_shape]
                     if s.ndims == union_shape.ndims), None)
  reduce_shape = full_shape or union_shape
  reduce_fn, reduced_mesh_axes = reduce_ops.reduce_slice_fn_and_mesh_axes(
      reduce_shape, output_shape, mesh_impl.tensor_layout(reduce_shape), "SUM")

  def multiply_then_reduce(*slices):
    expanded = [expand_dims_to(x, s, reduce_shape) for x, s in zip(slices, input_shapes)]
    return reduce_fn(functools.reduce(tf.multiply, expanded))

  if full_shape is not None or not dtype.is_floating:
    return multiply_then_reduce, reduced_mesh_axes
  equation = _einsum_equation(input_shapes, output_shape)
  return (lambda *slices: mesh_impl.einsum(equation, *slices)), reduced_mesh_axes


# ---- checks (one rule each) ----

def _check_has_inputs(inputs, name) -> None:
  if not inputs:
    raise ValueError(f"einsum {name or 'einsum'!r} needs at least one input tensor, got none.")


def _check_are_tensors(xs, name) -> None:
  bad = [x for x in xs if not isinstance(x, Tensor)]
  if bad:
    raise TypeError(
        f"einsum {name or 'einsum'!r}: inputs must be mtf Tensors, got {bad!r}; import TF values "
        f"with mtf.import_tf_tensor, or multiply by a python scalar with `*`.")


def _check_output_dims_are_broadcastable(inputs, output_shape: Shape, op_name: str) -> None:
  """An output dim in no input is broadcast, unless an input has a dim of that name (sizes differ)."""
  present = {d for x in inputs for d in x.shape}
  input_dims = {d.name: d for x in inputs for d in x.shape}
  for d in output_shape:
    if d in present:
      continue
    other = input_dims.get(d.name)
    if other is not None and other.size != d.size:
      raise ValueError(
          f"einsum {op_name!r}: output dimension {d.name!r} (size {d.size}) is in no input, and it "
          f"cannot be broadcast because the inputs have {d.name!r} with size {other.size}; use "
          f"size {other.size} in the output shape, or rename the output dimension.")


def _check_broadcast_dims_are_new(inputs, output_shape: Shape, broadcast_dims: Shape, op_name: str) -> None:
  present = {d for x in inputs for d in x.shape}
  for d in broadcast_dims:
    if d not in output_shape.dims or d in present:
      where = "an input has it" if d in present else f"it is not in the output shape {output_shape}"
      raise ValueError(
          f"einsum {op_name!r}: broadcast_dims lists {d} but {where}; list only output dims that no "
          f"input has (here {new_dims(inputs, output_shape)}).")


def _warn_unrequested_broadcast(inputs, output_shape: Shape, broadcast_dims: Shape, op_name: str) -> None:
  unrequested = [d for d in new_dims(inputs, output_shape) if d not in broadcast_dims.dims]
  if unrequested:
    warnings.warn(
        f"einsum {op_name!r}: output dimension(s) {[d.name for d in unrequested]} are in no input "
        f"(inputs {[x.shape for x in inputs]}), so the result is copied along them. If that is meant, "
        f"pass broadcast_dims={unrequested}; otherwise an input lacks the dimension (misnamed?) or "
        f"it should not be in output_shape {output_shape}.",
        BroadcastWarning, stacklevel=_stacklevel_of_caller_outside_package())


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _stacklevel_of_caller_outside_package() -> int:
  """The warnings stacklevel (seen from the caller of this) of the first frame outside mtf's code."""
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
    frame, level = frame.f_back, level + 1
  return level


def _check_reduced_dims_are_dimensions(reduced_dims, name) -> None:
  bad = [d for d in reduced_dims if not isinstance(d, Dimension)]
  if bad:
    raise ValueError(
        f"einsum {name or 'einsum'!r}: reduced_dims must be a list of mtf.Dimension, got "
        f"{reduced_dims!r} (bad entries {bad!r}); pass e.g. [x.shape.get_dim_by_name('d_model')].")


def _check_reduced_dims_match_output(input_dims, output_shape: Shape, reduced_dims, name) -> None:
  computed = [d for d in input_dims if d not in output_shape.dims]
  if set(computed) != set(reduced_dims):
    raise ValueError(
        f"einsum {name or 'einsum'!r}: reduced_dims={reduced_dims} contradicts "
        f"output_shape={output_shape}: the input dims missing from the output are {computed}. "
        f"Give only one of output_shape and reduced_dims, or make them agree.")
