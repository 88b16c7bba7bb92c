"""Slicing and joining along one named dimension: slice/pad, concat/split, stack/unstack.

Each op works slice by slice, so the dimension it cuts or joins must not be split over a mesh
dimension: each declares it unsplittable, and the layout check rejects a layout splitting it
before lowering. The pairs are each other's gradients.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, Shape
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._ops import _checks as checks
from mesh_tensorflow._ops import io as io_ops

__all__ = [
    "SliceOperation", "mtf_slice", "PadOperation", "pad", "ConcatOperation", "concat",
    "SplitOperation", "split", "StackOperation", "stack", "UnstackOperation", "unstack",
]


def _axis_of(shape: Shape, dim_name: str, what: str) -> int:
  """Index of the dimension called `dim_name` in `shape`; ValueError naming `what` if absent."""
  if dim_name not in shape.dimension_names:
    raise ValueError(f"{what}: dimension {dim_name!r} is not in {shape}; "
                     f"use one of {shape.dimension_names}.")
  return shape.dimension_names.index(dim_name)


def _next_name(x: Tensor, name: str) -> str:
  """The name the op about to be built will get (for errors raised before it joins the graph)."""
  return x.graph.unique_name(name, mark_as_used=False)


def _check_same_except(what: str, x: Tensor, first: Tensor, axis: int) -> None:
  """x must match `first` in dtype and in every dimension except (the size of) dimension `axis`."""
  if x.dtype != first.dtype:
    raise ValueError(f"{what}: {x.name!r} has dtype {x.dtype.name} but {first.name!r} "
                     f"has {first.dtype.name}; cast them to one dtype first.")
  a, b = x.shape, first.shape
  if (a.dimension_names != b.dimension_names
      or any(i != axis and da != db for i, (da, db) in enumerate(zip(a, b)))):
    raise ValueError(
        f"{what}: {x.name!r} has {a} but {first.name!r} has {b}; the inputs may differ "
        f"only in the size of {b[axis].name!r} (same dimension names, order and other sizes).")


class _AlongOneDimOperation(Operation):
  """An op that cuts or joins along one dimension within each processor's slice."""

  _verb = ""  # what it does along that dimension: "slice", "concat", ...

  def unsplittable_reason(self, dim_name: str) -> str:
    return (f"{self._verb} works along {dim_name!r} within each processor's slice, so {dim_name!r} "
            f"must be whole on every processor")


def _check_flat_paddings(what: str, paddings, dim_name: str) -> None:
  """mtf pads one named dimension, so paddings is [before, after], not TF's list of pairs."""
  if any(isinstance(p, (list, tuple)) for p in paddings):
    raise ValueError(
        f"{what}: paddings must be [before, after] for dimension {dim_name!r}, got the TF-style "
        f"nested {paddings!r}; mtf pads one named dimension per call, e.g. "
        f"mtf.pad(x, [1, 2], {dim_name!r}).")


def _replace_dim(shape: Shape, axis: int, new_dim: Dimension) -> Shape:
  return Shape(shape.dims[:axis] + [new_dim] + shape.dims[axis + 1:])


class SliceOperation(_AlongOneDimOperation):
  """x[..., begin:begin + size, ...] along the dimension named `slice_dim_name` (same name, new size)."""

  _verb = "slice"

  def __init__(self, x: Tensor, begin: int, size: int, slice_dim_name: str, name: Optional[str] = None):
    what = f"slice {_next_name(x, name or 'slice')!r}"
    axis = _axis_of(x.shape, slice_dim_name, what)
    begin, size = operator.index(begin), operator.index(size)
    full_size = x.shape[axis].size
    if begin < 0 or size < 0 or begin + size > full_size:
      raise ValueError(
          f"{what}: begin={begin}, size={size} is out of range for dimension "
          f"{slice_dim_name!r} of size {full_size}; need 0 <= begin and begin + size <= {full_size}.")
    super().__init__([x], name=name or "slice")
    self._axis = axis
    self._begin = begin
    self._slice_dim = Dimension(slice_dim_name, size)
    self._outputs = [Tensor(self, _replace_dim(x.shape, self._axis, self._slice_dim), x.dtype)]
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_splittable_and_unsplittable_dims("splittable", [slice_dim_name]))

  def gradient(self, grad_ys):
    full_size = self.inputs[0].shape[self._axis].size
    after = full_size - self._begin - self._slice_dim.size
    return [pad(grad_ys[0], [self._begin, after], self._slice_dim.name)]

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    ndims = self.inputs[0].shape.ndims
    begin = [0] * ndims
    begin[self._axis] = self._begin
    size = [-1] * ndims
    size[self._axis] = self._slice_dim.size
    y = mesh_impl.slicewise(lambda x: tf.slice(x, begin, size), lowering.tensors[self.inputs[0]])
    lowering.set_tensor_lowering(self.outputs[0], y)


