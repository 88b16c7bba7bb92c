"""mtf.pipeline: a pipelined residual MLP's loss and gradients equal the layer-by-layer model's.

The stacked weights are given as numpy arrays; the reference, in plain TF, applies layer l with
the weights at PipelineSchedule.layer_position(l), so the gradients w.r.t. the stacked weights
compare directly. Meshes split the stages, the batch and the MLP's hidden dimension.
"""

import io

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import assert_allclose, lower_and_evaluate

BATCH, D_MODEL, D_FF = 16, 4, 8


def _mlp_layer(h, get_variable, initial):
  """A residual MLP layer: h + relu(h w1) w2, the weights from `initial` (stacked arrays)."""
  d_model = h.shape.get_dim_by_name("d_model")
  d_ff = mtf.Dimension("d_ff", D_FF)
  w1 = get_variable("w1", [d_model, d_ff], initializer=tf.constant_initializer(initial["w1"]))
  w2 = get_variable("w2", [d_ff, d_model], initializer=tf.constant_initializer(initial["w2"]))
  hidden = mtf.relu(mtf.einsum([h, w1], output_shape=h.shape - d_model + d_ff))
  return h + mtf.einsum([hidden, w2], output_shape=h.shape)


def _stacked_weights(sched, seed=0):
  """Random stacked weights [stages, (slots,)] + layer shape, as the pipeline's variables hold them."""
  rng = np.random.RandomState(seed)
  lead = [sched.num_stages] + ([sched.slots_per_stage] if sched.slots_per_stage > 1 else [])
  return {"w1": rng.normal(0, 0.25, lead + [D_MODEL, D_FF]).astype(np.float32),
          "w2": rng.normal(0, 0.25, lead + [D_FF, D_MODEL]).astype(np.float32)}


def _inputs(seed=1):
  rng = np.random.RandomState(seed)
  return (rng.normal(size=[BATCH, D_MODEL]).astype(np.float32),
          rng.normal(size=[BATCH, D_MODEL]).astype(np.float32))


def _pipelined(sched, schedule, initial, mesh_shape, layout, recompute=False, given_microbatches=False):
  """[output, loss, d loss / d w1, d loss / d w2] of the pipelined MLP on the mesh.

  given_microbatches: x is [micro, batch / M, d_model], pipelined with microbatch_dim=micro (the
  output is returned as [batch, d_model] all the same).
  """
  x_value, target = _inputs()
  micro = sched.num_microbatches
  layers_per_round = sched.layers_per_tick if schedule == "circular" else 1

  def build(mesh):
    if given_microbatches:
      x, batch, micro_dim = _given_microbatches_input(mesh, x_value, micro)
      target_value = target.reshape(micro, -1, D_MODEL)
    else:
      batch, micro_dim, target_value = mtf.Dimension("batch", BATCH), None, target
      x = mtf.import_tf_tensor(mesh, tf.constant(x_value), shape=f"batch:{BATCH};d_model:{D_MODEL}")
    y = mtf.pipeline(lambda h, get: _mlp_layer(h, get, initial), x, sched.num_layers,
                     mtf.Dimension("stages", sched.num_stages), batch, micro, schedule=schedule,
                     layers_per_round=layers_per_round, recompute=recompute, microbatch_dim=micro_dim)
    loss = mtf.reduce_sum(y * mtf.import_tf_tensor(mesh, tf.constant(target_value), shape=y.shape))
    variables = {v.name.split("/")[-1]: v.outputs[0] for v in mesh.graph.trainable_variables}
    grads = mtf.gradients([loss], [variables["w1"], variables["w2"]])
    return [y, loss] + grads

  y, *rest = lower_and_evaluate(build, mesh_shape, layout)
  return [y.reshape(BATCH, D_MODEL)] + rest


def _given_microbatches_input(mesh, x_value, micro):
  """(x as [micro, batch / M, d_model], its batch dimension, its microbatch dimension)."""
  shape = f"micro:{micro};batch:{BATCH // micro};d_model:{D_MODEL}"
  x = mtf.import_tf_tensor(mesh, tf.constant(x_value.reshape(micro, -1, D_MODEL)), shape=shape)
  return x, x.shape.get_dim_by_name("batch"), x.shape.get_dim_by_name("micro")


