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


def _train_twice(share_replicas):
  """Two SGD steps of a [rows, cols] variable on a 2x4 mesh splitting only `rows` (4 replicas each)."""

  def build():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    rows, cols = mtf.Dimension("rows", 4), mtf.Dimension("cols", 6)
    w = mtf.get_variable(mesh, "w", [rows, cols],
                         initializer=tf.constant_initializer(np.arange(24.0).reshape(4, 6)))
    x = mtf.import_tf_tensor(mesh, tf.constant(np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)),
                             [rows, cols])
    loss = mtf.reduce_sum(mtf.square(w * x))
    update = mtf.assign_sub(w, 0.1 * mtf.gradients([loss], [w])[0])
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("r:2;c:4", "rows:r", cpu_devices(8),
                                                     share_replicas=share_replicas)
    lowering = mtf.Lowering(graph, {mesh: impl})
    slices = lowering.variables[w.operation]._slices
    return lowering, slices, lowering.export_to_tf_tensor(w), lowering.lowered_operation(update)

  with tf.Graph().as_default():
    lowering, slices, tf_w, update = build()
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      sess.run(update)
      sess.run(update)
      return slices, sess.run(tf_w)


def test_replicas_on_cpus_of_one_process_share_one_slice_variable_and_train_the_same():
  shared_slices, shared = _train_twice(share_replicas=None)
  own_slices, own = _train_twice(share_replicas=False)
  # rows:r splits over the 2 rows of the mesh; the 4 processors of each row hold equal slices.
  assert len({id(v) for v in shared_slices}) == 2 and len({id(v) for v in own_slices}) == 8
  assert [v.device for v in shared_slices] == ["/device:CPU:0"] * 4 + ["/device:CPU:4"] * 4
  w = np.arange(24.0).reshape(4, 6)
  x = np.linspace(-1, 1, 24).reshape(4, 6)
  for _ in range(2):
    w = w - 0.1 * 2 * w * x * x
  np.testing.assert_allclose(shared, w, rtol=1e-6)
  np.testing.assert_allclose(own, w, rtol=1e-6)


def test_gpu_meshes_keep_a_replica_per_device_unless_asked():
  assert not mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "", ["gpu:0", "gpu:1"]).share_replicas
  assert mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "", cpu_devices(2)).share_replicas