def mtf_slice(x: Tensor, begin: int, size: int, slice_dim_name: str, name: Optional[str] = None) -> Tensor:
  """Slices one dimension of x: `size` entries from `begin` (exported as `mtf.slice`)."""
  return SliceOperation(x, begin, size, slice_dim_name, name=name).outputs[0]


class PadOperation(_AlongOneDimOperation):
  """Zero-pads the dimension named `pad_dim_name` with paddings = [before, after]."""

  _verb = "pad"

  def __init__(self, x: Tensor, paddings: Sequence[int], pad_dim_name: str, name: Optional[str] = None):
    what = f"pad {_next_name(x, name or 'pad')!r}"
    _check_flat_paddings(what, paddings, pad_dim_name)
    paddings = [operator.index(p) for p in paddings]
    if len(paddings) != 2 or min(paddings) < 0:
      raise ValueError(f"{what}: paddings must be [before, after] with both >= 0, got {paddings}.")
    axis = _axis_of(x.shape, pad_dim_name, what)
    super().__init__([x], name=name or "pad")
    self._axis = axis
    self._paddings = paddings
    self._output_dim = Dimension(pad_dim_name, x.shape[self._axis].size + sum(paddings))
    self._outputs = [Tensor(self, _replace_dim(x.shape, self._axis, self._output_dim), x.dtype)]
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_splittable_and_unsplittable_dims("splittable", [pad_dim_name]))

  def gradient(self, grad_ys):
    size = self.inputs[0].shape[self._axis].size
    return [mtf_slice(grad_ys[0], self._paddings[0], size, self._output_dim.name)]

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    paddings = [[0, 0]] * self.inputs[0].shape.ndims
    paddings[self._axis] = self._paddings
    # zero padding is linear: a pending allreduce sum stays pending (a pipeline's weight
    # gradients then sum over the ticks before they are reduced once)
    y = mesh_impl.slicewise_delay_allreduce(lambda x: tf.pad(x, paddings), lowering.tensors[self.inputs[0]])
    lowering.set_tensor_lowering(self.outputs[0], y)


def pad(x: Tensor, paddings: Sequence[int], dim_name: str, name: Optional[str] = None) -> Tensor:
  """Zero-pads dimension `dim_name` of x by paddings = [before, after]."""
  return PadOperation(x, paddings, dim_name, name=name).outputs[0]


class ConcatOperation(_AlongOneDimOperation):
  """Concatenates tensors along `concat_dim_name`; all other dimensions must be equal."""

  _verb = "concat"

  def __init__(self, xs: Sequence[Tensor], concat_dim_name: str, name: Optional[str] = None):
    xs = list(xs)
    if not xs:
      raise ValueError(f"concat {name or 'concat'!r}: needs at least one tensor.")
    what = f"concat {_next_name(xs[0], name or 'concat')!r}"
    first = xs[0].shape
    axis = _axis_of(first, concat_dim_name, what)
    for x in xs[1:]:
      _check_same_except(what, x, xs[0], axis)
    super().__init__(xs, name=name or "concat")
    self._axis = axis
    self._concat_dim_name = concat_dim_name
    self._input_sizes = [x.shape[self._axis].size for x in xs]
    out_dim = Dimension(concat_dim_name, sum(self._input_sizes))
    self._outputs = [Tensor(self, _replace_dim(first, self._axis, out_dim), xs[0].dtype)]
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_splittable_and_unsplittable_dims("splittable", [concat_dim_name]))

  def gradient(self, grad_ys):
    return split(grad_ys[0], self.outputs[0].shape[self._axis], self._input_sizes)

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    y = mesh_impl.slicewise(lambda *xs: tf.concat(xs, axis=self._axis),
                            *[lowering.tensors[x] for x in self.inputs])
    lowering.set_tensor_lowering(self.outputs[0], y)


def concat(xs: Sequence[Tensor], concat_dim_name: str, name: Optional[str] = None) -> Tensor:
  """Concatenates xs along the dimension named `concat_dim_name`."""
  return ConcatOperation(xs, concat_dim_name, name=name).outputs[0]


class SplitOperation(_AlongOneDimOperation):
  """Splits `split_dim` into equal parts (an int) or parts of the listed sizes."""

  _verb = "split"

  def __init__(self, x: Tensor, split_dim: Dimension, num_or_size_splits, name: Optional[str] = None):
    what = f"split {_next_name(x, name or 'split')!r}"
    checks.check_dim_in(what, "split_dim", split_dim, x)
    if isinstance(num_or_size_splits, (list, tuple)):
      sizes = [operator.index(s) for s in num_or_size_splits]
      if sum(sizes) != split_dim.size or min(sizes, default=0) < 0:
        raise ValueError(f"{what}: sizes {sizes} do not add up to {split_dim.size}, "
                         f"the size of {split_dim.name!r} (or one is negative).")
    else:
      n = operator.index(num_or_size_splits)
      if n <= 0 or split_dim.size % n:
        raise ValueError(f"{what}: {n} parts do not divide {split_dim.name!r} of size "
                         f"{split_dim.size}; give a divisor, or a list of sizes.")
      sizes = [split_dim.size // n] * n
    super().__init__([x], name=name or "split")
    self._split_dim = split_dim
    self._axis = x.shape.dims.index(split_dim)
    self._output_sizes = sizes
    self._outputs = [Tensor(self, x.shape.resize_dimension(split_dim.name, s), x.dtype, index=i)
                     for i, s in enumerate(sizes)]
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_splittable_and_unsplittable_dims("splittable", [split_dim.name]))

  def gradient(self, grad_ys):
    grads = [g if g is not None else io_ops.zeros_like(out) for g, out in zip(grad_ys, self.outputs)]
    return [concat(grads, self._split_dim.name)]

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    values = mesh_impl.slicewise(lambda x: tuple(tf.split(x, self._output_sizes, axis=self._axis)),
                                 lowering.tensors[self.inputs[0]])
    for out, value in zip(self.outputs, values):
      lowering.set_tensor_lowering(out, value)


