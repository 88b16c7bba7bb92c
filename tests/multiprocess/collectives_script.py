"""Collectives and halo exchanges on CollectiveMeshImpl, in 1 process x 8 devices or N processes.

Run under `python -m mesh_tensorflow.launch` (each task writes its processors' results to
<out>/rank<R>.npz); tests call `run_cases()` in their own process for the 1 x 8 reference. The
meshes are 1-D and 2-D, one of them with each task's devices listed in reverse (TF ranks a
group's members by device index, not in the mesh's order). With --stall_rank R, task R builds
an alltoall and a shift but never runs them, so the other tasks' steps fail, each after the timeout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.collective_mesh_impl import Cluster, CollectiveMeshImpl, LostPeerError

NUM_PROCESSORS = 8
MESHES = {  # name: (mesh shape, devices listed in reverse within each task)
    "1d": ("all:8", False),
    "2d": ("b:2;m:4", False),
    "1d reversed": ("all:8", True),
}
SHIFTS = [(1, False), (-1, True), (2, True), (-3, False)]  # (offset, wrap)


def _devices(cluster, reverse: bool) -> list:
  if cluster is None:
    return [f"/cpu:{i}" for i in range(NUM_PROCESSORS)]
  devices = cluster.devices(NUM_PROCESSORS)
  if not reverse:
    return devices
  k = cluster.devices_per_task
  return [d for t in range(cluster.num_tasks) for d in reversed(devices[t * k:(t + 1) * k])]


def slice_value(pnum: int) -> np.ndarray:
  """Processor pnum's input slice: distinct values everywhere."""
  return np.arange(4 * 8, dtype=np.float32).reshape(4, 8) + 100 * pnum


def laid_out_input(impl):
  """This process's slices of the input, one per local processor, on its device."""
  return impl.LaidOutTensor(mtf.parallel(impl.devices, lambda p: tf.constant(slice_value(p)),
                                         impl.local_pnums))


def _halo_exchanges(mesh_shape: str, devices: list, cluster) -> list:
  """Whole results of mtf halo exchanges of blocks split over the mesh (2-D on a 2-D mesh)."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  if mtf.convert_to_shape(mesh_shape).ndims == 1:
    blocks, block, c = mtf.Dimension("blocks", 8), mtf.Dimension("block", 3), mtf.Dimension("c", 2)
    x = mtf.import_tf_tensor(mesh, tf.constant(np.arange(48, dtype=np.float32).reshape(8, 3, 2)),
                             [blocks, block, c])
    outputs = [mtf.halo_exchange(x, blocks, block, 2),
               mtf.left_halo_exchange(x, blocks, block, 4, wrap=True)]  # wider than a block
    layout = "blocks:all"
  else:
    hb, h = mtf.Dimension("hb", 2), mtf.Dimension("h", 3)
    wb, w = mtf.Dimension("wb", 4), mtf.Dimension("w", 3)
    x = mtf.import_tf_tensor(mesh, tf.constant(np.arange(72, dtype=np.float32).reshape(2, 3, 4, 3)),
                             [hb, h, wb, w])
    outputs = [mtf.halo_exchange(mtf.halo_exchange(x, hb, h, 1), wb, w, 2, wrap=True)]
    layout = "hb:b;wb:m"
  lowering = mtf.Lowering(graph, {mesh: CollectiveMeshImpl(mesh_shape, layout, devices, cluster)})
  return [lowering.export_to_tf_tensor(y) for y in outputs]


def build_cases(cluster=None) -> dict:
  """case name -> (pnums, tf tensors): this process's results of every case, in one graph.

  A halo exchange's result is the whole tensor, in every process (pnums [None]).
  """
  cases = {}
  for name, (mesh_shape, reverse) in MESHES.items():
    devices = _devices(cluster, reverse)
    impl = CollectiveMeshImpl(mesh_shape, "", devices, cluster)
    x = laid_out_input(impl)
    results = {}
    results["allreduce MAX all axes"] = impl.allreduce(x, list(range(impl.ndims)), "MAX")
    for axis in range(impl.ndims):
      results[f"allreduce SUM axis {axis}"] = impl.allreduce(x, [axis], "SUM")
      results[f"alltoall axis {axis}"] = impl.alltoall(x, axis, 1, 0)
      results[f"allconcat axis {axis}"] = impl.allconcat(x, axis, 1)
      for offset, wrap in SHIFTS:
        results[f"shift {offset} wrap {wrap} axis {axis}"] = impl.shift_by_n_processors(
            x, axis, offset, wrap)
    for case, y in results.items():
      cases[f"{name} {case}"] = (impl.local_pnums, y.tensor_list)
    for i, whole in enumerate(_halo_exchanges(mesh_shape, devices, cluster)):
      cases[f"{name} halo exchange {i}"] = ([None], [whole])
  return cases


def run_cases(cluster=None) -> dict:
  """case name -> {pnum (or None for a whole tensor): numpy value} for this process."""
  with tf.Graph().as_default() as graph:
    cases = build_cases(cluster)
    fetches = {name: tensors for name, (_, tensors) in cases.items()}
    if cluster:
      with cluster.session(graph=graph) as sess:
        values = cluster.run(sess, fetches)
    else:
      with tf.Session(config=tf.ConfigProto(device_count={"CPU": NUM_PROCESSORS})) as sess:
        values = sess.run(fetches)
  return {name: dict(zip(pnums, values[name])) for name, (pnums, _) in cases.items()}


def save_cases(cluster, out: str) -> None:
  """Writes this process's results of every case to <out>/rank<R>.npz ("case|pnum": value)."""
  results = run_cases(cluster)
  os.makedirs(out, exist_ok=True)
  arrays = {f"{name}|{pnum}": value for name, per_pnum in results.items()
            for pnum, value in per_pnum.items()}
  np.savez(os.path.join(out, f"rank{cluster.task_index if cluster else 0}.npz"), **arrays)
  print("wrote", len(arrays), "results", flush=True)


