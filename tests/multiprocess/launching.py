"""Running a test script on loopback under `python -m mesh_tensorflow.launch`."""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 8  # seconds a step (through Cluster.run) waits for a lost or stalled peer in these tests


def launch_script(script: str, num_processes: int, devices_per_process: int, *script_args,
                  timeout: float = 150) -> tuple:
  """(CompletedProcess, wall seconds) of `script` on num_processes x devices_per_process tasks."""
  command = [sys.executable, "-m", "mesh_tensorflow.launch", "--num_processes", str(num_processes),
             "--devices_per_process", str(devices_per_process), "--timeout", str(TIMEOUT), "--",
             sys.executable, script, *script_args]
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("TF_CONFIG", None)
  start = time.monotonic()
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  return result, time.monotonic() - start


def kill_a_peer_without_launcher(out_dir: str, die_at_step: int = 1) -> tuple:
  """Two tasks of train_script.py started by hand (no launcher); task 1 SIGKILLs itself at
  die_at_step. Returns (task 0's output, task 0's exit status, task 1's exit status)."""
  import json
  from mesh_tensorflow.launch import tf_configs
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
