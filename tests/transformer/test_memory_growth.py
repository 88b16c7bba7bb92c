"""Long runs: a 400-step run's resident memory does not grow with the steps."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.transformer import tiny_run

pytestmark = pytest.mark.slow  # trains 400 steps in a process of its own

STEPS = 400
STEPS_BINDINGS = tiny_run.TWO_DEVICES + [f"utils.run.train_steps = {STEPS}",
                                         "utils.run.save_checkpoints_steps = 50"]


def rss_mb(pid: int) -> float:
  with open(f"/proc/{pid}/status") as f:
    return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def test_rss_grows_less_than_50_mb_from_a_quarter_of_a_400_step_run_to_its_end(tmp_path, corpus):
  process = subprocess.Popen(tiny_run.main_command(str(tmp_path / "model"), corpus, STEPS_BINDINGS),
                             cwd=tiny_run.ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  samples = {}
  for line in process.stdout:
    match = re.match(rf"step (\d+)/{STEPS} ", line)
    if match and int(match.group(1)) >= STEPS // 4:
      samples[int(match.group(1))] = rss_mb(process.pid)
  assert process.wait(timeout=300) == 0
  quarter, end = samples[STEPS // 4], samples[STEPS]
  print(f"RSS at step {STEPS // 4}: {quarter:.1f} MB, at step {STEPS}: {end:.1f} MB, "
        f"most in between: {max(samples.values()):.1f} MB")
  assert max(samples.values()) - quarter < 50, samples