def _layer_by_layer(sched, initial):
  """The same quantities in plain TF, layer l reading the stacked weights at its (stage, slot)."""
  x_value, target = _inputs()
  with tf.Graph().as_default():
    w1, w2 = tf.constant(initial["w1"]), tf.constant(initial["w2"])
    h = tf.constant(x_value)
    for layer in range(sched.num_layers):
      stage, slot = sched.layer_position(layer)
      at = (stage, slot) if sched.slots_per_stage > 1 else (stage,)
      h = h + tf.matmul(tf.nn.relu(tf.matmul(h, w1[at])), w2[at])
    loss = tf.reduce_sum(h * target)
    with tf.Session() as sess:
      return sess.run([h, loss] + tf.gradients(loss, [w1, w2]))


# (mesh, layout, stages, layers for fill-drain, layers for circular: two rounds)
MESHES = [
    ("stage:8", "stages:stage", 8, 8, 16),
    ("stage:4;batch:2", "stages:stage;batch:batch", 4, 4, 8),
    ("stage:2;batch:2;model:2", "stages:stage;batch:batch;d_ff:model", 2, 4, 4),
]


@pytest.mark.parametrize("mesh_shape, layout, stages, fill_drain_layers, circular_layers", MESHES,
                         ids=[m[0] for m in MESHES])
@pytest.mark.parametrize("schedule", ["fill_drain", "circular"])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
def test_pipelined_mlp_loss_and_gradients_equal_the_layer_by_layer_model(
    mesh_shape, layout, stages, fill_drain_layers, circular_layers, schedule, microbatches):
  layers = fill_drain_layers if schedule == "fill_drain" else circular_layers
  sched = mtf.pipeline_schedule(layers, stages, microbatches, schedule)
  initial = _stacked_weights(sched)
  got = _pipelined(sched, schedule, initial, mesh_shape, layout)
  for g, e in zip(got, _layer_by_layer(sched, initial)):
    assert_allclose(g, e, rtol=1e-5, atol=1e-5)


# the microbatches split over the stages' mesh dimension (or not), as a Transformer's outer_batch
GIVEN_MICROBATCH_MESHES = [
    ("stage:8", "stages:stage;micro:stage", 8, 8, 8),
    ("stage:4;batch:2", "stages:stage;micro:stage;batch:batch", 4, 8, 4),
    ("stage:2;batch:2;model:2", "stages:stage;micro:stage;batch:batch;d_ff:model", 2, 4, 4),
    ("stage:2;batch:4", "stages:stage;batch:batch", 2, 4, 2),
]


@pytest.mark.parametrize("mesh_shape, layout, stages, layers, microbatches", GIVEN_MICROBATCH_MESHES,
                         ids=[m[1] for m in GIVEN_MICROBATCH_MESHES])
@pytest.mark.parametrize("schedule", ["fill_drain", "circular"])
def test_microbatches_given_as_a_dimension_split_over_the_stages_give_the_layer_by_layer_model(
    mesh_shape, layout, stages, layers, microbatches, schedule):
  sched = mtf.pipeline_schedule(layers * (2 if schedule == "circular" else 1), stages, microbatches, schedule)
  initial = _stacked_weights(sched)
  got = _pipelined(sched, schedule, initial, mesh_shape, layout, given_microbatches=True)
  for g, e in zip(got, _layer_by_layer(sched, initial)):
    assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_given_microbatches_must_number_num_microbatches():
  graph = mtf.Graph()
  x = mtf.zeros(mtf.Mesh(graph, "m"), f"micro:4;batch:2;d_model:{D_MODEL}")
  with pytest.raises(ValueError, match="'micro' holds 4 microbatches; give num_microbatches=4"):
    mtf.pipeline(lambda h, get: h, x, 4, mtf.Dimension("stages", 2), x.shape.get_dim_by_name("batch"), 2,
                 microbatch_dim=x.shape.get_dim_by_name("micro"))


