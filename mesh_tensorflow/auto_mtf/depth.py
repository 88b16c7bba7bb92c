"""Layouts of deep layer stacks: search two shallow copies of the model, extrapolate costs to full depth.

A model of N identical layers costs, per processor, a fixed part plus N times one layer's part:
FLOPs, collectives, per-op overhead and variable and optimizer bytes are sums over ops, so each
is affine in N and two depths d < d' determine it exactly (`extrapolate`). The layout search's
decision variables are per dimension name, which every depth shares, so the layouts of the
depth-d graph are those of the depth-N graph: `layout_for_depth` builds the model at d and d'
layers, scores every layout on both (the fast estimate, then the exact dry-run costing of the
best few) and ranks them by the costs extrapolated to N. Its work depends on d and d', not on
N, while the result equals a search of the full graph (tests compare both).

The activation peak is the one term that is not a sum: it is the largest of the peaks of the
schedule's phases, each affine in N, so it is convex in N and the line through depths d and d'
is exact while one phase (typically the layers' saved activations) holds the peak at both, and
a lower bound otherwise. Deeper representative depths make that more likely, at their cost.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np

from mesh_tensorflow._core.dims import convert_to_shape
from mesh_tensorflow._core.layout import convert_to_layout_rules
from mesh_tensorflow._cost import memory as memory_lib
from mesh_tensorflow._cost import model as cost_model
from mesh_tensorflow._cost.time_model import get_time_model
from mesh_tensorflow.auto_mtf import _solver, valid_layouts


def extrapolate(shallow, deep, depths: Sequence[int], num_layers: int):
  """The value at `num_layers` of the line through (depths[0], shallow) and (depths[1], deep)."""
  d0, d1 = depths
  return shallow + (deep - shallow) * (num_layers - d0) / (d1 - d0)


def extrapolate_memory(shallow: memory_lib.MemoryReport, deep: memory_lib.MemoryReport,
                       depths: Sequence[int], num_layers: int) -> memory_lib.MemoryReport:
  """Every additive memory term extrapolated; the largest collective's buffer is the larger one's."""
  return dataclasses.replace(
    deep,
    **{
      k: int(round(extrapolate(getattr(shallow, k), getattr(deep, k), depths, num_layers)))
      for k in ("variable_bytes", "slot_bytes", "activation_peak_bytes", "gradient_bytes")
    },
    comm_buffer_bytes=max(shallow.comm_buffer_bytes, deep.comm_buffer_bytes),
  )


@dataclasses.dataclass(frozen=True)
class DepthCost(cost_model.StepCost):
  """One layout's per-processor cost at `num_layers` layers, extrapolated from costings at `depths`.

  Events are not extrapolated.
  """

  depths: tuple

  @classmethod
  def from_reports(cls, shallow, deep, depths: Sequence[int], num_layers: int) -> DepthCost:
    """Every additive term extrapolated; the largest collective's buffer is the deeper graph's."""

    def line(get):
      return extrapolate(get(shallow), get(deep), depths, num_layers)

    memory = extrapolate_memory(shallow.memory, deep.memory, depths, num_layers)
    return cls(
      mesh_shape=deep.mesh_shape,
      layout_rules=deep.layout_rules,
      time_model=deep.time_model,
      num_layers=num_layers,
      depths=tuple(depths),
      compute_s=line(lambda r: r.compute_s),
      comm_s=line(lambda r: r.comm_s),
      overhead_s=line(lambda r: r.overhead_s),
      flops=line(lambda r: r.flops),
      memory=memory,
    )


class DepthProblem:
  """The layouts of a layer stack, scored at two shallow depths and extrapolated to `num_layers`.

  Has what `_solver.search` uses of a Problem. Both depths must have the same splittable
  dimensions, sizes and per-tensor conflicts (their layers identical), else ValueError.
  """

  def __init__(self, shallow: _solver.Problem, deep: _solver.Problem, depths: Sequence[int], num_layers: int):
    for what, a, b in (
      ("splittable dimensions", shallow.dims, deep.dims),
      ("dimension choices", shallow.domains, deep.domains),
      ("per-tensor conflicts", shallow.conflicts, deep.conflicts),
    ):
      if a != b:
        raise ValueError(
          f"The model at {depths[0]} and {depths[1]} layers has different {what} ({a} vs {b}): its "
          f"layers are not identical, so costs cannot be extrapolated to {num_layers} layers; search "
          f"the full graph with auto_mtf.layout instead."
        )
    self.shallow, self.deep = shallow, deep
    self.depths, self.num_layers = tuple(depths), num_layers
    self.dims, self.domains, self.conflicts = deep.dims, deep.domains, deep.conflicts
    self.mesh_shape, self.mesh_names = deep.mesh_shape, deep.mesh_names

  def count_upper_bound(self) -> int:
    return self.deep.count_upper_bound()

  def assignments(self) -> np.ndarray:
    return self.deep.assignments()

  def to_row(self, assignment: dict) -> np.ndarray:
    return self.deep.to_row(assignment)

  def to_assignment(self, row) -> dict:
    return self.deep.to_assignment(row)

  def dimension_sizes(self) -> dict:
    return self.deep.dimension_sizes()

  def estimate(self, rows: np.ndarray) -> tuple:
    (s0, m0), (s1, m1) = self.shallow.estimate(rows), self.deep.estimate(rows)
    with np.errstate(invalid="ignore"):  # inf - inf where a reshape cannot be planned: stays inf
      line = extrapolate(s0, s1, self.depths, self.num_layers)
    seconds = np.where(np.isfinite(s0) & np.isfinite(s1), line, np.inf)
    return seconds, extrapolate(m0, m1, self.depths, self.num_layers)

  def cost_report(self, assignment: dict) -> DepthCost:
    return DepthCost.from_reports(
      self.shallow.cost_report(assignment), self.deep.cost_report(assignment), self.depths, self.num_layers
    )

  def memory_report(self, assignment: dict) -> memory_lib.MemoryReport:
    return extrapolate_memory(self.shallow.memory_report(assignment), self.deep.memory_report(assignment),
                              self.depths, self.num_layers)


def problem_for_depth(
  build_graph: Callable[[int], tuple],
  num_layers: int,
  mesh_shape,
  time_model=None,
  depths: Sequence[int] = (2, 3),
) -> DepthProblem:
  """The DepthProblem of the model `build_graph(n) -> (mtf Graph, outputs)` at `num_layers` layers."""
  shallow, deep = (_problem_at(build_graph, d, mesh_shape, time_model) for d in depths)
  return DepthProblem(shallow, deep, depths, num_layers)


def _problem_at(build_graph: Callable[[int], tuple], num_layers: int, mesh_shape,
                time_model) -> _solver.Problem:
  """The layout search's Problem of the model built with `num_layers` layers."""
  graph, outputs = build_graph(num_layers)
  mesh_shape = convert_to_shape(mesh_shape)
  return _solver.Problem(graph, mesh_shape, valid_layouts.LayoutValidator(graph, mesh_shape), list(outputs),
                         get_time_model(time_model).for_mesh(mesh_shape))


