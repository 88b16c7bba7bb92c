"""TF2 use of mtf: a step lowered once into a TF function (mtf.tf2) against session mode and eager.

Two tables, every case timed interleaved (`--reps` repetitions of `--steps` calls, medians):

1. The benchmark Transformer's training step (benchmarks/_transformer_model.py) on each mesh,
   in session mode (a tf.compat.v1 Session, as bench_transformer.py builds it) and as a
   `mtf.tf2.MeshModule.function` called from eager code. Goal: the function within 1.10x of
   the same mesh in session mode.
2. The eager 2-layer MLP (batch 64, 256 -> 1024 -> 256), forward and backward (loss and both
   weight gradients): plain TF eager (GradientTape), plain TF in a tf.function, mtf built and
   lowered at every call (what eager callers of mtf.Lowering pay), and a mtf.tf2 function.
   Goal: mtf on one device within 2x of plain TF eager.

    python benchmarks/bench_tf2.py [--reps 5] [--steps 10] [--layouts "one device,data-parallel 8"]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np
import tensorflow as tf2
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

NUM_CPUS = 8
tf2.config.set_logical_device_configuration(  # before any TF op: the mesh's virtual CPUs
    tf2.config.list_physical_devices("CPU")[0], [tf2.config.LogicalDeviceConfiguration()] * NUM_CPUS)

import mesh_tensorflow as mtf  # noqa: E402
from benchmarks import _transformer_model as model  # noqa: E402
from benchmarks import bench_transformer  # noqa: E402

LAYOUTS = {name: bench_transformer.LAYOUTS[name]
           for name in ("one device", "data-parallel 8", "2x4 (batch x model)")}
MLP_BATCH, MLP_IN, MLP_HIDDEN = 64, 256, 1024


def _devices(mesh_shape: str) -> list:
  return [f"cpu:{i}" for i in range(mtf.convert_to_shape(mesh_shape).size)]


def time_interleaved(cases: dict, reps: int, steps: int, warmup: int = 2) -> dict:
  """name -> (median, best) seconds per call of cases[name]() over the repetitions.

  Each call returns once its result is ready. The best repetition is the one least disturbed
  by other work on the machine; on a loaded machine compare cases by it.
  """
  for call in cases.values():
    for _ in range(warmup):
      call()
  times = {name: [] for name in cases}
  for _ in range(reps):
    for name, call in cases.items():
      start = time.perf_counter()
      for _ in range(steps):
        call()
      times[name].append((time.perf_counter() - start) / steps)
  return {name: (statistics.median(t), min(t)) for name, t in times.items()}


# ---------------------------------------------------------------------------------------------
# 1. the Transformer step


def transformer_session_case(cfg, name: str) -> tuple:
  """(a call running one step, the first step's loss)."""
  shape, layout = LAYOUTS[name]
  case = bench_transformer.build_mtf(cfg, name, shape, layout, "placement", NUM_CPUS)
  return (lambda: case.session.run(case.fetches, case.feed)[0]), case.first_loss


def transformer_function_case(cfg, name: str) -> tuple:
  """(a call running one step, the first step's loss)."""
  shape, layout = LAYOUTS[name]
  module = mtf.tf2.MeshModule(mtf.placement_mesh_impl.PlacementMeshImpl(shape, layout, _devices(shape)))
  values = model.initial_values(cfg)
  step = module.function(
      lambda mesh, inputs, targets: model.mtf_train_step(cfg, mesh, inputs, targets, values),
      [tf2.TensorSpec([cfg.batch, cfg.length], tf.int32)] * 2)
  inputs, targets = (tf.constant(a) for a in model.batch_of_tokens(cfg, 0))
  return (lambda: step(inputs, targets).numpy()), float(step(inputs, targets))


# ---------------------------------------------------------------------------------------------
# 2. the eager MLP


def _mlp_data():
  rng = np.random.RandomState(0)
  return (tf.constant(rng.randn(MLP_BATCH, MLP_IN).astype(np.float32)),
          (rng.randn(MLP_IN, MLP_HIDDEN) / 16).astype(np.float32),
          (rng.randn(MLP_HIDDEN, MLP_IN) / 32).astype(np.float32))


def plain_mlp_case(compiled: bool) -> Callable:
  x, w1_value, w2_value = _mlp_data()
  w1, w2 = tf2.Variable(w1_value), tf2.Variable(w2_value)

  def step():
    with tf2.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)))
    return [loss] + tape.gradient(loss, [w1, w2])

  run = tf2.function(step) if compiled else step
  return lambda: [t.numpy() for t in run()]


def _mtf_mlp(mesh, x, w1, w2):
  """(loss, [d loss / d w1, d loss / d w2]) of the MLP; w1, w2 mtf Tensors."""
  batch, inp = mtf.Dimension("batch", MLP_BATCH), mtf.Dimension("inp", MLP_IN)
  hidden = mtf.Dimension("hidden", MLP_HIDDEN)
  h = mtf.relu(mtf.einsum([mtf.import_tf_tensor(mesh, x, [batch, inp]), w1], [batch, hidden]))
  out = mtf.einsum([h, w2], [batch, inp])
  loss = mtf.reduce_mean(mtf.square(out))
  return loss, mtf.gradients([loss], [w1, w2])


