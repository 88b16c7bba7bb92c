"""The pipeline cost model (_cost/pipeline_plan.py) against real pipelined graphs: per-processor
variable bytes and FLOPs (the bubble included: idle stages compute on zeros) equal the dry run's
of the pipelined Transformer, priced only from the unpipelined model's costs."""

from __future__ import annotations

import functools

import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._cost import model as cost_model
from mesh_tensorflow._cost import pipeline_plan, time_model
from mesh_tensorflow._explain import pipeline_search
from mesh_tensorflow.auto_mtf import depth
from mesh_tensorflow.transformer import transformer
from tests.transformer import model_check

BATCH, LENGTH, VOCAB, D_MODEL = 16, 8, 32, 16
MESH = "stage:2;b:2;m:2"
RULES = "vocab:m;batch:b;d_ff:m;heads:m"


def _graph(num_layers: int, outer_batch: int = 1, **pipeline):
  """(mtf Graph, [loss]) of a training step of a tiny LM, pipelined if `pipeline` says so; with
  outer_batch > 1 the ids are [outer_batch, batch / outer_batch, length]."""
  stack = transformer.make_layer_stack([model_check.SELF_ATTENTION, model_check.FEED_FORWARD],
                                       num_layers=num_layers,
                                       layer_stack_cls=functools.partial(transformer.LayerStack, **pipeline))
  model = transformer.Unitransformer(layer_stack=stack, d_model=D_MODEL, input_vocab_size=VOCAB,
                                     output_vocab_size=VOCAB, autoregressive=True, max_length=LENGTH)
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    shape = (f"batch:{BATCH};length:{LENGTH}" if outer_batch == 1 else
             f"outer_batch:{outer_batch};batch:{BATCH // outer_batch};length:{LENGTH}")
    ids = mtf.import_tf_tensor(mesh, tf.zeros(mtf.convert_to_shape(shape).to_integer_list, tf.int32), shape)
    _, loss = model.call_simple(transformer.autoregressive_inputs(ids), ids, True)
    variables = graph.trainable_variables
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    mtf.optimize.SgdOptimizer(0.1).apply_grads(grads, variables)
  return graph, [loss]


@pytest.mark.parametrize("stages,microbatches", [(2, 2), (2, 4), (4, 4)])
def test_priced_pipeline_has_the_lowered_variable_bytes_and_flops(stages, microbatches):
  num_layers = 4
  tm = time_model.get_time_model("cpu")
  shallow, deep = (cost_model.estimate_cost(g, MESH, RULES, outs, tm) for g, outs in (_graph(1), _graph(2)))
  sched = mtf.pipeline_schedule(num_layers, stages, microbatches)
  boundary = pipeline_search.boundary_bytes(_graph(1)[0], BATCH, LENGTH, 4)
  priced = pipeline_plan.pipeline_cost(
      lambda n: depth.DepthCost.from_reports(shallow, deep, (1, 2), n), num_layers, sched, boundary / 2,
      MESH, "stages:stage;" + RULES, tm, "stage")
  graph, outs = _graph(num_layers, pipeline_stages=stages, num_microbatches=microbatches)
  lowered = cost_model.estimate_cost(graph, MESH, "stages:stage;" + RULES, outs, tm)
  assert priced.memory.variable_bytes == lowered.memory.variable_bytes
  per_stage = num_layers // 2  # a processor's useful work: the layers of its stages (stage:2), and the rest
  assert priced.flops == pytest.approx(shallow.flops + (per_stage - 1) * (deep.flops - shallow.flops))
  # The lowering computes every tick on every stage (zeros where it idles): the bubble is real work.
  # Unpriced: the pipeline's own per-tick selections of stage 0 and the last stage (a few
  # elementwise products of a microbatch's activations), some % of this tiny model's FLOPs;
  # leaving out the bubble would be off by (M + S - 1) / M, 25% to 75% here.
  assert tm.compute_s(lowered.flops) == pytest.approx(priced.compute_s, rel=0.06)
  assert priced.bubble_fraction == pytest.approx((stages - 1) / (microbatches + stages - 1))


@pytest.mark.parametrize("stages,microbatches", [(2, 2), (2, 4)])
def test_outer_batch_microbatches_price_the_fixed_part_split_over_the_stages(stages, microbatches):
  """Microbatches given as outer_batch laid out over the stages: the embedding and the loss run
  on 1/S of the batch per processor, so the lowered pipelined graph computes less than with them
  on every stage in full, and the price built from the 0-layer graph's cost says how much."""
  num_layers = 4
  tm = time_model.get_time_model("cpu")
  outer_rules = "outer_batch:stage;stages:stage;" + RULES
  reports = [cost_model.estimate_cost(g, MESH, RULES, outs, tm)
             for g, outs in (_graph(0, microbatches), _graph(1, microbatches))]
  fixed_graph, fixed_outs = _graph(0, microbatches)
  outside = cost_model.estimate_cost(fixed_graph, MESH, outer_rules, fixed_outs, tm)
  sched = mtf.pipeline_schedule(num_layers, stages, microbatches)
  boundary = pipeline_search.boundary_bytes(_graph(1)[0], BATCH, LENGTH, 4)

  def price(outside_cost):
    return pipeline_plan.pipeline_cost(
        lambda n: depth.DepthCost.from_reports(*reports, (0, 1), n), num_layers, sched, boundary / 2,
        MESH, "stages:stage;" + RULES, tm, "stage", outside_cost=outside_cost)
  pipelined = functools.partial(_graph, num_layers, microbatches, pipeline_stages=stages,
                                num_microbatches=microbatches)
  graph, outs = pipelined()
  lowered_outer = cost_model.estimate_cost(graph, MESH, outer_rules, outs, tm)
  lowered_full = cost_model.estimate_cost(graph, MESH, "stages:stage;" + RULES, outs, tm)
  assert lowered_outer.flops < lowered_full.flops
  assert price(outside).flops < price(None).flops
  # Unpriced beside the per-tick selections: each microbatch is picked out, and put back, by a
  # one-hot einsum over the processor's share of the batch (M of them, forward and backward):
  # about 7% of this tiny model's FLOPs at M = 4, under 0.1% of the 100B decoder's at M = 128.
  assert tm.compute_s(lowered_outer.flops) == pytest.approx(price(outside).compute_s, rel=0.1)
  assert price(outside).memory.variable_bytes == lowered_outer.memory.variable_bytes
  assert price(outside).memory.activation_peak_bytes < price(None).memory.activation_peak_bytes
