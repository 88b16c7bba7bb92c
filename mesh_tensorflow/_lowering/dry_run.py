"""Dry run: what a layout costs, without devices or data.

`dry_run(graph, mesh_shape, layout_rules)` lowers the graph on the shape-only backend: every op
runs its normal `lower` code, so the communication events are exactly those a real lowering of
the same graph and layout records (tests check this for every op family), and the per-processor
memory of variables, optimizer state and activations follows from the slice shapes. The layout
explainer and the layout search stand on it.

Its cost does not depend on the number of processors (one slice stands for all of them, and
bytes come from the mesh arithmetic; see `_backends/shape_only.py`), and repeated layers cost
little: a 64-layer, 100B-parameter Transformer lowers in seconds on 8 or 4096 processors alike
(benchmarks/RESULTS.md, "Dry runs at pod scale"; benchmarks/bench_dry_run.py).
"""

from __future__ import annotations

import dataclasses
import functools

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import convert_to_shape
from mesh_tensorflow._core.layout import convert_to_layout_rules


@dataclasses.dataclass(frozen=True)
class DryRunResult:
  """Communication and per-processor memory of a graph under one mesh shape and layout.

  Attributes:
    events: the CommEvents, in lowering order (collectives of lazy sums nobody used are absent).
    counters: the (key, value) pairs `Lowering.counters` would hold.
    variable_bytes: per processor, the slices of trainable variables.
    slot_bytes: per processor, the slices of other variables (optimizer slots, step counters).
    activation_bytes: per processor, the output slices of every other op (none freed).
  """

  events: tuple
  counters: tuple
  variable_bytes: int
  slot_bytes: int
  activation_bytes: int

  @property
  def bytes_sent(self) -> int:
    """Bytes sent between processors, all events and processors together."""
    return sum(e.bytes_sent for e in self.events)

  @property
  def bytes_sent_per_processor(self) -> float:
    return sum(e.bytes_per_processor for e in self.events)


def dry_run(graph, mesh_shape, layout_rules, autostack: bool = False) -> DryRunResult:
  """Lowers `graph` (all on one mesh) shape-only under `mesh_shape` and `layout_rules`.

  Args:
    graph: an mtf Graph whose ops are all on one Mesh.
    mesh_shape: the mesh shape (anything mtf.convert_to_shape accepts), e.g. "rows:2;cols:4".
    layout_rules: the layout (anything mtf.convert_to_layout_rules accepts), e.g. "batch:rows".
    autostack: stack variables first, as Lowering(autostack=True) does (this rewrites the graph).

  Returns:
    A DryRunResult.

  Raises:
    ValueError: the graph's ops are on several meshes, or a layout rule splits a dimension
      unevenly or one an op can't split.

  Example:
    result = mtf.dry_run(graph, "rows:2;cols:4", "batch:rows;d_ff:cols")
    print(result.bytes_sent, [str(e) for e in result.events])
  """
  from mesh_tensorflow._backends.shape_only import ShapeOnlyMeshImpl
  mesh = _the_mesh(graph)
  values = _shared_values()
  impl = ShapeOnlyMeshImpl(convert_to_shape(mesh_shape), convert_to_layout_rules(layout_rules), values)
  with values.graph.as_default():
    lowering = _shape_only_lowering_class()(graph, {mesh: impl}, autostack=autostack)
  variable_bytes = slot_bytes = 0
  for v in graph.all_variables:
    size = impl.slice_size(v.shape) * tf.as_dtype(v.slice_dtype).size
    if v.trainable:
      variable_bytes += size
    else:
      slot_bytes += size
  variables = set(graph.all_variables)
  activation_bytes = sum(impl.slice_size(t.shape) * t.dtype.size
                         for op in graph.operations if op not in variables for t in op.outputs)
  return DryRunResult(events=tuple(lowering.communication_events), counters=tuple(lowering.counters),
                      variable_bytes=variable_bytes, slot_bytes=slot_bytes,
                      activation_bytes=activation_bytes)


_shared = []  # the ShapeValues every dry run of this process builds in


def _shared_values():
  """The process's ShapeValues (a fresh one once its graph has grown large)."""
  from mesh_tensorflow._backends.shape_only import ShapeValues
  if not _shared:
    _shared.append(ShapeValues())
  _shared[0] = _shared[0].fresh()
  return _shared[0]


@functools.cache
def _shape_only_lowering_class():
  """Lowering without random streams: the shape-only backend draws placeholders, not values."""
  from mesh_tensorflow._lowering.lowering import Lowering

  class ShapeOnlyLowering(Lowering):

    def random_key(self, op_key: int):
      del op_key
      return None

  return ShapeOnlyLowering


def _the_mesh(graph):
  meshes = list(dict.fromkeys(op.mesh for op in graph.operations))
  if len(meshes) != 1:
    raise ValueError(
        f"dry_run needs a graph on exactly one mesh, got {meshes}; lower multi-mesh graphs with "
        f"mtf.Lowering.")
  return meshes[0]
