"""The cost of a pipelined layout, from the unpipelined model's costs on one stage's processors.

A pipelined model (mtf.pipeline, LayerStack(pipeline_stages=S)) on the mesh `stage:S` x <a stage's
mesh> runs its L identical layers in S stages of L/S layers; everything else (embeddings, loss,
optimizer) runs on every stage as it would unpipelined on a stage's mesh. So, per processor, with
F the unpipelined model's fixed costs and P one layer's, both on a stage's mesh at the full batch
(auto_mtf.depth's extrapolation gives them):

* variables, optimizer state, gradients: F + (L/S) P;
* the schedule's T ticks (PipelineSchedule.num_ticks) each run K = layers_per_round layers on one
  microbatch (1/M of the batch) on every stage; a stage is busy M*R of them (R rounds), so the
  layers' compute and collectives stretch by T / (M R) (the bubble; the idle stages compute on
  zeros, as the lowering does), their op launches count T K times per stage;
* activations kept for the backward pass: every tick's, F + (L/S) P stretched the same; with
  recompute only every tick's input (T microbatch boundaries) plus one tick's layers, and the
  forward pass runs twice (the forward is taken as 1/3 of a layer's forward and backward FLOPs);
* two shifts per tick (forward and backward) of one microbatch's boundary activations along the
  stage mesh dimension;
* a layer's collectives run on one microbatch, so their staging buffer is 1/M of the full batch's.

With the microbatches given as a dimension laid out over the stages (a Transformer's outer_batch
with `outer_batch:stage`, mtf.pipeline's microbatch_dim), the fixed part F splits over the stages
instead of running on every stage in full: `outside_cost` gives it, costed under that layout; each
microbatch is then summed over the stages on its way in and its gradient on its way out.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from mesh_tensorflow._core.dims import convert_to_shape
from mesh_tensorflow._core.layout import convert_to_layout_rules
from mesh_tensorflow._cost import model as cost_model
from mesh_tensorflow._ops.pipeline_schedule import PipelineSchedule

FORWARD_SHARE = 1 / 3  # of a layer's forward-and-backward FLOPs: what recomputation repeats


@dataclasses.dataclass(frozen=True)
class PipelineCost(cost_model.StepCost):
  """A pipelined layout's per-processor cost."""

  schedule: PipelineSchedule
  recompute: bool

  @property
  def bubble_fraction(self) -> float:
    return self.schedule.bubble_fraction


def pipeline_cost(stage_cost_at: Callable[[float], object], num_layers: int, schedule: PipelineSchedule,
                  boundary_bytes: float, mesh_shape, layout_rules, time_model, stage_mesh_dim: str,
                  recompute: bool = False, outside_cost=None) -> PipelineCost:
  """The PipelineCost of `num_layers` layers pipelined by `schedule` on `mesh_shape`.

  Args:
    stage_cost_at: n -> the unpipelined model's per-processor cost (a DepthCost) with n layers
      on the whole mesh at the full batch, laid out without the stage mesh dimension for the
      layers (n = 0 gives the fixed part). A processor holds L * (stages per processor) / S.
    num_layers: L, the schedule's number of layers.
    schedule: the PipelineSchedule (stages, microbatches, rounds, layers per tick).
    boundary_bytes: one processor's bytes of the activations between two layers, at the full batch.
    mesh_shape, layout_rules: the whole mesh (with the stage mesh dimension) and its rules.
    time_model: the time model (a preset's topology gives the stage mesh dimension its links).
    stage_mesh_dim: the mesh dimension the stages are split over.
    recompute: recompute each tick's layers on the backward pass.
    outside_cost: the fixed part's cost (a DepthCost at 0 layers) with the microbatches given as
      a dimension split over the stage mesh dimension; None: the fixed part runs on every stage
      in full (stage_cost_at(0)).
  """
  mesh_shape, layout_rules = convert_to_shape(mesh_shape), convert_to_layout_rules(layout_rules)
  stages_per_processor = schedule.num_stages // mesh_shape.get_dim_by_name(stage_mesh_dim).size
  held = num_layers * stages_per_processor / schedule.num_stages  # the layers one processor holds
  fixed, stage = stage_cost_at(0), stage_cost_at(held)
  outside = outside_cost or fixed
  micro = schedule.num_microbatches
  ticks = schedule.num_ticks
  stretch = ticks / (micro * schedule.num_rounds)
  layer_compute = (stage.compute_s - fixed.compute_s) * stretch
  layer_activations = stage.memory.activation_peak_bytes - fixed.memory.activation_peak_bytes
  if recompute:
    layer_compute *= 1 + FORWARD_SHARE
    per_tick = schedule.layers_per_tick * stages_per_processor  # the layers a processor runs at a tick
    kept = ticks * stages_per_processor * boundary_bytes / micro + layer_activations * per_tick / held / micro
  else:
    kept = layer_activations * stretch
  tm = time_model.for_mesh(mesh_shape)
  microbatch_bytes = stages_per_processor * boundary_bytes / micro
  shift_s = 2 * ticks * tm.collective_s(microbatch_bytes, [stage_mesh_dim])
  if outside_cost is not None:  # each microbatch in, and its gradient out, summed over the stages
    shift_s += 2 * micro * tm.collective_s(microbatch_bytes, [stage_mesh_dim])
  peak = int(outside.memory.activation_peak_bytes + kept)
  buffer = max(outside.memory.comm_buffer_bytes, stage.memory.comm_buffer_bytes // micro)
  memory = dataclasses.replace(stage.memory, activation_peak_bytes=peak, comm_buffer_bytes=buffer,
                               remat=recompute)
  return PipelineCost(
      mesh_shape=mesh_shape, layout_rules=layout_rules, time_model=tm, num_layers=num_layers,
      schedule=schedule, recompute=recompute,
      compute_s=outside.compute_s + layer_compute,
      comm_s=outside.comm_s + (stage.comm_s - fixed.comm_s) * stretch + shift_s,
      overhead_s=outside.overhead_s + (stage.overhead_s - fixed.overhead_s) * stretch * micro,
      flops=outside.flops + stage.flops - fixed.flops, memory=memory)
