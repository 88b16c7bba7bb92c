"""GPT-Neo's own tests timed against this package and against the original it pins (issue #37).

GPT-Neo (EleutherAI/gpt-neo) pins mesh-tensorflow 0.1.18; its test_models.py has four tests
(test_model, test_sampling, test_mlm_sample_text, test_entmax), each building a new mtf graph
and lowering it eagerly. This script runs that file under pytest in a subprocess per side,
`--reps` times, alternating which side goes first, and prints a markdown table of each test's
median call time (pytest's `call` phase, wall and CPU) on both sides, their ratios, the four tests'
sum and the whole pytest process's wall time (which includes importing TensorFlow and mtf), and
the full garbage-collector passes that ran inside the tests' calls. Ours runs with
TensorFlow imported at start-up, as the original's import shim does (see side_env; --plain_ours
leaves that out).

No GPT-Neo code is here: `--gpt_neo_dir` is a checkout of it (its test_models.py and the modules
that imports). `--original_dir` is a folder the original is installed into, e.g.
`pip install --no-deps --target DIR mesh-tensorflow==0.1.18`; it runs with this repository's
import shim for TensorFlow 2.21 (tests/differential/shim/) on its path, as the differential tests
run the original 0.1.21. Each run checks that `mesh_tensorflow` came from the expected folder.

    python benchmarks/bench_gpt_neo_tests.py --gpt_neo_dir DIR --original_dir DIR [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "differential" / "shim"

# Runs pytest in the side's process and writes each test's call time and where mtf came from.
RUNNER = """
import gc, json, sys, time, pytest

class Record:
  def __init__(self):
    self.durations, self.outcomes, self.cpu = {}, {}, {}
    self.full_passes, self.full_pass_s, self._testing, self._start = 0, {}, None, 0.0
    gc.callbacks.append(self.on_collection)

  def on_collection(self, phase, info):
    if info["generation"] != 2 or self._testing is None:
      return
    if phase == "start":
      self._start = time.perf_counter()
    else:
      self.full_passes += 1
      self.full_pass_s[self._testing] += time.perf_counter() - self._start

  @pytest.hookimpl(wrapper=True)
  def pytest_runtest_call(self, item):
    self._testing, cpu = item.nodeid, time.process_time()
    self.full_pass_s[item.nodeid] = 0.0
    try:
      return (yield)
    finally:
      self._testing = None
      self.cpu[item.nodeid] = time.process_time() - cpu

  def pytest_runtest_logreport(self, report):
    if report.when == "call":
      self.durations[report.nodeid] = report.duration
      self.outcomes[report.nodeid] = report.outcome

record = Record()
code = pytest.main(["-q", "-p", "no:cacheprovider", "-W", "ignore", sys.argv[2]], plugins=[record])
import mesh_tensorflow
with open(sys.argv[1], "w") as f:
  json.dump({"code": int(code), "durations": record.durations, "cpu": record.cpu,
             "outcomes": record.outcomes,
             "mtf_file": mesh_tensorflow.__file__, "full_passes": record.full_passes,
             "full_pass_s": record.full_pass_s}, f)
