"""auto_mtf's entry points: a layout for a mesh shape, or a mesh shape and a layout for a device count."""

from __future__ import annotations

from typing import Iterator, Optional

from mesh_tensorflow._core.dims import Dimension, Shape, convert_to_shape
from mesh_tensorflow._core.layout import LayoutRules, convert_to_layout_rules
from mesh_tensorflow._cost.time_model import get_time_model
from mesh_tensorflow.auto_mtf import layout_optimizer, memory_estimator


def layout(
  mtf_graph,
  mesh_shape,
  mtf_outputs=(),
  memory_limit_bytes: Optional[float] = None,
  time_model=None,
  num_devices: Optional[int] = None,
) -> LayoutRules:
  """The layout rules with the lowest predicted step time for `mtf_graph` on `mesh_shape`.

  Args:
    mtf_graph: the mtf.Graph to lay out (all on one mesh).
    mesh_shape: a Shape or string, e.g. "batch:2;model:4".
    mtf_outputs: tensors kept to the end of the step (they count toward memory).
    memory_limit_bytes: the most one processor may hold (variables, optimizer state, activations).
    time_model: a TimeModel or a preset name (see mesh_tensorflow.cost_model.PRESETS); a preset's
      topology gives each dimension of the mesh its bandwidth and latency.
    num_devices: if given, the number of devices the mesh must cover.

  Raises:
    ValueError: the mesh size differs from num_devices; SolverError (a ValueError) when no layout
      fits the memory limit (it says by how much and which tensors dominate).

  Example: `rules = auto_mtf.layout(graph, "batch:2;model:4", [loss])`.
  """
  mesh_shape = convert_to_shape(mesh_shape)
  if num_devices is not None and mesh_shape.size != num_devices:
    raise ValueError(
      f"Mesh shape {mesh_shape} has {mesh_shape.size} processors but there are {num_devices} devices; "
      f"give a mesh shape whose sizes multiply to {num_devices}, or call "
      f"auto_mtf.layout_and_mesh_shape(graph, {num_devices}) to choose one."
    )
  estimator = memory_estimator.MemoryEstimator(mtf_graph, mesh_shape, mtf_outputs)
  optimizer = layout_optimizer.LayoutOptimizer(
    estimator,
    memory_limit_bytes=memory_limit_bytes,
    time_model=get_time_model(time_model).for_mesh(mesh_shape),
  )
  return convert_to_layout_rules(optimizer.solve())


def layout_and_mesh_shape(
  mtf_graph,
  num_machines: int,
  mtf_outputs=(),
  max_mesh_shape_dimensions: int = 2,
  memory_limit_bytes: Optional[float] = None,
  time_model=None,
) -> tuple:
  """(LayoutRules, mesh Shape) with the lowest predicted step time over mesh shapes of `num_machines`.

  Mesh dimensions are named mesh_0, mesh_1, ... (largest first); their sizes multiply to
  num_machines. Ties go to the mesh with fewer dimensions; mesh shapes with too many candidate
  layouts to enumerate are skipped.

  Raises:
    ValueError: num_machines is not a positive integer; SolverError when no mesh shape and layout
      fit the memory limit.
  """
  if not isinstance(num_machines, int) or num_machines < 1:
    raise ValueError(f"num_machines must be a positive int, got {num_machines!r}.")
  best, last_error = None, None
  for sizes in _mesh_shape_iterator(num_machines, max_mesh_shape_dimensions):
    mesh_shape = Shape([Dimension(f"mesh_{i}", s) for i, s in enumerate(sizes)])
    estimator = memory_estimator.MemoryEstimator(mtf_graph, mesh_shape, mtf_outputs)
    optimizer = layout_optimizer.LayoutOptimizer(
      estimator,
      memory_limit_bytes=memory_limit_bytes,
      time_model=get_time_model(time_model).for_mesh(mesh_shape),
    )
    try:
      rules = optimizer.solve()
    except (layout_optimizer.SolverError, layout_optimizer.SearchSpaceTooLarge) as e:
      last_error = e
      continue
    key = (optimizer.solution.step_s, len(sizes))
    if best is None or key < best[0]:
      best = (key, convert_to_layout_rules(rules), mesh_shape)
  if best is None:
    raise last_error
  return best[1], best[2]


def _mesh_shape_iterator(
  num_machines: int, max_mesh_shape_dimensions: Optional[int] = None
) -> Iterator[list]:
  """Non-increasing factorizations of num_machines into factors >= 2 ([1] for one machine)."""
  if num_machines == 1:
    yield [1]
    return
  limit = max_mesh_shape_dimensions if max_mesh_shape_dimensions is not None else num_machines

  def factorizations(n, largest, depth):
    if n == 1:
      yield []
      return
    if depth == 0:
      return
    for f in range(min(n, largest), 1, -1):
      if n % f == 0:
        for rest in factorizations(n // f, f, depth - 1):
          yield [f] + rest

  yield from factorizations(num_machines, num_machines, limit)
