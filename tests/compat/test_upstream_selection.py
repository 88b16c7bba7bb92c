"""top_k / nth-element calls in upstream's own test form: a 2x2 mesh, devices [""], gradients via grad_ys."""

import tensorflow.compat.v1 as tf
from absl.testing import parameterized
from tensorflow.python.framework import test_util

import mesh_tensorflow as mtf
from mesh_tensorflow import placement_mesh_impl

INPUTS = [[1, 10], [2, 9], [3, 8], [4, 7], [5, 6], [6, 5]]


def _mesh_impl():
  return placement_mesh_impl.PlacementMeshImpl(shape="rows:2,cols:2", layout="a:rows,b:cols",
                                               devices=["", "", "", ""])


class UpstreamStyleSelectionTest(parameterized.TestCase, tf.test.TestCase):

  @test_util.run_in_graph_and_eager_modes()
  def test_top_k_values_indices_and_gradient(self):
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    a_dim, b_dim, k_dim = mtf.Dimension("a", 6), mtf.Dimension("b", 2), mtf.Dimension("k", 2)
    inputs = tf.constant(INPUTS, dtype=tf.float32)
    d_values = tf.constant([[11, 12], [13, 14]], dtype=tf.float32)
    mtf_inputs = mtf.import_fully_replicated(mesh, inputs, shape=mtf.Shape([a_dim, b_dim]))
    mtf_d_values = mtf.import_tf_tensor(mesh, d_values, shape=mtf.Shape([b_dim, k_dim]))
    mtf_values, mtf_indices = mtf.top_k(mtf_inputs, reduced_dim=a_dim, k_dim=k_dim, name="test_top_k")
    [mtf_d_inputs] = mtf.gradients([mtf_values], [mtf_inputs], [mtf_d_values])
    lowering = mtf.Lowering(graph, {mesh: _mesh_impl()})
    values, indices, d_inputs = self.evaluate([
        lowering.export_to_tf_tensor(t) for t in (mtf_values, mtf_indices, mtf_d_inputs)])
    self.assertAllEqual(values, [[6, 5], [10, 9]])
    self.assertAllEqual(indices, [[5, 4], [0, 1]])
    self.assertAllEqual(d_inputs, [[0, 13], [0, 14], [0, 0], [0, 0], [12, 0], [11, 0]])

  @parameterized.parameters(("nth_largest_element", [5, 9]), ("nth_smallest_element", [2, 6]))
  @test_util.run_in_graph_and_eager_modes()
  def test_nth_element_with_positional_name(self, fn_name, expected):
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    a_dim, b_dim = mtf.Dimension("a", 6), mtf.Dimension("b", 2)
    mtf_inputs = mtf.import_tf_tensor(mesh, tf.constant(INPUTS, dtype=tf.float32),
                                      shape=mtf.Shape([a_dim, b_dim]))
    mtf_outputs = getattr(mtf, fn_name)(mtf_inputs, 1, a_dim, "test_" + fn_name)
    lowering = mtf.Lowering(graph, {mesh: _mesh_impl()})
    self.assertAllEqual(self.evaluate(lowering.export_to_tf_tensor(mtf_outputs)), expected)
