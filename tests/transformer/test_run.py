"""utils.run end to end (train, perplexity_eval, infer, scoring, export) and its up-front errors."""

from __future__ import annotations

import math
import os
import re

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow._backends import placement
from mesh_tensorflow.transformer import utils
from mesh_tensorflow.transformer._train import checkpoints, decode, model_fn, progress
from tests.transformer import shared_runs, tiny_run
from tests.transformer.tiny_run import run

# One worker runs the modules reading shared_runs.py's training, so it is done once.
pytestmark = [pytest.mark.xdist_group("tiny_transformer_run"), pytest.mark.slow]

trained = shared_runs.trained  # the shared 6-step run (a fixture)


def test_train_then_perplexity_eval_then_infer_then_score_and_export(tmp_path, corpus, trained):
  model_dir, out = shared_runs.copy_model_dir(trained, tmp_path / "model"), trained.out
  assert trained.result["step"] == 6 and math.isfinite(trained.result["loss"])
  assert "First training step done" in out
  assert len([line for line in out.splitlines() if line.startswith("step ")]) == 6
  assert [os.path.basename(p) for p in checkpoints.list_checkpoints(str(model_dir))] == ["model.ckpt-3",
                                                                                          "model.ckpt-6"]
  losses = progress.read_scalars(str(model_dir), "loss")
  assert [s for s, _ in losses] == list(range(1, 7)) and losses[-1][1] < losses[0][1]
  assert progress.read_scalars(str(model_dir), "tokens_per_sec")
  assert "run.train_steps = 6" in (model_dir / "operative_config.gin").read_text()
  reader = tf.train.load_checkpoint(str(model_dir / "model.ckpt-6"))
  assert reader.get_tensor("global_step") == 6
  assert any("embedding" in name for name in reader.get_variable_to_shape_map())

  tiny_run.configure_gin(corpus, tiny_run.TWO_DEVICES)
  [result] = run(model_dir, "perplexity_eval", dataset_split="validation", eval_checkpoint_step=-1)
  assert result["step"] == 6 and result["dataset"] == "heldout"
  assert 0 < result["bits_per_token"] < math.log2(384)  # better than uniform over the padded vocabulary
  assert progress.read_scalars(str(model_dir / "validation_eval"), "heldout/bits_per_token")

  prompts = tmp_path / "prompts.txt"
  prompts.write_text("line 3: the\nline\n")
  with gin.unlock_config():
    gin.bind_parameter("utils.decode_from_file.input_filename", str(prompts))
    gin.bind_parameter("utils.decode_from_file.output_filename", str(tmp_path / "decodes"))
  decodes = run(model_dir, "infer", eval_checkpoint_step=6)[6]
  assert len(decodes) == 2 and all(isinstance(d, str) for d in decodes)
  assert (tmp_path / "decodes-6").read_text().count("\n") == 2

  with gin.unlock_config():
    gin.bind_parameter("utils.score_from_strings.targets", ["line 1: the quick", "zzzz qqqq xxxx"])
  scores = run(model_dir, "score_from_strings", eval_checkpoint_step=6)[6]
  assert len(scores) == 2 and all(s < 0 for s in scores)
  heldout_scores = run(model_dir, "score_from_dataset", dataset_split="validation", eval_checkpoint_step=6)[6]
  assert len(heldout_scores) == result["examples"]
  np.testing.assert_allclose(-sum(heldout_scores) / result["tokens"], result["loss"], rtol=1e-5)

  export_dir = run(model_dir, "export_infer", export_path=str(tmp_path / "export"))
  assert export_dir == str(tmp_path / "export" / "6")
  outputs = run_saved_model(export_dir, "outputs", inputs=["line 3: the"] + [""] * 7)
  assert outputs.shape == (8,) and outputs[0].decode() == decodes[0]
  export_dir = run(model_dir, "export_score", export_path=str(tmp_path / "export_score"))
  exported_scores = run_saved_model(export_dir, "scores", targets=["line 1: the quick", "zzzz qqqq xxxx"])
  np.testing.assert_allclose(exported_scores[:2], scores, rtol=1e-5)


def run_saved_model(export_dir: str, output: str, **texts):
  """Loads a SavedModel (its main op fills the per-device slices) and runs its serving signature."""
  with tf.Graph().as_default(), tf.Session(config=tf.ConfigProto(device_count={"CPU": 8})) as sess:
    signature = tf.saved_model.loader.load(sess, [tf.saved_model.SERVING], export_dir).signature_def
    signature = signature["serving_default"]
    return sess.run(signature.outputs[output].name,
                    {signature.inputs[k].name: np.array(v) for k, v in texts.items()})


def test_a_checkpoint_of_a_different_model_is_refused_naming_the_variable_and_shapes(tmp_path, corpus,
                                                                                    trained):
  model_dir = shared_runs.copy_model_dir(trained, tmp_path / "model")
  tiny_run.configure_gin(corpus, tiny_run.TWO_DEVICES + ["utils.run.train_steps = 7", "d_ff = 64"])
  with pytest.raises(checkpoints.CheckpointMismatchError,
                     match=r"DenseReluDense/wi/kernel' with shape \[16, 32\].*has shape \[16, 64\]"):
    run(model_dir, "train")


