"""Who can connect: what a launched task's TensorFlow server listens on (docs/multi_process.md)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from mesh_tensorflow._launch.cluster import listening_addresses
from tests.multiprocess import launching

SCRIPT = os.path.join(launching.ROOT, "scripts", "listening_addresses.py")


def test_listening_addresses_reads_a_socket_bound_to_one_address():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    assert listening_addresses(port) == [f"127.0.0.1:{port}"]
  assert listening_addresses(port) == []


@pytest.mark.slow  # launches two TensorFlow processes
def test_a_launched_tasks_server_listens_on_every_interface_not_only_its_loopback_address():
  # The page's command (it launches itself as 2 tasks). What the docs say: TF 2.21 binds the
  # server to [::] (or 0.0.0.0) at the task's port, whatever host the cluster spec names, so the
  # cluster must run on a private network.
  result = subprocess.run([sys.executable, SCRIPT], cwd=launching.ROOT, capture_output=True, text=True,
                          timeout=150, env=dict(os.environ, PYTHONPATH=launching.ROOT))
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  lines = re.findall(r"^\[(\d)\] task \1: cluster address 127\.0\.0\.1:(\d+), listening on (.*)$",
                     result.stdout, re.M)
  assert sorted(rank for rank, _, _ in lines) == ["0", "1"], result.stdout[-3000:]
  for _, port, listening in lines:
    assert listening in (f"[::]:{port} (every interface)", f"0.0.0.0:{port} (every interface)"), listening
