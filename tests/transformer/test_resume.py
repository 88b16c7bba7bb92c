"""Crash safety of `python -m mesh_tensorflow.transformer.main` (subprocesses killed with SIGKILL)."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import time

import numpy as np
import pytest

from mesh_tensorflow.transformer._train import checkpoints, progress
from tests.transformer import tiny_run

pytestmark = pytest.mark.slow  # kills and resumes training processes

# With dropout on: a resumed run must also draw the masks an uninterrupted run would have.
STEPS = tiny_run.TWO_DEVICES + ["utils.run.train_steps = 30", "utils.run.save_checkpoints_steps = 5",
                                "dropout_rate = 0.1"]


def latest_step(model_dir) -> int:
  latest = checkpoints.latest_checkpoint(str(model_dir))
  return checkpoints.get_step_from_checkpoint_path(latest) if latest else 0


def kill_after_checkpoint(model_dir, corpus, step: int) -> int:
  """Starts a run, SIGKILLs it once its latest checkpoint is at `step`; returns its exit status."""
  process = subprocess.Popen(tiny_run.main_command(str(model_dir), corpus, STEPS), cwd=tiny_run.ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while latest_step(model_dir) < step and process.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  process.send_signal(signal.SIGKILL)
  return process.wait()


def test_killed_runs_resume_at_the_checkpointed_step_with_the_losses_of_an_uninterrupted_run(
    tmp_path, corpus):
  # The uninterrupted run trains in this process: only the interrupted one needs a process to kill.
  tiny_run.configure_gin(corpus, STEPS)
  tiny_run.run(tmp_path / "reference", "train")
  expected = dict(progress.read_scalars(str(tmp_path / "reference"), "loss"))
  assert sorted(expected) == list(range(1, 31))

  model_dir = tmp_path / "interrupted"
  assert kill_after_checkpoint(model_dir, corpus, 10) == -signal.SIGKILL  # kill -9 mid-training
  resumed_at = latest_step(model_dir)
  assert 10 <= resumed_at < 30
  saved = shlex.split((model_dir / "command").read_text())
  assert saved == tiny_run.main_command(str(model_dir), corpus, STEPS)  # every flag, pasteable
  finished = subprocess.run(saved, cwd=tiny_run.ROOT, capture_output=True, text=True, timeout=300)
  assert finished.returncode == 0, finished.stderr[-3000:]
  # The default output is the driver's own: no TensorFlow start-up or info lines, no warnings.
  assert not re.search(r"oneDNN|cpu_feature_guard|^[IWE]\d{4} |WARNING:tensorflow", finished.stderr, re.M), \
      finished.stderr[-3000:]
  assert f"Resuming from {model_dir}/model.ckpt-{resumed_at} at step {resumed_at}." in finished.stdout
  assert re.search(r"^step 30/30  loss [\d.]+  lr ", finished.stdout, re.M)
  assert (model_dir / "command.1").exists()  # one command file per run

  losses = dict(progress.read_scalars(str(model_dir), "loss"))  # the last write of each step wins
  assert sorted(losses) == list(range(1, 31))
  after = range(resumed_at + 1, 31)
  np.testing.assert_allclose([losses[s] for s in after], [expected[s] for s in after], rtol=1e-6)
