"""Transformer training step on a mesh of 8 processors cut into 1 x 8, 2 x 4 and 4 x 2 processes.

The model is the performance issue's (benchmarks/_transformer_model.py: 2 layers, d_model 256,
d_ff 1024, 4 heads, sequence 64, batch 16, vocabulary 1024, SGD, graph mode), on
CollectiveMeshImpl with 8 virtual CPU devices in all: one process of 8 (a plain session), or 2 or
4 processes started by `python -m mesh_tensorflow.launch` on loopback. Per process it records the
lowering time, the TF op count, the first step (variable initialisation, copy_masters_to_slices
and one step, after a barrier so that no process waits for a slower peer's lowering) and the
median step time over --reps repetitions of --steps steps after --warmup steps. Plain TF on one
device, timed by task 0 of every run between the repetitions (the others wait), gives the
step-time ratio. The table shows the slowest process of each run. The first and last losses of
every split (and every process) must agree.

    python benchmarks/bench_multiprocess.py [--splits 1x8,2x4,4x2] [--layouts data-parallel,2-D]
                                            [--reps 5] [--steps 1] [--warmup 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mesh_tensorflow as mtf  # noqa: E402
from benchmarks import _transformer_model as model  # noqa: E402
from benchmarks import bench_transformer as bench  # noqa: E402
from mesh_tensorflow._backends import tf_collectives  # noqa: E402
from mesh_tensorflow.collective_mesh_impl import Cluster, CollectiveMeshImpl  # noqa: E402

NUM_PROCESSORS = 8
LAYOUTS = {  # name: (mesh shape, layout rules)
    "data-parallel": ("all:8", "batch:all"),
    "2-D": ("b:2;m:4", "batch:b;d_ff:m;heads:m;vocab:m"),
}
PLAIN_TF = "plain TF, one device"
COLLECTIVE_TIMEOUT_S = 300  # lowering on a loaded 2-core machine can take a while


def barrier_fn(cluster: Optional[Cluster]):
  """A function that returns once every task has called it (for one process: at once).

  It sums one scalar per task with a collective, in a graph and session of its own; every task
  must build it at the same point (its instance key comes from the shared counter).
  """
  if cluster is None:
    return lambda: None
  devices = [f"{cluster.task_device(t)}/device:CPU:0" for t in range(cluster.num_tasks)]
  xs = [None] * cluster.num_tasks
  graph = tf.Graph()
  with graph.as_default(), tf.container("barrier"):
    with tf.device(devices[cluster.task_index]):
      xs[cluster.task_index] = tf.constant(1.0)
    settings = tf_collectives.CollectiveSettings(timeout_seconds=COLLECTIVE_TIMEOUT_S)
    total = tf_collectives.allreduce(xs, devices, "SUM", settings)[cluster.task_index]
  session = cluster.session(graph=graph)
  return lambda: session.run(total)


def build_mtf(cfg: model.Config, name: str, cluster: Optional[Cluster], wait_for_peers) -> bench.Case:
  """The mtf training step of layout `name` on this process's part of the mesh, built and started."""
  mesh_shape, layout = LAYOUTS[name]
  graph = tf.Graph()
  with graph.as_default(), tf.container(name):  # sessions on one server share variables by name
    inputs_ph, targets_ph = bench._placeholders(cfg)
    mtf_graph = mtf.Graph()
    mesh = mtf.Mesh(mtf_graph, "mesh")
    loss, updates = model.mtf_train_step(cfg, mesh, inputs_ph, targets_ph, model.initial_values(cfg))
    devices = None if cluster else [f"/cpu:{i}" for i in range(NUM_PROCESSORS)]
    start = time.perf_counter()
    impl = CollectiveMeshImpl(mesh_shape, layout, devices, cluster)
    lowering = mtf.Lowering(mtf_graph, {mesh: impl})
    fetches = [lowering.export_to_tf_tensor(loss),
               tf.group([lowering.lowered_operation(u) for u in updates])]
    build_s = time.perf_counter() - start
    num_ops = len(graph.get_operations())
    init = [tf.global_variables_initializer(), lowering.copy_masters_to_slices()]
  if cluster:
    session = cluster.session(graph=graph)
  else:
    session = tf.Session(graph=graph, config=tf.ConfigProto(device_count={"CPU": NUM_PROCESSORS}))
  case = bench.Case(name, session, fetches, bench._feed(cfg, inputs_ph, targets_ph), build_s=build_s,
                    num_ops=num_ops)
  wait_for_peers()  # the first step is timed from here: nobody waits for a slower peer's lowering
  return bench._start(case, init)


