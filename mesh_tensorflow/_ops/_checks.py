"""Input checks shared by op families that combine several tensors by dimension name."""

from __future__ import annotations

from typing import Sequence

from mesh_tensorflow._core.dims import convert_to_shape, names_with_two_sizes


def check_same_dtype(op_name: str, tensors: Sequence) -> None:
  if len({x.dtype for x in tensors}) > 1:
    found = ", ".join(f"{x.name!r} is {x.dtype.name}" for x in tensors)
    raise ValueError(f"{op_name}: inputs must have the same dtype, but dtypes differ: {found}; "
                     f"mtf.cast them first.")


def check_same_dimension_sizes(op_name: str, tensors: Sequence, output_shape=None) -> None:
  """Dimensions are matched by name, so a name must have one size across all inputs.

  Except a name that one input, or the output, holds with two sizes: a kernel [d_model=6,
  d_model=2] (or its gradient) declares them different Dimensions (0.1.21's dense makes one when
  output and input share a name).
  """
  shapes = [x.shape for x in tensors] + ([output_shape] if output_shape is not None else [])
  mapped = {name for shape in shapes for name in names_with_two_sizes(shape)}
  seen = {}
  for x in tensors:
    for d in x.shape:
      if d.name in mapped:
        continue
      first_size, first = seen.setdefault(d.name, (d.size, x))
      if first_size != d.size:
        raise ValueError(
            f"{op_name}: dimension {d.name!r} has size {first_size} in {first.name!r} ({first.shape}) "
            f"but size {d.size} in {x.name!r} ({x.shape}); same-named dimensions must have the same "
            f"size. Rename one (mtf.rename_dimension) or fix the sizes.")


def check_dim_in(op_name: str, arg_name: str, dim, x) -> None:
  """`dim` (name and size) must be a dimension of tensor `x`."""
  if dim not in x.shape.dims:
    raise ValueError(f"{op_name}: {arg_name} {dim} is not a dimension of {x.name!r} {x.shape}; pass one "
                     f"of {x.shape.dims} (names and sizes must both match).")


def check_output_has_input_dims(op_name: str, inputs, output_shape) -> None:
  """A broadcasting op does not reduce: its output keeps every input dimension."""
  for x in inputs:
    missing = [d for d in x.shape if d not in output_shape.dims]
    if missing:
      raise ValueError(
          f"{op_name}: output shape {output_shape} lacks {missing} of input {x.name!r} "
          f"({x.shape}); this op does not reduce. Add the dimensions to output_shape, or reduce "
          f"first with mtf.reduce_sum.")


def verify_no_new_dims(input_shapes: Sequence, output_shape) -> None:
  """Raises if `output_shape` has a dimension (name and size) that none of `input_shapes` has.

  For shape rules of ops that can only keep, reorder or drop input dimensions (a transpose, a
  reduction); upstream's public helper of the same name.

  Args:
    input_shapes: a list of Shapes (or anything mtf.convert_to_shape accepts).
    output_shape: a Shape (or anything mtf.convert_to_shape accepts).

  Raises:
    ValueError: if there are new dimensions in the output; the message names them.
  """
  input_shapes = [convert_to_shape(s) for s in input_shapes]
  output_shape = convert_to_shape(output_shape)
  input_dims = {d for s in input_shapes for d in s.dims}
  new_dims = [d for d in output_shape.dims if d not in input_dims]
  if new_dims:
    raise ValueError(
        f"No new dimensions allowed in output: output_shape {output_shape} has {new_dims}, which no "
        f"input has (input_shapes = {[s.dims for s in input_shapes]}). Dimensions match by name and "
        f"size: add the dimension to an input (e.g. mtf.broadcast) or remove it from the output.")
