"""Collectives and halo exchanges between processes: equal to one process, and only the needed bytes.

The equality tests read the launches of conftest.py's cluster_checks (tasks started with the
launcher on loopback; it stops them all when one fails, and a time limit bounds every launch).
The op tests build one task's graph of a two-task cluster without starting any server, and count
what its collectives send.
"""

from __future__ import annotations

import collections
import os
import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow._lowering.comm import shift_sources
from mesh_tensorflow.collective_mesh_impl import Cluster, CollectiveMeshImpl
from tests.multiprocess import collectives_script
from tests.multiprocess.launching import ROOT, SHAPES, launch_script, shared_launch

pytestmark = pytest.mark.slow  # launched clusters of TensorFlow processes

SCRIPT = os.path.join(ROOT, "tests", "multiprocess", "collectives_script.py")
STALL_TIMEOUT = 2.0  # seconds: nothing else runs in that launch, so no real step must fit in it


@pytest.mark.parametrize("num_processes,devices_per_process", sorted(SHAPES))
def test_allreduce_alltoall_shift_and_halo_exchange_between_processes_equal_one_process(
    cluster_checks, collectives_reference, num_processes, devices_per_process):
  run = cluster_checks(num_processes, devices_per_process)
  for rank in range(num_processes):  # each task wrote its results before training
    assert f"[{rank}] wrote " in run["stdout"], run["stdout"][-4000:]
  got = collections.defaultdict(dict)
  for rank in range(num_processes):
    with np.load(os.path.join(run["folder"], f"rank{rank}.npz")) as arrays:
      for key in arrays.files:
        name, pnum = key.rsplit("|", 1)
        if pnum == "None":  # a whole tensor: every process has it
          np.testing.assert_array_equal(arrays[key], got[name].setdefault(None, arrays[key]), name)
        else:
          got[name][int(pnum)] = arrays[key]
  assert sorted(got) == sorted(collectives_reference)
  for name, per_pnum in collectives_reference.items():
    assert sorted(got[name], key=str) == sorted(per_pnum, key=str), name
    for pnum, value in per_pnum.items():
      np.testing.assert_array_equal(got[name][pnum], value, f"{name}, processor {pnum}")


@pytest.fixture(scope="session")
def stalled_peer_launch(tmp_path_factory):
  """One launch of 2 x 4 tasks in which task 1 never runs its part of either case."""
  def launch(_folder):
    result, seconds = launch_script(SCRIPT, 2, 4, "--stall_rank", "1", timeout_seconds=STALL_TIMEOUT)
    return {"status": result.returncode, "stdout": result.stdout, "seconds": seconds}
  return shared_launch(tmp_path_factory, "stalled-peer", launch)


@pytest.mark.parametrize("case", collectives_script.STALL_CASES)
def test_peer_that_never_joins_an_alltoall_or_a_shift_is_reported_within_the_timeout(
    stalled_peer_launch, case):
  stdout = stalled_peer_launch["stdout"]
  assert stalled_peer_launch["status"] != 0
  assert f"[0] {case}: LostPeerError: Task 0 waited more than {STALL_TIMEOUT} s for a collective" in stdout, (
      stdout[-3000:])
  seconds = float(re.search(rf"^\[0\] {case} failed after ([\d.]+) s$", stdout, re.M).group(1))
  assert STALL_TIMEOUT <= seconds < STALL_TIMEOUT + 10, f"{case} failed after {seconds} s"
  assert "[launch] task 0 exited with status 1; stopping the other tasks" in stdout
  assert stalled_peer_launch["seconds"] < 90


def _ops_built(mesh_shape: str, task: int, devices_per_task: int, build) -> tuple:
  """(types of the TF ops build(impl, x) adds, the CollectiveMeshImpl), for one task of two."""
  cluster = Cluster(["127.0.0.1:1", "127.0.0.1:2"], task, devices_per_task)
  with tf.Graph().as_default() as graph:
    impl = CollectiveMeshImpl(mesh_shape, "", cluster=cluster)
    x = collectives_script.laid_out_input(impl)
    before = set(graph.get_operations())
    build(impl, x)
    return [op for op in graph.get_operations() if op not in before], impl


def _of_type(ops, op_type) -> list:
  return [op for op in ops if op.type == op_type]


@pytest.mark.parametrize("mesh_shape,axis", [("all:8", 0), ("b:2;m:4", 0), ("m:4;b:2", 0)])
def test_alltoall_between_processes_is_one_alltoall_kernel_per_member(mesh_shape, axis):
  ops, impl = _ops_built(mesh_shape, 1, 4, lambda impl, x: impl.alltoall(x, axis, 1, 0))
  kernels = _of_type(ops, "CollectiveAllToAllV2")
  assert len(kernels) == len(impl.local_pnums)
  assert not _of_type(ops, "CollectiveGatherV2")
  slice_size = collectives_script.slice_value(0).size
  for kernel in kernels:  # each member hands the kernel its own slice once: piece j goes to member j
    assert kernel.inputs[0].shape.num_elements() == slice_size
    assert kernel.get_attr("timeout_seconds") == impl.cluster.collective_timeout_seconds


@pytest.mark.parametrize("offset,wrap", [(1, False), (1, True), (-2, True), (3, False)])
def test_shift_between_processes_sends_each_slice_only_where_it_is_needed(offset, wrap):
  ops, impl = _ops_built("all:8", 0, 4, lambda impl, x: impl.shift_by_n_processors(
      x, 0, offset, wrap))
  assert not _of_type(ops, "CollectiveGatherV2")
  sources = shift_sources(8, offset, wrap)
  local = set(impl.local_pnums)
  to_send = [s for k, s in enumerate(sources) if s in local and k not in local]
  to_receive = [k for k, s in enumerate(sources) if k in local and s is not None and s not in local]
  sends, receives = _of_type(ops, "CollectiveBcastSendV2"), _of_type(ops, "CollectiveBcastRecvV2")
  assert len(sends) == len(to_send) and len(receives) == len(to_receive)
  slice_size = collectives_script.slice_value(0).size
  assert all(op.inputs[0].shape.num_elements() == slice_size for op in sends)
  assert all(op.outputs[0].shape.num_elements() == slice_size for op in receives)
  for op in sends + receives:  # a group of two: the source and the destination
    group_size = op.inputs[0 if op.type == "CollectiveBcastRecvV2" else 1]
    assert tf.get_static_value(group_size) == 2


@pytest.mark.parametrize("mesh_shape,axes,members_here", [
    ("all:8", [0], 4), ("b:2;m:4", [0], 1), ("m:4;b:2", [0], 2), ("m:4;b:2", [0, 1], 4)])
def test_allreduce_between_processes_is_one_collective_per_process(mesh_shape, axes, members_here):
  ops, impl = _ops_built(mesh_shape, 0, 4, lambda impl, x: impl.allreduce(x, axes, "SUM"))
  groups = len(impl.local_pnums) // members_here
  kernels = _of_type(ops, "CollectiveReduceV2")
  assert len(kernels) == groups  # this process's members' sum, one per group
  assert all(tf.get_static_value(op.inputs[1]) == 2 for op in kernels)  # a group of the 2 processes
  assert len(_of_type(ops, "AddN")) == (groups if members_here > 1 else 0)