"""


def side_env(side: str, dirs: dict, preamble: Optional[pathlib.Path]) -> dict:
  """The environment of a side's process: only that side's mesh_tensorflow importable first.

  The original's shim imports TensorFlow at start-up (its sitecustomize); `preamble`, a folder
  whose sitecustomize does only that, gives ours the same import order. The order decides when
  Python's collector runs its full passes (0.3 to 0.4 s each over TF's half a million objects):
  without it, ours ran its last start-up pass before TF's import had finished, and reached the
  next one during the tests, a pass the original's run had made before its tests began.
  """
  if side == "original":
    path = [dirs["original"], SHIM]
  else:
    path = ([preamble] if preamble else []) + [dirs["ours"]]
  return dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in path),
              TF_CPP_MIN_LOG_LEVEL="2")


def run_side(side: str, gpt_neo_dir: pathlib.Path, dirs: dict, test_file: str,
             preamble: Optional[pathlib.Path]) -> dict:
  """Runs GPT-Neo's test file under `side` once; returns its durations and the process wall time."""
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "result.json"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", RUNNER, str(out), test_file], cwd=gpt_neo_dir,
                          env=side_env(side, dirs, preamble), capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    if not out.exists():
      raise RuntimeError(f"the {side} run wrote no result:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
  expected = dirs[side]
  if not pathlib.Path(result["mtf_file"]).resolve().is_relative_to(expected.resolve()):
    raise RuntimeError(f"the {side} run imported mesh_tensorflow from {result['mtf_file']}, "
                       f"not from {expected}")
  failed = [name for name, outcome in result["outcomes"].items() if outcome != "passed"]
  if failed or result["code"] != 0:
    print(f"warning: under the {side} package, not passed: {failed or result['code']}\n"
          f"{done.stdout[-3000:]}", file=sys.stderr)
  result["wall"] = wall
  return result


def table(runs: dict) -> str:
  """The markdown table of medians over the repetitions, ours against the original.

  The last column leaves out the collector's full passes, which land in whichever test's call
  happens to cross the threshold (0.2 to 0.4 s each over TF's objects).
  """
  names = list(runs["ours"][0]["durations"])
  lines = ["| test | ours median s | original median s | ours / original | CPU s: ours | "
           "CPU s: original | CPU: ours / original | without full collector passes: ours / original |",
           "|---|---|---|---|---|---|---|---|"]

  def medians(measure) -> list:
    return [statistics.median(measure(r) for r in runs[side]) for side in ("ours", "original")]

  def row(label: str, wall, cpu=None, collected=None):
    (a, b), cells = medians(wall), ""
    if cpu is not None:
      c, d = medians(cpu)
      e, f = medians(lambda r: wall(r) - collected(r))
      cells = f" {c:.3f} | {d:.3f} | {c / d:.2f}x | {e / f:.2f}x"
    lines.append(f"| {label} | {a:.3f} | {b:.3f} | {a / b:.2f}x |{cells or '  |  | |'} |")

  for name in names:
    row(name.split("::")[-1], lambda r, n=name: r["durations"][n], lambda r, n=name: r["cpu"][n],
        lambda r, n=name: r["full_pass_s"][n])
  row("sum of the four", lambda r: sum(r["durations"].values()), lambda r: sum(r["cpu"].values()),
      lambda r: sum(r["full_pass_s"].values()))
  row("pytest process wall", lambda r: r["wall"])
  passes = {side: (sum(r["full_passes"] for r in rs), sum(sum(r["full_pass_s"].values()) for r in rs))
            for side, rs in runs.items()}
  lines.append("")
  lines.append("Full garbage-collector passes inside the tests' calls, all runs: " + "; ".join(
      f"{side} {n} ({t:.2f} s)" for side, (n, t) in passes.items()))
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gpt_neo_dir", type=pathlib.Path, required=True,
                      help="a GPT-Neo checkout (holding test_models.py)")
  parser.add_argument("--original_dir", type=pathlib.Path, required=True,
                      help="a folder the original mesh_tensorflow is installed into (pip --target)")
  parser.add_argument("--reps", type=int, default=5, help="runs of the test file per side")
  parser.add_argument("--ours_dir", type=pathlib.Path, default=ROOT,
                      help="the folder holding the mesh_tensorflow run as ours (default: this "
                           "repository), e.g. an earlier commit's `git archive` for a before/after")
  parser.add_argument("--test_file", default="test_models.py")
  parser.add_argument("--plain_ours", action="store_true",
                      help="run ours without importing TensorFlow at start-up as the shim does")
  args = parser.parse_args()
  print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  print("ours: " + ("plain" if args.plain_ours else "TensorFlow imported at start-up, as the "
                    "original's shim does"))
  runs = {"ours": [], "original": []}
  dirs = {"ours": args.ours_dir, "original": args.original_dir}
  with tempfile.TemporaryDirectory() as tmp:
    preamble = None
    if not args.plain_ours:
      preamble = pathlib.Path(tmp)
      (preamble / "sitecustomize.py").write_text("import tensorflow  # noqa: F401\n")
    for rep in range(args.reps):
      order = ("ours", "original") if rep % 2 == 0 else ("original", "ours")
      for side in order:
        runs[side].append(run_side(side, args.gpt_neo_dir, dirs, args.test_file, preamble))
      print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
          f"{side} {sum(runs[side][-1]['durations'].values()):.2f} s" for side in order),
            flush=True)
  print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  print(f"ours from {runs['ours'][0]['mtf_file']}; original from {runs['original'][0]['mtf_file']}")
  print()
  print(table(runs))


if __name__ == "__main__":
  main()
