"""Cluster.run's verdict on a failed step does not race a dying peer.

A task killed with SIGKILL keeps accepting connections for 40 to 120 ms; a survivor that probed
once, right after its step failed, found every server answering and raised TF's raw error (5 of
46 kills). A fake peer that keeps accepting for a while after the failure stands in for it.
"""

from __future__ import annotations

import socket
import threading

import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow._launch import cluster as cluster_lib


class _Peer:
  """A listening socket on loopback, closed `after` seconds after close_later()."""

  def __init__(self):
    self.socket = socket.socket()
    self.socket.bind(("127.0.0.1", 0))
    self.socket.listen(16)
    self.address = "127.0.0.1:%d" % self.socket.getsockname()[1]

  def close_later(self, after: float) -> None:
    threading.Timer(after, self.socket.close).start()


class _FailingSession:
  def __init__(self, error):
    self.error = error

  def run(self, *args, **kwargs):
    raise self.error


RESET = tf.errors.UnavailableError(None, None,
                                   "Collective ops is aborted by: recvmsg:Connection reset by peer")


@pytest.fixture
def peers():
  me, other = _Peer(), _Peer()
  yield me, other
  for peer in (me, other):
    peer.socket.close()


def test_a_peer_still_accepting_connections_when_the_step_fails_is_named_once_it_stops(peers):
  me, other = peers
  cluster = cluster_lib.Cluster([me.address, other.address], task_index=0)
  other.close_later(0.3)  # dies, but its port answers for a while
  with pytest.raises(cluster_lib.LostPeerError, match=rf"Lost task 1 \({other.address}\)") as raised:
    cluster.run(_FailingSession(RESET), [])
  assert raised.value.lost_tasks == [1]


def test_a_broken_connection_is_a_lost_peer_even_if_every_server_answers_again(peers, monkeypatch):
  me, other = peers
  monkeypatch.setattr(cluster_lib, "LOST_PEER_PROBE_SECONDS", 0.3)
  cluster = cluster_lib.Cluster([me.address, other.address], task_index=0)
  with pytest.raises(cluster_lib.LostPeerError, match=r"lost its connection to a peer .*Connection reset by "
                                                      r"peer.*answered again within 0.3 s") as raised:
    cluster.run(_FailingSession(RESET), [])
  assert raised.value.lost_tasks == []


def test_other_errors_are_raised_as_they_are(peers, monkeypatch):
  me, other = peers
  monkeypatch.setattr(cluster_lib, "LOST_PEER_PROBE_SECONDS", 0.1)
  cluster = cluster_lib.Cluster([me.address, other.address], task_index=0)
  error = tf.errors.InternalError(None, None, "a kernel failed")
  with pytest.raises(tf.errors.InternalError, match="a kernel failed"):
    cluster.run(_FailingSession(error), [])
