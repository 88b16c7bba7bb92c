"""Transformer training step: mtf layouts against the same model in plain TensorFlow, one process.

The model (benchmarks/_transformer_model.py) is the performance issue's: 2 layers, d_model 256,
d_ff 1024, 4 heads, sequence 64, batch 16, vocabulary 1024, SGD, graph mode. Every case is built
once (lowering time, first-step time and TF op count are recorded then); the step times of all
cases are then measured interleaved, `--reps` times, and reported as medians and as ratios to
plain TF on one device. Memory: the bytes of the TF variables the program runs with, per device,
against what the layout needs (each processor's slices of every variable, optimizer state included).

    python benchmarks/bench_transformer.py [--reps 5] [--steps 10] [--backend placement|collective]
                                           [--dtype float32|bfloat16] [--no_graph_optimizer]
                                           [--lean_graph_optimizer]
                                           [--master_as_slice] [--masters whole|sliced]
                                           [--sweep] [--sweep_devices 1,2,...]
                                           [--jit_compile] [--no_fuse] [--intra_op_threads N]
                                           [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Optional

import numpy as np
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mesh_tensorflow as mtf  # noqa: E402
from benchmarks import _transformer_model as model  # noqa: E402

# name -> (mesh shape, layout rules); the device count comes from the mesh shape.
LAYOUTS = {
    "one device": ("all:1", ""),
    "data-parallel 8": ("all:8", "batch:all"),
    "model-parallel 8": ("all:8", "d_ff:all;vocab:all;d_kv:all"),
    "2x4 (batch x model)": ("b:2;m:4", "batch:b;d_ff:m;heads:m;vocab:m"),
}


def sweep_layout(num_devices: int) -> tuple:
  """Data-parallel up to the batch size (16), then the rest of the devices split the model."""
  if num_devices <= 16:
    return f"all:{num_devices}", "batch:all"
  return f"b:16;m:{num_devices // 16}", "batch:b;d_ff:m;heads:m;vocab:m"


@dataclasses.dataclass
class Case:
  """A built training step in its own graph and session."""

  name: str
  session: tf.Session
  fetches: list
  feed: dict
  build_s: float = 0.0  # lowering (mtf) or graph building (plain TF)
  first_step_s: float = 0.0
  num_ops: int = 0
  first_loss: float = 0.0
  max_device_bytes: int = 0  # bytes of TF variables on the most-loaded device
  needed_bytes: int = 0  # the most any processor's slices need
  total_bytes: int = 0
  step_times: list = dataclasses.field(default_factory=list)

  def time_steps(self, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
      self.session.run(self.fetches, self.feed)
    seconds = (time.perf_counter() - start) / steps
    self.step_times.append(seconds)
    return seconds

  @property
  def median_step_s(self) -> float:
    return statistics.median(self.step_times)


# Threads per kernel of every session (0: TF's default, every core; one value per process: TF
# fixes a process's CPU thread pools when its first session starts), and whether grappler skips
# what mtf's session_config_for_devices skips on CPUs (lean_graph_optimization).
SESSION_OPTIONS = {"intra_op_threads": 0, "lean_graph_optimizer": False}


def _session(graph, num_cpus: int, graph_optimizer: bool) -> tf.Session:
  """A session on num_cpus virtual CPUs; graph_optimizer False skips TF's graph optimisation passes."""
  config = tf.ConfigProto(device_count={"CPU": num_cpus},
                          intra_op_parallelism_threads=SESSION_OPTIONS["intra_op_threads"])
  config.graph_options.rewrite_options.disable_meta_optimizer = not graph_optimizer
  if SESSION_OPTIONS["lean_graph_optimizer"]:
    mtf.placement_mesh_impl.lean_graph_optimization(config.graph_options.rewrite_options)
  return tf.Session(graph=graph, config=config)


