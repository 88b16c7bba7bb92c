"""auto_mtf.depth: a layer stack searched at two shallow depths equals the search of the full graph."""

from __future__ import annotations

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._explain.transformer_graph import build_transformer_graph
from mesh_tensorflow.auto_mtf import _solver, depth, valid_layouts

MESH = "b:2;m:4"


def mlp(num_layers: int) -> tuple:
  """A residual stack of `num_layers` dense-relu-dense layers, its loss, gradients and SGD updates."""
  with tf.Graph().as_default():
    return _mlp(num_layers)


def _mlp(num_layers: int) -> tuple:
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  batch, d_model = mtf.Dimension("batch", 64), mtf.Dimension("d_model", 32)
  hidden = mtf.Dimension("hidden", 256)
  x = mtf.random_uniform(mesh, [batch, d_model])
  for i in range(num_layers):
    h = mtf.layers.dense(x, hidden, reduced_dims=[d_model], activation=mtf.relu, name=f"layer_{i}/wi")
    x += mtf.layers.dense(h, d_model, reduced_dims=[hidden], name=f"layer_{i}/wo")
  loss = mtf.reduce_mean(mtf.square(x))
  variables = graph.trainable_variables
  grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
  mtf.optimize.SgdOptimizer(0.1).apply_grads(grads, variables)
  return graph, [loss]


def transformer(num_layers: int) -> tuple:
  gin.clear_config()
  bindings = [f"num_layers = {num_layers}", "d_model = 32", "d_ff = 128", "d_kv = 8", "num_heads = 4"]
  with tf.Graph().as_default():
    graph, loss = build_transformer_graph(["models/lm_base.gin"], bindings, 32, 16, vocab_size=64)
  return graph, [loss]


def full_problem(build, num_layers: int, time_model) -> _solver.Problem:
  graph, outputs = build(num_layers)
  mesh_shape = mtf.convert_to_shape(MESH)
  tm = mtf.cost_model.get_time_model(time_model).for_mesh(mesh_shape)
  return _solver.Problem(graph, mesh_shape, valid_layouts.LayoutValidator(graph, mesh_shape), outputs, tm)


@pytest.fixture(autouse=True)
def _graph_mode():
  with tf.Graph().as_default():
    yield


def test_a_dense_stack_searched_at_two_shallow_depths_gets_the_full_searchs_layout_and_costs():
  rules, cost = depth.layout_for_depth(mlp, 6, MESH, time_model="cpu", depths=(2, 3))
  full = _solver.search(full_problem(mlp, 6, "cpu"))
  assert sorted(rules) == sorted(full.assignment.items()) and full.assignment  # a real (split) layout
  assert cost.step_s == pytest.approx(full.report.step_s, rel=1e-9)
  assert cost.flops == pytest.approx(full.report.flops, rel=1e-12)
  assert cost.comm_s == pytest.approx(full.report.comm_s, rel=1e-9)
  m, exact = cost.memory, full.report.memory
  assert (m.variable_bytes, m.slot_bytes, m.activation_peak_bytes, m.comm_buffer_bytes) == (
    exact.variable_bytes, exact.slot_bytes, exact.activation_peak_bytes, exact.comm_buffer_bytes
  )


@pytest.mark.parametrize("build, num_layers", [(mlp, 6), (transformer, 4)])
def test_every_candidates_estimated_step_time_is_the_full_graphs_and_memory_never_more(build, num_layers):
  """Same estimates for every layout means the same ranking, so the same layouts get costed exactly."""
  problem = depth.problem_for_depth(build, num_layers, MESH, "tpu_v3", depths=(2, 3))
  rows = problem.assignments()
  seconds, memory = problem.estimate(rows)
  full = full_problem(build, num_layers, "tpu_v3")
  full_seconds, full_memory = full.estimate(rows)
  assert len(rows) > 10 and full.dims == problem.dims
  np.testing.assert_allclose(seconds, full_seconds, rtol=1e-9)
  # the activation peak is convex in the depth: the line through two depths never overshoots it
  assert (memory <= full_memory * (1 + 1e-12)).all()
  if build is mlp:  # one phase holds the peak at every depth: exact
    np.testing.assert_allclose(memory, full_memory, rtol=1e-9)
  best = problem.to_assignment(rows[np.argmin(seconds)])
  assert problem.cost_report(best).step_s == pytest.approx(full.cost_report(best).step_s, rel=1e-9)


def test_a_24_layer_search_is_the_same_size_as_a_4_layer_one():
  deep, shallow = (depth.problem_for_depth(mlp, n, MESH, "cpu") for n in (24, 4))
  for a, b in ((deep, shallow), (deep.shallow, shallow.shallow), (deep.deep, shallow.deep)):
    assert a.dims == b.dims and a.conflicts == b.conflicts  # decision variables and constraints
    assert len(a.assignments()) == len(b.assignments())
  for a, b in ((deep.shallow, shallow.shallow), (deep.deep, shallow.deep)):
    assert len(a.graph.operations) == len(b.graph.operations)  # what the estimate sums over
    assert a.memory_steps()[0].shape == b.memory_steps()[0].shape  # the memory peak's candidates
  # ...while the graph it stands for has six times the layers
  assert len(mlp(24)[0].operations) > 5 * len(mlp(4)[0].operations) - 50


def test_depths_must_be_two_increasing_layer_counts_and_the_layers_identical():
  with pytest.raises(ValueError, match="two layer counts"):
    depth.layout_for_depth(mlp, 6, MESH, depths=(3, 3))

  def uneven(n):  # the third layer is wider: its hidden dim differs
    return mlp(n) if n < 3 else _wider(n)

  with pytest.raises(ValueError, match="not identical"):
    depth.layout_for_depth(uneven, 6, MESH, depths=(2, 3))


def _wider(num_layers):
  graph, outputs = mlp(num_layers)
  mesh = outputs[0].mesh
  mtf.layers.dense(mtf.zeros(mesh, "batch:64,d_model:32"), mtf.Dimension("extra", 96), name="extra")
  return graph, outputs
