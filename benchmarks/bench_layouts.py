"""Layout search and cost model against measurement: the benchmark Transformer on 8 virtual CPUs.

For the model of benchmarks/_transformer_model.py (2 layers, d_model 256, d_ff 1024, 4 heads,
length 64, batch 16, vocab 1024, SGD, graph mode): calibrates a time model on the devices
(`mtf.cost_model.calibrate`), searches a mesh shape and layout for 8 devices
(`auto_mtf.layout_and_mesh_shape`, timed), predicts the step time of the searched layout and of
hand-written ones, then measures all of them interleaved (`--reps` rounds of `--steps` steps,
medians). Reports the Spearman rank correlation of predicted and measured times and the
searched layout's measured time against the best hand layout's.

    python benchmarks/bench_layouts.py [--reps 5] [--steps 5] [--backend placement|collective]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import numpy as np
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mesh_tensorflow as mtf  # noqa: E402
from benchmarks import _transformer_model as model  # noqa: E402
from benchmarks import bench_transformer  # noqa: E402

NUM_DEVICES = 8
# name -> (mesh shape, layout rules)
HAND_LAYOUTS = {
    "data-parallel": ("all:8", "batch:all"),
    "model-parallel": ("all:8", "d_ff:all;vocab:all;d_kv:all"),
    "2x4 batch x model": ("b:2;m:4", "batch:b;d_ff:m;heads:m;vocab:m"),
    "4x2 batch x model": ("b:4;m:2", "batch:b;d_ff:m;heads:m;vocab:m"),
    "2x4 sequence split": ("b:2;m:4", "batch:b;length:m"),
    "8 sequence split": ("all:8", "length:all"),
}


def mtf_graph(cfg):
  """(mtf Graph, loss) of the benchmark training step, for the cost model and the search."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  with tf.Graph().as_default():
    inputs, targets = model.batch_of_tokens(cfg, 0)
    loss, _ = model.mtf_train_step(cfg, mesh, tf.constant(inputs), tf.constant(targets),
                                   model.initial_values(cfg))
  return graph, loss


def spearman(a, b) -> float:
  """Spearman rank correlation (no ties expected in timings)."""
  ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
  return float(np.corrcoef(ra, rb)[0, 1])


def main(argv: Optional[list] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--steps", type=int, default=5, help="steps per timed repetition")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--backend", default="placement", choices=["placement", "collective"])
  args = parser.parse_args(argv)
  tf.disable_v2_behavior()
  cfg = model.Config()
  devices = [f"/cpu:{i}" for i in range(NUM_DEVICES)]
  config = tf.ConfigProto(device_count={"CPU": NUM_DEVICES})
  start = time.perf_counter()
  time_model = mtf.cost_model.calibrate(devices, session_config=config)
  print(f"calibration: {time.perf_counter() - start:.1f} s -> {time_model}")
  graph, loss = mtf_graph(cfg)
  start = time.perf_counter()
  rules, mesh_shape = mtf.auto_mtf.layout_and_mesh_shape(graph, NUM_DEVICES, [loss], time_model=time_model)
  search_s = time.perf_counter() - start
  searched_mesh = ";".join(f"{d.name}:{d.size}" for d in mesh_shape.dims)
  searched_rules = ";".join(f"{d}:{m}" for d, m in sorted(rules._pairs))
  print(f"search: {search_s:.1f} s -> mesh {searched_mesh}, layout {searched_rules}")
  layouts = dict(HAND_LAYOUTS, searched=(searched_mesh, searched_rules))
  predicted = {name: mtf.cost_model.estimate_cost(graph, m, r, [loss], time_model).step_s
               for name, (m, r) in layouts.items()}
  cases = [bench_transformer.build_mtf(cfg, name, m, r, args.backend, NUM_DEVICES)
           for name, (m, r) in layouts.items()]
  bench_transformer.run_interleaved(cases, args.reps, args.steps, args.warmup)
  measured = {c.name: c.median_step_s for c in cases}
  print("\n| layout | mesh | rules | predicted ms | measured ms (median) |")
  print("|---|---|---|---|---|")
  for name, (m, r) in layouts.items():
    print(f"| {name} | {m} | {r} | {predicted[name] * 1e3:.1f} | {measured[name] * 1e3:.1f} |")
  names = list(layouts)
  rho = spearman([predicted[n] for n in names], [measured[n] for n in names])
  best_hand = min(HAND_LAYOUTS, key=lambda n: measured[n])
  ratio = measured["searched"] / measured[best_hand]
  print(f"\nSpearman rank correlation (predicted vs measured, {len(names)} layouts): {rho:.2f}")
  print(f"searched / best hand layout ({best_hand}) measured step time: {ratio:.2f} (goal <= 1.10)")
  print(f"search time: {search_s:.1f} s (goal < 10 s)")


if __name__ == "__main__":
  main()