def test_recomputed_ticks_give_the_same_loss_and_gradients():
  sched = mtf.pipeline_schedule(8, 4, 2, "circular")
  initial = _stacked_weights(sched)
  got = _pipelined(sched, "circular", initial, "stage:4;batch:2", "stages:stage;batch:batch",
                   recompute=True)
  for g, e in zip(got, _layer_by_layer(sched, initial)):
    assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def _build_graph(num_layers, stages, microbatches, schedule="fill_drain", layers_per_round=1,
                 recompute=False, batch=BATCH, layer_fn=None, **kwargs):
  """(graph, output, number of layer_fn calls) of a pipelined MLP built without lowering."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "m")
  x = mtf.zeros(mesh, f"batch:{batch};d_model:{D_MODEL}")
  calls = []
  sched = mtf.pipeline_schedule(num_layers, stages, microbatches, schedule, layers_per_round)
  initial = _stacked_weights(sched)

  def layer(h, get):
    calls.append(h)
    return (layer_fn or _mlp_layer)(h, get, initial)
  y = mtf.pipeline(layer, x, num_layers, mtf.Dimension("stages", stages), mtf.Dimension("batch", batch),
               microbatches, schedule=schedule, layers_per_round=layers_per_round,
               recompute=recompute, **kwargs)
  return graph, y, len(calls)


def _count(graph, op_class) -> int:
  return sum(isinstance(op, op_class) for op in graph.operations)


@pytest.mark.parametrize("num_layers, stages, microbatches, schedule, layers_per_round, ticks", [
    (4, 4, 1, "fill_drain", 1, 4),     # S + M - 1
    (4, 2, 8, "fill_drain", 1, 9),
    (8, 4, 4, "fill_drain", 1, 7),     # two layers per stage per tick
    (8, 4, 4, "circular", 1, 11),      # (R - 1) * max(M, S) + M + S - 1, R = 2
    (8, 4, 2, "circular", 1, 9),       # M < S: a microbatch comes back just as stage 0 is free
    (4, 2, 8, "circular", 1, 17),      # M > S: it waits M - S ticks for stage 0
    (16, 4, 4, "circular", 2, 11),     # two layers per stage per round
])
def test_the_graph_runs_the_schedules_ticks_each_shifting_once(
    num_layers, stages, microbatches, schedule, layers_per_round, ticks):
  sched = mtf.pipeline_schedule(num_layers, stages, microbatches, schedule, layers_per_round)
  assert sched.num_ticks == ticks
  graph, y, calls = _build_graph(num_layers, stages, microbatches, schedule, layers_per_round)
  assert y.shape == mtf.Shape([mtf.Dimension("batch", BATCH), mtf.Dimension("d_model", D_MODEL)])
  assert _count(graph, mtf.ShiftOperation) == ticks - 1
  assert calls == ticks * sched.layers_per_tick
  assert sched.num_rounds * sched.num_microbatches * sched.num_stages == sum(
      sched.work(t, s) is not None for t in range(ticks) for s in range(stages))


def test_recompute_wraps_each_tick_in_a_recomputed_gradient():
  graph, _, _ = _build_graph(4, 2, 4, recompute=True)
  assert _count(graph, mtf.CustomGradientOperation) == mtf.pipeline_schedule(4, 2, 4).num_ticks


@pytest.mark.parametrize("num_layers, stages, microbatches, schedule, layers_per_round, bubble", [
    (4, 4, 4, "fill_drain", 1, 3 / 7),   # (S - 1) / (M + S - 1)
    (4, 2, 8, "fill_drain", 1, 1 / 9),
    (8, 4, 4, "circular", 1, 3 / 11),    # (S - 1) / (R * M + S - 1) when M >= S
    (8, 4, 2, "circular", 1, 5 / 9),     # M < S: stages idle while microbatches go round
])
def test_bubble_fraction_follows_the_documented_formula(num_layers, stages, microbatches, schedule,
                                                        layers_per_round, bubble):
  sched = mtf.pipeline_schedule(num_layers, stages, microbatches, schedule, layers_per_round)
  assert sched.bubble_fraction == pytest.approx(bubble)


def test_layers_sit_on_stages_in_blocks_for_fill_drain_and_round_robin_for_circular():
  fill = mtf.pipeline_schedule(8, 4, 2)
  assert [fill.layer_position(layer) for layer in range(8)] == [
      (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
  circular = mtf.pipeline_schedule(8, 4, 2, "circular")
  assert [circular.layer_position(layer) for layer in range(8)] == [
      (0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)]


def test_schedule_picture_shows_microbatches_per_stage_and_tick():
  assert mtf.pipeline_schedule(2, 2, 3).picture() == "stage 0: 0 1 2 .\nstage 1: . 0 1 2"
  assert mtf.pipeline_schedule(4, 2, 1, "circular").picture() == (
      "stage 0: 0a  . 0b  .\nstage 1:  . 0a  . 0b")


def test_variables_carry_the_stage_dimension_and_a_layer_dimension_when_a_stage_holds_several():
  graph, _, _ = _build_graph(8, 4, 2, "circular")
  shapes = sorted(str(v.shape) for v in graph.trainable_variables)
  assert shapes == ["Shape[stages=4, stages_layers=2, d_ff=8, d_model=4]",
                    "Shape[stages=4, stages_layers=2, d_model=4, d_ff=8]"]
  graph, _, _ = _build_graph(4, 4, 2)
  assert [v.shape.dims[0] for v in graph.trainable_variables] == [mtf.Dimension("stages", 4)] * 2
  assert all(len(v.shape) == 3 for v in graph.trainable_variables)


def test_dry_run_sees_each_stage_hold_its_share_of_the_variables():
  graph, y, _ = _build_graph(8, 4, 4, "circular")
  result = mtf.dry_run(graph, "stage:4;batch:2", "stages:stage;batch:batch")
  total = sum(v.outputs[0].size for v in graph.trainable_variables) * 4  # float32 bytes
  assert result.variable_bytes == total // 4
  assert result.bytes_sent > 0  # the shifts between stages


def test_explain_shows_one_shift_between_stages_per_tick_and_a_stages_share_of_the_variables():
  graph, y, _ = _build_graph(8, 4, 4, "circular")
  mtf.gradients([mtf.reduce_sum(y)], [v.outputs[0] for v in graph.trainable_variables])
  explanation = mtf.explain(graph, "stage:4;batch:2", "stages:stage;batch:batch", file=io.StringIO())
  forward_shifts = [line.split() for line in explanation.text.splitlines()
                    if line.startswith("pipeline/shift") and "gradients" not in line]
  assert len(forward_shifts) == mtf.pipeline_schedule(8, 4, 4, "circular").num_ticks - 1
  assert all(row[-2:] == ["stage", "shift_op"] for row in forward_shifts)
  total = sum(v.outputs[0].size for v in graph.trainable_variables) * 4  # float32 bytes
  assert explanation.report.memory.variable_bytes == total // 4


@pytest.mark.parametrize("schedule, num_layers", [("fill_drain", 4), ("circular", 8)])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_weight_gradients_are_allreduced_over_the_batch_once_per_step_not_once_per_tick(
    schedule, num_layers, microbatches):
  """Each tick's weight gradient is a partial sum over the batch's mesh dimension; the ticks' sum
  stays pending through the weight selection's gradient (pad, einsum), so each weight is
  allreduced once, however many ticks use it."""
  graph, y, _ = _build_graph(num_layers, 2, microbatches, schedule)
  variables = graph.trainable_variables
  grads = mtf.gradients([mtf.reduce_sum(y)], [v.outputs[0] for v in variables])
  mtf.optimize.SgdOptimizer(0.1).apply_grads(grads, variables)
  report = mtf.explain(graph, "stage:2;batch:4", "stages:stage;batch:batch", file=io.StringIO()).report
  over_batch = [e for e in report.events if e.kind == "allreduce" and e.mesh_axes == (1,)]
  assert len(over_batch) == len(variables) == 2


def test_emulated_simd_backend_runs_each_microbatch_through_every_layer():
  """Weightless identical layers h -> 2h + 1 (four of them: 16x + 15), circular with M > S, so a
  microbatch waits for stage 0; the SIMD backend's shifts and sums run on emulated TPU replicas."""
  from tests.backends.test_simd_mesh_impl import _lower_on_replicas
  x_value = _inputs()[0]

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(x_value), shape=f"batch:{BATCH};d_model:{D_MODEL}")
    return [mtf.pipeline(lambda h, get: h * 2.0 + 1.0, x, 4, mtf.Dimension("stages", 2),
                         mtf.Dimension("batch", BATCH), 4, schedule="circular")]
  with tf.Graph().as_default():
    got, = _lower_on_replicas(build, "stage:2;batch:2", "stages:stage;batch:batch", list(range(4)))
  assert_allclose(got, 16 * x_value + 15)


