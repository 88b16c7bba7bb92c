"""Dropout-heavy Transformer step: how mtf draws random numbers, against plain TF's dropout.

The benchmark Transformer (benchmarks/_transformer_model.py) with dropout 0.1 after the attention
weights, the ReLU and both block outputs, on one device, data-parallel 8 and 2x4 (8 virtual CPUs,
graph mode). Each mtf layout is built three ways:

* "layout-independent, XLA": the package's draw (each element a hash of its global index; the
  integer part compiled by XLA);
* "layout-independent, TF ops": the same values from plain TF integer ops (what loops built with
  tf.compat.v1 control flow use);
* "per-slice stateless": each processor's slice drawn by tf.random.stateless_uniform seeded with
  the slice number, the draw mtf used before layout-independent draws (values differ per layout).

Plain TF's steps (tf.nn.dropout, stateful) with and without dropout are the reference. Step times
are medians of interleaved rounds, as ratios to plain TF with dropout on one device.

    python benchmarks/bench_random.py [--reps 5] [--steps 10] [--layouts one,dp8,2x4]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from unittest import mock

import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import _transformer_model as model  # noqa: E402
from benchmarks import bench_transformer as bench  # noqa: E402
from mesh_tensorflow._lowering import random_bits  # noqa: E402
from mesh_tensorflow._lowering.mesh_impl import MeshImpl  # noqa: E402

LAYOUTS = {"one": ("one device", "all:1", ""),
           "dp8": ("data-parallel 8", "all:8", "batch:all"),
           "2x4": ("2x4", "b:2;m:4", "batch:b;d_ff:m;heads:m;vocab:m")}


def _per_slice_stateless(self, shape, tf_fn, kwargs, key=None):
  """The draw before layout-independent values: a stateless draw per slice, seeded by its number."""
  assert random_bits.kind_of(tf_fn) == "uniform", "the benchmark model draws uniforms only"
  slice_shape = self.slice_shape(shape)

  def draw(slice_num):
    seed = tf.stack([tf.bitcast(key, tf.int64), tf.cast(slice_num, tf.int64)])
    return tf.random.stateless_uniform(slice_shape, seed=seed, **kwargs)
  return self.slicewise(draw, self.laid_out_slice_num(shape))


DRAWS = {
    "layout-independent, XLA": contextlib.nullcontext,
    "layout-independent, TF ops": lambda: mock.patch.object(random_bits, "_may_compile", lambda: False),
    "per-slice stateless": lambda: mock.patch.object(MeshImpl, "random", _per_slice_stateless),
}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--layouts", default="one,dp8,2x4")
  parser.add_argument("--dropout_rate", type=float, default=0.1)
  args = parser.parse_args(argv)
  tf.disable_v2_behavior()
  cfg = dataclasses.replace(model.Config(), dropout_rate=args.dropout_rate)
  reference = bench.build_plain_tf(cfg, 8)
  reference.name = f"plain TF, one device, dropout {args.dropout_rate}"
  cases = [reference, bench.build_plain_tf(model.Config(), 8)]
  cases[-1].name = "plain TF, one device, no dropout"
  for key in args.layouts.split(","):
    name, mesh_shape, layout = LAYOUTS[key]
    for draw, patch in DRAWS.items():
      with patch():
        cases.append(bench.build_mtf(cfg, f"{name}: {draw}", mesh_shape, layout, "placement", 8))
  bench.run_interleaved(cases, args.reps, args.steps, args.warmup)
  bench.print_step_table(cases, reference)


if __name__ == "__main__":
  main()
