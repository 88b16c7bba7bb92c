"""launch --max_restarts: a task SIGKILLed mid-run is restarted with the others and the run ends as
an uninterrupted one; a task that fails at start is not restarted."""

from __future__ import annotations

import io
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow.launch import Launch
from tests.multiprocess import launching, train_script

pytestmark = pytest.mark.slow  # launches clusters of TensorFlow processes

SCRIPT = os.path.join(launching.ROOT, "tests", "multiprocess", "restart_script.py")
STEPS = 6
KILL_AFTER = 3  # task 1 is killed once the chief's checkpoint of this many steps exists


def supervised(launch: Launch) -> dict:
  """Runs launch.supervise() in a thread (the test's thread injects faults); {"status": ...} at the end."""
  result = {}

  def run():
    with launching._tasks_environment():
      result["status"] = launch.supervise()
  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return result, thread


def final_variables(ckpt_dir: str) -> dict:
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(ckpt_dir))
  return {name: reader.get_tensor(name) for name in ("w1", "w2", "global_step")}


def test_a_task_killed_mid_run_is_restarted_and_the_run_ends_with_the_uninterrupted_variables(tmp_path):
  with tf.Graph().as_default():
    train_script.train(*train_script.LAYOUTS["2d"], STEPS, ckpt_dir=str(tmp_path / "reference"))
  ckpt_dir = str(tmp_path / "ckpt")
  out = io.StringIO()
  launch = Launch([sys.executable, SCRIPT, "--steps", str(STEPS), "--ckpt_dir", ckpt_dir], 2, 4,
                  launching.TIMEOUT, out=out, max_restarts=2, checkpoint_dir=ckpt_dir)
  result, thread = supervised(launch)
  deadline = time.monotonic() + 150
  while not (tf.train.latest_checkpoint(ckpt_dir) or "").endswith(f"model-{KILL_AFTER}"):
    assert time.monotonic() < deadline and thread.is_alive(), out.getvalue()[-4000:]
    time.sleep(0.02)
  victim = dict(launch.processes)[1]
  os.kill(victim.pid, signal.SIGKILL)
  thread.join(timeout=240)
  log = out.getvalue()
  assert result.get("status") == 0, log[-4000:]
  # the launcher's lines (a task's traceback names restart_script.py too)
  restarts = [line for line in log.splitlines() if line.startswith("[launch]") and "; restart " in line]
  print("\n".join(restarts))
  assert len(restarts) == 1, log[-4000:]
  assert restarts[0].startswith("[launch] task 1 was killed by signal 9 at step ")
  assert restarts[0].endswith(f"; restart 1 of 2 from model-{steps_from_line(restarts[0])}")
  got, expected = final_variables(ckpt_dir), final_variables(str(tmp_path / "reference"))
  assert got["global_step"] == expected["global_step"] == STEPS
  for name in ("w1", "w2"):
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def steps_from_line(line: str) -> int:
  """The checkpoint step a restart line names (model-N)."""
  return int(line.rsplit("model-", 1)[1])


def test_task_1_killed_at_twelve_moments_and_restarted_each_time_ends_as_an_uninterrupted_run(tmp_path):
  steps, kills = 40, 12
  with tf.Graph().as_default():
    train_script.train(*train_script.LAYOUTS["2d"], steps, ckpt_dir=str(tmp_path / "reference"))
  ckpt_dir = str(tmp_path / "ckpt")
  out = io.StringIO()
  launch = Launch([sys.executable, SCRIPT, "--steps", str(steps), "--ckpt_dir", ckpt_dir], 2, 4,
                  launching.TIMEOUT, out=out, max_restarts=kills, checkpoint_dir=ckpt_dir)
  result, thread = supervised(launch)
  moments, killed, deadline = random.Random(0), [], time.monotonic() + 400
  while len(killed) < kills:
    victim = dict(launch.processes).get(1)
    start = steps_done(ckpt_dir)
    while victim is None or victim in killed:  # the next attempt
      assert time.monotonic() < deadline and thread.is_alive(), out.getvalue()[-4000:]
      time.sleep(0.01)
      victim, start = dict(launch.processes).get(1), steps_done(ckpt_dir)
    while not (launch.progress.stepped and steps_done(ckpt_dir) > start):
      assert time.monotonic() < deadline and victim.poll() is None, out.getvalue()[-4000:]
      time.sleep(0.005)
    time.sleep(moments.uniform(0, 0.05))
    os.kill(victim.pid, signal.SIGKILL)
    killed.append(victim)
  thread.join(timeout=240)
  log = out.getvalue()
  assert result.get("status") == 0, log[-4000:]
  restarts = [line for line in log.splitlines() if "; restart " in line]
  print("\n".join(restarts))
  assert len(restarts) == kills and all("task 1 was killed by signal 9" in line for line in restarts)
  got, expected = final_variables(ckpt_dir), final_variables(str(tmp_path / "reference"))
  assert got["global_step"] == expected["global_step"] == steps
  for name in ("w1", "w2"):
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def steps_done(ckpt_dir: str) -> int:
  latest = tf.train.latest_checkpoint(ckpt_dir)
  return int(latest.rsplit("-", 1)[1]) if latest else 0


def test_a_task_failing_at_start_is_tried_once_and_its_message_shown():
  out = io.StringIO()
  launch = Launch([sys.executable, "-c", "import sys; sys.exit('cannot open the data')"], 2,
                  out=out, max_restarts=3)
  with launching._tasks_environment():
    status = launch.supervise()
  log = out.getvalue()
  assert status == 1
  # The first task to fail, then the give-up line (the other task may be stopped before it prints).
  assert log.count("cannot open the data") >= 2
  assert "restart 1" not in log
  assert "[launch] giving up: task " in log and "before any task finished a step" in log
  assert log.strip().splitlines()[-1].endswith("its last line: cannot open the data")