def split(x: Tensor, split_dim: Dimension, num_or_size_splits, name: Optional[str] = None) -> list:
  """Splits x along split_dim into `num_or_size_splits` (int: equal parts; list: sizes) tensors."""
  return SplitOperation(x, split_dim, num_or_size_splits, name=name).outputs


class StackOperation(_AlongOneDimOperation):
  """Stacks equal-shaped tensors along a new dimension `dim_name` inserted at position `axis`."""

  _verb = "stack"

  def __init__(self, xs: Sequence[Tensor], dim_name: str, axis: int, name: Optional[str] = None):
    xs = list(xs)
    if not xs:
      raise ValueError(f"stack {name or 'stack'!r}: needs at least one tensor.")
    what = f"stack {_next_name(xs[0], name or 'stack')!r}"
    ndims = xs[0].shape.ndims
    if axis < 0:
      axis += ndims + 1
    if not 0 <= axis <= ndims:
      raise ValueError(f"{what}: axis {axis} is out of range for {ndims}-d inputs; "
                       f"use -{ndims + 1} <= axis <= {ndims}.")
    if dim_name in xs[0].shape.dimension_names:
      raise ValueError(f"{what}: the new dimension {dim_name!r} is already in "
                       f"{xs[0].shape}; pick another name.")
    for x in xs[1:]:
      if x.shape != xs[0].shape or x.dtype != xs[0].dtype:
        raise ValueError(f"{what}: {x.name!r} ({x.shape}, {x.dtype.name}) differs "
                         f"from {xs[0].name!r} ({xs[0].shape}, {xs[0].dtype.name}); stacked "
                         f"tensors must have one shape and dtype.")
    super().__init__(xs, name=name or "stack")
    self._axis = axis
    self._new_dim = Dimension(dim_name, len(xs))
    dims = xs[0].shape.dims
    self._outputs = [Tensor(self, Shape(dims[:axis] + [self._new_dim] + dims[axis:]), xs[0].dtype)]
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_splittable_and_unsplittable_dims("splittable", [dim_name]))

  def gradient(self, grad_ys):
    return unstack(grad_ys[0], self._new_dim)

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    y = mesh_impl.slicewise(lambda *xs: tf.stack(xs, axis=self._axis),
                            *[lowering.tensors[x] for x in self.inputs])
    lowering.set_tensor_lowering(self.outputs[0], y)


def stack(xs: Sequence[Tensor], dim_name: str, axis: int = 0, name: Optional[str] = None) -> Tensor:
  """Stacks xs along a new dimension `dim_name` of size len(xs) at `axis` (negative counts from the end)."""
  return StackOperation(xs, dim_name, axis, name=name).outputs[0]


class UnstackOperation(_AlongOneDimOperation):
  """Splits x along `dim` into dim.size tensors without that dimension."""

  _verb = "unstack"

  def __init__(self, x: Tensor, dim: Dimension, name: Optional[str] = None):
    checks.check_dim_in(f"unstack {_next_name(x, name or 'unstack')!r}", "dim", dim, x)
    super().__init__([x], name=name or "unstack")
    self._dim = dim
    self._axis = x.shape.dims.index(dim)
    self._outputs = [Tensor(self, x.shape - dim, x.dtype, index=i) for i in range(dim.size)]
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_splittable_and_unsplittable_dims("splittable", [dim.name]))

  def gradient(self, grad_ys):
    grads = [g if g is not None else io_ops.zeros_like(out) for g, out in zip(grad_ys, self.outputs)]
    return [stack(grads, self._dim.name, self._axis)]

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    values = mesh_impl.slicewise(
        lambda x: tuple(tf.unstack(x, num=self._dim.size, axis=self._axis)),
        lowering.tensors[self.inputs[0]])
    for out, value in zip(self.outputs, values):
      lowering.set_tensor_lowering(out, value)


def unstack(x: Tensor, dim: Dimension, name: Optional[str] = None) -> list:
  """The dim.size tensors x[..., i, ...] along `dim`."""
  return UnstackOperation(x, dim, name=name).outputs
