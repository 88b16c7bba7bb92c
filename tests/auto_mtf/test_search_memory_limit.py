"""The search under a tight memory limit: the leanest layouts are costed when the fastest don't fit."""

from __future__ import annotations

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.auto_mtf import _solver, valid_layouts
from tests.auto_mtf.test_depth import mlp


class _LeanLooksSlow(_solver.Problem):
  """The fast estimate ranks the leanest layout last by time (as when its communication looks slow)."""

  def estimate(self, rows):
    seconds, memory = super().estimate(rows)
    return np.where(memory == memory.min(), seconds + 1.0, seconds), memory


def test_when_the_fastest_layouts_exceed_the_limit_the_leanest_are_costed_and_the_fitting_one_returned():
  with tf.Graph().as_default():
    graph, outputs = mlp(4)
    mesh_shape = mtf.convert_to_shape("b:2;m:4")
    tm = mtf.cost_model.get_time_model("cpu").for_mesh(mesh_shape)
    validator = valid_layouts.LayoutValidator(graph, mesh_shape)
    problem = _LeanLooksSlow(graph, mesh_shape, validator, outputs, tm)
    rows = problem.assignments()
    seconds, memory = problem.estimate(rows)
    leanest = problem.to_assignment(rows[np.argmin(memory)])
    limit = problem.cost_report(leanest).memory.total_bytes
    tried_first = [problem.to_assignment(rows[i]) for i in np.argsort(seconds)[:4]]
    assert all(problem.cost_report(a).memory.total_bytes > limit for a in tried_first)
    solution = _solver.search(problem, memory_limit_bytes=limit, top_k=1)  # tries the 4 fastest first
  assert solution.assignment == leanest and solution.report.memory.total_bytes <= limit
