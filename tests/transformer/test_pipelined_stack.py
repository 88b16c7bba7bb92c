"""LayerStack(pipeline_stages=...): a pipelined Transformer LM trains as the unpipelined one does,
and their checkpoints (weights and optimizer state) are interchangeable."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer
from tests.harness import cpu_devices, session_config
from mesh_tensorflow.transformer._train import progress
from tests.transformer import model_check, tiny_run

VOCAB, LENGTH, BATCH = 12, 8, 8
IDS = np.random.RandomState(0).randint(1, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)

MESHES = {
    "stage:8": ("stage:8", "stages:stage"),
    "stage:4;batch:2": ("stage:4;batch:2", "stages:stage;batch:batch"),
    "stage:2;batch:2;model:2": ("stage:2;batch:2;model:2",
                                "stages:stage;batch:batch;heads:model;d_ff:model;vocab:model"),
}
UNPIPELINED = ("rows:2;cols:4", "batch:rows;heads:cols;d_ff:cols")


def _lm(num_layers: int, dropout_rate=None, **pipeline) -> transformer.Unitransformer:
  legacy = {} if dropout_rate is None else {"dropout_rate": dropout_rate, "norm_epsilon": 1e-6}
  stack_cls = functools.partial(transformer.LayerStack, **legacy, **pipeline)
  stack = transformer.make_layer_stack([model_check.SELF_ATTENTION, model_check.FEED_FORWARD],
                                       num_layers=num_layers, layer_stack_cls=stack_cls)
  return transformer.Unitransformer(layer_stack=stack, d_model=8, input_vocab_size=VOCAB,
                                    output_vocab_size=VOCAB, autoregressive=True, max_length=LENGTH,
                                    vocab_divisor=4)


def _train(model, mesh_layout, steps: int, save: str, *, restore=None, optimizer="adafactor",
           mode="train", masters="whole", outer_batch=1):
  """(loss per step, {checkpoint name: value} after training) of `model` on IDS.

  restore: a checkpoint prefix to start from (all variables, optimizer state included);
  save: the prefix the trained variables are written to (and read back from);
  outer_batch: > 1 gives the ids as [outer_batch, batch / outer_batch, length].
  """
  mesh_shape, layout = mtf.convert_to_shape(mesh_layout[0]), mesh_layout[1]
  with tf.Graph().as_default():
    tf.set_random_seed(1)  # random ops are then keyed by the seed and their layer's scope
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    ids = (model_check.import_ids(mesh, IDS) if outer_batch == 1 else model_check.import_ids(
        mesh, IDS.reshape(outer_batch, -1, LENGTH), ("outer_batch", "batch", "length")))
    _, loss = model.call_simple(transformer.autoregressive_inputs(ids), ids, True, mode=mode)
    variables = graph.trainable_variables
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    opt = (mtf.optimize.AdafactorOptimizer(learning_rate=0.05) if optimizer == "adafactor"
           else mtf.optimize.SgdOptimizer(0.5))
    updates = opt.apply_grads(grads, variables)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, cpu_devices(mesh_shape.size),
                                                     masters=masters)
    lowering = mtf.Lowering(graph, {mesh: impl})
    tf_loss = lowering.export_to_tf_tensor(loss)
    train_op = tf.group([lowering.lowered_operation(op) for op in updates])
    to_masters = lowering.copy_slices_to_masters()
    saver = tf.train.Saver(tf.global_variables())
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      if restore:
        saver.restore(sess, restore)
      sess.run(lowering.copy_masters_to_slices())
      losses = []
      for _ in range(steps):
        losses.append(sess.run([tf_loss, train_op])[0])
      sess.run(to_masters)
      saver.save(sess, save)
  reader = tf.train.load_checkpoint(save)
  values = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
  layer_stacks = [v for v in graph.all_variables if v.is_layer_stack]
  assert bool(layer_stacks) == (model.layer_stack._pipeline is not None)  # pylint: disable=protected-access
  return np.array(losses), values


@pytest.fixture(scope="module")
def start(tmp_path_factory):
  """An unpipelined 4-block LM's initial checkpoint, its losses and final variables for 3 steps."""
  directory = tmp_path_factory.mktemp("pipelined_stack")
  prefix = os.path.join(directory, "start")
  _train(_lm(4), UNPIPELINED, 0, prefix)
  losses, values = _train(_lm(4), UNPIPELINED, 3, os.path.join(directory, "end"), restore=prefix)
  return prefix, losses, values


