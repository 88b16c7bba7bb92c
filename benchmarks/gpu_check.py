"""The benchmark Transformer on one GPU: plain TF against mtf, XLA off and on, and mtf over 2 and 4
logical GPUs carved out of the one physical GPU with the placement and the collective backends.

Every case is a TF2 function (plain TF: a tf.function; mtf: `mtf.tf2.MeshModule.function`), timed
interleaved (`--reps` repetitions of `--steps` steps, medians), one table. `--dry` runs the same
cases on virtual CPUs with a tiny model, so the suite can check the script without a GPU.

    python benchmarks/gpu_check.py [--dry] [--reps 5] [--steps 10] [--gpu_memory_mb 8192]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import tensorflow as tf2
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

NUM_LOGICAL = 4  # logical devices carved out of the one physical device
TINY = {"num_layers": 1, "d_model": 32, "d_ff": 64, "heads": 2, "length": 8, "batch": 8, "vocab": 64}


def carve_devices(dry: bool, memory_mb: int) -> str:
  """Splits the one GPU (dry: the CPU) into NUM_LOGICAL logical devices; returns their type.

  Must run before any TF op. Without a GPU and without --dry it raises: the check would
  otherwise time CPUs and call them GPUs.
  """
  if dry:
    tf2.config.set_logical_device_configuration(
        tf2.config.list_physical_devices("CPU")[0], [tf2.config.LogicalDeviceConfiguration()] * NUM_LOGICAL)
    return "cpu"
  gpus = tf2.config.list_physical_devices("GPU")
  if not gpus:
    raise SystemExit("gpu_check: no GPU visible to TensorFlow; run with --dry to check the script on CPUs")
  tf2.config.set_logical_device_configuration(
      gpus[0], [tf2.config.LogicalDeviceConfiguration(memory_limit=memory_mb)] * NUM_LOGICAL)
  return "gpu"


def plain_case(cfg, model, device: str, jit_compile: bool) -> Callable:
  """One SGD step of the plain-TF Transformer on `device`; returns the loss."""
  inputs, targets = (tf.constant(a) for a in model.batch_of_tokens(cfg, 0))
  with tf.device(device):
    weights = {name: tf2.Variable(value) for name, value in model.initial_values(cfg).items()}

  @tf2.function(jit_compile=jit_compile)
  def step(inputs, targets):
    with tf.device(device), tf2.GradientTape() as tape:
      loss = model.plain_tf_loss(cfg, inputs, targets, weights)
      grads = tape.gradient(loss, list(weights.values()))
      for w, g in zip(weights.values(), grads):
        w.assign_sub(cfg.learning_rate * tf.convert_to_tensor(g))  # embedding: slices
    return loss
  return lambda: float(step(inputs, targets))


def mtf_case(cfg, model, mtf, backend: str, devices: list, jit_compile: bool) -> Callable:
  """One SGD step of the mtf Transformer, data-parallel over `devices`; returns the loss."""
  shape, layout = f"all:{len(devices)}", "batch:all" if len(devices) > 1 else ""
  if backend == "placement":
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(shape, layout, devices, jit_compile=jit_compile)
  else:
    impl = mtf.collective_mesh_impl.CollectiveMeshImpl(shape, layout, devices, jit_compile=jit_compile)
  values = model.initial_values(cfg)
  step = mtf.tf2.MeshModule(impl).function(
      lambda mesh, inputs, targets: model.mtf_train_step(cfg, mesh, inputs, targets, values),
      [tf2.TensorSpec([cfg.batch, cfg.length], tf.int32)] * 2)
  inputs, targets = (tf.constant(a) for a in model.batch_of_tokens(cfg, 0))
  return lambda: float(step(inputs, targets))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dry", action="store_true", help="virtual CPUs and a tiny model: no GPU needed")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--gpu_memory_mb", type=int, default=8192, help="memory of each logical GPU")
  args = parser.parse_args(argv)
  kind = carve_devices(args.dry, args.gpu_memory_mb)

  import mesh_tensorflow as mtf  # after carve_devices: importing mtf runs TF ops
  from benchmarks import _transformer_model as model
  from benchmarks.bench_tf2 import time_interleaved
  tf.logging.set_verbosity(tf.logging.ERROR)
  cfg = model.Config(**TINY) if args.dry else model.Config()
  devices = [f"/{kind}:{i}" for i in range(NUM_LOGICAL)]
  cases = {}  # (case, logical devices, XLA) -> call
  for xla in (False, True):
    cases["plain TF", 1, xla] = plain_case(cfg, model, devices[0], xla)
    cases["mtf placement", 1, xla] = mtf_case(cfg, model, mtf, "placement", devices[:1], xla)
  for n in (2, NUM_LOGICAL):
    for backend in ("placement", "collective"):
      cases[f"mtf {backend}, data-parallel", n, False] = mtf_case(cfg, model, mtf, backend, devices[:n],
                                                                  False)
  first_loss = {key: call() for key, call in cases.items()}
  seconds = time_interleaved(cases, args.reps, args.steps)
  reference = seconds["plain TF", 1, False][0]
  physical = tf2.config.list_physical_devices(kind.upper())[0].name
  print(f"\ngpu_check: {'dry run on virtual CPUs, tiny model' if args.dry else 'one GPU'}; "
        f"{NUM_LOGICAL} logical {kind.upper()}s of {physical}\n")
  print("| case | logical devices | XLA | step ms (median) | best ms | ratio to plain TF, XLA off "
        "| first loss |")
  print("|---|---|---|---|---|---|---|")
  for (name, n, xla), (median, best) in seconds.items():
    print(f"| {name} | {n} | {'on' if xla else 'off'} | {median * 1e3:.2f} | {best * 1e3:.2f} | "
          f"{median / reference:.2f}x | {first_loss[name, n, xla]:.4f} |")


if __name__ == "__main__":
  main()
