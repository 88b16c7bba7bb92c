"""Per-processor memory: variables, optimizer state and the peak of activations under a schedule."""

from __future__ import annotations

import dataclasses

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import convert_to_shape
from mesh_tensorflow._core.layout import convert_to_layout_rules
from mesh_tensorflow._cost.flops import per_processor_elements


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Bytes one processor holds. `largest` lists (tensor name, bytes) of the biggest slices at the peak."""

  variable_bytes: int
  slot_bytes: int
  activation_peak_bytes: int
  largest: tuple

  @property
  def total_bytes(self) -> int:
    return self.variable_bytes + self.slot_bytes + self.activation_peak_bytes


def slice_bytes(tensor, mesh_shape, layout_rules) -> int:
  return per_processor_elements(tensor.shape.dims, mesh_shape, layout_rules) * tf.as_dtype(tensor.dtype).size


def estimate_memory(
  graph, mesh_shape, layout_rules, outputs=(), scheduler_alg: str = "LIST", schedule=None
) -> MemoryReport:
  """Memory of one processor: variable slices (trainable / other) and the activation peak.

  Activations are all non-variable op outputs, allocated when their op runs and freed after
  their last consumer, in the order of `schedule` (default: `scheduler.minimize_peak_memory`).
  """
  from mesh_tensorflow.auto_mtf import graph_interface, scheduler

  mesh_shape, layout_rules = convert_to_shape(mesh_shape), convert_to_layout_rules(layout_rules)

  variables = set(graph.all_variables)
  var_bytes = {v: slice_bytes(v.outputs[0], mesh_shape, layout_rules) for v in variables}
  interface = graph_interface.GraphInterface(graph)
  for t in outputs:
    interface.set_tensor_final(t.name)
  if schedule is None:
    schedule = scheduler.minimize_peak_memory(interface, scheduler_alg)
  sizes = {
    t.name: slice_bytes(t, mesh_shape, layout_rules)
    for op in graph.operations
    if op not in variables
    for t in op.outputs
  }
  peak, peak_contents = 0, frozenset()
  for contents in interface.compute_memory_contents_under_schedule(schedule):
    total = sum(sizes.get(name, 0) for name in contents)
    if total > peak:
      peak, peak_contents = total, contents
  by_size = sorted((-sizes[name], name) for name in peak_contents if name in sizes)
  largest = [(name, -negative_size) for negative_size, name in by_size]
  return MemoryReport(
    variable_bytes=sum(b for v, b in var_bytes.items() if v.trainable),
    slot_bytes=sum(b for v, b in var_bytes.items() if not v.trainable),
    activation_peak_bytes=peak,
    largest=tuple(largest[:5]),
  )
