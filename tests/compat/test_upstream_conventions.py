"""The harness conventions of upstream's own test-suite: tf.test.TestCase, run_in_graph_and_eager_modes,
self.evaluate, device lists of "" -- the build -> Lowering -> export -> evaluate flow in both modes."""

import numpy as np
import tensorflow.compat.v1 as tf
from absl.testing import parameterized
from tensorflow.python.framework import test_util

import mesh_tensorflow as mtf
from mesh_tensorflow import placement_mesh_impl


class UpstreamStyleLoweringTest(parameterized.TestCase, tf.test.TestCase):

  @test_util.run_in_graph_and_eager_modes()
  def test_scalar_import_export_round_trip(self):
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    inputs = tf.constant(0.)
    mtf_inputs = mtf.import_tf_tensor(mesh, tf_tensor=inputs, shape=mtf.Shape([]))
    mesh_impl = placement_mesh_impl.PlacementMeshImpl(shape=[], layout={}, devices=[""])
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    outputs = lowering.export_to_tf_tensor(mtf_inputs)
    inputs_value, outputs_value = self.evaluate([inputs, outputs])
    self.assertEqual(inputs_value, outputs_value)
    self.evaluate(lowering.copy_masters_to_slices())
    self.evaluate(lowering.copy_slices_to_masters())

  @parameterized.parameters(
      ("all:2", "a:all", 2), ("rows:2,cols:2", "a:rows,b:cols", 4), ([], {}, 1))
  @test_util.run_in_graph_and_eager_modes()
  def test_variable_round_trip_through_slices(self, mesh_shape, layout, num_devices):
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    value = np.arange(24, dtype=np.float32).reshape(4, 6)
    var = mtf.get_variable(mesh, "var", [mtf.Dimension("a", 4), mtf.Dimension("b", 6)],
                           initializer=tf.constant_initializer(value))
    doubled = var * 2.0
    mesh_impl = placement_mesh_impl.PlacementMeshImpl(
        shape=mesh_shape, layout=layout, devices=[""] * num_devices)
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    self.evaluate(tf.global_variables_initializer())
    self.evaluate(lowering.copy_masters_to_slices())
    self.assertAllEqual(self.evaluate(lowering.export_to_tf_tensor(doubled)), 2 * value)

  @test_util.run_in_graph_and_eager_modes()
  def test_einsum_gradient_through_lowering(self):
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    a, b, c = mtf.Dimension("a", 4), mtf.Dimension("b", 2), mtf.Dimension("c", 6)
    x_np = np.random.RandomState(0).randn(4, 2).astype(np.float32)
    y_np = np.random.RandomState(1).randn(2, 6).astype(np.float32)
    x = mtf.import_tf_tensor(mesh, tf.constant(x_np), shape=[a, b])
    y = mtf.import_tf_tensor(mesh, tf.constant(y_np), shape=[b, c])
    loss = mtf.reduce_sum(mtf.einsum([x, y], output_shape=[a, c]))
    dx, = mtf.gradients([loss], [x])
    mesh_impl = placement_mesh_impl.PlacementMeshImpl(
        shape="rows:2;cols:2", layout="a:rows;b:cols", devices=[""] * 4)
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    self.assertAllClose(self.evaluate(lowering.export_to_tf_tensor(dx)),
                        np.tile(y_np.sum(axis=1), [4, 1]))


if __name__ == "__main__":
  tf.disable_v2_behavior()
  tf.enable_eager_execution()
  tf.test.main()
