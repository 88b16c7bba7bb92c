"""`explain --search` over pipelines: stage counts, meshes of a stage and microbatch counts.

The model is built at two shallow depths once, its batch given as `outer_batch` x `batch`; each
mesh `stage:S;b:x;m:y` is costed exactly on both, unpipelined, with the layout family
`batch:b;d_ff:m;heads:m` (the layers use a stage's processors `b x m`) and `vocab` on the larger
of `m` and `stage`, and once more with `outer_batch:stage` for the work outside the pipeline: a
pipeline whose microbatches are the outer batch (outer_batch_size = M) splits the embedding and the
loss over the stages instead of running them on every stage in full. Every microbatch count M and
recompute choice is then priced analytically by _cost/pipeline_plan.py (no pipelined graph is
built), so the whole search costs a few dry runs.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Callable, Optional

from mesh_tensorflow._cost import model as cost_model
from mesh_tensorflow._cost import pipeline_plan
from mesh_tensorflow._explain import report as report_lib
from mesh_tensorflow._ops.pipeline_schedule import pipeline_schedule
from mesh_tensorflow.auto_mtf import depth

STAGE_MESH_DIM = "stage"
OUTER_BATCH = "outer_batch"
MODEL_SPLITS = (8, 16, 32)  # the model mesh dimensions tried inside a stage
MAX_STAGES = 16
MAX_PICTURE_TICKS = 40  # wider schedules are drawn without their middle ticks
DEPTHS = (0, 1)  # the layer counts the model is built and costed at: the fixed part alone, and one layer


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One pipelined layout and its cost."""

  stages: int
  microbatches: int
  stage_mesh: str
  stage_rules: str
  cost: pipeline_plan.PipelineCost
  outer_batch: bool = False  # the microbatches are the outer batch, split over the stages

  @property
  def mesh(self) -> str:
    return f"{STAGE_MESH_DIM}:{self.stages};{self.stage_mesh}"

  @property
  def layout(self) -> str:
    outer = f"{OUTER_BATCH}:{STAGE_MESH_DIM};" if self.outer_batch else ""
    return f"{outer}stages:{STAGE_MESH_DIM};{self.stage_rules}"

  @property
  def gin_lines(self) -> str:
    """The gin bindings that build this pipeline."""
    lines = [f"LayerStack.pipeline_stages = {self.stages}",
             f"LayerStack.num_microbatches = {self.microbatches}"]
    if self.cost.recompute:
      lines.append("LayerStack.recompute_grads = True")
    if self.outer_batch:
      lines.append(f"tpu_estimator_model_fn.outer_batch_size = {self.microbatches}")
    return "; ".join(lines)

  def fits(self) -> bool:
    limit = self.cost.time_model.memory_bytes
    return limit is None or self.cost.memory.fits(limit)


def boundary_bytes(graph, batch: int, length: int, activation_bytes: int) -> int:
  """Bytes of a Transformer's activations between two layers ([batch, length, d_model]), unsplit."""
  sizes = {d.size for v in graph.trainable_variables for d in v.shape.dims if d.name == "d_model"}
  if len(sizes) != 1:
    raise ValueError(f"pipeline search: expected one d_model size among the model's variables, got {sizes}.")
  return batch * length * sizes.pop() * activation_bytes