def _placeholders(cfg):
  return (tf.placeholder(tf.int32, [cfg.batch, cfg.length], name="inputs"),
          tf.placeholder(tf.int32, [cfg.batch, cfg.length], name="targets"))


def _start(case: Case, init_ops: list) -> Case:
  """Initialises the variables and runs (and times) the first step."""
  start = time.perf_counter()
  for op in init_ops:
    case.session.run(op)
  case.first_loss = float(case.session.run(case.fetches, case.feed)[0])
  case.first_step_s = time.perf_counter() - start
  return case


def _feed(cfg, inputs_ph, targets_ph) -> dict:
  inputs, targets = model.batch_of_tokens(cfg, 0)
  return {inputs_ph: inputs, targets_ph: targets}


def _build_plain(name: str, cfg, num_cpus: int, graph_optimizer: bool, train_step) -> Case:
  """A plain-TF case: train_step(inputs, targets, initial values) -> (loss, train op)."""
  graph = tf.Graph()
  start = time.perf_counter()
  with graph.as_default():
    inputs_ph, targets_ph = _placeholders(cfg)
    loss, train = train_step(inputs_ph, targets_ph, model.initial_values(cfg))
    init = tf.global_variables_initializer()
  build_s = time.perf_counter() - start
  case = Case(name, _session(graph, num_cpus, graph_optimizer), [loss, train],
              _feed(cfg, inputs_ph, targets_ph), build_s=build_s, num_ops=len(graph.get_operations()))
  case.max_device_bytes = case.needed_bytes = case.total_bytes = sum(
      v.size * 4 for v in model.initial_values(cfg).values())
  return _start(case, [init])


def build_plain_tf(cfg, num_cpus: int, dtype=tf.float32, graph_optimizer: bool = True) -> Case:
  def train_step(inputs, targets, values):
    with tf.device("/cpu:0"):
      return model.plain_tf_train_step(cfg, inputs, targets, values, dtype)
  return _build_plain(f"plain TF, one device ({dtype.name})", cfg, num_cpus, graph_optimizer, train_step)


def build_plain_tf_data_parallel(cfg, num_cpus: int, graph_optimizer: bool = True) -> Case:
  """Hand-written data parallelism over num_cpus devices in plain TF: what a mesh can reach."""
  devices = [f"/cpu:{i}" for i in range(num_cpus)]

  def train_step(inputs, targets, values):
    return model.plain_tf_data_parallel_train_step(cfg, inputs, targets, values, devices)
  return _build_plain(f"plain TF, data-parallel {num_cpus} (hand-written)", cfg, num_cpus,
                      graph_optimizer, train_step)


# Options of the backends' constructors (masters, fuse_slicewise, jit_compile), set from the
# command line.
IMPL_OPTIONS = {}


def _mesh_impl(backend: str, mesh_shape: str, layout: str, devices: list, master_as_slice: bool):
  if backend == "placement":
    return mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, devices, master_as_slice,
                                                     **IMPL_OPTIONS)
  from mesh_tensorflow.collective_mesh_impl import CollectiveMeshImpl
  return CollectiveMeshImpl(mesh_shape, layout, devices, **IMPL_OPTIONS)


def ops_run_by(fetches) -> set:
  """The TF ops a session runs for `fetches` (tensors or ops): their inputs, transitively."""
  todo = [f.op if isinstance(f, tf.Tensor) else f for f in fetches]
  seen = set()
  while todo:
    op = todo.pop()
    if op not in seen:
      seen.add(op)
      todo += [t.op for t in op.inputs] + list(op.control_inputs)
  return seen


