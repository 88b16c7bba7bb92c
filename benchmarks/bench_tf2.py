"""TF2 use of mtf: a step lowered once into a TF function (mtf.tf2) against session mode and eager.

Two tables, every case timed interleaved (`--reps` repetitions of `--steps` calls, medians):

1. The benchmark Transformer's training step (benchmarks/_transformer_model.py) on each mesh,
   in session mode (a tf.compat.v1 Session, as bench_transformer.py builds it) and as a
   `mtf.tf2.MeshModule.function` called from eager code. Goal: the function within 1.10x of
   the same mesh in session mode.
2. The eager 2-layer MLP (batch 64, 256 -> 1024 -> 256 by default; `--mlp 512,1024,4096` is
   issue #37's), forward and backward (loss and both weight gradients): plain TF eager
   (GradientTape), plain TF in a tf.function, and on each of two meshes of 8 virtual CPUs
   (data-parallel 8, and 2x4: the batch over 2, the hidden units over 4) the floor (plain TF
   written by hand over the 8 device-placed shards, backward and sums included, eager and in a
   tf.function), mtf built and lowered at every call (what eager callers of mtf.Lowering pay
   without the lowering cache), the mtf.tf2 function's graph built at every call and served by
   the lowering cache (mtf.lowering_cache: its program runs, nothing is lowered), and a mtf.tf2
   function. Every case is reported against plain TF eager on one device and against its mesh's
   floor in its own mode (eager cases against the eager floor, functions against the
   tf.function floor; one-device cases against data-parallel 8's).
   Goals: mtf on one device within 2x of plain TF eager; the mtf.tf2 function within 1.1x of
   the floor on both meshes; the lowering cache within 1.2x of the mtf.tf2 function (a third
   table gives the cache against the function and against lowering at every call).

    python benchmarks/bench_tf2.py [--reps 5] [--steps 10] [--layouts "one device,data-parallel 8"]
                                   [--mlp BATCH,IN,HIDDEN]
"""

from __future__ import annotations

import argparse
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class MlpSize:
  """The eager MLP's batch and widths: in -> hidden -> in."""

  batch: int = 64
  inp: int = 256
  hidden: int = 1024

  @classmethod
  def parse(cls, text: str) -> MlpSize:
    """"BATCH,IN,HIDDEN" -> MlpSize; the batch must split into NUM_CPUS shards."""
    size = cls(*(int(n) for n in text.split(",")))
    if size.batch % NUM_CPUS:
      raise ValueError(f"--mlp batch {size.batch} does not split into {NUM_CPUS} shards: "
                       f"pick a multiple of {NUM_CPUS}")
    return size


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


def _mlp_data(size: MlpSize):
  rng = np.random.RandomState(0)
  return (tf.constant(rng.randn(size.batch, size.inp).astype(np.float32)),
          (rng.randn(size.inp, size.hidden) / 16).astype(np.float32),
          (rng.randn(size.hidden, size.inp) / 32).astype(np.float32))


def _compiled(step: Callable, compiled: bool) -> Callable:
  """A call running step (eagerly, or as a tf.function) and returning its tensors as arrays."""
  run = tf2.function(step) if compiled else step
  return lambda: [t.numpy() for t in run()]


def plain_mlp_case(size: MlpSize, compiled: bool) -> Callable:
  x, w1_value, w2_value = _mlp_data(size)
  w1, w2 = tf2.Variable(w1_value), tf2.Variable(w2_value)

  def step():
    with tf2.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)))
    return [loss] + tape.gradient(loss, [w1, w2])
  return _compiled(step, compiled)


@dataclasses.dataclass(frozen=True)
class HandMesh:
  """A hand-written floor's mesh: the batch split `rows` ways, the hidden units `cols` ways."""

  name: str
  rows: int
  cols: int
  mtf_shape: str  # the same mesh and layout in mtf
  mtf_layout: str


HAND_MESHES = (HandMesh("data-parallel 8", NUM_CPUS, 1, "all:8", "batch:all"),
               HandMesh("2x4", 2, 4, "b:2;m:4", "batch:b;hidden:m"))


