"""The placement backend on devices of a TensorFlow cluster (/job:worker/task:K/...), as on several hosts.

Two in-process servers on loopback stand in for two hosts; the mesh spans both, so the lowering's
collectives cross the "network" between tasks.
"""

import socket

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf


def _free_ports(n):
  sockets = [socket.socket() for _ in range(n)]
  for s in sockets:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


def test_training_step_on_a_two_task_cluster_matches_numpy():
  cluster = tf.train.ClusterSpec({"worker": ["127.0.0.1:%d" % p for p in _free_ports(2)]})
  config = tf.ConfigProto(device_count={"CPU": 2})
  servers = [tf.distribute.Server(cluster, "worker", i, config=config, start=True) for i in range(2)]
  devices = ["/job:worker/task:%d/device:CPU:%d" % (task, cpu) for task in range(2) for cpu in range(2)]
  rng = np.random.RandomState(0)
  x_np = rng.randn(8, 6).astype(np.float32)
  w_np = rng.randn(6, 4).astype(np.float32)
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "cluster_mesh")
    batch, d_in, d_out = mtf.Dimension("batch", 8), mtf.Dimension("d_in", 6), mtf.Dimension("d_out", 4)
    x = mtf.import_tf_tensor(mesh, tf.constant(x_np), shape=[batch, d_in])
    w = mtf.get_variable(mesh, "w", [d_in, d_out], initializer=tf.constant_initializer(w_np))
    loss = mtf.reduce_sum(mtf.square(mtf.einsum([x, w], output_shape=[batch, d_out])))
    grad, = mtf.gradients([loss], [w])
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("hosts:2;cpus:2", "batch:hosts;d_out:cpus", devices)
    lowering = mtf.Lowering(graph, {mesh: impl})
    tf_loss, tf_grad = lowering.export_to_tf_tensor(loss), lowering.export_to_tf_tensor(grad)
    placed = {t.device for t in lowering.tensors[grad].to_laid_out_tensor().tensor_list}
    assert placed == set(devices)
    with tf.Session(servers[0].target, config=config) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      got_loss, got_grad = sess.run([tf_loss, tf_grad])
  y = x_np @ w_np
  np.testing.assert_allclose(got_loss, (y ** 2).sum(), rtol=1e-5)
  np.testing.assert_allclose(got_grad, x_np.T @ (2 * y), rtol=1e-5, atol=1e-5)
