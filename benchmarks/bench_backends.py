"""Placement vs collective backend over the device count: lowering time, TF ops, first step, step.

A small data-parallel MLP training step (4 blocks of d 64 -> h 128 -> d 64, batch 64, SGD) is
lowered onto 1, 2, 4, ... virtual CPU devices of one process with each backend; the same model in
plain TF on one device gives the reference step time, measured in the same run.

    python benchmarks/bench_backends.py [--devices 1,8,64] [--steps 5]

Columns: TF graph nodes (plus nodes inside traced functions), lowering seconds, first-step
seconds, median step ms and its ratio to plain TF.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import tensorflow as tf2
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mesh_tensorflow as mtf  # noqa: E402
from mesh_tensorflow.collective_mesh_impl import CollectiveMeshImpl  # noqa: E402

BATCH, D, H, BLOCKS = 64, 64, 128, 4

BACKENDS = {
    "placement": lambda shape, devices: mtf.placement_mesh_impl.PlacementMeshImpl(
        shape, "batch:all", devices),
    "placement_unfused": lambda shape, devices: mtf.placement_mesh_impl.PlacementMeshImpl(
        shape, "batch:all", devices, fuse_slicewise=False),
    "collective": lambda shape, devices: CollectiveMeshImpl(shape, "batch:all", devices),
}


def _mtf_update_ops(mesh):
  batch, d, h = mtf.Dimension("batch", BATCH), mtf.Dimension("d", D), mtf.Dimension("h", H)
  x = mtf.random_uniform(mesh, [batch, d])
  weights = []
  for i in range(BLOCKS):
    w1 = mtf.get_variable(mesh, "w1_%d" % i, [d, h])
    w2 = mtf.get_variable(mesh, "w2_%d" % i, [h, d])
    x = mtf.einsum([mtf.relu(mtf.einsum([x, w1], output_shape=[batch, h])), w2], output_shape=[batch, d])
    weights += [w1, w2]
  grads = mtf.gradients([mtf.reduce_mean(mtf.square(x))], weights)
  return [mtf.assign_sub(w, g * 0.1) for w, g in zip(weights, grads)]


def _plain_tf_train_op():
  x = tf.random.uniform([BATCH, D])
  weights = []
  for i in range(BLOCKS):
    w1 = tf.get_variable("w1_%d" % i, [D, H], use_resource=True)
    w2 = tf.get_variable("w2_%d" % i, [H, D], use_resource=True)
    x = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
    weights += [w1, w2]
  grads = tf.gradients(tf.reduce_mean(tf.square(x)), weights)
  return tf.group([w.assign_sub(g * 0.1) for w, g in zip(weights, grads)])


def _step_times(sess, train_op, steps):
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    sess.run(train_op)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(backend, n, steps, config):
  with tf.Graph().as_default() as tf_graph:
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    updates = _mtf_update_ops(mesh)
    start = time.perf_counter()
    lowering = mtf.Lowering(graph, {mesh: BACKENDS[backend]("all:%d" % n, ["/cpu:%d" % i for i in range(n)])})
    train_op = tf.group([lowering.lowered_operation(op) for op in updates])
    lowering_s = time.perf_counter() - start
    graph_def = tf_graph.as_graph_def()
    nodes = len(graph_def.node)
    function_nodes = sum(len(f.node_def) for f in graph_def.library.function)
    with tf.Session(config=config) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      start = time.perf_counter()
      sess.run(train_op)
      first_s = time.perf_counter() - start
      step_s = _step_times(sess, train_op, steps)
  return nodes, function_nodes, lowering_s, first_s, step_s


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--devices", default="1,8,64")
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args(argv)
  counts = [int(n) for n in args.devices.split(",")]
  cpus = tf2.config.list_physical_devices("CPU")
  tf2.config.set_logical_device_configuration(
      cpus[0], [tf2.config.LogicalDeviceConfiguration()] * max(counts))
  tf.disable_eager_execution()
  config = tf.ConfigProto(device_count={"CPU": max(counts)})
  with tf.Graph().as_default():
    train_op = _plain_tf_train_op()
    with tf.Session(config=config) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train_op)
      plain_s = _step_times(sess, train_op, args.steps)
  print(f"plain TF, one device: step {plain_s * 1000:.1f} ms ({os.cpu_count()} cores)")
  print(f"{'devices':>7} {'backend':<18} {'nodes':>6} {'in fns':>6} {'lower s':>7} {'first s':>7} "
        f"{'step ms':>8} {'x plain':>7}")
  for n in counts:
    for backend in BACKENDS:
      nodes, function_nodes, lowering_s, first_s, step_s = measure(backend, n, args.steps, config)
      print(f"{n:>7} {backend:<18} {nodes:>6} {function_nodes:>6} {lowering_s:>7.2f} {first_s:>7.2f} "
            f"{step_s * 1000:>8.1f} {step_s / plain_s:>7.2f}", flush=True)


if __name__ == "__main__":
  main()
