"""Floating-point operations per processor, per op, under a mesh shape and layout.

The count is a simple, documented model: an einsum costs 2 flops (multiply and add) per element
of the union of its input and output dimensions; a convolution 2 flops per output element per
filter element it sums over; every other op with floating-point outputs one flop per element
of its largest input or output slice; variables, constants, imports, pure data movement
(reshape, rename, stop_gradient) and pass-throughs (depend, custom_gradient's outputs) cost
nothing. Each count is divided by the number of processors its split dimensions spread it over.
"""

from __future__ import annotations

from mesh_tensorflow._core.layout import LayoutRules

_FREE = frozenset(
  {
    "Variable",
    "ReadVariable",
    "Constant",
    "ImportOperation",
    "ImportLaidOutTensorOperation",
    "ReshapeOperation",
    "StopGradient",
    "Assign",
    "Depend",
    "SoftDepend",
    "CustomGradientOperation",
    "RangeOperation",
    "PrintOperation",
  }
)


def per_processor_elements(dims, mesh_shape, layout_rules: LayoutRules) -> int:
  """Elements of one processor's part of a space with dimensions `dims` (each mesh dim counted once)."""
  elements, used = 1, set()
  for d in dims:
    elements *= d.size
    axis = layout_rules.tensor_dimension_to_mesh_axis(d, mesh_shape)
    if axis is not None and axis not in used:
      used.add(axis)
      elements //= mesh_shape[axis].size
  return elements


def _union_dims(op) -> list:
  dims = {}
  for t in (*op.inputs, *op.outputs):
    for d in t.shape.dims:
      dims.setdefault(d.name, d)
  return list(dims.values())


def op_flops(op, mesh_shape, layout_rules: LayoutRules) -> int:
  """FLOPs one processor spends on `op` (see the module docstring for the model)."""
  kind = type(op).__name__
  if kind in _FREE or not op.outputs:
    return 0
  if kind == "EinsumOperation":
    return 2 * per_processor_elements(_union_dims(op), mesh_shape, layout_rules)
  if "Conv" in kind and len(op.inputs) >= 2:
    filter_elements = op.inputs[1].shape.size // op.inputs[1].shape.dims[-1].size
    return 2 * filter_elements * per_processor_elements(op.outputs[0].shape.dims, mesh_shape, layout_rules)
  return max(
    per_processor_elements(t.shape.dims, mesh_shape, layout_rules) for t in (*op.inputs, *op.outputs)
  )
