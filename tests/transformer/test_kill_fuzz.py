"""Crash consistency: a run SIGKILLed at 12 moments, half of them inside a checkpoint save, and
restarted each time, ends with the variables and per-step losses of an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer._train import checkpoints, progress
from tests.transformer import tiny_run

pytestmark = pytest.mark.slow  # 13 training processes

STEPS = tiny_run.TWO_DEVICES + ["utils.run.train_steps = 100", "utils.run.save_checkpoints_steps = 1",
                                "dropout_rate = 0.1"]
KILLS = 12


def latest_step(model_dir: str) -> int:
  latest = checkpoints.latest_checkpoint(model_dir)
  return checkpoints.get_step_from_checkpoint_path(latest) if latest else 0


def saving(model_dir: str) -> bool:
  """Whether a save is under way: its temporary files (checkpoint or state file) exist."""
  return any(name.startswith(".tmp-") for name in os.listdir(model_dir))


def kill_once(model_dir: str, corpus: str, during_save: bool, delay: float, log=subprocess.DEVNULL) -> bool:
  """Starts a run and SIGKILLs it once it trained a step past where it started: at once when a
  save's temporary files appear (during_save), else after `delay` s. Returns whether it was saving
  (its temporary files are left)."""
  start = latest_step(model_dir)
  process = subprocess.Popen(tiny_run.main_command(model_dir, corpus, STEPS), cwd=tiny_run.ROOT,
                             stdout=subprocess.DEVNULL, stderr=log)
  deadline = time.time() + 300
  while latest_step(model_dir) <= start and process.poll() is None and time.time() < deadline:
    time.sleep(0.005)
  if during_save:
    while not saving(model_dir) and process.poll() is None and time.time() < deadline:
      pass  # a save lasts milliseconds: poll without sleeping
  else:
    time.sleep(delay)
  process.send_signal(signal.SIGKILL)
  assert process.wait() == -signal.SIGKILL, "the run ended before the kill"
  return saving(model_dir)


def weights(model_dir: str) -> dict:
  reader = tf.train.load_checkpoint(checkpoints.latest_checkpoint(model_dir))
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def test_twelve_kills_half_during_saves_each_restarted_end_as_an_uninterrupted_run(tmp_path, corpus):
  tiny_run.configure_gin(corpus, STEPS)
  tiny_run.run(tmp_path / "reference", "train")
  model_dir = str(tmp_path / "killed")
  os.makedirs(model_dir)
  moments = random.Random(0)
  with open(tmp_path / "killed_runs.log", "w") as log:
    try:
      landed_in_saves = sum(kill_once(model_dir, corpus, i % 2 == 0, moments.uniform(0, 0.03), log)
                            for i in range(KILLS))
    finally:
      log.flush()
      print((tmp_path / "killed_runs.log").read_text()[-3000:])
  killed_at = latest_step(model_dir)
  finished = subprocess.run(tiny_run.main_command(model_dir, corpus, STEPS), cwd=tiny_run.ROOT,
                            capture_output=True, text=True, timeout=300)
  assert finished.returncode == 0, finished.stderr[-3000:]
  print(f"{KILLS} kills, {landed_in_saves} inside a save; the last at step {killed_at}")
  assert landed_in_saves >= 3 and killed_at < 100
  expected, got = weights(str(tmp_path / "reference")), weights(model_dir)
  assert got.keys() == expected.keys() and got["global_step"] == 100
  for name, value in expected.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  reference_losses = dict(progress.read_scalars(str(tmp_path / "reference"), "loss"))
  assert dict(progress.read_scalars(model_dir, "loss")) == reference_losses  # the last write of each step
