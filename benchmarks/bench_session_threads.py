"""Threads per kernel: bench_transformer.py with TF's default and with one thread per kernel.

TF fixes a process's CPU thread pools when its first session starts, so the two settings cannot
be compared within one process: this script runs bench_transformer.py alternately in fresh
processes, `--rounds` times each, and reports every case's median step under each setting as a
ratio to plain TF on one device *at TF's default* (its best: one device gains nothing from fewer
threads per kernel). One thread per kernel is what `session_config_for_devices` picks for 8
virtual devices on 2 cores (mtf.placement_mesh_impl; the Transformer driver uses it).

    python benchmarks/bench_session_threads.py [--rounds 3] [-- bench_transformer.py flags]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile

SETTINGS = {"TF default": 0, "1 per kernel": 1}
REFERENCE = "plain TF, one device (float32)"


def run_bench(intra_op_threads: int, flags: list) -> dict:
  """One bench_transformer.py process: case name -> its results."""
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_transformer.py")
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "results.json")
    subprocess.run([sys.executable, script, "--intra_op_threads", str(intra_op_threads), "--json", out]
                   + flags, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
      return {case["name"]: case for case in json.load(f)}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("flags", nargs="*", help="bench_transformer.py flags (after --)")
  args = parser.parse_args(argv)
  flags = args.flags or ["--reps", "3", "--steps", "3", "--warmup", "1"]
  steps = collections.defaultdict(list)  # (setting, case) -> step ms per round
  for _ in range(args.rounds):
    for setting, threads in SETTINGS.items():
      for name, case in run_bench(threads, flags).items():
        steps[setting, name].append(case["step_ms"])
  reference = statistics.median(steps["TF default", REFERENCE])
  names = list(dict.fromkeys(name for _, name in steps))
  print(f"{args.rounds} rounds of `bench_transformer.py {' '.join(flags)}`; medians; ratio to plain TF "
        f"one device at TF's default ({reference:.1f} ms)\n")
  print("| case | " + " | ".join(f"{s}: step ms | {s}: ratio" for s in SETTINGS) + " |")
  print("|---|" + "---|---|" * len(SETTINGS))
  for name in names:
    cells = []
    for setting in SETTINGS:
      ms = statistics.median(steps[setting, name])
      cells += [f"{ms:.1f}", f"{ms / reference:.2f}x"]
    print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
