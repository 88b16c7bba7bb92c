"""`python -m mesh_tensorflow.explain --search` on a deep model: the depth-extrapolated layout search.

The model is built at two shallow depths and the layout search ranks every layout by its costs
extrapolated to the full number of layers (`auto_mtf.depth`), so a pod-scale model of 64 layers
is planned in the time of 2 and 3. When no layout fits the memory limit, the layout with the
least memory is shown with its `fits: no` line.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

from mesh_tensorflow._explain import report as report_lib
from mesh_tensorflow.auto_mtf import _solver, depth

SEARCH_DEPTHS = (2, 3)


def search_deep_model(
  build_graph: Callable[[int], tuple],
  num_layers: int,
  mesh_shape,
  time_model,
  tokens_per_step: Optional[int] = None,
  file=None,
) -> tuple:
  """Searches a layout of a `num_layers`-layer model and prints it with its fits/predicted lines.

  Args:
    build_graph: called with a layer count, returns (mtf Graph, output Tensors) of the model.
    num_layers: the model's depth.
    mesh_shape: a Shape or string.
    time_model: a TimeModel with a memory size (an accelerator preset); its memory is the limit.
    tokens_per_step: tokens one step trains on, for the predicted tokens/s.
    file: where to print (default stdout).
  Returns:
    The printed (assignment {dim: mesh dim}, depth.DepthCost).
  """
  file = file or sys.stdout
  problem = depth.problem_for_depth(build_graph, num_layers, mesh_shape, time_model, SEARCH_DEPTHS)
  how = f"searched at {SEARCH_DEPTHS[0]} and {SEARCH_DEPTHS[1]} layers, costs extrapolated to {num_layers}"
  try:
    solution = _solver.search(problem, time_model.memory_bytes)
    assignment, cost = solution.assignment, solution.report
    title = "searched layout"
  except _solver.NoLayoutFits as e:
    print(e, file=file)
    assignment, cost = e.assignment, problem.cost_report(e.assignment)
    title = "no layout fits; the one with the least memory"
  layout = ";".join(f"{d}:{m}" for d, m in sorted(assignment.items())) or "(replicated)"
  print(
    "\n".join([
      f"{title}: {layout} ({how})",
      f"Layout {layout} on mesh {cost.mesh_shape} ({cost.mesh_shape.size} processors), {num_layers} layers",
      report_lib.memory_sum(cost.memory) + ".",
      report_lib.step_line(cost),
      report_lib.fits_line(cost),
      report_lib.predicted_line(cost, tokens_per_step),
    ]),
    file=file,
  )
  return assignment, cost
