"""What the driver's per-batch id check (transformer/_train/id_checks.py) costs, as a ratio of step time.

The benchmark Transformer (benchmarks/_transformer_model.py: 2 layers, d_model 256, batch 16,
length 64, vocabulary 1024, SGD) trains on one CPU device from a tf.data pipeline of token
batches, once with the driver's IdCheck on the batches and once without, in the same process,
the two interleaved (in alternating order). Also timed: the input pipeline alone (reading a
batch), with and without the check, which isolates the check's own cost from a whole step's noise.

    python benchmarks/bench_id_check.py [--reps 6] [--steps 20] [--batches 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional

import numpy as np
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mesh_tensorflow as mtf  # noqa: E402
from mesh_tensorflow.transformer._train import id_checks  # noqa: E402

import _transformer_model as model  # noqa: E402

NUM_BATCHES = 64  # distinct batches the pipeline repeats


def _batches(cfg: model.Config) -> tf.data.Dataset:
  pairs = [model.batch_of_tokens(cfg, step) for step in range(NUM_BATCHES)]
  return tf.data.Dataset.from_tensor_slices({"inputs": np.stack([p[0] for p in pairs]),
                                             "targets": np.stack([p[1] for p in pairs])}).repeat()


def _pipeline(cfg: model.Config, checked: bool):
  """The next-batch tensors of the repeated batches, checked by the driver's IdCheck if `checked`."""
  dataset = _batches(cfg)
  if checked:
    check = id_checks.IdCheck({"inputs": cfg.vocab, "targets": cfg.vocab}, lambda bad: f"batch {bad.index}",
                              id_checks.BadIdPolicy())
    dataset = check.apply(dataset, "the benchmark's batches")
  return tf.data.make_one_shot_iterator(dataset.prefetch(2)).get_next()


class Case:
  """One graph: a training step (or, with step=False, only the read of a batch), checked or not."""

  def __init__(self, cfg: model.Config, checked: bool, step: bool):
    self.name = f"{'step' if step else 'read a batch'}, check {'on' if checked else 'off'}"
    self.times: list = []
    graph = tf.Graph()
    with graph.as_default():
      batch = _pipeline(cfg, checked)
      if step:
        mtf_graph = mtf.Graph()
        mesh = mtf.Mesh(mtf_graph, "mesh")
        loss, updates = model.mtf_train_step(cfg, mesh, batch["inputs"], batch["targets"],
                                             model.initial_values(cfg))
        lowering = mtf.Lowering(mtf_graph, {mesh: mtf.placement_mesh_impl.PlacementMeshImpl(
            "", "", ["/cpu:0"])})
        self.fetches = [lowering.export_to_tf_tensor(loss),
                        tf.group([lowering.lowered_operation(u) for u in updates])]
        init = [tf.global_variables_initializer(), lowering.copy_masters_to_slices()]
      else:
        self.fetches, init = batch, []
      self.session = tf.Session(graph=graph)
      self.session.run(init)
      self.session.run(self.fetches)  # the first run traces and allocates

  def time_runs(self, runs: int) -> None:
    start = time.perf_counter()
    for _ in range(runs):
      self.session.run(self.fetches)
    self.times.append((time.perf_counter() - start) / runs)

  @property
  def median_ms(self) -> float:
    return statistics.median(self.times) * 1e3


def main(argv: Optional[list] = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=6, help="interleaved measurements per case")
  parser.add_argument("--steps", type=int, default=20, help="training steps per measurement")
  parser.add_argument("--batches", type=int, default=2000, help="batches read per pipeline measurement")
  args = parser.parse_args(argv)
  cfg = model.Config()
  steps = [Case(cfg, checked, step=True) for checked in (False, True)]
  reads = [Case(cfg, checked, step=False) for checked in (False, True)]
  for rep in range(args.reps):
    order = 1 if rep % 2 else -1  # alternate which case runs first
    for case in steps[::order]:
      case.time_runs(args.steps)
    for case in reads[::order]:
      case.time_runs(args.batches)
  step_ms = steps[0].median_ms
  print("| case | median ms | / step with the check off |\n|---|---|---|")
  for case in steps + reads:
    print(f"| {case.name} | {case.median_ms:.3f} | {case.median_ms / step_ms:.4f} |")
  check_ms = reads[1].median_ms - reads[0].median_ms
  print(f"\nThe check's own cost per batch: {check_ms:.3f} ms = {check_ms / step_ms:.2%} of a step "
        f"({step_ms:.1f} ms); whole steps with it: {steps[1].median_ms / step_ms:.3f} of those without.")
  return {"step_ms": step_ms, "check_ms": check_ms, "step_ratio": steps[1].median_ms / step_ms}


if __name__ == "__main__":
  main()
