"""A small mtf training run on CollectiveMeshImpl, for 1 process x 8 devices or N processes.

Run directly (one process, 8 virtual CPUs) or under `python -m mesh_tensorflow.launch`. Every
task writes its per-step losses and gradients to <out>/rank<R>.json; the chief saves a checkpoint
after every step. --die_at_step kills task 1 (SIGKILL) there, once the chief has saved the steps
before it (its save would otherwise race the launcher stopping the chief); --restore resumes
from the latest checkpoint in --ckpt_dir. Tests also call `train` in their own process (1 x 8 reference).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import time

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
          restore: bool = False, die_at_step: int = -1) -> list:
  """Runs `steps` SGD steps; returns per step {"step", "loss", "grads"} (grads as nested lists)."""
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


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--layouts", default="2d", help="comma-separated names from LAYOUTS")
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--out", required=True)
  parser.add_argument("--ckpt_dir", default="")
  parser.add_argument("--die_at_step", type=int, default=-1)
  parser.add_argument("--restore", action="store_true")
  args = parser.parse_args()
  tf.disable_eager_execution()
  cluster = Cluster.from_tf_config()
  results = {name: train(*LAYOUTS[name], args.steps, cluster, args.ckpt_dir, args.restore, args.die_at_step)
             for name in args.layouts.split(",")}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"rank{cluster.task_index if cluster else 0}.json"), "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main()
