"""layout_optimizer: variable names, assignments, solve and evaluate_layout (upstream conventions)."""

import contextlib
import io

import pytest

import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.auto_mtf import layout_optimizer, memory_estimator, print_cp_model_solution


def _optimizer(memory_limit_bytes=None):
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  x = mtf.zeros(mesh, "a:10,b:5")
  y = mtf.zeros(mesh, "b:5,c:20")
  z = mtf.einsum([x, y], "a:10,c:20")
  estimator = memory_estimator.MemoryEstimator(graph, mtf.convert_to_shape("m1:2;m2:2"), [z])
  return layout_optimizer.LayoutOptimizer(estimator, memory_limit_bytes=memory_limit_bytes)


class VariableNamesTest(tf.test.TestCase):

  def test_global_var_name(self):
    self.assertEqual(layout_optimizer._global_var_name("cake", "lie"), "x_(cake:lie)")

  def test_local_var_name_lists_sorted_dims_with_their_mesh_dims(self):
    self.assertEqual(layout_optimizer._local_var_name(frozenset(), {}), "y_()")
    self.assertEqual(layout_optimizer._local_var_name(frozenset(["channel", "width"]), {}),
                     "y_(channel,width)")
    self.assertEqual(layout_optimizer._local_var_name(frozenset(["width", "height", "channel"]),
                                                      {"channel": "y", "height": "x"}),
                     "y_(channel:y,height:x,width)")


class AssignmentsTest(tf.test.TestCase):

  def test_generate_assignments_maps_each_mesh_dim_at_most_once(self):
    assignments = layout_optimizer._generate_assignments({"s1", "s2", "s3"}, {"m1": 4, "m2": 8})
    self.assertIn({}, assignments)
    self.assertIn({"s3": "m2"}, assignments)
    self.assertIn({"s1": "m2", "s2": "m1"}, assignments)
    self.assertNotIn({"s1": "m2", "s3": "m2"}, assignments)
    self.assertLen(assignments, 1 + 6 + 6)


class LayoutOptimizerTest(tf.test.TestCase):

  def test_solve_splits_both_free_dimensions(self):
    optimizer = _optimizer()
    layout = optimizer.solve()
    self.assertIn(layout, ("a:m1;c:m2", "a:m2;c:m1"))
    self.assertEqual(optimizer._graph.get_num_operations(), 3)

  def test_evaluate_layout_prefers_splitting(self):
    optimizer = _optimizer()
    self.assertAlmostEqual(optimizer.evaluate_layout("a:m1;c:m2"), optimizer.evaluate_layout("a:m2;c:m1"))
    self.assertLess(optimizer.evaluate_layout("a:m1;c:m2"), optimizer.evaluate_layout("a:m1"))
    self.assertLess(optimizer.evaluate_layout("a:m1"), optimizer.evaluate_layout(""))

  def test_solver_error_says_by_how_much_and_which_tensors_dominate(self):
    optimizer = _optimizer(memory_limit_bytes=100)
    message = r"needs 500 bytes \(400 over\).*dominated by constant_1:0"
    with self.assertRaisesRegex(layout_optimizer.SolverError, message) as cm:
      optimizer.solve()
    self.assertGreater(cm.exception.excess_bytes, 0)
    self.assertIn("b:5", str(cm.exception))  # b: no mesh dimension can split it

  def test_print_solution_prints_the_decisions(self):
    optimizer = _optimizer()
    optimizer.solve()
    out = io.StringIO()
    print_cp_model_solution.print_solution(optimizer._model, optimizer.solution, file=out)
    lines = out.getvalue().splitlines()
    assignment = optimizer.solution.assignment
    expected = [f"x_({d}:{m}) = {int(assignment.get(d) == m)}" for d in ("a", "c") for m in ("m1", "m2")]
    self.assertEqual(lines[:-1], expected)
    self.assertEqual(sum(line.endswith("= 1") for line in lines), 2)
    self.assertIn("predicted step", lines[-1])

  def test_solve_print_solution_prints_the_same_decisions(self):
    optimizer = _optimizer()
    with contextlib.redirect_stdout(io.StringIO()) as printed:
      layout = optimizer.solve(print_solution=True)
    out = io.StringIO()
    print_cp_model_solution.print_solution(optimizer._model, optimizer.solution, file=out)
    self.assertEqual(printed.getvalue(), out.getvalue())
    self.assertEqual(layout, optimizer.solution.layout_string)
    with contextlib.redirect_stdout(io.StringIO()) as silent:
      optimizer.solve()
    self.assertEqual(silent.getvalue(), "")

  def test_solver_error_is_constructed_as_upstream_and_is_what_no_fit_raises(self):
    error = layout_optimizer.SolverError("no solution", 3)
    self.assertEqual(error.args, ("no solution", 3))
    self.assertIsInstance(error, ValueError)
    with self.assertRaises(layout_optimizer.SolverError):
      _optimizer(memory_limit_bytes=100).solve()


