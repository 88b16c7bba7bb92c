"""Session settings: bench_transformer.py under TF's defaults, one thread per kernel, lean or no grappler.

TF fixes a process's CPU thread pools when its first session starts, so settings cannot be
compared within one process: this script runs bench_transformer.py alternately in fresh
processes, `--rounds` times per setting, and reports every case's median step, lowering and
first step under each setting, the step as a ratio to plain TF on one device *under TF's
defaults* (what a plain-TF user gets). One thread per kernel and lean grappler are what
`session_config_for_devices` picks for 8 virtual devices on 2 cores (mtf.placement_mesh_impl;
the Transformer driver uses it).

    python benchmarks/bench_session_config.py [--rounds 3] [--settings "TF defaults,..."]
                                              [-- bench_transformer.py flags]
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

SETTINGS = {  # name -> bench_transformer.py flags
    "TF defaults": [],
    "1 thread per kernel": ["--intra_op_threads", "1"],
    "no grappler": ["--no_graph_optimizer"],
    "1 thread per kernel and no grappler": ["--intra_op_threads", "1", "--no_graph_optimizer"],
    "1 thread per kernel and lean grappler": ["--intra_op_threads", "1", "--lean_graph_optimizer"],
}
REFERENCE = "plain TF, one device (float32)"


def run_bench(flags: list) -> dict:
  """One bench_transformer.py process: case name -> its results."""
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_transformer.py")
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "results.json")
    subprocess.run([sys.executable, script, "--json", out] + flags, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
      return {case["name"]: case for case in json.load(f)}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--settings", default=",".join(SETTINGS),
                      help="comma-separated names of SETTINGS (the reference needs 'TF defaults')")
  parser.add_argument("flags", nargs="*", help="bench_transformer.py flags (after --)")
  args = parser.parse_args(argv)
  settings = {name: SETTINGS[name] for name in args.settings.split(",")}
  flags = args.flags or ["--reps", "3", "--steps", "3", "--warmup", "1"]
  results = collections.defaultdict(list)  # (setting, case) -> its results, one per round
  for _ in range(args.rounds):
    for setting, setting_flags in settings.items():
      for name, case in run_bench(setting_flags + flags).items():
        results[setting, name].append(case)

  def median(setting, name, key):
    return statistics.median(case[key] for case in results[setting, name])

  reference = median("TF defaults", REFERENCE, "step_ms")
  names = list(dict.fromkeys(name for _, name in results))
  print(f"{args.rounds} rounds of `bench_transformer.py {' '.join(flags)}`; medians; ratio: step "
        f"time to plain TF one device under TF's defaults ({reference:.1f} ms)\n")
  print("| case | setting | step ms | ratio | lowering s | first step s |")
  print("|---|---|---|---|---|---|")
  for name in names:
    for setting in settings:
      ms = median(setting, name, "step_ms")
      print(f"| {name} | {setting} | {ms:.1f} | {ms / reference:.2f}x | "
            f"{median(setting, name, 'lowering_s'):.2f} | {median(setting, name, 'first_step_s'):.2f} |")

if __name__ == "__main__":
  main()