def layout_for_depth(
  build_graph: Callable[[int], tuple],
  num_layers: int,
  mesh_shape,
  memory_limit_bytes: Optional[float] = None,
  time_model=None,
  depths: Sequence[int] = (2, 3),
) -> tuple:
  """(LayoutRules, DepthCost): the best layout of a `num_layers`-layer stack, searched at `depths`.

  Args:
    build_graph: called with a layer count, returns (mtf Graph, list of output Tensors) of the
      model with that many identical layers (everything else unchanged).
    num_layers: the depth to plan for.
    mesh_shape: a Shape or string, e.g. "b:16;m:32".
    memory_limit_bytes: the most one processor may hold at `num_layers` layers.
    time_model: a TimeModel or a preset name (e.g. "tpu_v3").
    depths: the two layer counts the model is built and costed at (d0 < d1); when `num_layers`
      is at most d1 the full model is searched instead and the cost is exact.

  Raises:
    ValueError: bad depths, or the layers are not identical at the two depths; SolverError when
      no layout fits the memory limit.
  """
  depths = tuple(depths)
  if len(depths) != 2 or not 1 <= depths[0] < depths[1]:
    raise ValueError(f"depths must be two layer counts 1 <= d0 < d1, got {depths}.")
  if num_layers <= depths[1]:
    problem = _problem_at(build_graph, num_layers, mesh_shape, time_model)
    solution = _solver.search(problem, memory_limit_bytes)
    report = solution.report
    cost = DepthCost.from_reports(report, report, (num_layers - 1, num_layers), num_layers)
  else:
    problem = problem_for_depth(build_graph, num_layers, mesh_shape, time_model, depths)
    solution = _solver.search(problem, memory_limit_bytes)
    cost = solution.report
  return convert_to_layout_rules(list(solution.assignment.items())), cost