def _assert_same_variables(got: dict, want: dict, atol=1e-5):
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], atol=atol, err_msg=name)


CASES = [  # (mesh, stages, microbatches, schedule, masters)
    ("stage:4;batch:2", 4, 1, "fill_drain", "whole"),
    ("stage:4;batch:2", 4, 4, "fill_drain", "sliced"),
    ("stage:2;batch:2;model:2", 2, 2, "fill_drain", "whole"),
    ("stage:2;batch:2;model:2", 4, 2, "fill_drain", "sliced"),
    ("stage:2;batch:2;model:2", 2, 4, "circular", "sliced"),
]


@pytest.mark.parametrize("mesh,stages,microbatches,schedule,masters", CASES)
def test_pipelined_lm_trains_as_unpipelined(start, tmp_path, mesh, stages, microbatches, schedule, masters):
  """Losses, and the checkpoint after 3 steps (weights and Adafactor's per-layer state, under the
  unpipelined names), equal the unpipelined model's, from the same checkpoint (so restoring
  across the switch works too), with whole or sliced masters."""
  prefix, want_losses, want_values = start
  model = _lm(4, pipeline_stages=stages, num_microbatches=microbatches, pipeline_schedule=schedule)
  losses, values = _train(model, MESHES[mesh], 3, str(tmp_path / "end"), restore=prefix, masters=masters)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  _assert_same_variables(values, want_values)


@pytest.mark.parametrize("mesh,stages,microbatches,schedule", [
    ("stage:4;batch:2", 4, 4, "fill_drain"), ("stage:2;batch:2;model:2", 2, 2, "circular")])
def test_outer_batch_as_the_microbatches_split_over_the_stages_trains_as_unpipelined(
    start, tmp_path, mesh, stages, microbatches, schedule):
  """With outer_batch_size = num_microbatches the pipeline takes outer_batch's entries as its
  microbatches, and the layout `outer_batch:stage` splits the embedding and the loss over the
  stages: the losses and the checkpoint still equal the unpipelined model's."""
  prefix, want_losses, want_values = start
  model = _lm(4, pipeline_stages=stages, num_microbatches=microbatches, pipeline_schedule=schedule)
  mesh_shape, layout = MESHES[mesh]
  losses, values = _train(model, (mesh_shape, f"outer_batch:stage;{layout}"), 3, str(tmp_path / "end"),
                          restore=prefix, outer_batch=microbatches)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  _assert_same_variables(values, want_values)


def test_outer_batch_microbatches_with_dropout_draw_the_unpipelined_masks(tmp_path):
  start = str(tmp_path / "start")
  _train(_lm(4, dropout_rate=0.2), UNPIPELINED, 0, start)
  sgd = {"restore": start, "optimizer": "sgd"}
  want, _ = _train(_lm(4, dropout_rate=0.2), UNPIPELINED, 6, str(tmp_path / "a"), **sgd)
  model = _lm(4, dropout_rate=0.2, pipeline_stages=4, num_microbatches=4)
  got, _ = _train(model, ("stage:4;batch:2", "outer_batch:stage;stages:stage;batch:batch"), 6,
                  str(tmp_path / "c"), outer_batch=4, **sgd)
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("mesh,stages,microbatches,schedule", [
    ("stage:4;batch:2", 4, 2, "fill_drain"), ("stage:2;batch:2;model:2", 2, 4, "circular")])
