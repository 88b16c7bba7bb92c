"""The benchmark Transformer's contractions: tf.einsum against mtf's CPU contraction, one thread.

Every two-operand einsum of the training step (bench_transformer.py's model, forward and
gradients) at the slice shapes of data-parallel 8 (batch 2 per device: 8 copies per run) and of
one device (batch 16), each computed by tf.einsum and by `cpu_contraction.einsum`
(mesh_tensorflow/_backends/cpu_contraction.py: few rows and many columns in column blocks). One
thread per kernel, as `session_config()` gives 8 virtual devices on 2 cores; medians of `--reps`
interleaved runs, weighted by how often the step computes each einsum.

    python benchmarks/bench_contraction.py [--reps 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mesh_tensorflow._backends import cpu_contraction  # noqa: E402

# (equation, x shape, y shape, times per step) at batch 16; the leading "b" is the batch.
EINSUMS = [
    ("bld,dhk->blhk", (16, 64, 256), (256, 4, 64), 6),
    ("blhk,bmhk->bhlm", (16, 64, 4, 64), (16, 64, 4, 64), 4),
    ("bhlm,bmhk->blhk", (16, 4, 64, 64), (16, 64, 4, 64), 4),
    ("blhk,hkd->bld", (16, 64, 4, 64), (4, 64, 256), 2),
    ("bld,df->blf", (16, 64, 256), (256, 1024), 3),
    ("blf,fd->bld", (16, 64, 1024), (1024, 256), 2),
    ("blv,dv->bld", (16, 64, 1024), (256, 1024), 1),
    ("blv,bld->dv", (16, 64, 1024), (16, 64, 256), 1),
    ("bld,fd->blf", (16, 64, 256), (1024, 256), 2),
    ("bld,blf->fd", (16, 64, 256), (16, 64, 1024), 2),
    ("blf,df->bld", (16, 64, 1024), (256, 1024), 2),
    ("blf,bld->df", (16, 64, 1024), (16, 64, 256), 2),
    ("bld,hkd->blhk", (16, 64, 256), (4, 64, 256), 2),
    ("bld,blhk->hkd", (16, 64, 256), (16, 64, 4, 64), 2),
    ("blhk,bhlm->bmhk", (16, 64, 4, 64), (16, 4, 64, 64), 2),
    ("bmhk,dhk->bmd", (16, 64, 4, 64), (256, 4, 64), 4),
    ("bmhk,bmd->dhk", (16, 64, 4, 64), (16, 64, 256), 4),
    ("bhlm,blhk->bmhk", (16, 4, 64, 64), (16, 64, 4, 64), 2),
    ("blhk,dhk->bld", (16, 64, 4, 64), (256, 4, 64), 2),
    ("blhk,bld->dhk", (16, 64, 4, 64), (16, 64, 256), 2),
]
IMPLEMENTATIONS = {"tf.einsum": tf.einsum, "cpu_contraction": cpu_contraction.einsum}
SLICINGS = {"data-parallel 8 (8 slices of batch 2)": (2, 8), "one device (batch 16)": (16, 1)}


def _with_batch(equation: str, shapes, batch: int) -> list:
  inputs = equation.split("->")[0].split(",")
  return [[batch if letter == "b" else n for letter, n in zip(letters, shape)]
          for letters, shape in zip(inputs, shapes)]


def build_runs(session_graph, batch: int, copies: int, einsum) -> list:
  """Per EINSUMS entry, the tensors computing it `copies` times (from variables: nothing folds)."""
  rng = np.random.RandomState(0)
  runs = []
  with session_graph.as_default():
    for equation, x_shape, y_shape, _ in EINSUMS:
      outs = []
      for _ in range(copies):
        x, y = [tf.Variable(rng.uniform(-1, 1, s).astype(np.float32))
                for s in _with_batch(equation, [x_shape, y_shape], batch)]
        # Fetch a reduction: a fetched group of ops would let TF prune the unread products.
        outs.append(tf.reduce_sum(einsum(equation, x.read_value(), y.read_value())))
      runs.append(outs)
  return runs


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=15)
  args = parser.parse_args(argv)
  tf.disable_v2_behavior()
  graph = tf.Graph()
  runs = {(s, i): build_runs(graph, *SLICINGS[s], IMPLEMENTATIONS[i])
          for s in SLICINGS for i in IMPLEMENTATIONS}
  config = tf.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
  times = {key: [[] for _ in EINSUMS] for key in runs}
  with tf.Session(graph=graph, config=config) as sess:
    sess.run(tf.variables_initializer(graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES)))
    for rep in range(args.reps + 2):  # two warm-up runs
      for key, per_einsum in runs.items():
        for k, outs in enumerate(per_einsum):
          start = time.perf_counter()
          sess.run(outs)
          if rep >= 2:
            times[key][k].append(time.perf_counter() - start)
  print(f"ms per step's worth of each einsum (median of {args.reps}), one thread; TF's matmuls: "
        f"{'Eigen' if cpu_contraction.blocks_help() else 'oneDNN'} (CPU meshes use column blocks "
        f"with Eigen only; TF_ENABLE_ONEDNN_OPTS switches)\n")
  header = [f"{s}: {i}" for s in SLICINGS for i in IMPLEMENTATIONS]
  print("| einsum | per step | " + " | ".join(header) + " |")
  print("|---|---|" + "---|" * len(header))
  medians = {key: [statistics.median(t) * 1e3 for t in per] for key, per in times.items()}
  for k, (equation, _, _, count) in enumerate(EINSUMS):
    print(f"| {equation} | {count} | " + " | ".join(f"{medians[key][k]:.2f}" for key in runs) + " |")
  print("| weighted total | | " + " | ".join(
      f"{sum(m * e[3] for m, e in zip(medians[key], EINSUMS)):.1f}" for key in runs) + " |")


if __name__ == "__main__":
  main()
