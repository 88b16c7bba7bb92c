"""Cluster: the processes of one mesh, described the TensorFlow way (TF_CONFIG or a cluster spec).

Every process is one task of the job "worker" and starts one `tf.distribute.Server`; sessions on
that server run this process's part of the program, and TF's collective runtime (group leader:
task 0) connects the parts.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional, Sequence

import tensorflow.compat.v1 as tf

# Set by `python -m mesh_tensorflow.launch` next to TF_CONFIG.
DEVICES_PER_PROCESS_ENV = "MTF_DEVICES_PER_PROCESS"
TIMEOUT_ENV = "MTF_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 60.0
# How long Cluster.run keeps probing the peers' servers after a failed step.
LOST_PEER_PROBE_SECONDS = 5.0
# What TF's error text says when a peer's connection broke (the peer died or restarted).
_BROKEN_CONNECTION = ("connection reset", "socket closed", "connection refused", "broken pipe",
                      "recvmsg", "failed to connect", "connection aborted")


def listening_addresses(port: int) -> list:
  """The addresses TCP sockets of this machine listen on at `port` ("0.0.0.0:P", "[::]:P": every
  interface), read from Linux's /proc/net/tcp and tcp6 (empty elsewhere)."""
  found = []
  for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
    if not os.path.exists(table):
      continue
    with open(table) as f:
      for row in f.read().splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        address, local_port = local.rsplit(":", 1)
        if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
          raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
          host = socket.inet_ntop(family, raw)
          found.append(f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}")
  return found


class LostPeerError(RuntimeError):
  """A collective between tasks failed because a peer task died, hung or became unreachable."""

  def __init__(self, message: str, lost_tasks: Sequence[int]):
    super().__init__(message)
    self.lost_tasks = list(lost_tasks)


def _is_broken_connection(error: tf.errors.OpError) -> bool:
  return isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError)) and any(
      text in error.message.lower() for text in _BROKEN_CONNECTION)


