"""Pipelined Transformer step time against data and model parallelism, and the planner's ranking.

An 8-block decoder of the Transformer package (d_model 128, d_ff 512, 4 heads, length 64, batch
32, vocabulary 1024, SGD, graph mode) on 8 virtual CPUs: data-parallel `b:8`, model-parallel
`b:2;m:4` and pipelined meshes `stage:S;b:8/S` (S = 2, 4, 8) with M = 4, 8, 16 microbatches,
each also with the microbatches given as the outer batch split over the stages
(`outer_batch:stage`: the embedding and the loss split over the stages too). Every case is built
and lowered once; step times are then measured interleaved, `--reps` times, and reported as
medians and as ratios to data parallelism, beside the cost model's predicted ratio (cpu time
model; pipelines priced by _cost/pipeline_plan.py from the unpipelined model, as `explain
--search` prices them). Then the planner's wall time: `explain --search` (graph construction
included) for the ~100B decoder at 1024 x 2048 tokens on 64, 512 and 2048 TPU v3 chips.

    python benchmarks/bench_pipeline.py [--reps 5] [--steps 5] [--skip_planner]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import statistics
import sys
import time

import numpy as np
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mesh_tensorflow as mtf  # noqa: E402
from mesh_tensorflow._cost import model as cost_model  # noqa: E402
from mesh_tensorflow._cost import pipeline_plan, time_model  # noqa: E402
from mesh_tensorflow._explain import cli, pipeline_search  # noqa: E402
from mesh_tensorflow.auto_mtf import depth  # noqa: E402
from mesh_tensorflow.transformer import transformer, transformer_layers  # noqa: E402

LAYERS, D_MODEL, D_FF, HEADS, LENGTH, BATCH, VOCAB = 8, 128, 512, 4, 64, 32, 1024
PLAIN = {"data parallel b:8": ("b:8", "batch:b"),
         "model parallel b:2;m:4": ("b:2;m:4", "batch:b;heads:m;d_ff:m;vocab:m")}
MODEL_100B = ["--gin_file=models/lm_base.gin", "--gin_param=num_layers = 64", "--gin_param=d_model = 12288",
              "--gin_param=d_ff = 49152", "--gin_param=num_heads = 96", "--gin_param=d_kv = 128",
              "--gin_param=Unitransformer.max_length = 2048", "--length=2048", "--vocab_size=32768",
              "--accelerator=tpu_v3", "--batch=1024"]


def _model(num_layers: int, **pipeline) -> transformer.Unitransformer:
  layers = [(transformer_layers.SelfAttention, {"num_heads": HEADS, "key_value_size": D_MODEL // HEADS}),
            (transformer_layers.DenseReluDense, {"hidden_size": D_FF})]
  stack = transformer.make_layer_stack(layers, num_layers=num_layers,
                                       layer_stack_cls=functools.partial(transformer.LayerStack, **pipeline))
  return transformer.Unitransformer(layer_stack=stack, d_model=D_MODEL, input_vocab_size=VOCAB,
                                    output_vocab_size=VOCAB, autoregressive=True, max_length=LENGTH)


def _graph(model, outer_batch: int = 1):
  """(mtf Graph, mesh, loss, update ops) of one SGD step on fixed ids ([outer_batch, batch / outer_batch,
  length] when outer_batch > 1)."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  ids = np.random.RandomState(0).randint(1, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)
  shape = (f"batch:{BATCH};length:{LENGTH}" if outer_batch == 1 else
           f"outer_batch:{outer_batch};batch:{BATCH // outer_batch};length:{LENGTH}")
  ids = ids.reshape(mtf.convert_to_shape(shape).to_integer_list)
  inputs = mtf.import_tf_tensor(mesh, tf.constant(ids), shape)
  _, loss = model.call_simple(transformer.autoregressive_inputs(inputs), inputs, True)
  variables = graph.trainable_variables
  grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
  return graph, mesh, loss, mtf.optimize.SgdOptimizer(0.01).apply_grads(grads, variables)


class Case:
  """One layout, built and lowered in its own TF graph and session."""

  def __init__(self, name: str, mesh_shape: str, rules: str, outer_batch: int = 1, **pipeline):
    self.name, self.mesh_shape, self.rules = name, mesh_shape, rules
    self.tf_graph = tf.Graph()
    with self.tf_graph.as_default():
      graph, mesh, loss, updates = _graph(_model(LAYERS, **pipeline), outer_batch)
      size = mtf.convert_to_shape(mesh_shape).size
      impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, rules, ["cpu:%d" % i for i in range(size)])
      lowering = mtf.Lowering(graph, {mesh: impl})
      self.loss = lowering.export_to_tf_tensor(loss)
      self.train_op = tf.group([lowering.lowered_operation(op) for op in updates])
      self.session = tf.Session(config=tf.ConfigProto(device_count={"CPU": 8}))
      self.session.run(tf.global_variables_initializer())
      self.session.run(lowering.copy_masters_to_slices())
      self.session.run(self.train_op)  # the first step (graph optimisation) is not timed
    self.times = []

  def time_steps(self, steps: int) -> None:
    start = time.perf_counter()
    for _ in range(steps):
      self.session.run(self.train_op)
    self.times.append((time.perf_counter() - start) / steps)