def test_pipelined_lm_with_dropout_trains_with_the_unpipelined_masks(tmp_path, mesh, stages, microbatches,
                                                                     schedule):
  """20 SGD steps with dropout 0.2, from one checkpoint: every stage draws its layer's
  unpipelined mask for its microbatch's rows, so the losses equal the unpipelined run's (and
  differ from a run without dropout)."""
  start = str(tmp_path / "start")
  _train(_lm(4, dropout_rate=0.2), UNPIPELINED, 0, start)
  sgd = {"restore": start, "optimizer": "sgd"}
  want, _ = _train(_lm(4, dropout_rate=0.2), UNPIPELINED, 20, str(tmp_path / "a"), **sgd)
  plain, _ = _train(_lm(4, dropout_rate=0.0), UNPIPELINED, 20, str(tmp_path / "b"), **sgd)
  model = _lm(4, dropout_rate=0.2, pipeline_stages=stages, num_microbatches=microbatches,
              pipeline_schedule=schedule)
  got, _ = _train(model, MESHES[mesh], 20, str(tmp_path / "c"), **sgd)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert np.abs(plain - want).max() > 1e-3


def test_pipelined_checkpoint_restores_unpipelined(start, tmp_path):
  """Two pipelined steps, saved; the unpipelined model resumes from that checkpoint and its third
  step is the uninterrupted run's third step."""
  prefix, want_losses, want_values = start
  middle = str(tmp_path / "middle")
  first, _ = _train(_lm(4, pipeline_stages=4, num_microbatches=2), MESHES["stage:4;batch:2"], 2, middle,
                    restore=prefix, masters="sliced")
  last, values = _train(_lm(4), UNPIPELINED, 1, str(tmp_path / "end"), restore=middle)
  np.testing.assert_allclose(np.concatenate([first, last]), want_losses, rtol=1e-5)
  _assert_same_variables(values, want_values)


def test_pipelined_eval_matches_unpipelined(start, tmp_path):
  """Eval mode (no z_loss) pipelines too, with the unpipelined loss."""
  prefix = start[0]
  want, _ = _train(_lm(4), UNPIPELINED, 1, str(tmp_path / "a"), restore=prefix, optimizer="sgd", mode="eval")
  losses, _ = _train(_lm(4, pipeline_stages=2, num_microbatches=4), MESHES["stage:2;batch:2;model:2"], 1,
                     str(tmp_path / "b"), restore=prefix, optimizer="sgd", mode="eval")
  np.testing.assert_allclose(losses, want, rtol=1e-5)


def _build(model):
  with tf.Graph().as_default():
    mesh = mtf.Mesh(mtf.Graph(), "mesh")
    ids = model_check.import_ids(mesh, IDS)
    model.call_simple(transformer.autoregressive_inputs(ids), ids, True)


def test_blocks_that_differ_are_refused_with_the_block_named():
  layers = [transformer.make_layer_stack([model_check.SELF_ATTENTION, model_check.FEED_FORWARD],
                                         num_layers=1).layers,
            transformer.make_layer_stack([model_check.FEED_FORWARD], num_layers=1).layers]
  layers[1][0].set_name("block_001/layer_000")
  stack = transformer.LayerStack(layers[0] + layers[1], pipeline_stages=2)
  model = transformer.Unitransformer(layer_stack=stack, d_model=8, input_vocab_size=VOCAB,
                                     output_vocab_size=VOCAB, autoregressive=True, max_length=LENGTH)
  with pytest.raises(ValueError, match="block 'block_001' holds layers .*the blocks must be alike"):
    _build(model)


def test_layers_outside_blocks_are_refused_with_the_fix():
  stack = transformer.make_layer_stack([model_check.FEED_FORWARD], num_layers=2, block_scope=False,
                                       layer_stack_cls=functools.partial(transformer.LayerStack,
                                                                         pipeline_stages=2))
  model = transformer.Unitransformer(layer_stack=stack, d_model=8, input_vocab_size=VOCAB,
                                     output_vocab_size=VOCAB, autoregressive=True, max_length=LENGTH)
  with pytest.raises(ValueError, match="'layer_000' is not in a block.*block_scope=True"):
    _build(model)