def test_collective_backend_gives_the_layer_by_layer_model():
  sched = mtf.pipeline_schedule(4, 2, 4, "circular")
  initial = _stacked_weights(sched)
  x_value, target = _inputs()

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(x_value), shape=f"batch:{BATCH};d_model:{D_MODEL}")
    y = mtf.pipeline(lambda h, get: _mlp_layer(h, get, initial), x, 4, mtf.Dimension("stages", 2),
                 mtf.Dimension("batch", BATCH), 4, schedule="circular")
    return [y]
  got, = lower_and_evaluate(build, "stage:2;batch:2", "stages:stage;batch:batch", backend="collective")
  assert_allclose(got, _layer_by_layer(sched, initial)[0])


def test_emulated_simd_backend_runs_microbatches_given_over_the_stages():
  """As above, the 4 microbatches given as a dimension split over the stages' mesh dimension."""
  from tests.backends.test_simd_mesh_impl import _lower_on_replicas
  x_value = _inputs()[0]

  def build(mesh):
    x, batch, micro = _given_microbatches_input(mesh, x_value, 4)
    return [mtf.pipeline(lambda h, get: h * 2.0 + 1.0, x, 4, mtf.Dimension("stages", 2), batch, 4,
                         schedule="circular", microbatch_dim=micro)]
  with tf.Graph().as_default():
    got, = _lower_on_replicas(build, "stage:2;batch:2", "micro:stage;stages:stage;batch:batch",
                              list(range(4)))
  assert_allclose(got.reshape(BATCH, D_MODEL), 16 * x_value + 15)


