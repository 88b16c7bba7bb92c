"""valid_layouts.LayoutValidator: splittable dimensions and divisibility (upstream conventions)."""

import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.auto_mtf import valid_layouts


class LayoutValidatorTest(tf.test.TestCase):

  def setUp(self):
    super().setUp()
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    a, b = mtf.Dimension("a", 5), mtf.Dimension("b", 10)
    x1 = mtf.zeros(mesh, mtf.Shape([a, b, mtf.Dimension("concat", 15)]))
    x2 = mtf.zeros(mesh, mtf.Shape([a, b, mtf.Dimension("concat", 20)]))
    mtf.concat([x1, x2], "concat")
    mtf.zeros(mesh, mtf.anonymous_shape(mtf.Shape([a, b])))  # anonymous dims are never splittable
    self.validator = valid_layouts.LayoutValidator(graph, mtf.convert_to_shape("m1:4;m2:2"))

  def test_splittable_names_exclude_concatenated_and_anonymous_dims(self):
    self.assertEqual(self.validator.splittable_mtf_dimension_names, {"a", "b"})

  def test_mesh_dimension_name_to_size(self):
    self.assertEqual(self.validator.mesh_dimension_name_to_size, {"m1": 4, "m2": 2})

  def test_valid_assignment_needs_a_splittable_dim_and_a_dividing_mesh_dim(self):
    self.assertFalse(self.validator.is_valid_assignment("a", "m1"))  # 4 does not divide 5
    self.assertFalse(self.validator.is_valid_assignment("a", "m2"))
    self.assertFalse(self.validator.is_valid_assignment("b", "m1"))
    self.assertTrue(self.validator.is_valid_assignment("b", "m2"))
    self.assertFalse(self.validator.is_valid_assignment("concat", "m1"))  # concat can't split it
    self.assertFalse(self.validator.is_valid_assignment("concat", "m2"))

  def test_sizes_gcd_is_what_must_be_divided(self):
    self.assertEqual(self.validator.mtf_dimension_name_to_size_gcd["concat"], 5)
