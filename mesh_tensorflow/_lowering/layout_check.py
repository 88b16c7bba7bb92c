"""The layout check: rejects, before lowering, a layout the graph cannot be lowered with.

A pure function of the graph, the mesh shape and the layout rules (no devices, no TF ops), so a
layout search can reject a layout without lowering. `Lowering` runs it for every mesh first, so
a bad layout fails here, naming the op, the dimension, the mesh dimension and the rule to drop,
instead of somewhere inside an op's lowering.
"""

from __future__ import annotations

import difflib
import warnings
from collections import abc
from typing import Iterator, Optional

from mesh_tensorflow._core.dims import Dimension, Shape, convert_to_shape
from mesh_tensorflow._core.errors import LayoutError, LayoutRuleWarning, UnsplittableDimensionError
from mesh_tensorflow._core.graph import Graph, Mesh
from mesh_tensorflow._core.layout import LayoutRules, convert_to_layout_rules, slice_shape
from mesh_tensorflow._core.operation import Operation


def check_layout(graph: Graph, mesh_shape, layout_rules, mesh: Optional[Mesh] = None) -> None:
  """Raises ValueError if `graph` (its ops on `mesh`; all ops if None) can't be lowered so.

  Per op, and per op nested in it (a while loop's body), in graph order:
  * no dimension the op declares unsplittable is split (UnsplittableDimensionError, a LayoutError);
  * each output's layout is valid: every mesh dimension used once per tensor, every tensor
    dimension on at most one mesh dimension, and split evenly.

  Example: `check_layout(graph, "rows:2;cols:4", "batch:rows;hidden:cols")`.
  """
  mesh_shape = convert_to_shape(mesh_shape)
  layout_rules = convert_to_layout_rules(layout_rules)
  valid_shapes = set()  # many tensors share a shape; each is checked once
  for op in _operations(graph, mesh):
    _check_splits_only_splittable_dims(op, mesh_shape, layout_rules)
    for t in op.outputs:
      if t.shape not in valid_shapes:
        _check_valid_tensor_layout(op, t, mesh_shape, layout_rules)
        valid_shapes.add(t.shape)


def _check_valid_tensor_layout(op: Operation, tensor, mesh_shape: Shape, layout_rules: LayoutRules) -> None:
  """slice_shape's check, its message naming the tensor and the op (a variable: its name) it comes from."""
  try:
    slice_shape(tensor.shape, mesh_shape, layout_rules)
  except ValueError as e:
    raise LayoutError(f"Tensor {tensor.name!r} (output of {type(op).__name__} {op.name!r}): {e}",
                      op=op) from e


def check_mesh_impls(graph: Graph, mesh_to_impl) -> None:
  """`check_layout` for each mesh in `mesh_to_impl` ({mtf.Mesh: MeshImpl}) with its impl's layout.

  Also warns (LayoutRuleWarning, pointing at the caller of `Lowering`) about each layout rule
  that looks misspelled: see `misspelled_rules`.
  """
  _check_is_mesh_to_impl(mesh_to_impl)
  for mesh, impl in mesh_to_impl.items():
    tensor_dims = {d.name for op in _operations(graph, mesh) for t in op.outputs for d in t.shape.dims}
    for message in misspelled_rules(impl.shape, impl.layout_rules, tensor_dims):
      warnings.warn(message, LayoutRuleWarning, stacklevel=3)
    check_layout(graph, impl.shape, impl.layout_rules, mesh=mesh)


# How alike a rule's name and an existing one must be to call it a typo. Tensor dimensions are
# held to a closer match: shipped layouts name dimensions that many models lack (outer_batch,
# experts), which are not typos of the ones they have (batch).
_MESH_DIM_CUTOFF, _TENSOR_DIM_CUTOFF = 0.6, 0.8


def misspelled_rules(mesh_shape, layout_rules, tensor_dims=()) -> list:
  """A message per rule naming a dimension that is absent but has a close name: a likely typo.

  A rule for a mesh dimension absent from this mesh, or for a tensor dimension absent from this
  graph, is legitimate (shipped layout files name `model` and run on meshes without it; they name
  `experts` for models without experts), so only near misses are reported: `hidden:modle` on a
  mesh with `model`, `dff:model` in a graph with `d_ff` (`tensor_dims`: the graph's dimension
  names; empty: not checked). Such a rule does not apply.
  """
  mesh_shape = convert_to_shape(mesh_shape)
  names = mesh_shape.dimension_names
  messages = []
  for dim, mesh_dim in convert_to_layout_rules(layout_rules):
    close = difflib.get_close_matches(mesh_dim, names, n=1, cutoff=_MESH_DIM_CUTOFF)
    if mesh_dim not in names and close:
      messages.append(
          f"Layout rule {dim}:{mesh_dim} names mesh dimension {mesh_dim!r}, which this mesh does not "
          f"have (its dimensions: {', '.join(names)}): did you mean {close[0]!r}? The rule does not "
          f"apply, so {dim!r} is not split by it.")
    close = difflib.get_close_matches(dim, sorted(tensor_dims), n=1, cutoff=_TENSOR_DIM_CUTOFF)
    if tensor_dims and dim not in tensor_dims and close:
      messages.append(
          f"Layout rule {dim}:{mesh_dim} names tensor dimension {dim!r}, which no tensor of this graph "
          f"has: did you mean {close[0]!r}? The rule does not apply, so {close[0]!r} is not split "
          f"by it.")
  return messages


def _operations(graph: Graph, mesh: Optional[Mesh]) -> Iterator[Operation]:
  """Ops on `mesh` in graph order, each preceded by the ops nested in it (so those are blamed)."""
  for op in graph.operations:
    if mesh is None or op.mesh is mesh:
      yield from op.nested_operations()
      yield op


def _check_splits_only_splittable_dims(op: Operation, mesh_shape: Shape, layout_rules: LayoutRules) -> None:
  for name in sorted(op.layout_unsplittable_dims):
    mesh_axis = layout_rules.tensor_dimension_to_mesh_axis(Dimension(name, 0), mesh_shape)
    if mesh_axis is None:
      continue
    mesh_dim = mesh_shape[mesh_axis]
    rule = f"{name}:{mesh_dim.name}"
    raise UnsplittableDimensionError(
        f"{type(op).__name__} {op.name!r} can't split dimension {name!r}: the layout rule {rule} "
        f"splits it over mesh dimension {mesh_dim.name!r} (size {mesh_dim.size}), but "
        f"{op.unsplittable_reason(name)}. Remove the layout rule {rule}, or rename {name!r} "
        f"(mtf.rename_dimension) before this op so that the rule does not apply to it.",
        op=op, dimension=name, mesh_dimension=mesh_dim.name)


def _check_is_mesh_to_impl(mesh_to_impl) -> None:
  if not isinstance(mesh_to_impl, abc.Mapping):
    raise TypeError(
        f"Lowering needs mesh_to_impl, a dict {{mtf.Mesh: MeshImpl}}, got a "
        f"{type(mesh_to_impl).__name__}; write mtf.Lowering(graph, {{mesh: mesh_impl}}).")
  for mesh, impl in mesh_to_impl.items():
    if not isinstance(mesh, Mesh) or not (hasattr(impl, "shape") and hasattr(impl, "layout_rules")):
      raise TypeError(
          f"mesh_to_impl must map mtf.Mesh objects to MeshImpls, got {mesh!r}: {impl!r}; write "
          f"mtf.Lowering(graph, {{mesh: mesh_impl}}).")