def stage_meshes(processors: int, batch: int) -> list:
  """(mesh, rules, b) of one stage's processors: b x m for m in MODEL_SPLITS (b must divide the batch)."""
  return [(f"b:{processors // m};m:{m}", "batch:b;d_ff:m;heads:m", processors // m)
          for m in MODEL_SPLITS if processors % m == 0 and processors > m and batch % (processors // m) == 0]


def candidates(build_graph: Callable[[int, int], tuple], num_layers: int, processors: int, time_model,
               batch: int, length: int, activation_bytes: int) -> list:
  """Every pipelined layout of the model on `processors`, costed (fill-drain, with and without recompute).

  Args:
    build_graph: (n, outer_batch_size) -> (mtf Graph, outputs) of the unpipelined model with n
      layers, its batch given as outer_batch x batch.
    num_layers: the model's depth L; stage counts (powers of 2 up to MAX_STAGES) divide it and
      the processor count.
    processors: the number of processors of the whole mesh.
    time_model: a TimeModel with a memory size.
    batch: the batch size (microbatches and the batch mesh dimension must divide it).
    length, activation_bytes: the sequence length and the activations' bytes per element (the
      activations between two layers are [batch, length, d_model]).
  """
  stage_counts = [2 ** i for i in range(1, MAX_STAGES.bit_length())]
  stage_counts = [s for s in stage_counts if num_layers % s == 0 and processors % s == 0]
  splits = [split for s in stage_counts for _, _, split in stage_meshes(processors // s, batch)]
  outer = _outer_batch_size(batch, stage_counts, splits)
  graphs = [build_graph(d, outer) for d in DEPTHS]
  boundary = boundary_bytes(graphs[1][0], batch, length, activation_bytes)
  ret = []
  for stages in stage_counts:
    for stage_mesh, rules, batch_split in stage_meshes(processors // stages, batch):
      mesh = f"{STAGE_MESH_DIM}:{stages};{stage_mesh}"
      model_split = processors // stages // batch_split
      costing_rules = f"vocab:{STAGE_MESH_DIM if stages > model_split else 'm'};{rules}"
      stage_cost_at = _depth_costs(graphs, mesh, costing_rules, time_model)
      outside_cost = None
      if outer % stages == 0 and (batch // outer) % batch_split == 0:
        fixed_graph, fixed_outputs = graphs[0]  # no layers: the work outside the pipeline alone
        outside_cost = cost_model.estimate_cost(
            fixed_graph, mesh, f"{OUTER_BATCH}:{STAGE_MESH_DIM};vocab:m;{rules}", fixed_outputs, time_model)
      for micro in _microbatch_counts(batch, batch_split, stages):
        sched = pipeline_schedule(num_layers, stages, micro)
        for recompute in (False, True):
          cost = pipeline_plan.pipeline_cost(
              stage_cost_at, num_layers, sched, boundary / batch_split, mesh,
              f"stages:{STAGE_MESH_DIM};{costing_rules}", time_model, STAGE_MESH_DIM, recompute,
              outside_cost=outside_cost)
          if outside_cost is None:
            ret.append(Candidate(stages, micro, stage_mesh, costing_rules, cost))
          else:  # outside the pipeline the stage mesh dimension holds outer_batch, so vocab goes on m
            ret.append(Candidate(stages, micro, stage_mesh, f"vocab:m;{rules}", cost, outer_batch=True))
  return ret


def _outer_batch_size(batch: int, stage_counts: list, batch_splits: list) -> int:
  """The costing graphs' outer batch: the most stages it splits over, leaving an inner batch that
  every stage mesh's batch split divides (1 if none)."""
  fitting = [s for s in stage_counts
             if batch % s == 0 and all((batch // s) % split == 0 for split in batch_splits)]
  return max(fitting, default=1)


def _depth_costs(graphs: list, mesh: str, rules: str, time_model) -> Callable:
  """n -> the DepthCost of the model at n layers, from dry runs of `graphs` (at DEPTHS)."""
  shallow, deep = (cost_model.estimate_cost(g, mesh, rules, outs, time_model) for g, outs in graphs)
  return lambda n: depth.DepthCost.from_reports(shallow, deep, DEPTHS, n)


def _microbatch_counts(batch: int, batch_split: int, stages: int) -> list:
  """M from S up, doubling, while a microbatch still splits over the batch mesh dimension."""
  ret, micro = [], stages
  while batch % micro == 0 and (batch // micro) % batch_split == 0:
    ret.append(micro)
    micro *= 2
  return ret


def best(found: list) -> Optional[Candidate]:
  """The fastest candidate that fits, or None."""
  fitting = [c for c in found if c.fits()]
  return min(fitting, key=lambda c: c.cost.step_s) if fitting else None


def describe(c: Candidate, tokens_per_step: Optional[int]) -> str:
  """What explain prints of a pipelined layout: layout, memory, step, pipeline, schedule, fits, predicted."""
  sched = c.cost.schedule
  lines = [
      f"Layout {c.layout} on mesh {c.mesh} ({c.cost.mesh_shape.size} processors), {c.cost.num_layers} layers "
      f"in {c.stages} stages x {c.microbatches} microbatches ("
      f"{'fill_drain' if sched.num_rounds == 1 else 'circular'}"
      f"{', recompute' if c.cost.recompute else ''})",
      f"gin: {c.gin_lines}",
      report_lib.memory_sum(c.cost.memory) + ".",
      report_lib.step_line(c.cost),
      pipeline_line(sched),
  ]
  elided = "; '~' the ticks left out" if sched.num_ticks > MAX_PICTURE_TICKS else ""
  lines += [f"Schedule (a row per stage, a column per tick; '.' idles{elided}):",
            sched.picture(MAX_PICTURE_TICKS)]
  lines += [report_lib.fits_line(c.cost), report_lib.predicted_line(c.cost, tokens_per_step)]
  return "\n".join(lines)


def pipeline_line(sched) -> str:
  """`pipeline: S stages, M microbatches, T ticks, bubble B%`."""
  return (f"pipeline: {sched.num_stages} stages, {sched.num_microbatches} microbatches, {sched.num_ticks} "
          f"ticks of {sched.layers_per_tick} layer(s), bubble {100 * sched.bubble_fraction:.1f}% of every "
          f"stage's ticks")


def print_search(found: list, tokens_per_step: Optional[int], file=None, top: int = 5) -> Optional[Candidate]:
  """Prints the fastest fitting candidates as a table and the best one in full; returns it."""
  file = file or sys.stdout
  chosen = best(found)
  ranked = sorted(found, key=lambda c: (not c.fits(), c.cost.step_s))[:top]
  print("pipelined layouts (costed unpipelined at 0 and 1 layers, pipelines priced by their schedules), "
        "the fastest:", file=file)
  print(f"  {'mesh':<22} {'microbatches':>12} {'recompute':>9} {'bubble':>7} {'memory':>10} {'fits':>4} "
        f"{'tokens/s':>12}", file=file)
  for c in ranked:
    rate = tokens_per_step / c.cost.step_s if tokens_per_step else math.nan
    print(f"  {c.mesh:<22} {c.microbatches:>12} {'yes' if c.cost.recompute else 'no':>9} "
          f"{100 * c.cost.bubble_fraction:>6.1f}% {c.cost.memory.total_bytes / 1e9:>7.1f} GB "
          f"{'yes' if c.fits() else 'no':>4} {rate:>12,.0f}", file=file)
  if chosen is None:
    print("no pipelined layout fits either", file=file)
    return None
  print(f"searched pipelined layout: {chosen.layout} on mesh {chosen.mesh}", file=file)
  print(describe(chosen, tokens_per_step), file=file)
  return chosen
