"""Candidate algorithms for each collective between virtual CPU devices of one process.

For each collective (allreduce, allconcat, alltoall, a shift) over a group of `--devices` virtual
CPU devices in tf.compat.v1 graph mode, times every candidate on tensors sized like a small
Transformer's gradients and activations:

* `ring`: the placement backend's rings of tf.identity copies (`ring_collectives.py`);
* `tf_collective`: TF collective ops (`CollectiveReduceV2` / `CollectiveGatherV2` /
  `CollectiveAllToAllV2` / two-member `CollectiveBcastSendV2` and `RecvV2` pairs for the shift),
  one per device (the collective backend's path with `in_process_fast_path=False`);
* `direct`: plain ops on one device plus tf.identity copies (the collective backend's in-process
  path, `tf_collectives.py`);
* `chunked`: for allreduce, each device sums one chunk, then every device concatenates them.

Runs are interleaved (machine noise hits every candidate alike); reports the median ms per run
over --reps repetitions and the ratio to the fastest candidate.

    python benchmarks/bench_collectives.py [--devices 8] [--reps 7] [--iters 10] [--num_tensors N]
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

from mesh_tensorflow._backends import ring_collectives, tf_collectives  # noqa: E402

_COLLECTIVE_OPS = tf_collectives.CollectiveSettings(in_process_fast_path=False)


def _chunked_allreduce(xs, devices):
  """Reduce-scatter by summing chunk k on device k, then every device concatenates the chunks."""
  n = len(xs)
  chunks = []
  for x, device in zip(xs, devices):
    with tf.device(device):
      chunks.append(tf.split(tf.reshape(x, [-1]), n))
  sums = []
  for k, device in enumerate(devices):
    with tf.device(device):
      sums.append(tf.add_n([c[k] for c in chunks]))
  ret = []
  for x, device in zip(xs, devices):
    with tf.device(device):
      ret.append(tf.reshape(tf.concat(sums, 0), x.shape))
  return ret


def _candidates(concat_axis=1):
  return {
      "allreduce": {
          "ring": lambda xs, d: ring_collectives.allreduce_ring(xs, d, "SUM"),
          "tf_collective": lambda xs, d: tf_collectives.allreduce(xs, d, "SUM", _COLLECTIVE_OPS),
          "direct": lambda xs, d: tf_collectives.allreduce(xs, d, "SUM"),
          "chunked": _chunked_allreduce,
      },
      "allconcat": {
          "ring": lambda xs, d: ring_collectives.allconcat_ring(xs, d, concat_axis),
          "tf_collective": lambda xs, d: tf_collectives.allconcat(xs, d, concat_axis, _COLLECTIVE_OPS),
          "direct": lambda xs, d: tf_collectives.allconcat(xs, d, concat_axis),
      },
      "alltoall": {
          "ring": lambda xs, d: ring_collectives.alltoall_ring(xs, d, 0, 1),
          "tf_collective": lambda xs, d: tf_collectives.alltoall(xs, d, 0, 1, _COLLECTIVE_OPS),
          "direct": lambda xs, d: tf_collectives.alltoall(xs, d, 0, 1),
      },
      "shift": {
          "tf_collective": lambda xs, d: tf_collectives.receive(
              xs, d, [None] + list(range(len(xs) - 1)), _COLLECTIVE_OPS),
          "direct": lambda xs, d: tf_collectives.receive(xs, d, [None] + list(range(len(xs) - 1))),
      },
  }


# (collective, number of tensors, per-device slice shape): gradients of a ~2M-parameter model
# (32 tensors, 8 MB per device) and of a smaller one; activations [batch, length, d_model] / 8.
CASES = [
    ("allreduce", 32, [256, 256]),
    ("allreduce", 32, [32, 128]),
    ("allconcat", 8, [256, 32]),
    ("alltoall", 8, [256, 32]),
    ("shift", 8, [256, 32]),
]


def _build(collective, algorithm, num_tensors, slice_shape, devices):
  """One fetchable op running the collective on num_tensors fresh tensors per device."""
  outputs = []
  for _ in range(num_tensors):
    xs = []
    for device in devices:
      with tf.device(device):  # variables: read, not recomputed or constant-folded, each run
        xs.append(tf.Variable(tf.random.uniform(slice_shape), use_resource=True).read_value())
    ys = _candidates()[collective][algorithm](xs, devices)
    for y, device in zip(ys, devices):
      with tf.device(device):  # consumed as a gradient is: added into a variable on each device
        total = tf.Variable(tf.zeros(y.shape), use_resource=True)
        outputs.append(total.assign_add(y, read_value=False))
  return tf.group(outputs)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--num_tensors", type=int, default=None,
                      help="tensors per collective (default: each case's, 8 or 32); small for a quick check")
  args = parser.parse_args(argv)
  cpus = tf2.config.list_physical_devices("CPU")
  tf2.config.set_logical_device_configuration(
      cpus[0], [tf2.config.LogicalDeviceConfiguration()] * args.devices)
  tf.disable_eager_execution()
  devices = ["/cpu:%d" % i for i in range(args.devices)]
  print(f"{args.devices} virtual CPU devices, {os.cpu_count()} cores; median ms per run of "
        f"{args.iters} iterations over {args.reps} interleaved repetitions")
  print(f"{'collective':<10} {'tensors x slice':<16} {'algorithm':<14} {'ms':>8} {'ratio':>7}")
  for collective, num_tensors, slice_shape in CASES:
    num_tensors = args.num_tensors or num_tensors
    algorithms = list(_candidates()[collective])
    with tf.Graph().as_default():
      fetches = {a: _build(collective, a, num_tensors, slice_shape, devices) for a in algorithms}
      config = tf.ConfigProto(device_count={"CPU": args.devices})
      with tf.Session(config=config) as sess:
        sess.run(tf.global_variables_initializer())
        for fetch in fetches.values():
          sess.run(fetch)  # warm-up: kernels, collective groups
        times = {a: [] for a in algorithms}
        for _ in range(args.reps):
          for a in algorithms:
            start = time.perf_counter()
            for _ in range(args.iters):
              sess.run(fetches[a])
            times[a].append((time.perf_counter() - start) / args.iters * 1000)
    medians = {a: statistics.median(v) for a, v in times.items()}
    best = min(medians.values())
    shape = f"{num_tensors}x{slice_shape}"
    for a in algorithms:
      print(f"{collective:<10} {shape:<16} {a:<14} {medians[a]:8.2f} {medians[a] / best:7.2f}")


if __name__ == "__main__":
  main()
