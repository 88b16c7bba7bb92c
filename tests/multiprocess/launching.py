"""Running test scripts as the tasks of a loopback cluster, and sharing a launch between tests.

Tasks are started by the launcher's `Launch` in the test's own process: a `python -m
mesh_tensorflow.launch` process would import TensorFlow (~5 s of CPU) only to watch its tasks.
test_launcher.py checks the command line itself, and docs/multi_process.md runs it.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import subprocess
import sys
import threading
import time

from mesh_tensorflow.launch import Launch, tf_configs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 8  # seconds a step (through Cluster.run) waits for a lost or stalled peer in these tests

# The launches of cluster_checks_script.py (conftest.py's cluster_checks): cluster shapes,
# (processes, devices per process) -> the step at which task 1 SIGKILLs itself in the last layout
# (after the chief saved the steps before it), or None to finish every step.
SHAPES = {(2, 4): 2, (4, 2): None}
LAYOUTS = ["data", "model", "2d"]  # of train_script.py, trained in this order
STEPS = 4  # steps a layout trains, in the launches and in the one-process reference


@contextlib.contextmanager
def _tasks_environment():
  """os.environ as the tasks should inherit it (the launcher copies it when it starts them)."""
  saved = dict(os.environ)
  os.environ.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
  os.environ.pop("TF_CONFIG", None)  # set, it would make the launcher run one task as that one
  try:
    yield
  finally:
    os.environ.clear()
    os.environ.update(saved)


def launch_script(script: str, num_processes: int, devices_per_process: int, *script_args,
                  timeout_seconds: float = TIMEOUT, limit: float = 150) -> tuple:
  """(CompletedProcess, wall seconds) of `script` on num_processes x devices_per_process tasks.

  The CompletedProcess holds the launcher's exit status and everything it printed (each task's
  lines with their rank prefix, and its own `[launch]` lines). timeout_seconds is the tasks'
  collective timeout (--timeout); after `limit` seconds every task is stopped.
  """
  out = io.StringIO()
  launch = Launch([sys.executable, script, *script_args], num_processes, devices_per_process,
                  timeout_seconds, out=out)

  def stop_at_the_limit():
    out.write(f"[test] the launch ran past {limit} s; stopping every task\n")
    launch.stop()

  watchdog = threading.Timer(limit, stop_at_the_limit)
  start = time.monotonic()
  try:
    with _tasks_environment():
      launch.start()
    watchdog.start()
    status = launch.wait()
  finally:
    watchdog.cancel()
    launch.stop()
  return subprocess.CompletedProcess(launch.command, status, out.getvalue()), time.monotonic() - start


def shared_launch(tmp_path_factory, name: str, launch) -> dict:
  """launch(folder) -> a JSON-able dict, run once per test session even across pytest-xdist workers.

  The first test that asks runs it in a folder of the session's base temporary directory (shared by
  the workers of one run) and stores the dict; others (on any worker) wait for it and read it.
  Add "folder" to the dict to find the files the launch wrote.
  """
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # every worker's base directory is a subfolder of the run's
  folder = root / f"shared-{name}"
  summary = folder / "summary.json"
  with open(root / f"shared-{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not summary.exists():
      folder.mkdir(exist_ok=True)
      summary.write_text(json.dumps(launch(folder)))
  return dict(json.loads(summary.read_text()), folder=str(folder))


def kill_a_peer_without_launcher(out_dir: str, die_at_step: int = 1) -> tuple:
  """Two tasks of train_script.py started by hand (no launcher); task 1 SIGKILLs itself at
  die_at_step. Returns (task 0's output, task 0's exit status, task 1's exit status)."""
  script = os.path.join(ROOT, "tests", "multiprocess", "train_script.py")
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", MTF_DEVICES_PER_PROCESS="4",
             MTF_COLLECTIVE_TIMEOUT=str(TIMEOUT))
  args = [sys.executable, script, "--steps", str(die_at_step + 3), "--die_at_step", str(die_at_step),
          "--out", out_dir]
  tasks = [subprocess.Popen(args, cwd=ROOT, env=dict(env, TF_CONFIG=json.dumps(c)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for c in tf_configs(2)]
  try:
    survivor_output = tasks[0].communicate(timeout=150)[0]
    tasks[1].wait(timeout=30)
  finally:
    for task in tasks:
      task.kill()
  return survivor_output, tasks[0].returncode, tasks[1].returncode