def plain_mesh_mlp_case(size: MlpSize, mesh: HandMesh, compiled: bool) -> Callable:
  """The floor: the MLP written by hand over rows x cols device-placed shards, backward included.

  Device (i, j) (cpu:i*cols+j) holds batch shard i and hidden shard j of both weights (kept as
  variables of their own, as mtf keeps its slices). Sums over j (the output) and over i (the
  weight gradients) are tf.add_n, and each matmul uses the kernel that is fastest for its
  operands here: MatMul, transpose_a for a weight gradient, BatchMatMulV2 with adj_y for the
  hidden units' gradient (oneDNN's MatMul is slow with transpose_b). Each shard's loss is its
  part of the whole batch's mean, so the sums are the whole batch's loss and gradients.
  """
  x, w1_value, w2_value = _mlp_data(size)
  w1 = [tf2.Variable(v) for v in np.split(w1_value, mesh.cols, axis=1)]
  w2 = [tf2.Variable(v) for v in np.split(w2_value, mesh.cols, axis=0)]
  scale = 1.0 / (size.batch * size.inp)

  def device(i, j):
    return tf.device(f"cpu:{i * mesh.cols + j}")

  def step():
    xs = tf.split(x, mesh.rows)
    losses, w1_grads, w2_grads = [], [[] for _ in w1], [[] for _ in w2]
    for i, x_i in enumerate(xs):
      hidden = []
      for j in range(mesh.cols):
        with device(i, j):
          pre = tf.matmul(x_i, w1[j])
          hidden.append((pre, tf.nn.relu(pre)))
      with device(i, 0):
        out = tf.add_n([tf.matmul(h, w2[j]) for j, (_, h) in enumerate(hidden)])
        losses.append(tf.reduce_sum(tf.square(out)) * scale)
        d_out = out * (2 * scale)
      for j, (pre, h) in enumerate(hidden):
        with device(i, j):
          d_h = tf.raw_ops.BatchMatMulV2(x=d_out, y=w2[j], adj_y=True)
          w2_grads[j].append(tf.matmul(h, d_out, transpose_a=True))
          w1_grads[j].append(tf.matmul(x_i, tf.raw_ops.ReluGrad(gradients=d_h, features=pre),
                                       transpose_a=True))
    with tf.device("cpu:0"):
      return [tf.add_n(losses), tf.concat([tf.add_n(g) for g in w1_grads], axis=1),
              tf.concat([tf.add_n(g) for g in w2_grads], axis=0)]
  return _compiled(step, compiled)


def _mtf_mlp(size: MlpSize, mesh, x, w1, w2):
  """(loss, [d loss / d w1, d loss / d w2]) of the MLP; w1, w2 mtf Tensors."""
  batch, inp = mtf.Dimension("batch", size.batch), mtf.Dimension("inp", size.inp)
  hidden = mtf.Dimension("hidden", size.hidden)
  h = mtf.relu(mtf.einsum([mtf.import_tf_tensor(mesh, x, [batch, inp]), w1], [batch, hidden]))
  out = mtf.einsum([h, w2], [batch, inp])
  loss = mtf.reduce_mean(mtf.square(out))
  return loss, mtf.gradients([loss], [w1, w2])


def mtf_mlp_lowered_per_call(size: MlpSize, mesh_shape: str, layout: str) -> Callable:
  """What an eager caller of mtf.Lowering pays: the mtf graph built and lowered at every call.

  The lowering cache is switched off for the call (with it, see mtf_mlp_lowering_cache).
  """
  x, w1_value, w2_value = _mlp_data(size)
  w1, w2 = tf2.Variable(w1_value), tf2.Variable(w2_value)
  inp, hidden = mtf.Dimension("inp", size.inp), mtf.Dimension("hidden", size.hidden)

  def step():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    loss, grads = _mtf_mlp(size, mesh, x, mtf.import_fully_replicated(mesh, w1, [inp, hidden]),
                           mtf.import_fully_replicated(mesh, w2, [hidden, inp]))
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, _devices(mesh_shape))
    with mtf.lowering_cache(enabled=False):
      lowering = mtf.Lowering(graph, {mesh: impl})
    return [lowering.export_to_tf_tensor(t).numpy() for t in [loss] + grads]
  return step


def _mtf_mlp_of_variables(size: MlpSize, mesh, w1_value, w2_value, x):
  """The mtf.tf2 function's graph: the MLP of two mtf variables, its loss and their gradients."""
  inp, hidden = mtf.Dimension("inp", size.inp), mtf.Dimension("hidden", size.hidden)
  w1 = mtf.get_variable(mesh, "w1", [inp, hidden], initializer=tf.constant_initializer(w1_value))
  w2 = mtf.get_variable(mesh, "w2", [hidden, inp], initializer=tf.constant_initializer(w2_value))
  loss, grads = _mtf_mlp(size, mesh, x, w1, w2)
  return [loss] + grads


def mtf_mlp_lowering_cache(size: MlpSize, mesh_shape: str, layout: str) -> Callable:
  """The mtf.tf2 function's graph built and mtf.Lowering-ed eagerly at every call, its variables
  kept by tf.compat.v1.make_template: the process's lowering cache lowers it twice, then runs
  its program."""
  x, w1_value, w2_value = _mlp_data(size)

  def step():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    outputs = _mtf_mlp_of_variables(size, mesh, w1_value, w2_value, x)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, _devices(mesh_shape))
    lowering = mtf.Lowering(graph, {mesh: impl})
    return [lowering.export_to_tf_tensor(t).numpy() for t in outputs]
  return tf.make_template("mlp", step)