def test_stages_that_do_not_divide_the_blocks_are_refused():
  with pytest.raises(ValueError, match="stages"):
    _build(_lm(3, pipeline_stages=2))


def test_microbatches_that_do_not_divide_the_batch_are_refused():
  with pytest.raises(ValueError, match="num_microbatches=3 does not divide the batch dimension 'batch'"):
    _build(_lm(4, pipeline_stages=2, num_microbatches=3))


OUTER_BATCH_LAYOUT = "outer_batch:stage,stages:stage,batch:batch,d_ff:model,heads:model,vocab:model"


def test_driver_run_with_outer_batch_microbatches_over_the_stages_gives_the_2x4_losses(tmp_path, corpus,
                                                                                      monkeypatch):
  """docs/pipeline.md's gin lines: cpu8_pipeline.gin with outer_batch_size = num_microbatches and
  outer_batch:stage trains as cpu8_dp_mp does, from scratch (initial weights included)."""
  two_blocks = ["num_layers = 2", "utils.run.train_steps = 3"]
  microbatch_dims = []
  pipeline = mtf.pipeline

  def spy(*args, microbatch_dim=None, **kwargs):
    microbatch_dims.append(microbatch_dim)
    return pipeline(*args, microbatch_dim=microbatch_dim, **kwargs)
  monkeypatch.setattr(mtf, "pipeline", spy)

  def run_with(model_dir, layout, bindings=()):
    tiny_run.configure_gin(corpus, two_blocks + list(bindings), layout=layout)
    tiny_run.run(model_dir, "train")
    return dict(progress.read_scalars(str(model_dir), "loss"))

  want = run_with(tmp_path / "plain", "layouts/cpu8_dp_mp.gin")
  got = run_with(tmp_path / "outer", "layouts/cpu8_pipeline.gin", [
      "tpu_estimator_model_fn.outer_batch_size = 4", f'utils.run.layout_rules = "{OUTER_BATCH_LAYOUT}"'])
  assert microbatch_dims and all(d == mtf.Dimension("outer_batch", 4) for d in microbatch_dims)
  assert sorted(got) == sorted(want) == [1, 2, 3]
  np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [want[s] for s in (1, 2, 3)], rtol=2e-5)


def test_driver_run_switches_between_the_pipeline_and_the_2x4_layout(tmp_path, corpus):
  """utils.run from scratch with layouts/cpu8_pipeline.gin for 2 steps, layouts/cpu8_dp_mp.gin to
  step 4 and the pipeline again to step 6, in one model_dir: the losses are an uninterrupted
  cpu8_dp_mp run's (the same initial weights too: the pipeline creates the layers' variables in
  the unpipelined order, and TF seeds initializers by creation order)."""
  two_blocks = ["num_layers = 2", "utils.run.save_checkpoints_steps = 2"]

  def run_to(model_dir, steps, layout):
    tiny_run.configure_gin(corpus, two_blocks + [f"utils.run.train_steps = {steps}"], layout=layout)
    tiny_run.run(model_dir, "train")
    return dict(progress.read_scalars(str(model_dir), "loss"))

  want = run_to(tmp_path / "plain", 6, "layouts/cpu8_dp_mp.gin")
  for steps, layout in [(2, "layouts/cpu8_pipeline.gin"), (4, "layouts/cpu8_dp_mp.gin"),
                        (6, "layouts/cpu8_pipeline.gin")]:
    got = run_to(tmp_path / "switched", steps, layout)
  assert sorted(got) == list(range(1, 7))
  np.testing.assert_allclose([got[s] for s in range(1, 7)], [want[s] for s in range(1, 7)], rtol=2e-5)
