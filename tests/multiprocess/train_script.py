"""A small mtf training run on CollectiveMeshImpl, for 1 process x 8 devices or N processes.

Run directly (one process, 8 virtual CPUs) or under `python -m mesh_tensorflow.launch`. Every
task writes its per-step losses and gradients to <out>/rank<R>.json, after every step (so a run
that is stopped keeps the steps it finished). With --ckpt_dir the chief saves a checkpoint of the
last of --layouts after every step; --die_at_step kills task 1 (SIGKILL) there in that layout,
once the chief has saved the steps before it (its save would otherwise race the launcher stopping
the chief); --restore resumes it from the latest checkpoint in --ckpt_dir. Tests also call `train`
in their own process (1 x 8 reference).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import time
from typing import Callable, Optional

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.collective_mesh_impl import Cluster, CollectiveMeshImpl

BATCH, D_IN, HIDDEN, D_OUT = 8, 4, 8, 4


def build(mesh):
  """Loss of a two-layer ReLU net with dropout on a fixed batch, its gradients and an SGD update.

  Dropout draws a fresh mask at every run; every process draws its slices of the same mask.
  """
  batch, d_in = mtf.Dimension("batch", BATCH), mtf.Dimension("d_in", D_IN)
  hidden, d_out = mtf.Dimension("hidden", HIDDEN), mtf.Dimension("d_out", D_OUT)
  rng = np.random.RandomState(0)
  x = mtf.import_tf_tensor(mesh, tf.constant(rng.randn(BATCH, D_IN).astype(np.float32)), [batch, d_in])
  y = mtf.import_tf_tensor(mesh, tf.constant(rng.randn(BATCH, D_OUT).astype(np.float32)), [batch, d_out])
  w1 = mtf.get_variable(mesh, "w1", [d_in, hidden])  # random init: same seed, same values everywhere
  w2 = mtf.get_variable(mesh, "w2", [hidden, d_out])
  h = mtf.dropout(mtf.relu(mtf.einsum([x, w1], output_shape=[batch, hidden])), rate=0.25)
  out = mtf.einsum([h, w2], output_shape=[batch, d_out])
  loss = mtf.reduce_mean(mtf.square(out - y))
  grads = mtf.gradients([loss], [w1, w2])
  update = mtf.optimize.SgdOptimizer(0.1).apply_grads(grads, [w1.operation, w2.operation])
  return loss, grads, update


LAYOUTS = {  # name: (mesh shape, layout rules)
    "data": ("all:8", "batch:all"),
    "model": ("all:8", "hidden:all"),
    "2d": ("b:2;m:4", "batch:b;hidden:m"),
}


def train(mesh_shape: str, layout: str, steps: int, cluster=None, ckpt_dir: str = "",
          restore: bool = False, die_at_step: int = -1,
          after_step: Optional[Callable[[list], None]] = None) -> list:
  """Runs `steps` SGD steps; returns per step {"step", "loss", "grads"} (grads as nested lists).

  after_step(records so far) is called after every step.
  """
  rank = cluster.task_index if cluster else 0
  # A container per run: sessions on one server share variables by name (see Cluster).
  with tf.Graph().as_default() as tf_graph, tf.container(f"{mesh_shape}/{layout}"):
    tf.set_random_seed(1)
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    loss, grads, update = build(mesh)
    mesh_impl = CollectiveMeshImpl(mesh_shape, layout, cluster=cluster,
                                   devices=None if cluster else ["/cpu:%d" % i for i in range(8)])
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    fetches = [lowering.export_to_tf_tensor(t) for t in [loss, *grads]]
    train_op = tf.group([lowering.lowered_operation(op) for op in update])
    step_var = tf.train.get_or_create_global_step()
    next_step = tf.assign_add(step_var, 1)
    save_masters = lowering.copy_slices_to_masters()
    load_masters = lowering.copy_masters_to_slices()
    saver = tf.train.Saver(tf.global_variables())
    if cluster:
      sess = cluster.session(graph=tf_graph)
    else:
      sess = tf.Session(graph=tf_graph, config=tf.ConfigProto(device_count={"CPU": 8}))
    if ckpt_dir and rank == 0:
      os.makedirs(ckpt_dir, exist_ok=True)
    records = []
    with sess:
      sess.run(tf.global_variables_initializer())
      latest = tf.train.latest_checkpoint(ckpt_dir) if restore else None
      if latest:
        saver.restore(sess, latest)
      sess.run(load_masters)
      run = functools.partial(cluster.run, sess) if cluster else sess.run
      for _ in range(steps):
        step = int(sess.run(step_var))
        if step == die_at_step and rank == 1:
          _wait_for_the_chiefs_checkpoint(ckpt_dir, step)
          os.kill(os.getpid(), signal.SIGKILL)
        values = run(fetches)
        run(train_op)
        sess.run(next_step)
        records.append({"step": step, "loss": float(values[0]), "grads": [v.tolist() for v in values[1:]]})
        if ckpt_dir:
          run(save_masters)  # every task: the gather is collective
          if rank == 0:
            saver.save(sess, os.path.join(ckpt_dir, "model"), global_step=step + 1)
        print(f"step {step} loss {values[0]:.6f}", flush=True)
        if after_step:
          after_step(records)
  return records


def _wait_for_the_chiefs_checkpoint(ckpt_dir: str, step: int, timeout_seconds: float = 60.0) -> None:
  """Until the chief's checkpoint after `step` steps is written (if a ckpt_dir is given).

  The launcher stops every task when one dies, so dying at once would race the chief's save of
  the step before; the tests want that checkpoint whole.
  """
  if not ckpt_dir or step == 0:
    return
  deadline = time.monotonic() + timeout_seconds
  while not (tf.train.latest_checkpoint(ckpt_dir) or "").endswith(f"model-{step}"):
    if time.monotonic() > deadline:
      raise TimeoutError(f"the chief wrote no checkpoint model-{step} in {ckpt_dir} "
                         f"within {timeout_seconds} s")
    time.sleep(0.05)


def train_layouts(cluster, names: list, steps: int, out: str, ckpt_dir: str = "", restore: bool = False,
                  die_at_step: int = -1) -> None:
  """Trains each layout of `names` in turn, writing every step's record to <out>/rank<R>.json.

  ckpt_dir, restore and die_at_step apply to the last layout (a checkpoint holds one run).
  """
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, f"rank{cluster.task_index if cluster else 0}.json")
  results = {}

  def write(name, records):
    results[name] = records
    with open(path + ".tmp", "w") as f:  # then renamed: a task stopped while writing leaves the last file
      json.dump(results, f)
    os.replace(path + ".tmp", path)

  for i, name in enumerate(names):
    last = i == len(names) - 1
    train(*LAYOUTS[name], steps, cluster, ckpt_dir if last else "", restore and last,
          die_at_step if last else -1, after_step=functools.partial(write, name))


def add_flags(parser: argparse.ArgumentParser) -> None:
  """The flags of a training run (also cluster_checks_script.py's)."""
  parser.add_argument("--layouts", default="2d", help="comma-separated names from LAYOUTS")
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--out", required=True)
  parser.add_argument("--ckpt_dir", default="", help="checkpoints of the last of --layouts")
  parser.add_argument("--die_at_step", type=int, default=-1, help="task 1 dies there, in the last layout")
  parser.add_argument("--restore", action="store_true")


def train_as_flagged(cluster, args: argparse.Namespace) -> None:
  """train_layouts as the flags of add_flags say."""
  train_layouts(cluster, args.layouts.split(","), args.steps, args.out, args.ckpt_dir, args.restore,
                args.die_at_step)


def main():
  parser = argparse.ArgumentParser()
  add_flags(parser)
  args = parser.parse_args()
  tf.disable_eager_execution()
  train_as_flagged(Cluster.from_tf_config(), args)


if __name__ == "__main__":
  main()