def variable_bytes_per_device(graph, run=None) -> dict:
  """Device -> bytes of the TF variables placed there ("" counts as CPU:0, where TF puts it).

  With `run` (the fetches the program runs: initialisers, steps), only the variables those reach:
  TF creates no others. (A variable that nothing run reaches, such as the never-initialised master
  left in the graph by PlacementMeshImpl(masters="sliced"), holds no memory.)
  """
  ret = {}
  ops = graph.get_operations() if run is None else ops_run_by(run)
  for op in ops:
    if op.type not in ("VarHandleOp", "VariableV2"):
      continue
    shape = tf.TensorShape(op.get_attr("shape"))
    dtype = tf.as_dtype(op.get_attr("dtype"))
    device = tf.DeviceSpec.from_string(op.device or "/cpu:0")
    key = f"{device.device_type or 'CPU'}:{device.device_index or 0}"
    ret[key] = ret.get(key, 0) + shape.num_elements() * dtype.size
  return ret


def needed_bytes_per_processor(mtf_graph, mesh_impl) -> int:
  """The most bytes any processor's slices of all variables take (optimizer state included)."""
  per_processor = np.zeros(mesh_impl.size, np.int64)
  for v in mtf_graph.all_variables:
    slice_bytes = int(np.prod(mesh_impl.slice_shape(v.shape))) * v.slice_dtype.size
    per_processor += slice_bytes
  return int(per_processor.max())


def build_mtf(cfg, name: str, mesh_shape: str, layout: str, backend: str, num_cpus: int,
              slice_dtype=tf.float32, activation_dtype=tf.float32, graph_optimizer: bool = True,
              master_as_slice: bool = False) -> Case:
  graph = tf.Graph()
  with graph.as_default():
    inputs_ph, targets_ph = _placeholders(cfg)
    mtf_graph = mtf.Graph()
    mesh = mtf.Mesh(mtf_graph, "mesh")
    loss, updates = model.mtf_train_step(cfg, mesh, inputs_ph, targets_ph, model.initial_values(cfg),
                                         slice_dtype, activation_dtype)
    num_processors = mtf.convert_to_shape(mesh_shape).size
    impl = _mesh_impl(backend, mesh_shape, layout, [f"/cpu:{i}" for i in range(num_processors)],
                      master_as_slice)
    start = time.perf_counter()
    lowering = mtf.Lowering(mtf_graph, {mesh: impl})
    fetches = [lowering.export_to_tf_tensor(loss),
               tf.group([lowering.lowered_operation(u) for u in updates])]
    build_s = time.perf_counter() - start
    init = [tf.global_variables_initializer(), lowering.copy_masters_to_slices()]
  per_device = variable_bytes_per_device(graph, init + fetches)
  case = Case(name, _session(graph, num_cpus, graph_optimizer), fetches, _feed(cfg, inputs_ph, targets_ph),
              build_s=build_s, num_ops=len(graph.get_operations()),
              max_device_bytes=max(per_device.values()),
              needed_bytes=needed_bytes_per_processor(mtf_graph, impl),
              total_bytes=sum(per_device.values()))
  return _start(case, init)


def _mb(n: int) -> str:
  return f"{n / 1e6:.1f}"


