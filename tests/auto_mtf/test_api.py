"""auto_mtf.layout and layout_and_mesh_shape (upstream conventions), mesh shapes for several counts."""

import tensorflow.compat.v1 as tf
from absl.testing import parameterized

import mesh_tensorflow as mtf
from mesh_tensorflow import auto_mtf


def _graph():
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  x = mtf.zeros(mesh, "a:10,b:5")
  y = mtf.zeros(mesh, "b:5,c:20")
  return graph, mtf.einsum([x, y], "a:10,c:20")


A, B, C = (mtf.convert_to_dimension(d) for d in (("a", 10), ("b", 5), ("c", 20)))


class LayoutTest(parameterized.TestCase, tf.test.TestCase):

  def test_layout_splits_each_dim_over_a_mesh_dim_that_divides_it(self):
    graph, z = _graph()
    mesh_shape = mtf.convert_to_shape("m1:4,m2:2")
    layout = auto_mtf.layout(graph, mesh_shape, [z])
    self.assertEqual(layout.tensor_dimension_to_mesh_axis(A, mesh_shape), 1)
    self.assertIsNone(layout.tensor_dimension_to_mesh_axis(B, mesh_shape))
    self.assertEqual(layout.tensor_dimension_to_mesh_axis(C, mesh_shape), 0)

  def test_layout_and_mesh_shape(self):
    graph, z = _graph()
    layout, mesh_shape = auto_mtf.layout_and_mesh_shape(graph, 8, [z])
    self.assertEqual(layout.tensor_dimension_to_mesh_axis(A, mesh_shape), 1)
    self.assertIsNone(layout.tensor_dimension_to_mesh_axis(B, mesh_shape))
    self.assertEqual(layout.tensor_dimension_to_mesh_axis(C, mesh_shape), 0)
    self.assertCountEqual(mesh_shape.dims, [mtf.Dimension("mesh_0", 4), mtf.Dimension("mesh_1", 2)])
    layout, mesh_shape = auto_mtf.layout_and_mesh_shape(graph, 8, [z], 1)
    for dim in (A, B, C):
      self.assertIsNone(layout.tensor_dimension_to_mesh_axis(dim, mesh_shape))
    self.assertCountEqual(mesh_shape.dims, [mtf.Dimension("mesh_0", 8)])

  @parameterized.parameters(1, 2, 3, 4, 6, 8, 12)
  def test_layout_and_mesh_shape_covers_exactly_the_machines(self, num_machines):
    graph, z = _graph()
    _, mesh_shape = auto_mtf.layout_and_mesh_shape(graph, num_machines, [z])
    self.assertEqual(mesh_shape.size, num_machines)

  def test_mesh_shape_iterator(self):
    it = auto_mtf.api._mesh_shape_iterator
    self.assertCountEqual(it(1), [[1]])
    self.assertCountEqual(it(2), [[2]])
    self.assertCountEqual(it(4), [[4], [2, 2]])
    self.assertCountEqual(it(8), [[8], [4, 2], [2, 2, 2]])
    self.assertCountEqual(it(12), [[12], [6, 2], [4, 3], [3, 2, 2]])
    self.assertCountEqual(it(8, max_mesh_shape_dimensions=2), [[8], [4, 2]])

  def test_mesh_size_must_match_the_device_count(self):
    graph, z = _graph()
    with self.assertRaisesRegex(ValueError, "has 8 processors but there are 6 devices"):
      auto_mtf.layout(graph, "m1:4;m2:2", [z], num_devices=6)
    with self.assertRaisesRegex(ValueError, "positive int"):
      auto_mtf.layout_and_mesh_shape(graph, 0, [z])

  def test_no_layout_fits_names_the_excess_and_undividable_dims(self):
    graph, z = _graph()
    with self.assertRaisesRegex(ValueError, r"memory limit of 10 bytes.*over.*can split: b:5"):
      auto_mtf.layout(graph, "m1:4;m2:2", [z], memory_limit_bytes=10)


def test_too_many_candidate_layouts_is_a_clear_error_and_layout_and_mesh_shape_skips_that_mesh(monkeypatch):
  from mesh_tensorflow.auto_mtf import _solver, layout_optimizer
  graph, z = _graph()
  monkeypatch.setattr(_solver, "MAX_ENUMERATED", 5)  # a:10 and c:20 have 3 x 3 choices on a 2-D mesh
  try:
    auto_mtf.layout(graph, "m1:2;m2:2", [z])
  except layout_optimizer.SearchSpaceTooLarge as e:
    assert "9 candidate layouts" in str(e) and "fewer dimensions" in str(e)
  else:
    raise AssertionError("expected SearchSpaceTooLarge")
  _, mesh_shape = auto_mtf.layout_and_mesh_shape(graph, 4, [z])
  assert mesh_shape.dims == [mtf.Dimension("mesh_0", 4)]


def test_a_name_one_tensor_holds_with_two_sizes_is_never_split_and_the_layout_lowers():
  """A dense map io=64 -> io=32 makes the kernel [io=64, io=32]; a rule for io would put both on
  one mesh dimension, so the search leaves io unsplit, though it is the only dim a 2-way mesh
  dimension divides here (batch 1, hidden 3)."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  x = mtf.zeros(mesh, "batch:1;io:64")
  y = mtf.layers.dense(x, mtf.Dimension("io", 32), reduced_dims=x.shape.dims[-1:], name="proj")
  z = mtf.layers.dense(y, mtf.Dimension("hidden", 3), reduced_dims=y.shape.dims[-1:], name="up")
  loss = mtf.reduce_sum(z)
  mtf.gradients([loss], [v.outputs[0] for v in graph.trainable_variables])
  mesh_shape = mtf.convert_to_shape("m:2")
  layout = auto_mtf.layout(graph, mesh_shape, [loss])
  assert layout._pairs == set(), layout
  # Not even a candidate: no decision variable for io (so no exact costing is spent on it).
  estimator = auto_mtf.memory_estimator.MemoryEstimator(graph, mesh_shape, [loss])
  variables = auto_mtf.layout_optimizer.LayoutOptimizer(estimator)._model.Proto().variables
  assert variables == [], variables
  for op in graph.operations:  # every tensor has a valid layout under the result
    for t in op.outputs:
      layout.tensor_layout(t.shape, mesh_shape)


def test_a_tie_goes_to_the_layout_whose_mesh_dim_names_match_the_dims_they_hold():
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  x = mtf.zeros(mesh, "batch:8,d_model:4")
  w = mtf.get_variable(mesh, "w", "d_model:4,d_ff:8")
  loss = mtf.reduce_sum(mtf.einsum([x, w], "batch:8,d_ff:8"))
  # batch and d_ff are interchangeable here: both layouts cost the same, on either mesh order.
  for mesh_shape in ("batch:2;model:2", "model:2;batch:2"):
    assert list(auto_mtf.layout(graph, mesh_shape, [loss])) == [("batch", "batch"), ("d_ff", "model")]
