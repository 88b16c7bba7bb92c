"""The layout check: rejects, before lowering, a layout the graph cannot be lowered with.

A pure function of the graph, the mesh shape and the layout rules (no devices, no TF ops), so a
layout search can reject a layout without lowering. `Lowering` runs it for every mesh first, so
a bad layout fails here, naming the op, the dimension, the mesh dimension and the rule to drop,
instead of somewhere inside an op's lowering.
"""

from __future__ import annotations

from collections import abc
from typing import Iterator, Optional

from mesh_tensorflow._core.dims import Dimension, Shape, convert_to_shape
from mesh_tensorflow._core.errors import UnsplittableDimensionError
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
        slice_shape(t.shape, mesh_shape, layout_rules)
        valid_shapes.add(t.shape)


def check_mesh_impls(graph: Graph, mesh_to_impl) -> None:
  """`check_layout` for each mesh in `mesh_to_impl` ({mtf.Mesh: MeshImpl}) with its impl's layout."""
  _check_is_mesh_to_impl(mesh_to_impl)
  for mesh, impl in mesh_to_impl.items():
    check_layout(graph, impl.shape, impl.layout_rules, mesh=mesh)


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
