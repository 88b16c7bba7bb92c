"""Starts N copies of a command as the tasks of one TF cluster on loopback, and watches them.

Each task gets TF_CONFIG (its index among N workers on free 127.0.0.1 ports) and
MTF_DEVICES_PER_PROCESS; each line it prints is prefixed with "[rank] ". When a task fails (non-zero
exit or killed by a signal) the launcher names it, stops the others (SIGTERM, then SIGKILL after a
grace period) and exits with that task's status; when all succeed it exits 0; when the launcher
itself is terminated, it stops the tasks first. With max_restarts K it instead stops them all and
starts them again (on fresh ports; they resume from their latest checkpoint), saying so in one line,
up to K times; it gives up sooner when an attempt fails before any task printed a step line
(`step N...`, or the driver's `First training step done`): a crash at start would only repeat.
Under a scheduler
that already set TF_CONFIG, the command runs once, as that task, with TF_CONFIG as it is. A
command starting with `python` runs with the launcher's own interpreter (the same environment).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from mesh_tensorflow._launch.cluster import DEVICES_PER_PROCESS_ENV, TIMEOUT_ENV

GRACE_SECONDS = 5.0
RESTART_DELAY_SECONDS = 1.0  # between stopping the tasks and starting them again
_POLL_SECONDS = 0.05
# A task's line saying it finished a training step (the driver's progress lines, or `step N ...`).
_STEP_LINE = re.compile(r"^(?:step (\d+)\b|First training step done)")


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


def latest_checkpoint_name(checkpoint_dir: Optional[str]) -> str:
  """The basename of checkpoint_dir's latest checkpoint (its TF state file), for restart lines."""
  import tensorflow.compat.v1 as tf  # only when a restart needs it
  path = tf.train.latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
  return os.path.basename(path) if path else "its latest checkpoint"


class _Progress:
  """What the tasks' output said: the last step line's number, and each task's last line."""

  def __init__(self):
    self.stepped = False
    self.step = None
    self.last_lines = {}

  def read(self, rank: int, line: str) -> None:
    if line.strip():
      self.last_lines[rank] = line.rstrip()
    match = _STEP_LINE.match(line)
    if match:
      self.stepped = True
      if match.group(1) is not None:
        self.step = int(match.group(1))


class _LineWriter:
  """Writes whole lines from several threads: a task stopped mid-line gets its line ended, so the
  launcher's own lines always start a line of their own."""

  def __init__(self, out):
    self._out = out
    self._lock = threading.Lock()

  def write_line(self, text: str) -> None:
    with self._lock:
      self._out.write(text if text.endswith("\n") else text + "\n")
      self._out.flush()


def _pump(stream, rank: int, out: _LineWriter, progress: _Progress) -> None:
  for line in iter(stream.readline, b""):
    text = line.decode(errors="replace")
    progress.read(rank, text)
    out.write_line(f"[{rank}] {text}")
  stream.close()


class Launch:
  """The running tasks of one launch (use `run`, or start/wait separately in tests)."""

  def __init__(self, command: Sequence[str], num_processes: int, devices_per_process: int = 1,
               timeout_seconds: Optional[float] = None, out=None, max_restarts: int = 0,
               checkpoint_dir: Optional[str] = None):
    if num_processes < 1:
      raise ValueError(f"--num_processes must be at least 1, got {num_processes}.")
    if not command:
      raise ValueError("No command to launch: put it after '--', e.g. -- python train.py.")
    if max_restarts < 0:
      raise ValueError(f"--max_restarts must be 0 or more, got {max_restarts}.")
    self.command = list(command)
    if self.command[0] in ("python", "python3"):  # the tasks run in the launcher's environment
      self.command[0] = sys.executable
    self.num_processes = num_processes
    self.devices_per_process = devices_per_process
    self.timeout_seconds = timeout_seconds
    self.out = out or sys.stdout
    self._lines = _LineWriter(self.out)
    self.max_restarts = max_restarts
    self.checkpoint_dir = checkpoint_dir
    self.processes = []
    self._pumps = []
    self.progress = _Progress()
    self.failure = None  # (rank, status) of the last attempt's first failed task

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
    self.processes, self._pumps, self.progress, self.failure = [], [], _Progress(), None
    if os.environ.get("TF_CONFIG"):
      ranks = [(json.loads(os.environ["TF_CONFIG"]).get("task", {}).get("index", 0), None)]
    else:
      ranks = list(enumerate(tf_configs(self.num_processes)))
    for rank, tf_config in ranks:
      process = subprocess.Popen(self.command, env=self._env(tf_config), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
      pump = threading.Thread(target=_pump, args=(process.stdout, rank, self._lines, self.progress),
                              daemon=True)
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
      self.failure = failed
      self._say(f"task {rank} {_describe(status)}; stopping the other tasks")
      self.stop()
    for pump in self._pumps:
      pump.join(timeout=GRACE_SECONDS)
    return 0 if failed is None else _exit_code(failed[1]) or 1

  def supervise(self) -> int:
    """start and wait, restarting every task after a failure up to max_restarts times; returns
    the exit status of the last attempt."""
    restarts = 0
    while True:
      self.start()
      status = self.wait()
      if status == 0 or not self.max_restarts:
        return status
      rank, code = self.failure
      last_line = self.progress.last_lines.get(rank, "(no output)")
      if not self.progress.stepped:
        self._say(f"giving up: task {rank} {_describe(code)} before any task finished a step, so a "
                  f"restart would fail the same way; its last line: {last_line}")
        return status
      if restarts == self.max_restarts:
        self._say(f"giving up after {restarts} restarts (--max_restarts): task {rank} {_describe(code)}; "
                  f"its last line: {last_line}")
        return status
      restarts += 1
      at_step = f" at step {self.progress.step}" if self.progress.step is not None else ""
      self._say(f"task {rank} {_describe(code)}{at_step}; restart {restarts} of {self.max_restarts} "
                f"from {latest_checkpoint_name(self.checkpoint_dir)}")
      time.sleep(RESTART_DELAY_SECONDS)

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
    self._lines.write_line(f"[launch] {message}")

  def run(self) -> int:
    """Starts the tasks and waits for them (call from the main thread).

    A SIGTERM or SIGHUP to the launcher stops the tasks too (they run in sessions of their own,
    so a signal to the launcher alone would leave them running), then exits with 128 + signal.
    """
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
      return self.supervise()
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
