"""Benchmarks, reported as ratios against plain TensorFlow measured in the same run.

1. The example classifier's training step on 8 virtual CPU devices for each layout, against the
   same model written in plain TensorFlow on one device.
2. The time to lower a 100-op mtf graph onto 1, 8 and 64 (virtual) devices, against the time to
   build the equivalent plain TF graph once.

    python benchmarks/bench_classifier.py [--steps 30] [--warmup 3] [--batch_size 512] [--device cpu|gpu]
                                          [--lowering_devices 1,8,64]

Training-step times are measured on 8 devices only; lowering times on each --lowering_devices count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import tensorflow as tf2
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mesh_tensorflow as mtf  # noqa: E402
from examples import classifier  # noqa: E402

NUM_CPUS = 8


def _time_steps(sess, fetches, feeds, warmup: int) -> float:
  """Seconds per step over feeds[warmup:] (at least one), after running feeds[:warmup] untimed."""
  if len(feeds) <= warmup:
    raise ValueError(f"{len(feeds)} feeds leave no step to time after {warmup} warm-up steps.")
  for feed in feeds[:warmup]:
    sess.run(fetches, feed)
  start = time.perf_counter()
  for feed in feeds[warmup:]:
    sess.run(fetches, feed)
  return (time.perf_counter() - start) / (len(feeds) - warmup)


def _feeds(images_ph, labels_ph, batch_size, steps):
  images, labels = classifier.make_dataset(batch_size * steps, seed=1)
  return [{images_ph: images[i * batch_size:(i + 1) * batch_size],
           labels_ph: labels[i * batch_size:(i + 1) * batch_size]} for i in range(steps)]


def mtf_step_time(mesh_shape, layout, devices, batch_size, hidden, steps, warmup) -> float:
  with tf.Graph().as_default():
    images_ph = tf.placeholder(tf.float32, [batch_size, 64])
    labels_ph = tf.placeholder(tf.int32, [batch_size])
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "bench")
    loss, _, updates = classifier.build_train_step(mesh, images_ph, labels_ph, batch_size, hidden, 0.1)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, devices)
    lowering = mtf.Lowering(graph, {mesh: impl})
    fetches = [lowering.export_to_tf_tensor(loss),
               tf.group([lowering.lowered_operation(u) for u in updates])]
    with tf.Session(config=tf.ConfigProto(device_count={"CPU": NUM_CPUS})) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      return _time_steps(sess, fetches, _feeds(images_ph, labels_ph, batch_size, warmup + steps), warmup)


def plain_tf_step_time(device, batch_size, hidden, steps, warmup) -> float:
  with tf.Graph().as_default(), tf.device(device):
    images_ph = tf.placeholder(tf.float32, [batch_size, 64])
    labels_ph = tf.placeholder(tf.int32, [batch_size])
    w1 = tf.get_variable("w1", [64, hidden], initializer=tf.random_normal_initializer(stddev=0.1))
    w2 = tf.get_variable("w2", [hidden, 10], initializer=tf.random_normal_initializer(stddev=0.1))
    logits = tf.matmul(tf.nn.relu(tf.matmul(images_ph, w1)), w2)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels_ph, logits=logits))
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.Session(config=tf.ConfigProto(device_count={"CPU": NUM_CPUS})) as sess:
      sess.run(tf.global_variables_initializer())
      return _time_steps(sess, [loss, train], _feeds(images_ph, labels_ph, batch_size, warmup + steps),
                         warmup)


def _chain_graph(mesh, num_ops: int):
  """About num_ops mtf ops: einsums, adds and activations over a [batch, d] activation."""
  batch, d = mtf.Dimension("batch", 64), mtf.Dimension("d", 64)
  x = mtf.ones(mesh, [batch, d])
  w = mtf.ones(mesh, [d, mtf.Dimension("d2", 64)])
  while len(mesh.graph.operations) < num_ops:
    h = mtf.einsum([x, w], output_shape=[batch, mtf.Dimension("d2", 64)])
    x = mtf.rename_dimension(mtf.tanh(h), "d2", "d") + x
  return x


def lowering_seconds(num_devices: int, num_ops: int = 100) -> float:
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "bench")
    out = _chain_graph(mesh, num_ops)
    mesh_shape = "all:%d" % num_devices
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(
        mesh_shape, "batch:all", ["cpu:%d" % (i % NUM_CPUS) for i in range(num_devices)])
    tf_ops_before = len(tf.get_default_graph().get_operations())
    start = time.perf_counter()
    lowering = mtf.Lowering(graph, {mesh: impl})
    lowering.export_to_tf_tensor(out)
    seconds = time.perf_counter() - start
    return seconds, len(graph.operations), len(tf.get_default_graph().get_operations()) - tf_ops_before


def plain_tf_graph_seconds(num_ops: int = 100):
  """Time to build a plain TF graph of about num_ops ops on one device; returns (seconds, ops)."""
  with tf.Graph().as_default():
    start = time.perf_counter()
    x = tf.ones([64, 64])
    w = tf.ones([64, 64])
    for _ in range(num_ops // 3):
      x = tf.tanh(tf.matmul(x, w)) + x
    return time.perf_counter() - start, len(tf.get_default_graph().get_operations())


def main(argv=None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=30, help="timed training steps (after --warmup)")
  parser.add_argument("--warmup", type=int, default=3, help="untimed training steps first")
  parser.add_argument("--batch_size", type=int, default=512)
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
  parser.add_argument("--lowering_devices", default="1,8,64",
                      help="comma-separated device counts to time the lowering on")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.warmup < 0:
    parser.error(f"--steps must be at least 1 and --warmup at least 0 (got {args.steps}, {args.warmup}).")
  tf.logging.set_verbosity(tf.logging.ERROR)

  if args.device == "gpu":
    n = len(tf2.config.list_physical_devices("GPU"))
    if n == 0:
      parser.error("--device gpu: TensorFlow sees no GPU here (tf.config.list_physical_devices('GPU') "
                   "is empty). Install TensorFlow with CUDA (pip install -e '.[gpu]') on a GPU machine, "
                   "or use --device cpu.")
    devices = ["gpu:%d" % (i % n) for i in range(8)]
    reference_device = "gpu:0"
  else:
    devices = ["cpu:%d" % i for i in range(8)]
    reference_device = "cpu:0"
  print(f"# training step ({args.steps} timed after {args.warmup} warm-up), batch {args.batch_size}, "
        f"hidden {args.hidden}, devices {devices[:2]}...")
  baseline = plain_tf_step_time(reference_device, args.batch_size, args.hidden, args.steps, args.warmup)
  print(f"{'plain TF, 1 device':32s} {baseline * 1e3:8.3f} ms/step   ratio 1.00")
  for name, (mesh_shape, layout) in classifier.LAYOUTS.items():
    t = mtf_step_time(mesh_shape, layout, devices, args.batch_size, args.hidden, args.steps, args.warmup)
    print(f"{'mtf ' + name + ', 8 devices':32s} {t * 1e3:8.3f} ms/step   ratio {t / baseline:.2f}")

  print("\n# lowering a 100-op graph (per-TF-op cost compares the work per op created)")
  plain_tf_graph_seconds()  # warm up TF's op-building caches
  reference, reference_ops = plain_tf_graph_seconds()
  per_op = reference / reference_ops
  print(f"{'plain TF graph build':32s} {reference * 1e3:8.1f} ms  {reference_ops:6d} TF ops  "
        f"{per_op * 1e6:6.1f} us/op  ratio 1.0")
  for n in [int(n) for n in args.lowering_devices.split(",")]:
    seconds, num_ops, tf_ops = lowering_seconds(n)
    print(f"{'mtf lowering, %d devices' % n:32s} {seconds * 1e3:8.1f} ms  {tf_ops:6d} TF ops  "
          f"{seconds / tf_ops * 1e6:6.1f} us/op  ratio {seconds / tf_ops / per_op:.2f}"
          f"   ({num_ops} mtf ops; whole-graph ratio {seconds / reference:.1f})")


if __name__ == "__main__":
  cpus = tf2.config.list_physical_devices("CPU")
  tf2.config.set_logical_device_configuration(
      cpus[0], [tf2.config.LogicalDeviceConfiguration()] * NUM_CPUS)
  main()
