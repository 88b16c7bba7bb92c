"""estimate_cost: compute, communication, memory and predicted step time of one processor."""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Union

from mesh_tensorflow._core.dims import convert_to_shape
from mesh_tensorflow._core.layout import convert_to_layout_rules
from mesh_tensorflow._cost import flops as flops_lib
from mesh_tensorflow._cost import memory as memory_lib
from mesh_tensorflow._cost import time_model as time_model_lib
from mesh_tensorflow._lowering.dry_run import dry_run


@dataclasses.dataclass(frozen=True)
class StepCost:
  """A layout's per-processor step cost derived from other costings (extrapolated to a depth, or
  priced for a pipeline), without events: what the fits, step and predicted lines read."""

  mesh_shape: object
  layout_rules: object
  time_model: object
  num_layers: int
  compute_s: float
  comm_s: float
  overhead_s: float
  flops: float
  memory: memory_lib.MemoryReport

  @property
  def step_s(self) -> float:
    return self.compute_s + self.comm_s + self.overhead_s


@dataclasses.dataclass(frozen=True)
class CostReport:
  """What one processor does in a step under `layout_rules` on `mesh_shape`, and how long it takes.

  Attributes:
    events: the CommEvents of a dry run (exactly those a real lowering records).
    op_flops: {op name: FLOPs per processor}, summed over the ops of one name (recompute_grad's
      copies of a forward op keep its name).
    memory: a MemoryReport (variables, optimizer state, activation peak).
    compute_s, comm_s, overhead_s: the time model's three terms (overhead: the per-op and per-step
      floors); step_s their sum.
  """

  mesh_shape: object
  layout_rules: object
  events: tuple
  op_flops: dict
  num_ops: int
  memory: memory_lib.MemoryReport
  time_model: time_model_lib.TimeModel
  compute_s: float
  comm_s: float
  overhead_s: float

  @property
  def step_s(self) -> float:
    return self.compute_s + self.comm_s + self.overhead_s

  @property
  def flops(self) -> int:
    return sum(self.op_flops.values())

  @property
  def bytes_sent(self) -> int:
    """Bytes sent between processors, all collectives and processors together."""
    return sum(e.bytes_sent for e in self.events)

  @property
  def comm_bytes_per_processor(self) -> float:
    return sum(e.bytes_per_processor for e in self.events)

  def comm_bytes_by_kind(self) -> dict:
    """{(kind, mesh dim names): bytes one processor sends}."""
    out = collections.Counter()
    for e in self.events:
      out[(e.kind, mesh_dim_names(self.mesh_shape, e.mesh_axes))] += e.bytes_per_processor
    return dict(out)


def mesh_dim_names(mesh_shape, mesh_axes) -> tuple:
  return tuple(mesh_shape.dims[a].name for a in mesh_axes)


def estimate_cost(
  graph,
  mesh_shape,
  layout_rules,
  outputs=(),
  time_model: Union[None, str, time_model_lib.TimeModel] = None,
  scheduler_alg: str = "LIST",
  schedule: Optional[list] = None,
) -> CostReport:
  """The cost of one step of `graph` on each processor of `mesh_shape` under `layout_rules`.

  Args:
    graph: an mtf Graph on one mesh.
    mesh_shape, layout_rules: as for mtf.dry_run.
    outputs: mtf Tensors kept in memory to the end of the step.
    time_model: a TimeModel, or a preset name ("cpu", "gpu", "tpu", "tpu_v3", "tpu_v4", "tpu_v5e",
      "a100", "h100"); default "cpu". A preset's topology gives each mesh dimension its bandwidth.
    scheduler_alg / schedule: the operation order used for the activation peak.

  Raises:
    ValueError: the layout is invalid for the graph (see mtf.check_layout).
  """
  mesh_shape = convert_to_shape(mesh_shape)
  layout_rules = convert_to_layout_rules(layout_rules)
  tm = time_model_lib.get_time_model(time_model).for_mesh(mesh_shape)
  events = dry_run(graph, mesh_shape, layout_rules).events
  op_flops = collections.Counter()
  for op in graph.operations:
    op_flops[op.name] += flops_lib.op_flops(op, mesh_shape, layout_rules)
  memory = memory_lib.estimate_memory(
    graph, mesh_shape, layout_rules, outputs, scheduler_alg, schedule, events=events
  )
  comm_s = sum(
    tm.collective_s(e.bytes_per_processor, mesh_dim_names(mesh_shape, e.mesh_axes)) for e in events
  )
  num_ops = len(graph.operations)
  return CostReport(
    mesh_shape=mesh_shape,
    layout_rules=layout_rules,
    events=tuple(events),
    op_flops=dict(op_flops),
    num_ops=num_ops,
    memory=memory,
    time_model=tm,
    compute_s=tm.compute_s(sum(op_flops.values())),
    comm_s=comm_s,
    overhead_s=num_ops * tm.op_overhead_s + tm.step_overhead_s,
  )
