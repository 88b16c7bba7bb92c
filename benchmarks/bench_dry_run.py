"""Dry-run time and memory against the processor count, for a 100B-parameter Transformer.

Builds the training step (loss, gradients, the gin optimizer's updates) of a decoder-only
Transformer of 64 layers, d_model 12288, d_ff 49152, 96 heads of 128, vocabulary 32768, batch
1024 x length 2048 (116B parameters: 64 x (4 d_model^2 + 2 d_model d_ff) plus the embeddings)
once, then lowers it shape-only (`mtf.dry_run`) on meshes "batch:P/m;model:m" (m = min(P, 32))
under "batch:batch;d_ff:model;heads:model;vocab:model" for P = 1, 2, 4, ..., 4096. Prints, per P,
the wall and CPU seconds of the dry run, its events and bytes sent per processor, and the
process's peak resident memory so far (getrusage; it includes TensorFlow itself and the mtf
graph). Smaller models: --num_layers, --d_model.

    python benchmarks/bench_dry_run.py [--num_layers 64] [--d_model 12288] [--max_processors 4096]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Optional

import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mesh_tensorflow as mtf  # noqa: E402
from mesh_tensorflow._explain.transformer_graph import build_transformer_graph  # noqa: E402

LAYOUT = "batch:batch;d_ff:model;heads:model;vocab:model"


def _peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # Linux: KiB


def _timed(fn):
  wall, cpu = time.perf_counter(), time.process_time()
  result = fn()
  return result, time.perf_counter() - wall, time.process_time() - cpu


def main(argv: Optional[list] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num_layers", type=int, default=64)
  parser.add_argument("--d_model", type=int, default=12288)
  parser.add_argument("--batch", type=int, default=1024)
  parser.add_argument("--length", type=int, default=2048)
  parser.add_argument("--max_processors", type=int, default=4096)
  args = parser.parse_args(argv)
  tf.disable_v2_behavior()
  d = args.d_model
  bindings = [f"num_layers = {args.num_layers}", f"d_model = {d}", f"d_ff = {4 * d}",
              f"num_heads = {d // 128}", "d_kv = 128",
              f"transformer.Unitransformer.max_length = {args.length}"]
  (graph, _), wall, cpu = _timed(lambda: build_transformer_graph(
      ["models/lm_base.gin"], bindings, args.batch, args.length, vocab_size=32768))
  params = sum(v.shape.size for v in graph.trainable_variables)
  print(f"model: {args.num_layers} layers, d_model {d}, {params / 1e9:.1f}B parameters, "
        f"{len(graph.operations)} mtf ops; graph built in {wall:.1f} s ({cpu:.1f} s CPU), "
        f"peak RSS {_peak_rss_gb():.2f} GB")
  print("\n| processors | mesh | dry run s (wall) | dry run s (CPU) | events | "
        "bytes sent per processor | peak RSS GB |")
  print("|---|---|---|---|---|---|---|")
  p = 1
  while p <= args.max_processors:
    m = min(p, 32)
    mesh = f"batch:{p // m};model:{m}"
    result, wall, cpu = _timed(lambda mesh=mesh: mtf.dry_run(graph, mesh, LAYOUT))
    print(f"| {p} | {mesh} | {wall:.1f} | {cpu:.1f} | {len(result.events)} | "
          f"{result.bytes_sent_per_processor:,.0f} | {_peak_rss_gb():.2f} |", flush=True)
    p *= 2


if __name__ == "__main__":
  main()
