"""Crash safety of `python -m mesh_tensorflow.transformer.main` (subprocesses killed with SIGKILL)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

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


def final_weights(model_dir) -> dict:
  reader = tf.train.load_checkpoint(checkpoints.latest_checkpoint(str(model_dir)))
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def training_pid(model_dir) -> int:
  """The pid of the run holding model_dir's lock (0 while none does)."""
  match = re.match(r"pid (\d+) ", (model_dir / ".lock").read_text() if (model_dir / ".lock").exists() else "")
  return int(match.group(1)) if match else 0


def test_max_restarts_restarts_a_killed_run_by_itself_and_it_ends_with_the_uninterrupted_variables(
    tmp_path, corpus):
  tiny_run.configure_gin(corpus, STEPS)
  tiny_run.run(tmp_path / "reference", "train")
  model_dir = tmp_path / "supervised"
  command = tiny_run.main_command(str(model_dir), corpus, STEPS) + ["--max_restarts=2"]
  supervisor = subprocess.Popen(command, cwd=tiny_run.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
  deadline = time.time() + 300
  while latest_step(model_dir) < 10 and supervisor.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  os.kill(training_pid(model_dir), signal.SIGKILL)  # the child training, not the supervisor
  out = supervisor.communicate(timeout=300)[0]
  assert supervisor.returncode == 0, out[-3000:]
  [restart] = [line for line in out.splitlines() if line.startswith("[launch]") and "restart" in line]
  print(restart)
  assert re.fullmatch(r"\[launch\] task 0 was killed by signal 9 at step \d+; restart 1 of 2 from "
                      r"model\.ckpt-\d+", restart)
  assert "[0] step 30/30" in out
  got, expected = final_weights(model_dir), final_weights(tmp_path / "reference")
  assert got.keys() == expected.keys() and got["global_step"] == 30
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)