STALL_CASES = ("alltoall", "shift")


def run_with_a_stalled_peer(cluster, stall_rank: int) -> None:
  """Runs an alltoall, then a wrapped shift, on all:8 while task stall_rank never runs its part.

  Task stall_rank starts its server and sleeps; the others wait until every server answers (the
  peer is in the cluster, it only never joins the collectives), then run each case as a step of
  its own. Each step raises LostPeerError after the timeout; the task prints "<case>: <error>"
  and "<case> failed after <seconds> s" (a case that fails otherwise raises).
  """
  with tf.Graph().as_default() as graph:
    impl = CollectiveMeshImpl("all:8", "", cluster=cluster)
    x = laid_out_input(impl)
    steps = {"alltoall": impl.alltoall(x, 0, 1, 0), "shift": impl.shift_by_n_processors(x, 0, 1, True)}
    with cluster.session(graph=graph) as sess:
      if cluster.task_index == stall_rank:
        time.sleep(600)
      _wait_for_every_server(cluster)
      for case in STALL_CASES:
        start = time.monotonic()
        try:
          cluster.run(sess, steps[case].tensor_list)
        except LostPeerError as e:
          print(f"{case}: LostPeerError: {e}", flush=True)
          print(f"{case} failed after {time.monotonic() - start:.3f} s", flush=True)


def _wait_for_every_server(cluster, seconds: float = 120.0) -> None:
  deadline = time.monotonic() + seconds
  while cluster.unreachable_tasks():
    if time.monotonic() > deadline:
      raise TimeoutError(f"tasks {cluster.unreachable_tasks()} started no server within {seconds} s")
    time.sleep(0.05)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="")
  parser.add_argument("--stall_rank", type=int, default=-1)
  args = parser.parse_args()
  tf.disable_eager_execution()
  cluster = Cluster.from_tf_config()
  if args.stall_rank >= 0:
    run_with_a_stalled_peer(cluster, args.stall_rank)
    sys.exit(1)  # its steps failed
  save_cases(cluster, args.out)


if __name__ == "__main__":
  main()