def _predicted_plain(mesh_shape: str, rules: str, tm) -> float:
  with tf.Graph().as_default():
    graph, _, loss, _ = _graph(_model(LAYERS))
  return cost_model.estimate_cost(graph, mesh_shape, rules, [loss], tm).step_s


def _predicted_pipelined(stages: int, micro: int, tm, outer: bool) -> float:
  """The planner's price: the unpipelined model at 0 and 1 layers on the 3-D mesh (and, with the
  microbatches as the outer batch, its 0-layer part under outer_batch:stage), then the schedule."""
  mesh, rules = f"stage:{stages};b:{8 // stages}", "batch:b"
  graphs = []
  for n in pipeline_search.DEPTHS:
    with tf.Graph().as_default():
      graph, _, loss, _ = _graph(_model(n), micro)
    graphs.append((graph, [loss]))
  reports = [cost_model.estimate_cost(g, mesh, rules, outs, tm) for g, outs in graphs]
  outside = cost_model.estimate_cost(*graphs[0][:1], mesh, f"outer_batch:stage;{rules}", graphs[0][1],
                                     tm) if outer else None
  boundary = pipeline_search.boundary_bytes(graphs[1][0], BATCH, LENGTH, 4) / (8 // stages)

  def stage_cost_at(n):
    return depth.DepthCost.from_reports(reports[0], reports[1], pipeline_search.DEPTHS, n)

  sched = mtf.pipeline_schedule(LAYERS, stages, micro)
  cost = pipeline_plan.pipeline_cost(stage_cost_at, LAYERS, sched, boundary, mesh,
                                     f"stages:stage;{rules}", tm, "stage", outside_cost=outside)
  return cost.step_s


def _planner_times() -> list:
  """(processors, mesh, seconds of explain --search, the pipelined layout it found)."""
  rows = []
  for mesh in ("b:8;m:8", "b:16;m:32", "b:64;m:32"):
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
      cli.main([*MODEL_100B, f"--mesh_shape={mesh}", "--search"])
    seconds = time.perf_counter() - start
    found = [line for line in out.getvalue().splitlines() if line.startswith("searched pipelined layout")]
    rows.append((mtf.convert_to_shape(mesh).size, mesh, seconds, found[0] if found else "none fits"))
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--skip_planner", action="store_true")
  args = parser.parse_args()
  tm = time_model.get_time_model("cpu")
  cases, predicted = [], {}
  for name, (mesh, rules) in PLAIN.items():
    cases.append(Case(name, mesh, rules))
    predicted[name] = _predicted_plain(mesh, rules, tm)
  for stages in (2, 4, 8):
    for micro in (4, 8, 16):
      if (BATCH // micro) % (8 // stages):
        continue  # a microbatch must split over the batch mesh dimension
      for outer in (False, True) if micro % stages == 0 else (False,):  # outer_batch splits over stages
        name = f"pipeline S={stages} M={micro}" + (" outer batch" if outer else "")
        cases.append(Case(name, f"stage:{stages};b:{8 // stages}",
                          ("outer_batch:stage;" if outer else "") + "stages:stage;batch:b",
                          micro if outer else 1, pipeline_stages=stages, num_microbatches=micro))
        predicted[name] = _predicted_pipelined(stages, micro, tm, outer)
  for _ in range(args.reps):
    for case in cases:
      case.time_steps(args.steps)
  base, base_predicted = statistics.median(cases[0].times), predicted[cases[0].name]
  print(f"{'case':<38} {'step ms':>9} {'/ data parallel':>16} {'predicted /':>12}")
  for case in cases:
    step = statistics.median(case.times)
    ratio = predicted[case.name] / base_predicted
    print(f"{case.name:<38} {step * 1e3:>9.1f} {step / base:>16.2f} {ratio:>12.2f}")
  if not args.skip_planner:
    print("\nexplain --search for the ~100B decoder (1024 x 2048 tokens per step, TPU v3), graph "
          "construction included:")
    for processors, mesh, seconds, found in _planner_times():
      print(f"  {processors:>5} processors ({mesh}): {seconds:5.1f} s  {found}")


if __name__ == "__main__":
  main()