def test_a_layout_the_lowering_rejects_is_skipped_for_the_next_best(monkeypatch):
  from mesh_tensorflow.auto_mtf import _solver
  real = _solver.cost_model.estimate_cost

  def reject_full_splits(graph, mesh_shape, rules, *args, **kwargs):
    if len(rules) == 2:
      raise ValueError("an op can't take this layout")
    return real(graph, mesh_shape, rules, *args, **kwargs)
  monkeypatch.setattr(_solver.cost_model, "estimate_cost", reject_full_splits)
  layout = _optimizer().solve()
  assert layout.count(":") == 1


def _upstream_optimizer(mesh_shape: str, unstack: bool = False):
  """Upstream's layout_optimizer_test graph: x1 [a:10, b:5], x2 [b:5, c:20], einsum -> [a, c]."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  x1 = mtf.zeros(mesh, "a:10,b:5")
  x2 = mtf.zeros(mesh, "b:5,c:20")
  if unstack:  # upstream's testOptimizeLayoutUnsplittable: a and c become unsplittable
    mtf.UnstackOperation(x1, mtf.Dimension("a", 10))
    mtf.UnstackOperation(x2, mtf.Dimension("c", 20))
  else:
    mtf.einsum([x1, x2], "a:10,c:20")
  return _optimizer_for(graph, mesh_shape)


def _optimizer_for(graph, mesh_shape: str):
  return layout_optimizer.LayoutOptimizer(memory_estimator.MemoryEstimator(graph, mesh_shape))


def test_evaluate_layout_scores_layouts_the_solver_never_picks_and_the_solution_is_lowest():
  # Upstream's testOptimizeLayout: a:10 and b:5 do not divide over m1:4, b:5 not over m2:2.
  optimizer = _upstream_optimizer("m1:4,m2:2")
  layout = optimizer.solve()
  assert layout == "a:m2;c:m1"
  value = optimizer.evaluate_layout(layout)
  for other in ("a:m1;b:m2", "a:m1;c:m2", "b:m1;a:m2", "b:m1;c:m2", "c:m1;b:m2"):
    assert value < optimizer.evaluate_layout(other), other
  assert optimizer.evaluate_layout("c:m1;a:m2") == value


def test_a_split_that_does_not_divide_costs_a_ceil_share_like_the_padded_graph():
  # a:10 over m1:4 leaves ceil(10/4) = 3 rows per processor: the exact prediction for a:12.
  scored = _upstream_optimizer("m1:4,m2:2").evaluate_layout("a:m1;c:m2")
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  mtf.einsum([mtf.zeros(mesh, "a:12,b:5"), mtf.zeros(mesh, "b:5,c:20")], "a:12,c:20")
  padded = _optimizer_for(graph, "m1:4,m2:2").evaluate_layout("a:m1;c:m2")
  assert scored == pytest.approx(padded, rel=1e-12)


def test_a_size_one_mesh_dimension_is_assigned_when_a_dimension_can_take_it():
  # Upstream's testOptimizeLayoutTiebreak: splitting b over m3:1 costs nothing, and upstream prefers it.
  assert _upstream_optimizer("m1:4,m2:2,m3:1").solve() == "a:m2;b:m3;c:m1"


def test_evaluate_layout_skips_rules_for_unsplittable_dimensions_and_rejects_bad_rules():
  optimizer = _upstream_optimizer("m1:4,m2:2", unstack=True)
  assert optimizer.solve() == ""
  assert optimizer.evaluate_layout("a:m1;c:m2") == optimizer.evaluate_layout("")  # skipped, as upstream
  with pytest.raises(ValueError, match="names mesh dimension 'm9'.*'m1', 'm2'"):
    optimizer.evaluate_layout("b:m9")
  with pytest.raises(ValueError, match="'b' is given two mesh dimensions"):
    optimizer.evaluate_layout("b:m1;b:m2")


def test_repeated_ops_add_no_decision_variables_to_the_model_0_1_21s_tests_read():
  """0.1.21's tests count `optimizer._model.Proto().variables` (its CP-SAT model) for a graph of
  100 identical einsums: one variable per (dimension, mesh dimension), whatever the op count."""
  def model_variables(repeats):
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    x, y = mtf.zeros(mesh, "a:10,b:5"), mtf.zeros(mesh, "b:5,c:20")
    for _ in range(repeats):
      mtf.einsum([x, y], "a:10,c:20")
    estimator = memory_estimator.MemoryEstimator(graph, mtf.convert_to_shape("m1:2;m2:2"), [])
    optimizer = layout_optimizer.LayoutOptimizer(estimator)
    return optimizer._model.Proto().variables

  # b (size 5) divides by neither mesh dimension: a and c may each take m1 or m2.
  assert model_variables(1) == model_variables(100) == [("a", "m1"), ("a", "m2"), ("c", "m1"), ("c", "m2")]
