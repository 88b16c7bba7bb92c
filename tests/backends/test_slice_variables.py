"""Slice variables: uninitialised until the masters are copied in, in no collection, reused per TF graph."""

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._lowering.laid_out import slice_variable
from tests.harness import cpu_devices, session_config


def test_slice_variable_is_in_no_collection_and_reused_in_the_same_graph():
  with tf.Graph().as_default(), tf.variable_scope("outer"):
    with tf.name_scope("some_op"):
      first = slice_variable("w_slice_1", [2, 3], tf.float32, "cpu:1")
    again = slice_variable("w_slice_1", [2, 3], tf.float32, "cpu:1")
    assert again is first and first.name == "outer/w_slice_1:0"
    assert first.device == "/device:CPU:1"
    assert not tf.global_variables() and not tf.trainable_variables()


def test_a_lowering_initialises_slices_only_through_copy_masters_to_slices():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    w = mtf.get_variable(mesh, "w", [mtf.Dimension("d", 8)], initializer=tf.ones_initializer())
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", "d:all", cpu_devices(4))
    lowering = mtf.Lowering(graph, {mesh: impl})
    tf_w = lowering.export_to_tf_tensor(w)
    assert [v.name for v in tf.global_variables()] == ["w:0"]  # the master only
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      uninitialised = sess.run(tf.report_uninitialized_variables(lowering.variables[w.operation]._slices))
      assert len(uninitialised) == 4
      sess.run(lowering.copy_masters_to_slices())
      np.testing.assert_array_equal(sess.run(tf_w), np.ones(8))