def worker(args) -> None:
  """One process of a split: builds and times the cases, writes rank<R>.json.

  Task 0 also times plain TF, in each repetition while the other tasks wait at a barrier, so
  every split has a reference measured at the same time (the machine's load drifts).
  """
  tf.disable_v2_behavior()
  tf.logging.set_verbosity(tf.logging.ERROR)
  cfg = model.Config()
  cluster = Cluster.from_tf_config()
  wait_for_peers = barrier_fn(cluster)
  plain = None
  if cluster is None or cluster.is_chief:
    plain = bench.build_plain_tf(cfg, NUM_PROCESSORS)
    plain.name = PLAIN_TF
  cases = [build_mtf(cfg, name, cluster, wait_for_peers) for name in args.layouts.split(",")]
  mine = [plain] + cases if plain else cases
  for c in mine:
    for _ in range(args.warmup):
      c.session.run(c.fetches, c.feed)
  for _ in range(args.reps):
    wait_for_peers()
    if plain:
      plain.time_steps(args.steps)
    wait_for_peers()
    for c in cases:
      c.time_steps(args.steps)
  records = [{"case": c.name, "lowering_s": c.build_s, "first_step_s": c.first_step_s,
              "num_ops": c.num_ops, "step_s": c.median_step_s, "first_loss": c.first_loss,
              "last_loss": float(c.session.run(c.fetches[0], c.feed))} for c in mine]
  rank = cluster.task_index if cluster else 0
  with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(records, f)


def run_split(split: str, args, out: str) -> list:
  """Runs the worker as `split` ("PxD": P processes of D devices); every rank's records."""
  num_processes, devices_per_process = (int(n) for n in split.split("x"))
  os.makedirs(out)
  worker_argv = [__file__, "--worker", "--out", out, "--layouts", args.layouts, "--reps", str(args.reps),
                 "--steps", str(args.steps), "--warmup", str(args.warmup)]
  env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if num_processes == 1:  # one process, a plain session
    command = [sys.executable, *worker_argv]
  else:
    command = [sys.executable, "-m", "mesh_tensorflow.launch", "--num_processes", str(num_processes),
               "--devices_per_process", str(devices_per_process), "--timeout", str(COLLECTIVE_TIMEOUT_S),
               "--", sys.executable, *worker_argv]
  result = subprocess.run(command, env=env, capture_output=True, text=True)
  if result.returncode != 0:
    raise RuntimeError(f"split {split} failed (status {result.returncode}):\n{result.stdout[-3000:]}"
                       f"\n{result.stderr[-3000:]}")
  records = []
  for rank in range(num_processes):
    with open(os.path.join(out, f"rank{rank}.json")) as f:
      records += [dict(r, split=split, rank=rank) for r in json.load(f)]
  return records


def print_table(records: list) -> None:
  """One row per case and split: the slowest process's numbers, losses from task 0.

  The ratio is to plain TF timed in the same run (plain TF's own row: the one-process run's).
  """
  plain = {r["split"]: r for r in records if r["case"] == PLAIN_TF}
  print("\n| layout | processes x devices | TF ops per process | lowering s | first step s | "
        "step ms (median) | plain TF ms, same run | ratio to plain TF | first loss | last loss |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  rows = {}
  for r in records:
    if r["case"] != PLAIN_TF or r["split"].startswith("1x"):
      rows.setdefault((r["case"], r["split"]), []).append(r)
  for (case, split), group in rows.items():
    step_s = max(r["step_s"] for r in group)
    processes = "1 x 1" if case == PLAIN_TF else split.replace("x", " x ")
    print(f"| {case} | {processes} | {max(r['num_ops'] for r in group)} | "
          f"{max(r['lowering_s'] for r in group):.2f} | {max(r['first_step_s'] for r in group):.2f} | "
          f"{step_s * 1e3:.1f} | {plain[split]['step_s'] * 1e3:.1f} | "
          f"{step_s / plain[split]['step_s']:.2f}x | {group[0]['first_loss']:.5f} | "
          f"{group[0]['last_loss']:.5f} |")


def check_losses_agree(records: list, rtol: float = 1e-4) -> None:
  """Every process of every split computed the same first and last loss per layout."""
  for case in {r["case"] for r in records if r["case"] != PLAIN_TF}:
    for key in ("first_loss", "last_loss"):
      losses = [r[key] for r in records if r["case"] == case]
      if not np.allclose(losses, losses[0], rtol=rtol):
        raise AssertionError(f"{case}: the splits' {key}es differ: {losses}")
  print(f"\nfirst and last losses of every split and process agree (rtol {rtol})")


def main(argv: Optional[list] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--splits", default="1x8,2x4,4x2", help="processes x devices, 1x8 first")
  parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--steps", type=int, default=1, help="steps per timed repetition")
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--quick", action="store_true", help="1x8 and 2x4, the 2-D layout, 1 repetition")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--out", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    worker(args)
    return
  if args.quick:
    args.splits, args.layouts, args.reps, args.warmup = "1x8,2x4", "2-D", 1, 0
  if not args.splits.startswith("1x"):
    parser.error("--splits must start with a one-process split (1xN)")
  print(f"load average before: {os.getloadavg()}; CPUs: {os.cpu_count()}")
  records = []
  with tempfile.TemporaryDirectory() as tmp:
    for split in args.splits.split(","):
      start = time.perf_counter()
      records += run_split(split, args, os.path.join(tmp, split))
      print(f"{split}: {time.perf_counter() - start:.0f} s", flush=True)
  print_table(records)
  check_losses_agree(records)
  print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
  main()