def print_step_table(cases: list, reference: Case) -> None:
  print("\n| case | step ms (median) | ratio to plain TF | lowering s | first step s | TF ops | "
        "max device var MB | needed MB | total var MB | first loss |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for c in cases:
    print(f"| {c.name} | {c.median_step_s * 1e3:.1f} | {c.median_step_s / reference.median_step_s:.2f}x | "
          f"{c.build_s:.2f} | {c.first_step_s:.2f} | {c.num_ops} | {_mb(c.max_device_bytes)} | "
          f"{_mb(c.needed_bytes)} | {_mb(c.total_bytes)} | {c.first_loss:.4f} |")


def run_interleaved(cases: list, reps: int, steps: int, warmup: int) -> None:
  for c in cases:
    for _ in range(warmup):
      c.session.run(c.fetches, c.feed)
  for _ in range(reps):
    for c in cases:
      c.time_steps(steps)


def main(argv: Optional[list] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--steps", type=int, default=10, help="steps per timed repetition")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--backend", choices=["placement", "collective"], default="placement")
  parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                      help="slice and activation dtype of the mtf cases (masters stay float32)")
  parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
  parser.add_argument("--no_graph_optimizer", action="store_true",
                      help="skip TF's graph optimisation passes (grappler) at session start")
  parser.add_argument("--lean_graph_optimizer", action="store_true",
                      help="grappler without the passes mtf's session_config_for_devices skips on CPUs")
  parser.add_argument("--master_as_slice", action="store_true",
                      help="placement backend: masters of unsplit variables serve as a processor's slice")
  parser.add_argument("--masters", choices=["whole", "sliced"], default="whole",
                      help="sliced: no whole master variables; slices are checkpointed as parts")
  parser.add_argument("--jit_compile", action="store_true",
                      help="compile each device's fused program with XLA")
  parser.add_argument("--no_fuse", action="store_true",
                      help="build every slicewise computation per device (no fused device program)")
  parser.add_argument("--no_plain_data_parallel", action="store_true",
                      help="leave out the hand-written data-parallel plain TF case")
  parser.add_argument("--sweep", action="store_true", help="data-parallel device-count sweep instead")
  parser.add_argument("--sweep_devices", default="1,2,4,8,16,32,64")
  parser.add_argument("--intra_op_threads", type=int, default=0,
                      help="threads per kernel in every session of this run (0: TF's default, every "
                           "core; 1: what mtf's session_config_for_devices picks for 8 devices on 2 cores)")
  parser.add_argument("--json", help="also write the cases' results to this file")
  args = parser.parse_args(argv)
  SESSION_OPTIONS.update(intra_op_threads=args.intra_op_threads,
                         lean_graph_optimizer=args.lean_graph_optimizer)
  tf.disable_v2_behavior()
  tf.logging.set_verbosity(tf.logging.ERROR)
  IMPL_OPTIONS.update(masters=args.masters, jit_compile=args.jit_compile,
                      fuse_slicewise=not args.no_fuse)
  cfg = model.Config()
  dtype = tf.as_dtype(args.dtype)
  opt = not args.no_graph_optimizer
  print(f"load average before: {os.getloadavg()}; CPUs: {os.cpu_count()}; backend: {args.backend}; "
        f"dtype: {args.dtype}; graph optimizer: {opt} (lean: {args.lean_graph_optimizer}); "
        f"options: {IMPL_OPTIONS}; "
        f"intra-op threads: {args.intra_op_threads or 'default'}")
  if args.sweep:
    counts = [int(n) for n in args.sweep_devices.split(",")]
    num_cpus = max(counts)
    cases = [build_plain_tf(cfg, num_cpus, graph_optimizer=opt)]
    for n in counts:
      shape, layout = sweep_layout(n)
      cases.append(build_mtf(cfg, f"{n} devices ({shape}; {layout})", shape, layout, args.backend,
                             num_cpus, dtype, dtype, opt, args.master_as_slice))
  else:
    num_cpus = 8
    cases = [build_plain_tf(cfg, num_cpus, graph_optimizer=opt)]
    if dtype != tf.float32:
      cases.append(build_plain_tf(cfg, num_cpus, dtype, opt))
    elif not args.no_plain_data_parallel:
      cases.append(build_plain_tf_data_parallel(cfg, num_cpus, opt))
    for name in args.layouts.split(","):
      shape, layout = LAYOUTS[name]
      cases.append(build_mtf(cfg, name, shape, layout, args.backend, num_cpus, dtype, dtype, opt,
                             args.master_as_slice))
  run_interleaved(cases, args.reps, args.steps, args.warmup)
  print_step_table(cases, cases[0])
  print(f"\nload average after: {os.getloadavg()}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump([{"name": c.name, "step_ms": c.median_step_s * 1e3, "lowering_s": c.build_s,
                  "first_step_s": c.first_step_s, "ops": c.num_ops} for c in cases], f, indent=1)


if __name__ == "__main__":
  main()
