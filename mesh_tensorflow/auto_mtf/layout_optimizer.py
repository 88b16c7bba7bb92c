"""LayoutOptimizer: the best layout for a graph and mesh (upstream `auto_mtf.layout_optimizer`).

The objective is the cost model's predicted step time (compute + communication + per-op
overhead, see `mesh_tensorflow.cost_model`); an optional memory limit per processor is a hard
constraint. The solver is `_solver.search` (see its docstring for why no external solver).
"""

from __future__ import annotations

import itertools
from typing import Optional

from absl import logging

from mesh_tensorflow._core.layout import convert_to_layout_rules
from mesh_tensorflow._cost import model as cost_model
from mesh_tensorflow.auto_mtf import _solver, print_cp_model_solution
from mesh_tensorflow.auto_mtf.print_cp_model_solution import _global_var_name  # noqa: F401  (0.1.21's home)

SolverError = _solver.SolverError
SearchSpaceTooLarge = _solver.SearchSpaceTooLarge


def _local_var_name(splittable_dimensions, assignment: dict) -> str:
  """Name of one operation's local assignment: its splittable dims (sorted), with mesh dims where assigned."""
  parts = [f"{d}:{assignment[d]}" if d in assignment else d for d in sorted(splittable_dimensions)]
  return "y_(" + ",".join(parts) + ")"


def _generate_assignments(splittable_dimensions, mesh_dimension_to_size: dict) -> list:
  """Every injective map of some splittable dimensions to distinct mesh dimensions (the empty one too)."""
  assignments = []
  for n in range(1 + min(len(splittable_dimensions), len(mesh_dimension_to_size))):
    for dims in itertools.combinations(sorted(splittable_dimensions), n):
      for mesh_dims in itertools.permutations(sorted(mesh_dimension_to_size), n):
        assignments.append(dict(zip(dims, mesh_dims)))
  return assignments


class LayoutOptimizer:
  """Finds the layout with the lowest predicted step time (within a memory limit, if given).

  Args:
    memory_estimator: a MemoryEstimator (graph, mesh shape, outputs).
    scheduler_alg: "LIST" or "NAIVE", the operation order for the activation peak.
    memory_limit_bytes: the most one processor may hold, or None.
    time_model: a TimeModel or a preset name ("cpu", "gpu", "tpu").
  """

  def __init__(
    self,
    memory_estimator,
    scheduler_alg: str = "LIST",
    memory_limit_bytes: Optional[float] = None,
    time_model=None,
  ):
    from mesh_tensorflow.auto_mtf import scheduler

    self._memory_estimator = memory_estimator
    self._graph = memory_estimator.get_graph_interface()
    self._memory_limit_bytes = memory_limit_bytes
    if scheduler_alg == "LIST":  # graph order for a graph with recomputed layers, as the cost model
      schedule = _solver.memory_schedule(memory_estimator.mtf_graph, memory_estimator.mtf_outputs)
    else:
      schedule = scheduler.minimize_peak_memory(self._graph, scheduler_alg)
    self._model = _solver.Problem(
      memory_estimator.mtf_graph,
      memory_estimator.mesh_shape,
      memory_estimator.get_layout_validator(),
      memory_estimator.mtf_outputs,
      time_model,
      schedule,
    )
    self.solution: Optional[_solver.Solution] = None
    self._any_assignment_model: Optional[_solver.Problem] = None  # built by evaluate_layout on demand

  def solve(self, print_solution: bool = False) -> str:
    """The best layout as a rules string ("a:m2;c:m1"); the Solution is kept in `self.solution`.

    Args:
      print_solution: also print every decision and the cost (print_cp_model_solution).
    Raises:
      SolverError: no layout fits the memory limit.
    """
    self.solution = _solver.search(self._model, self._memory_limit_bytes)
    if print_solution:
      print_cp_model_solution.print_solution(self._model, self.solution)
    return self.solution.layout_string

  def evaluate_layout(self, layout) -> float:
    """Predicted step time (seconds) of `layout`: any assignment, also one the solver never picks.

    A layout the lowering accepts gets the cost model's prediction (`cost_report(...).step_s`).
    Any other assignment (e.g. a mesh dimension that does not divide the dimension) is scored by
    the solver's fast estimate, a processor holding ceil(size / mesh size) of a dimension as
    upstream counted it, plus the same per-op overhead; for an assignment the search enumerates
    that estimate and the prediction agree up to the communication model.
    As upstream, rules for dimensions no op may split are skipped with a warning.

    Args:
      layout: a layout string ("d_ff:m1;heads:m2"), LayoutRules or list of pairs.
    Returns:
      Seconds per step (inf where a reshape's layout change cannot be planned at all).
    Raises:
      ValueError: a rule names a mesh dimension the mesh lacks, or a dimension twice.
    """
    assignment = self._splittable_assignment(layout)
    try:
      return self.cost_report(list(assignment.items())).step_s
    except (ValueError, NotImplementedError):  # the lowering rejects it: score it all the same
      if self._any_assignment_model is None:
        model = self._model
        self._any_assignment_model = _solver.Problem(
          model.graph, model.mesh_shape, _solver.AnyAssignment(self._memory_estimator.get_layout_validator()),
          model.outputs, model.time_model, model.schedule,
        )
      return _solver.estimated_step_s(self._any_assignment_model, assignment)

  def _splittable_assignment(self, layout) -> dict:
    """{dim: mesh dim} of `layout`, without (and warning about) dims that no op may split."""
    validator = self._memory_estimator.get_layout_validator()
    mesh_names = [d.name for d in self._model.mesh_shape.dims]
    assignment = {}
    for dim, mesh_dim in convert_to_layout_rules(layout):
      if mesh_dim not in mesh_names:
        raise ValueError(
          f"evaluate_layout: rule {dim}:{mesh_dim} names mesh dimension {mesh_dim!r}, but the mesh "
          f"{self._model.mesh_shape} has {mesh_names}; use one of those."
        )
      if dim in assignment:
        raise ValueError(
          f"evaluate_layout: dimension {dim!r} is given two mesh dimensions ({assignment[dim]} and "
          f"{mesh_dim}); a dimension is split over at most one. Keep one rule."
        )
      if dim not in validator.splittable_mtf_dimension_names:
        logging.warning("evaluate_layout: skipping %s:%s: no operation of the graph may split %r.",
                        dim, mesh_dim, dim)
        continue
      assignment[dim] = mesh_dim
    return assignment

  def cost_report(self, layout) -> cost_model.CostReport:
    model = self._model
    return cost_model.estimate_cost(
      model.graph,
      model.mesh_shape,
      convert_to_layout_rules(layout),
      model.outputs,
      model.time_model,
      schedule=model.schedule,
    )
