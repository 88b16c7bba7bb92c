"""Starts N copies of a command as the tasks of one TF cluster on loopback, and watches them.

Each task gets TF_CONFIG (its index among N workers on free 127.0.0.1 ports) and
MTF_DEVICES_PER_PROCESS; each line it prints is prefixed with "[rank] ". When a task fails (non-zero
exit or killed by a signal) the launcher names it, stops the others (SIGTERM, then SIGKILL after a
grace period) and exits with that task's status; when all succeed it exits 0; when the launcher
itself is terminated, it stops the tasks first. Under a scheduler
that already set TF_CONFIG, the command runs once, as that task, with TF_CONFIG as it is. A
command starting with `python` runs with the launcher's own interpreter (the same environment).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from mesh_tensorflow._launch.cluster import DEVICES_PER_PROCESS_ENV, TIMEOUT_ENV

GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.05


def free_ports(n: int) -> list:
  """n distinct free TCP ports on 127.0.0.1 (all held open while choosing, so they differ)."""
  sockets = [socket.socket() for _ in range(n)]
  try:
    for s in sockets:
      s.bind(("127.0.0.1", 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def tf_configs(num_processes: int, ports: Optional[Sequence[int]] = None) -> list:
  """TF_CONFIG (as a dict) for each of num_processes worker tasks on loopback."""
  ports = list(ports) if ports is not None else free_ports(num_processes)
  workers = [f"127.0.0.1:{p}" for p in ports]
  return [{"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
          for i in range(num_processes)]


def _describe(status: int) -> str:
  return f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"


def _exit_code(status: int) -> int:
  return 128 - status if status < 0 else status


def _pump(stream, rank: int, out) -> None:
  for line in iter(stream.readline, b""):
    out.write(f"[{rank}] {line.decode(errors='replace')}")
    out.flush()
  stream.close()


class Launch:
  """The running tasks of one launch (use `run`, or start/wait separately in tests)."""

  def __init__(self, command: Sequence[str], num_processes: int, devices_per_process: int = 1,
               timeout_seconds: Optional[float] = None, out=None):
    if num_processes < 1:
      raise ValueError(f"--num_processes must be at least 1, got {num_processes}.")
    if not command:
      raise ValueError("No command to launch: put it after '--', e.g. -- python train.py.")
    self.command = list(command)
    if self.command[0] in ("python", "python3"):  # the tasks run in the launcher's environment
      self.command[0] = sys.executable
    self.num_processes = num_processes
    self.devices_per_process = devices_per_process
    self.timeout_seconds = timeout_seconds
    self.out = out or sys.stdout
    self.processes = []
    self._pumps = []

  def _env(self, tf_config: Optional[dict]) -> dict:
    env = dict(os.environ)
    if tf_config is not None:
      env["TF_CONFIG"] = json.dumps(tf_config)
    env[DEVICES_PER_PROCESS_ENV] = str(self.devices_per_process)
    if self.timeout_seconds is not None:
      env[TIMEOUT_ENV] = str(self.timeout_seconds)
    env["PYTHONUNBUFFERED"] = "1"
    return env

  def start(self) -> None:
    """Starts every task (one, as given, if TF_CONFIG is already set by a scheduler)."""
    if os.environ.get("TF_CONFIG"):
      ranks = [(json.loads(os.environ["TF_CONFIG"]).get("task", {}).get("index", 0), None)]
    else:
      ranks = list(enumerate(tf_configs(self.num_processes)))
    for rank, tf_config in ranks:
      process = subprocess.Popen(self.command, env=self._env(tf_config), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
      pump = threading.Thread(target=_pump, args=(process.stdout, rank, self.out), daemon=True)
      pump.start()
      self.processes.append((rank, process))
      self._pumps.append(pump)

  def wait(self) -> int:
    """Waits for every task; on the first failure stops the others. Returns the exit status."""
    failed = None
    while failed is None:
      statuses = [(rank, p.poll()) for rank, p in self.processes]
      failed = next(((r, s) for r, s in statuses if s not in (None, 0)), None)
      if all(s == 0 for _, s in statuses):
        break
      if failed is None:
        time.sleep(_POLL_SECONDS)
    if failed is not None:
      rank, status = failed
      self._say(f"task {rank} {_describe(status)}; stopping the other tasks")
      self.stop()
    for pump in self._pumps:
      pump.join(timeout=GRACE_SECONDS)
    return 0 if failed is None else _exit_code(failed[1]) or 1

  def stop(self) -> None:
    """SIGTERM to every running task's process group, SIGKILL to those still alive after a grace."""
    running = [p for _, p in self.processes if p.poll() is None]
    for p in running:
      _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for p in running:
      try:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        _signal_group(p, signal.SIGKILL)
        p.wait()

  def _say(self, message: str) -> None:
    self.out.write(f"[launch] {message}\n")
    self.out.flush()

  def run(self) -> int:
    """Starts the tasks and waits for them (call from the main thread).

    A SIGTERM or SIGHUP to the launcher stops the tasks too (they run in sessions of their own,
    so a signal to the launcher alone would leave them running), then exits with 128 + signal.
    """
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
      self.start()
      return self.wait()
    finally:
      self.stop()
      for sig, handler in previous.items():
        signal.signal(sig, handler)


def _exit_on_signal(signum, _frame) -> None:
  raise SystemExit(128 + signum)


def _signal_group(process, sig) -> None:
  try:
    os.killpg(process.pid, sig)
  except ProcessLookupError:
    pass