def test_init_checkpoint_warm_starts_a_fresh_model_dir_at_step_zero(tmp_path, corpus, capsys, trained):
  tiny_run.configure_gin(corpus, tiny_run.TWO_DEVICES + ["utils.run.train_steps = 1"])
  run(tmp_path / "fine_tuned", "train", init_checkpoint=str(trained.model_dir / "model.ckpt-6"))
  assert re.search(r"Initialised \d+ variables from init_checkpoint .*model.ckpt-6", capsys.readouterr().out)
  pretrained = dict(progress.read_scalars(str(trained.model_dir), "loss"))
  [(step, loss)] = progress.read_scalars(str(tmp_path / "fine_tuned"), "loss")
  assert step == 1 and loss < pretrained[1]  # same first batch, but from the trained weights


DROPOUT_STEPS = 5


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory) -> dict:
  """name -> the losses of DROPOUT_STEPS uninterrupted steps: with dropout_rate 0.1 on one device
  ("single") and on the 2x4 mesh ("2x4"), and without dropout on one device ("no_dropout")."""
  directory = tmp_path_factory.mktemp("uninterrupted")
  corpus = tiny_run.write_corpus(str(directory))
  losses = {}
  try:
    for name, layout, dropout_rate in [("single", "layouts/single.gin", 0.1),
                                       ("2x4", "layouts/cpu8_dp_mp.gin", 0.1),
                                       ("no_dropout", "layouts/single.gin", 0.0)]:
      tiny_run.configure_gin(corpus, [f"utils.run.train_steps = {DROPOUT_STEPS}",
                                      f"utils.run.save_checkpoints_steps = {DROPOUT_STEPS}",
                                      f"dropout_rate = {dropout_rate}"], layout=layout)
      run(directory / name, "train")
      losses[name] = [loss for _, loss in progress.read_scalars(str(directory / name), "loss")]
  finally:
    gin.clear_config()
    utils.FLAGS.unparse_flags()
  return losses


def test_training_continues_under_other_meshes_from_a_batch_8_checkpoint(tmp_path, corpus,
                                                                         uninterrupted_losses):
  """batch:8 for 3 steps, then batch:2;model:4 to step 4, then one device to step 5: the losses are
  those of an uninterrupted run, dropout masks included."""
  dropout = ["dropout_rate = 0.1"]
  data_parallel = ["utils.run.mesh_shape = 'batch:8'", "utils.run.layout_rules = 'batch:batch'"] + dropout
  for steps, bindings, layout in [(3, data_parallel, "layouts/cpu8_dp_mp.gin"),
                                  (4, dropout, "layouts/cpu8_dp_mp.gin"), (5, dropout, "layouts/single.gin")]:
    tiny_run.configure_gin(corpus, bindings + [f"utils.run.train_steps = {steps}"], layout=layout)
    run(tmp_path / "continued", "train")
  continued = dict(progress.read_scalars(str(tmp_path / "continued"), "loss"))
  assert sorted(continued) == [1, 2, 3, 4, 5]
  np.testing.assert_allclose([continued[s] for s in range(1, 6)], uninterrupted_losses["single"], rtol=2e-5)


def test_dropout_training_gives_the_same_losses_on_one_device_and_on_a_2x4_mesh(uninterrupted_losses):
  """Dropout masks do not depend on the layout: steps with dropout_rate 0.1 agree, and differ from
  the same steps without dropout."""
  losses = uninterrupted_losses
  assert len(losses["single"]) == DROPOUT_STEPS
  np.testing.assert_allclose(losses["2x4"], losses["single"], rtol=2e-5)
  assert np.abs(np.array(losses["no_dropout"]) - losses["single"]).min() > 1e-4


@pytest.mark.parametrize("bindings, message", [
    (["utils.run.mode = 'train_and_eval'"], r"Unknown mode 'train_and_eval'.*perplexity_eval"),
    (["utils.run.mesh_shape = 'batch:4'"], r"mesh_shape Shape\[batch=4\] has 4 processors but mesh_devices "
                                           r"lists 8 devices"),
    (["num_heads = 3", "d_kv = 5"], r"Layout rule heads:model splits dimension 'heads' \(size \d+.*4 ways"),
    (["utils.run.dataset_split = 'validation'"], r"mode 'train' trains on dataset_split 'train'"),
])
def test_bad_configurations_fail_before_any_training_step(tmp_path, corpus, bindings, message):
  tiny_run.configure_gin(corpus, bindings)
  with pytest.raises(ValueError, match=message):
    utils.run(tpu_job_name=None, tpu=None, gcp_project=None, tpu_zone=None, model_dir=str(tmp_path))
  assert not checkpoints.list_checkpoints(str(tmp_path))
  assert not progress.read_scalars(str(tmp_path), "loss")


def test_prompts_keep_their_end_and_other_inputs_their_start():
  assert decode.fit_to_length([5, 6, 7, 8, 9], 4, is_prompt=True) == [7, 8, 9]   # room for one more
  assert decode.fit_to_length([5, 6, 7, 8, 9], 4, is_prompt=False) == [5, 6, 7, 8]
  assert decode.clean_ids([5, 6, 0, 7, 1, 8, 0]) == [5, 6, 7]


@pytest.mark.parametrize("cores, threads_per_kernel", [(16, 2), (8, 1), (2, 1)])
def test_the_driver_session_has_the_meshs_cpus_and_a_share_of_the_cores_per_kernel(
    monkeypatch, cores, threads_per_kernel):
  monkeypatch.setattr(placement, "usable_cores", lambda: cores)
  config = model_fn.session_config([f"cpu:{i}" for i in range(8)])
  assert config.device_count["CPU"] == 8 and not config.allow_soft_placement
  assert config.intra_op_parallelism_threads == threads_per_kernel
  assert model_fn.session_config(None) == tf.ConfigProto(allow_soft_placement=False)