def mtf_mlp_function(size: MlpSize, mesh_shape: str, layout: str) -> Callable:
  x, w1_value, w2_value = _mlp_data(size)
  module = mtf.tf2.MeshModule(mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout,
                                                                         _devices(mesh_shape)))

  def fn(mesh, x):
    return _mtf_mlp_of_variables(size, mesh, w1_value, w2_value, x), []
  step = module.function(fn, [tf2.TensorSpec([size.batch, size.inp], tf.float32)])
  return lambda: [t.numpy() for t in step(x)]


def floor_name(mesh: HandMesh, compiled: bool) -> str:
  return f"plain TF {mesh.name} {'tf.function' if compiled else 'eager'} (floor)"


def mlp_cases(size: MlpSize) -> dict:
  """Case name -> (call, the name of the floor it is compared with: its mesh's, in its own mode)."""
  dp8, two_by_four = HAND_MESHES
  cases = {"plain TF eager": (plain_mlp_case(size, False), floor_name(dp8, False)),
           "plain TF tf.function": (plain_mlp_case(size, True), floor_name(dp8, True)),
           "mtf one device, lowered per call": (
               mtf_mlp_lowered_per_call(size, "all:1", ""), floor_name(dp8, False)),
           "mtf one device, lowering cache": (
               mtf_mlp_lowering_cache(size, "all:1", ""), floor_name(dp8, False)),
           "mtf one device, mtf.tf2 function": (
               mtf_mlp_function(size, "all:1", ""), floor_name(dp8, True))}
  for mesh in HAND_MESHES:
    for compiled in (False, True):
      cases[floor_name(mesh, compiled)] = (plain_mesh_mlp_case(size, mesh, compiled),
                                           floor_name(mesh, compiled))
    cases[f"mtf {mesh.name}, lowered per call"] = (
        mtf_mlp_lowered_per_call(size, mesh.mtf_shape, mesh.mtf_layout), floor_name(mesh, False))
    cases[f"mtf {mesh.name}, lowering cache"] = (
        mtf_mlp_lowering_cache(size, mesh.mtf_shape, mesh.mtf_layout), floor_name(mesh, False))
    cases[f"mtf {mesh.name}, mtf.tf2 function"] = (
        mtf_mlp_function(size, mesh.mtf_shape, mesh.mtf_layout), floor_name(mesh, True))
  return cases


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
  parser.add_argument("--mlp", type=MlpSize.parse, default=MlpSize(),
                      help="the eager MLP's BATCH,IN,HIDDEN (issue #37's: 512,1024,4096)")
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

  size = args.mlp
  mlp = mlp_cases(size)
  _check_same({name: call for name, (call, _) in mlp.items()})
  seconds = time_interleaved({name: call for name, (call, _) in mlp.items()}, args.reps, args.steps)
  eager, eager_best = seconds["plain TF eager"]
  print(f"\nEager MLP, batch {size.batch}, {size.inp} -> {size.hidden} -> {size.inp}, forward + "
        f"backward; the floor: plain TF by hand over the mesh's {NUM_CPUS} device-placed shards, "
        f"in the case's mode\n")
  print("| case | ms (median) | ratio to plain TF eager | ratio to the floor | best ms | best ratio "
        "| best ratio to the floor |")
  print("|---|---|---|---|---|---|---|")
  for name, (s, best) in seconds.items():
    floor, floor_best = seconds[mlp[name][1]]
    print(f"| {name} | {s * 1e3:.2f} | {s / eager:.2f}x | {s / floor:.2f}x | {best * 1e3:.2f} | "
          f"{best / eager_best:.2f}x | {best / floor_best:.2f}x |")
  print("\nThe lowering cache (the graph built at every call, its program run) against the "
        "mtf.tf2 function and against lowering at every call\n")
  print("| mesh | cache ms (median) | / mtf.tf2 function | / lowered per call | best: / function "
        "| best: / lowered per call |")
  print("|---|---|---|---|---|---|")
  for mesh in ("one device",) + tuple(m.name for m in HAND_MESHES):
    (c, c_best), (f, f_best), (p, p_best) = (seconds[f"mtf {mesh}, {case}"] for case in (
        "lowering cache", "mtf.tf2 function", "lowered per call"))
    print(f"| {mesh} | {c * 1e3:.2f} | {c / f:.2f}x | {c / p:.2f}x | {c_best / f_best:.2f}x | "
          f"{c_best / p_best:.2f}x |")
  print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
  main()
