"""Layer calls in the form upstream's layers tests make them (tf.test.TestCase, graph and eager modes,
1-processor PlacementMeshImpl with devices [""], global init then copy_masters_to_slices)."""

import numpy as np
import tensorflow.compat.v1 as tf
from absl.testing import parameterized
from tensorflow.python.framework import test_util

import mesh_tensorflow as mtf
from mesh_tensorflow import placement_mesh_impl


def _lower_single(graph, mesh, outputs):
  mesh_impl = placement_mesh_impl.PlacementMeshImpl(shape=[], layout={}, devices=[""])
  lowering = mtf.Lowering(graph, {mesh: mesh_impl})
  return lowering, [lowering.export_to_tf_tensor(x) for x in outputs]


class UpstreamStyleLayersTest(parameterized.TestCase, tf.test.TestCase):

  @parameterized.parameters((4, True, "not_channels"), (8, False, "channels"))
  @test_util.run_in_graph_and_eager_modes()
  def test_dense_with_new_dim_named_like_the_reduced_dim(self, units, use_bias, new_dim_name):
    inputs = tf.random_normal([2, 3])
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    batch_dim, channels_dim = mtf.Dimension("batch", 2), mtf.Dimension("channels", 3)
    mtf_inputs = mtf.import_tf_tensor(mesh, inputs, shape=mtf.Shape([batch_dim, channels_dim]))
    mtf_outputs = mtf.layers.dense(mtf_inputs, new_dims=mtf.Dimension(new_dim_name, units),
                                   reduced_dims=[channels_dim], activation=mtf.relu, use_bias=use_bias)
    lowering, (actual_outputs,) = _lower_single(graph, mesh, [mtf_outputs])
    tf_group = lowering.copy_masters_to_slices()
    self.evaluate(tf.global_variables_initializer())
    self.evaluate(tf_group)
    actual = self.evaluate(actual_outputs)
    self.assertEqual(actual.shape, (2, units))
    self.assertTrue(np.all(actual >= 0))

  @test_util.run_in_graph_and_eager_modes()
  def test_weights_nonzero_without_variables(self):
    inputs = tf.constant([[3, 1, 0], [1, 0, 0]])
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    mtf_inputs = mtf.import_tf_tensor(
        mesh, inputs, shape=mtf.Shape([mtf.Dimension("batch", 2), mtf.Dimension("channels", 3)]))
    lowering, (actual_outputs,) = _lower_single(graph, mesh, [mtf.layers.weights_nonzero(mtf_inputs)])
    self.evaluate(lowering.copy_masters_to_slices())
    self.assertAllEqual(self.evaluate(actual_outputs), [[1., 1., 0.], [1., 0., 0.]])

  @parameterized.parameters((2, 16, 3, 4, 2, 2), (1, 8, 5, 3, 1, 4))
  @test_util.run_in_graph_and_eager_modes()
  def test_masked_local_attention_1d_on_a_length_q_dim(self, batch, length, io_channels, kv_channels,
                                                       heads, window_size):
    query = tf.random_normal([batch, length, io_channels])
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    shape = mtf.Shape([mtf.Dimension("batch", batch), mtf.Dimension("length_q", length),
                       mtf.Dimension("io_channels", io_channels)])
    mtf_query = mtf.import_tf_tensor(mesh, query, shape=shape)
    mtf_outputs = mtf.layers.masked_local_attention_1d(
        mtf_query, kv_channels=mtf.Dimension("kv_channels", kv_channels),
        heads=mtf.Dimension("heads", heads), is_training=False, window_size=window_size)
    lowering, (actual_outputs,) = _lower_single(graph, mesh, [mtf_outputs])
    tf_group = lowering.copy_masters_to_slices()
    self.evaluate(tf.global_variables_initializer())
    self.evaluate(tf_group)
    self.assertEqual(self.evaluate(actual_outputs).shape, (batch, length, io_channels))

  @test_util.run_in_graph_and_eager_modes()
  def test_multihead_self_attention_and_dense_relu_dense_keep_the_input_shape(self):
    x = tf.random_normal([2, 4, 3])
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    shape = mtf.Shape([mtf.Dimension("batch", 2), mtf.Dimension("length", 4), mtf.Dimension("io", 3)])
    mtf_x = mtf.import_tf_tensor(mesh, x, shape=shape)
    attention = mtf.layers.multihead_attention(
        mtf_x, None, None, kv_channels=mtf.Dimension("kv", 5), heads=mtf.Dimension("heads", 2),
        is_training=False)
    ffn = mtf.layers.dense_relu_dense(mtf_x, hidden_channels=mtf.Dimension("hidden", 6), is_training=False)
    lowering, outputs = _lower_single(graph, mesh, [attention, ffn])
    tf_group = lowering.copy_masters_to_slices()
    self.evaluate(tf.global_variables_initializer())
    self.evaluate(tf_group)
    for value in self.evaluate(outputs):
      self.assertEqual(value.shape, (2, 4, 3))

  @parameterized.parameters(("max_pool2d", (2, 2)), ("avg_pool2d", (1, 2)), ("max_pool3d", [2, 2, 2]),
                            ("avg_pool3d", [1, 2, 2]))
  @test_util.run_in_graph_and_eager_modes()
  def test_pools_on_5d_inputs_with_gradients(self, fn_name, ksize):
    x = tf.random_normal([2, 4, 4, 4, 3])
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    shape = mtf.Shape([mtf.Dimension(n, s) for n, s in
                       [("batch", 2), ("depth", 4), ("height", 4), ("width", 4), ("channels", 3)]])
    mtf_x = mtf.import_tf_tensor(mesh, x, shape=shape)
    y = getattr(mtf.layers, fn_name)(mtf_x, ksize=ksize)
    dx, = mtf.gradients([mtf.reduce_sum(y)], [mtf_x])
    _, (dx_value,) = _lower_single(graph, mesh, [dx])
    window = int(np.prod(ksize))
    dx_value = self.evaluate(dx_value)
    if fn_name.startswith("avg"):
      self.assertAllClose(dx_value, np.full(dx_value.shape, 1.0 / window))
    else:
      self.assertEqual(np.count_nonzero(dx_value), dx_value.size // window)


if __name__ == "__main__":
  tf.disable_v2_behavior()
  tf.enable_eager_execution()
  tf.test.main()