class Cluster:
  """The worker tasks of a mesh that spans processes, and this process's place among them.

  Args:
    workers: "host:port" of every task, in task order.
    task_index: this process's task.
    devices_per_task: devices each task contributes to the mesh (CPU: that many virtual devices).
    device_type: "CPU" or "GPU".
    timeout_seconds: a step run through `run` fails after this long (its session deadline), and
      a collective op between tasks after twice this long (a backstop for other sessions); 0: never.
    job: the job name of the tasks.

  Example:
    cluster = Cluster.from_tf_config()  # None when TF_CONFIG is unset: a single process
    sess = cluster.session()            # starts this task's server on first use
  """

  def __init__(self, workers: Sequence[str], task_index: int, devices_per_task: int = 1,
               device_type: str = "CPU", timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
               job: str = "worker"):
    self.workers = list(workers)
    if not 0 <= task_index < len(self.workers):
      raise ValueError(f"Cluster: task_index {task_index} is not one of the {len(self.workers)} "
                       f"tasks {self.workers}.")
    if devices_per_task < 1:
      raise ValueError(f"Cluster: devices_per_task must be at least 1, got {devices_per_task}.")
    self.task_index = task_index
    self.devices_per_task = devices_per_task
    self.device_type = device_type.upper()
    self.timeout_seconds = float(timeout_seconds)
    self.job = job
    self._server = None

  @classmethod
  def from_tf_config(cls, tf_config=None, devices_per_task: Optional[int] = None,
                     **kwargs) -> Optional[Cluster]:
    """The cluster in TF_CONFIG (a JSON string or dict; default: the environment), or None.

    devices_per_task defaults to $MTF_DEVICES_PER_PROCESS (set by the launcher), else 1;
    timeout_seconds to $MTF_COLLECTIVE_TIMEOUT, else 60.
    """
    if tf_config is None:
      tf_config = os.environ.get("TF_CONFIG")
      if not tf_config:
        return None
    if isinstance(tf_config, str):
      tf_config = json.loads(tf_config)
    task = tf_config.get("task", {})
    job = task.get("type", "worker")
    workers = tf_config.get("cluster", {}).get(job)
    if not workers:
      raise ValueError(f"TF_CONFIG has no tasks of job {job!r}: {tf_config}.")
    if devices_per_task is None:
      devices_per_task = int(os.environ.get(DEVICES_PER_PROCESS_ENV, "1"))
    kwargs.setdefault("timeout_seconds", float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_SECONDS)))
    return cls(workers, int(task.get("index", 0)), devices_per_task, job=job, **kwargs)

  @property
  def collective_timeout_seconds(self) -> float:
    """The timeout of every collective op between tasks: twice the step deadline of `run`.

    A lost peer is then noticed by the session deadline, which cancels the step cleanly; TF 2.21
    sometimes crashes (SIGSEGV) when a collective op's own timeout aborts it instead.
    """
    return 2 * self.timeout_seconds

  @property
  def num_tasks(self) -> int:
    return len(self.workers)

  @property
  def is_chief(self) -> bool:
    """Task 0: the one process that writes checkpoints and summaries."""
    return self.task_index == 0

  def task_device(self, task: int) -> str:
    return f"/job:{self.job}/replica:0/task:{task}"

  def devices(self, num_processors: int) -> list:
    """One device per processor: task 0's devices first, then task 1's, ... (contiguous blocks)."""
    if num_processors != self.num_tasks * self.devices_per_task:
      raise ValueError(
          f"Cluster: a mesh of {num_processors} processors does not fit {self.num_tasks} tasks x "
          f"{self.devices_per_task} devices; make the mesh size equal to their product.")
    return [f"{self.task_device(t)}/device:{self.device_type}:{d}"
            for t in range(self.num_tasks) for d in range(self.devices_per_task)]

  def is_local(self, device: str) -> bool:
    """True if `device` belongs to this process's task."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.job == self.job and spec.task == self.task_index

  def session_config(self) -> tf.ConfigProto:
    """Session and server config: virtual CPU devices and the collective group leader."""
    config = tf.ConfigProto()
    if self.device_type == "CPU":
      config.device_count["CPU"] = self.devices_per_task
    config.experimental.collective_group_leader = self.task_device(0)
    # This process sees only its own task: ops placed nowhere (master variables) stay here.
    config.device_filters.append(self.task_device(self.task_index))
    # Sessions on one server share variables by name (isolate_session_state would separate them,
    # but TF 2.21 then crashes when a collective is aborted): a process that builds a second
    # graph with the same names builds it under tf.container("<unique name>").
    return config

  def server(self) -> tf.distribute.Server:
    """This task's server (started on first use; one per process).

    TensorFlow 2.21 binds it to every interface of the machine at the task's port (its ServerDef
    has a port but no address), not only to the host its cluster spec names: anyone who can reach
    the port can run ops in it, so the tasks must be on a private network (docs/multi_process.md).
    """
    if self._server is None:
      spec = tf.train.ClusterSpec({self.job: self.workers})
      self._server = tf.distribute.Server(spec, self.job, self.task_index,
                                          config=self.session_config(), start=True)
    return self._server

  def session(self, graph=None) -> tf.Session:
    """A session on this task's server that runs this process's part of the program."""
    return tf.Session(self.server().target, graph=graph, config=self.session_config())

  def unreachable_tasks(self, probe_seconds: float = 2.0) -> list:
    """Tasks (other than this one) whose server no longer accepts connections."""
    lost = []
    for task, address in enumerate(self.workers):
      if task == self.task_index:
        continue
      host, port = address.rsplit(":", 1)
      try:
        socket.create_connection((host, int(port)), timeout=probe_seconds).close()
      except OSError:
        lost.append(task)
    return lost

  def run(self, sess: tf.Session, fetches, feed_dict=None):
    """sess.run(fetches), turning a failed collective into a LostPeerError naming the lost task.

    The step fails after `timeout_seconds` (or at once if a peer's connection breaks); the lost
    task is the one whose server stopped answering, else a hung one. A task killed with SIGKILL
    keeps accepting connections for a while (40 to 120 ms measured), so the servers are probed
    again for up to LOST_PEER_PROBE_SECONDS before concluding that every peer still answers; a
    step that failed on a broken connection is a LostPeerError even then.
    """
    options = tf.RunOptions(timeout_in_ms=int(self.timeout_seconds * 1000)) if self.timeout_seconds else None
    try:
      return sess.run(fetches, feed_dict=feed_dict, options=options)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.AbortedError, tf.errors.CancelledError, tf.errors.InternalError) as e:
      # After a deadline a dead peer died long ago; a broken connection may be a dying one.
      lost = self._tasks_stopping_to_answer(
          0.0 if isinstance(e, tf.errors.DeadlineExceededError) else LOST_PEER_PROBE_SECONDS)
      if lost:
        names = ", ".join(f"task {t} ({self.workers[t]})" for t in lost)
        raise LostPeerError(f"Lost {names}: its server stopped answering while task "
                            f"{self.task_index} waited for a collective ({type(e).__name__}).",
                            lost) from e
      if isinstance(e, tf.errors.DeadlineExceededError):
        raise LostPeerError(
            f"Task {self.task_index} waited more than {self.timeout_seconds} s for a collective "
            f"(its step ran past the deadline); "
            f"every task's server still answers, so a peer is hung (or slower than the timeout: "
            f"raise it with --timeout / MTF_COLLECTIVE_TIMEOUT).", []) from e
      if _is_broken_connection(e):
        raise LostPeerError(
            f"Task {self.task_index} lost its connection to a peer during a collective "
            f"({type(e).__name__}: {e.message.splitlines()[0][:200]}), though every task's server "
            f"answered again within {LOST_PEER_PROBE_SECONDS:g} s: a peer restarted, or the network "
            f"failed.", []) from e
      raise

  def _tasks_stopping_to_answer(self, seconds: float) -> list:
    """unreachable_tasks, probed again until one is found or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while True:
      lost = self.unreachable_tasks(probe_seconds=1.0)
      if lost or time.monotonic() >= deadline:
        return lost
      time.sleep(0.05)