def test_collective_backend_runs_microbatches_given_over_the_stages():
  sched = mtf.pipeline_schedule(4, 2, 4, "circular")
  initial = _stacked_weights(sched)
  x_value = _inputs()[0]

  def build(mesh):
    x, batch, micro = _given_microbatches_input(mesh, x_value, 4)
    return [mtf.pipeline(lambda h, get: _mlp_layer(h, get, initial), x, 4, mtf.Dimension("stages", 2),
                         batch, 4, schedule="circular", microbatch_dim=micro)]
  got, = lower_and_evaluate(build, "stage:2;batch:2", "micro:stage;stages:stage;batch:batch",
                            backend="collective")
  assert_allclose(got.reshape(BATCH, D_MODEL), _layer_by_layer(sched, initial)[0])


# ---- bad input: each a build-time error naming the dimension and the fix ----

def test_stages_that_do_not_divide_the_layers_are_refused():
  with pytest.raises(ValueError, match=r"4 stages do not divide the 6 layers.*one of \[1, 2, 3, 6\]"):
    _build_graph(6, 4, 2)
  with pytest.raises(ValueError, match=r"2 stages x 2 layers_per_round = 4 do not divide the 6 layers"):
    mtf.pipeline_schedule(6, 2, 2, "circular", layers_per_round=2)


def test_microbatches_that_do_not_divide_the_batch_are_refused():
  with pytest.raises(ValueError, match=r"num_microbatches=3 does not divide the batch dimension 'batch' "
                                       r"of size 16.*among \[1, 2, 4, 8, 16\]"):
    _build_graph(4, 2, 3)


def test_stages_on_the_batchs_mesh_dimension_are_refused_at_build_time():
  with pytest.raises(mtf.LayoutError, match=r"stage dimension 'stages' and the batch dimension 'batch' "
                                            r"on the same mesh dimension 'x'.*a mesh dimension of "
                                            r"their own") as e:
    _build_graph(4, 2, 2, mesh_shape="x:2;y:2", layout="stages:x;batch:x")
  assert (e.value.dimension, e.value.mesh_dimension) == ("stages", "x")


def test_stages_on_the_batchs_mesh_dimension_are_refused_by_the_lowerings_layout_check():
  graph, _, _ = _build_graph(4, 2, 2)
  with pytest.raises(mtf.LayoutError, match=r"'stages' and 'batch'.*same mesh dimension 'x'"):
    mtf.dry_run(graph, "x:2", "stages:x;batch:x")


def test_a_microbatch_its_mesh_dimension_does_not_divide_is_refused_at_build_time():
  with pytest.raises(mtf.LayoutError, match=r"a microbatch holds 2 of the batch dimension 'batch' "
                                            r"\(16 / 8 microbatches\).*'b' of size 4.*at most 4"):
    _build_graph(4, 2, 8, mesh_shape="s:2;b:4", layout="stages:s;batch:b")


def test_a_stage_dimension_the_input_already_has_is_refused():
  with pytest.raises(ValueError, match=r"already has a dimension 'd_model'.*give it a new name"):
    graph = mtf.Graph()
    x = mtf.zeros(mtf.Mesh(graph, "m"), "batch:4;d_model:4")
    mtf.pipeline(lambda h, get: h, x, 4, mtf.Dimension("d_model", 2), x.shape.dims[0], 2)


def test_a_layer_changing_the_activation_shape_is_refused():
  with pytest.raises(ValueError, match=r"layer_fn must return a Tensor of its input's shape"):
    _build_graph(4, 2, 2, layer_fn=lambda h, get, initial: mtf.reduce_sum(h, reduced_dim=h.shape.dims[-1]))


def test_fill_drain_refuses_layers_per_round():
  with pytest.raises(ValueError, match=r"layers_per_round=2 applies to the circular schedule"):
    mtf.pipeline_schedule(8, 2, 2, layers_per_round=2)
