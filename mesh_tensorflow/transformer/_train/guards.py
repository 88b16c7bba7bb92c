"""What keeps a training run's model_dir safe: one run at a time, and a checkpoint when stopped.

- `model_dir_lock`: an exclusive `fcntl` lock on `model_dir/.lock` for the run's lifetime. The
  operating system releases it when the process ends, however it ends, so a killed run leaves no
  stale lock; a second run on the same directory is refused, naming the holder.
- `stop_requests`: SIGTERM and SIGINT set a flag instead of killing the process mid-step; the
  training loop saves a checkpoint of the last finished step, says so, and the signal then takes
  its usual effect.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import threading

LOCK_FILE = ".lock"


class ModelDirInUseError(RuntimeError):
  """Another run holds the lock on the model_dir."""


@contextlib.contextmanager
def model_dir_lock(model_dir: str):
  """Holds model_dir's lock (local directories; other file systems are not locked)."""
  if "://" in model_dir:
    yield
    return
  import fcntl  # POSIX only; imported here so that the module imports everywhere
  path = os.path.join(model_dir, LOCK_FILE)
  with open(path, "a+") as f:
    try:
      fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      holder = f.read().strip() or "an unknown process"
      raise ModelDirInUseError(
          f"{model_dir} is in use by another training run ({holder}; lock file {path}). Wait for it to "
          f"finish or stop it, or train in another model_dir.") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}: {' '.join(sys.argv)}\n")
    f.flush()
    try:
      yield
    finally:
      f.truncate(0)
      fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class StopRequest:
  """The signal that asked the run to stop, if any."""

  signum = None

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name

  def resend(self) -> None:
    """Delivers the signal again, now with its previous handler (e.g. KeyboardInterrupt).

    A process that started with the signal ignored (a parent's SIG_IGN, as pytest-xdist's workers
    pass on SIGINT) would go on and exit 0: it exits with the shell's status for the signal instead.
    """
    os.kill(os.getpid(), self.signum)
    raise SystemExit(128 + self.signum)


@contextlib.contextmanager
def stop_requests():
  """Yields a StopRequest whose signum is set by SIGTERM or SIGINT (main thread only)."""
  request = StopRequest()
  if threading.current_thread() is not threading.main_thread():
    yield request
    return
  stop_signals = (signal.SIGTERM, signal.SIGINT)

  def handler(signum, frame):
    del frame
    request.signum = signum
  previous = {s: signal.signal(s, handler) for s in stop_signals}
  try:
    yield request
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
