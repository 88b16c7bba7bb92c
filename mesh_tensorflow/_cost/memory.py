"""Per-processor memory: parameters, optimizer state, the activation peak under a schedule, buffers.

The variable bytes are exactly what a lowering allocates per processor (each variable's slice in
its slice dtype: bfloat16 masters take 2 bytes, Adafactor's factored slots their row and column
vectors, Adam two full slots), because they come from the graph's own variables. Activations follow
the graph as built: a Transformer built with `recompute_grads` (mtf.recompute_grad) recomputes its
layers on the backward pass, so their activations are freed after the forward pass and the peak
drops accordingly.
"""

from __future__ import annotations

import collections
import dataclasses

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import convert_to_shape
from mesh_tensorflow._core.layout import convert_to_layout_rules
from mesh_tensorflow._cost import graph_interface, scheduler
from mesh_tensorflow._cost.flops import per_processor_elements


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Bytes one processor holds.

  Attributes:
    variable_bytes: trainable variables' slices (the parameters), in their slice dtype.
    slot_bytes: the other variables' slices (optimizer slots, counters).
    activation_peak_bytes: the most the op outputs (forward activations kept for the backward
      pass, gradients, temporaries) occupy at once under the schedule.
    largest: (tensor name, bytes) of the biggest slices at that peak.
    gradient_bytes: one gradient slice per trainable variable (activation dtype); these are op
      outputs, so the activation peak holds those alive at the peak (not an extra term).
    comm_buffer_bytes: the largest collective's staging buffer (what one processor sends in it),
      held beside the activations while it runs.
    remat: whether the graph recomputes activations on the backward pass (mtf.recompute_grad).
  """

  variable_bytes: int
  slot_bytes: int
  activation_peak_bytes: int
  largest: tuple
  gradient_bytes: int = 0
  comm_buffer_bytes: int = 0
  remat: bool = False

  @property
  def total_bytes(self) -> int:
    return self.variable_bytes + self.slot_bytes + self.activation_peak_bytes + self.comm_buffer_bytes

  def fits(self, limit_bytes: float) -> bool:
    """Whether the total fits in `limit_bytes` per processor."""
    return self.total_bytes <= limit_bytes


def slice_bytes(tensor, mesh_shape, layout_rules) -> int:
  return per_processor_elements(tensor.shape.dims, mesh_shape, layout_rules) * tf.as_dtype(tensor.dtype).size


def variable_slice_bytes(variable, mesh_shape, layout_rules) -> int:
  """Bytes of one processor's slice of an mtf Variable, in its slice dtype (what the lowering allocates)."""
  elements = per_processor_elements(variable.outputs[0].shape.dims, mesh_shape, layout_rules)
  return elements * tf.as_dtype(variable.slice_dtype).size


def estimate_memory(
  graph, mesh_shape, layout_rules, outputs=(), scheduler_alg: str = "LIST", schedule=None, events=()
) -> MemoryReport:
  """Memory of one processor: variable slices (trainable / other), the activation peak, buffers.

  Activations are all non-variable op outputs, allocated when their op runs and freed after
  their last consumer, in the order of `schedule` (default: `scheduler.minimize_peak_memory`).
  `events` (the dry run's CommEvents) give the communication buffer.
  """
  mesh_shape, layout_rules = convert_to_shape(mesh_shape), convert_to_layout_rules(layout_rules)

  variables = set(graph.all_variables)
  var_bytes = {v: variable_slice_bytes(v, mesh_shape, layout_rules) for v in variables}
  if schedule is None:
    if len({op.name for op in graph.operations}) < len(graph.operations):
      # Recomputed ops (mtf.recompute_grad) keep their originals' names, as upstream's do; a
      # schedule keyed by names would mix them up. Graph order recomputes each layer when its
      # gradient arrives, which is the order rematerialisation is for.
      schedule = list(range(len(graph.operations)))
    else:
      interface = graph_interface.GraphInterface(graph)
      for t in outputs:
        interface.set_tensor_final(t.name)
      schedule = scheduler.minimize_peak_memory(interface, scheduler_alg)
  sizes = {
    t: slice_bytes(t, mesh_shape, layout_rules)
    for op in graph.operations
    if op not in variables
    for t in op.outputs
  }
  peak, peak_contents = 0, ()
  for contents in _memory_contents(graph.operations, schedule, outputs):
    total = sum(sizes.get(t, 0) for t in contents)
    if total > peak:
      peak, peak_contents = total, tuple(contents)
  largest = sorted(((t.name, sizes[t]) for t in peak_contents if t in sizes), key=lambda x: (-x[1], x[0]))
  return MemoryReport(
    variable_bytes=sum(b for v, b in var_bytes.items() if v.trainable),
    slot_bytes=sum(b for v, b in var_bytes.items() if not v.trainable),
    activation_peak_bytes=peak,
    largest=tuple(largest[:5]),
    gradient_bytes=sum(
      slice_bytes(v.outputs[0], mesh_shape, layout_rules) for v in graph.trainable_variables
    ),
    comm_buffer_bytes=int(max((e.bytes_per_processor for e in events), default=0)),
    remat=any(type(op).__name__ == "CustomGradientOperation" for op in graph.operations),
  )


def _memory_contents(operations, schedule, finals):
  """Per scheduled op (an index into `operations`), the tensors in memory while it runs.

  A tensor is allocated when its op runs and freed after its last consumer; `finals` are never
  freed; a tensor nobody consumes is freed right after its op. Tensors are told apart by identity,
  not name (a recomputed op's outputs share its original's names).
  """
  uses = collections.Counter(t for op in operations for t in op.inputs)
  uses.update(finals)
  live = {}
  for index in schedule:
    op = operations[index]
    for t in op.outputs:
      live[t] = None
    yield live.keys()
    for t in op.outputs:
      if uses[t] == 0:
        live.pop(t, None)
    for t in op.inputs:
      uses[t] -= 1
      if uses[t] == 0:
        live.pop(t, None)
