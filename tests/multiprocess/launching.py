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
