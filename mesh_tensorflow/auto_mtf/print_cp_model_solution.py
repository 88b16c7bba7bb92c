"""Prints a layout solution as its decision variables (upstream `auto_mtf.print_cp_model_solution`)."""

from __future__ import annotations

import sys


def _global_var_name(splittable_dimension: str, mesh_dimension: str) -> str:
  """Name of the decision "split `splittable_dimension` over `mesh_dimension`"."""
  return f"x_({splittable_dimension}:{mesh_dimension})"


def print_solution(model, solver, file=None) -> None:
  """Prints each decision x_(dim:mesh_dim) = 0/1 of `model` (a LayoutOptimizer._model) and the cost.

  Args:
    model: the search problem (`LayoutOptimizer._model`).
    solver: what the search solved, the Solution `LayoutOptimizer.solve` kept
      (`optimizer.solution`); 0.1.21 passed its CP solver here.
    file: where to print (default stdout).
  """
  file = file or sys.stdout
  for dim in model.dims:
    for axis in model.domains[dim][1:]:
      mesh_dim = model.mesh_names[axis]
      value = int(solver.assignment.get(dim) == mesh_dim)
      print(f"{_global_var_name(dim, mesh_dim)} = {value}", file=file)
  print(
    f"estimated step: {solver.estimated_s * 1e3:.3f} ms, predicted step: {solver.step_s * 1e3:.3f} ms",
    file=file,
  )