def mtf_mlp_lowered_per_call(mesh_shape: str, layout: str) -> Callable:
  """What an eager caller of mtf.Lowering pays: the mtf graph built and lowered at every call."""
  x, w1_value, w2_value = _mlp_data()
  w1, w2 = tf2.Variable(w1_value), tf2.Variable(w2_value)
  inp, hidden = mtf.Dimension("inp", MLP_IN), mtf.Dimension("hidden", MLP_HIDDEN)

  def step():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    loss, grads = _mtf_mlp(mesh, x, mtf.import_fully_replicated(mesh, w1, [inp, hidden]),
                           mtf.import_fully_replicated(mesh, w2, [hidden, inp]))
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, _devices(mesh_shape))
    lowering = mtf.Lowering(graph, {mesh: impl})
    return [lowering.export_to_tf_tensor(t).numpy() for t in [loss] + grads]
  return step


def mtf_mlp_function(mesh_shape: str, layout: str) -> Callable:
  x, w1_value, w2_value = _mlp_data()
  inp, hidden = mtf.Dimension("inp", MLP_IN), mtf.Dimension("hidden", MLP_HIDDEN)
  module = mtf.tf2.MeshModule(mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout,
                                                                         _devices(mesh_shape)))

  def fn(mesh, x):
    w1 = mtf.get_variable(mesh, "w1", [inp, hidden], initializer=tf.constant_initializer(w1_value))
    w2 = mtf.get_variable(mesh, "w2", [hidden, inp], initializer=tf.constant_initializer(w2_value))
    loss, grads = _mtf_mlp(mesh, x, w1, w2)
    return [loss] + grads, []
  step = module.function(fn, [tf2.TensorSpec([MLP_BATCH, MLP_IN], tf.float32)])
  return lambda: [t.numpy() for t in step(x)]


def _check_same(cases: dict) -> None:
  """Every case computes the same loss and gradients (to float32 rounding)."""
  reference_name, reference = next(iter(cases.items()))
  expected = reference()
  for name, call in cases.items():
    for got, want in zip(call(), expected):
      np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6,
                                 err_msg=f"{name} differs from {reference_name}")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
  args = parser.parse_args(argv)
  tf.logging.set_verbosity(tf.logging.ERROR)
  print(f"load average before: {os.getloadavg()}; CPUs: {os.cpu_count()}")

  cfg = model.Config()
  names = args.layouts.split(",")
  cases = {}
  for name in names:
    cases[f"{name}, session"], session_loss = transformer_session_case(cfg, name)
    cases[f"{name}, mtf.tf2 function"], function_loss = transformer_function_case(cfg, name)
    np.testing.assert_allclose(function_loss, session_loss, rtol=1e-5,
                               err_msg=f"{name}: the first steps' losses differ")
  seconds = time_interleaved(cases, args.reps, args.steps)
  print("\nTransformer training step (ms, median)\n")
  print("| mesh | session | mtf.tf2 function | function / session | best: session | best: function "
        "| best: function / session |")
  print("|---|---|---|---|---|---|---|")
  for name in names:
    (s, s_best), (f, f_best) = seconds[f"{name}, session"], seconds[f"{name}, mtf.tf2 function"]
    print(f"| {name} | {s * 1e3:.1f} | {f * 1e3:.1f} | {f / s:.2f}x | {s_best * 1e3:.1f} | "
          f"{f_best * 1e3:.1f} | {f_best / s_best:.2f}x |")

  mlp = {"plain TF eager": plain_mlp_case(False),
         "plain TF tf.function": plain_mlp_case(True),
         "mtf one device, lowered per call": mtf_mlp_lowered_per_call("all:1", ""),
         "mtf data-parallel 8, lowered per call": mtf_mlp_lowered_per_call("all:8", "batch:all"),
         "mtf one device, mtf.tf2 function": mtf_mlp_function("all:1", ""),
         "mtf data-parallel 8, mtf.tf2 function": mtf_mlp_function("all:8", "batch:all")}
  _check_same(mlp)
  seconds = time_interleaved(mlp, args.reps, args.steps)
  eager, eager_best = seconds["plain TF eager"]
  print(f"\nEager MLP, batch {MLP_BATCH}, {MLP_IN} -> {MLP_HIDDEN} -> {MLP_IN}, forward + backward\n")
  print("| case | ms (median) | ratio to plain TF eager | best ms | best ratio |")
  print("|---|---|---|---|---|")
  for name, (s, best) in seconds.items():
    print(f"| {name} | {s * 1e3:.2f} | {s / eager:.2f}x | {best * 1e3:.2f} | {best / eager_best:.2f}x |")
  print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
  main()
