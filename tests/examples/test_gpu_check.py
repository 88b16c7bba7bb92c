"""benchmarks/gpu_check.sh --dry: the GPU check runs on virtual CPUs and prints its one table."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ("| case | logical devices | XLA | step ms (median) | best ms | ratio to plain TF, XLA off "
          "| first loss |")
CASES = [("plain TF", "1", "off"), ("mtf placement", "1", "off"), ("plain TF", "1", "on"),
         ("mtf placement", "1", "on"), ("mtf placement, data-parallel", "2", "off"),
         ("mtf collective, data-parallel", "2", "off"), ("mtf placement, data-parallel", "4", "off"),
         ("mtf collective, data-parallel", "4", "off")]


def test_dry_run_prints_every_case_with_the_same_first_loss():
  result = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry"], cwd=ROOT, capture_output=True,
                          text=True, timeout=100, env={**os.environ, "PYTHON": sys.executable})
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert HEADER in lines, result.stdout
  rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[lines.index(HEADER) + 2:]]
  assert [tuple(row[:3]) for row in rows] == CASES
  assert rows[0][5] == "1.00x"  # the reference row
  first_losses = {row[6] for row in rows}
  assert len(first_losses) == 1, f"the cases start from different losses: {rows}"
  assert 3.0 < float(first_losses.pop()) < 6.0  # about ln(64): the tiny model's vocabulary
