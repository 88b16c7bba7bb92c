"""The estimator-era API of transformer.utils (0.1.21's, as T5 calls it) on a tiny encoder-decoder.

get_estimator -> train_model (and a resumed train_model) -> Estimator.evaluate -> scoring
(compute_log_likelihoods, score_from_strings) -> eval_model -> infer_model -> export_model, each
checked against another path through the driver: the eval metrics against the scores, the
scores of score_from_strings and score_from_dataset against compute_log_likelihoods, eval_model's
predictions against infer_model's decodes, and the SavedModel's outputs against both.
"""

from __future__ import annotations

import functools

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import dataset as dataset_lib, utils
from mesh_tensorflow.transformer import vocabulary as vocabulary_lib
from mesh_tensorflow.transformer._train import checkpoints, progress
from mesh_tensorflow.transformer._train import decode as decode_lib
from mesh_tensorflow.transformer._train import estimator as estimator_lib
from tests.transformer.test_run import run_saved_model

VOCAB = vocabulary_lib.ByteVocabulary()
LENGTHS = {"inputs": 8, "targets": 8}
BATCH = 4
WORDS = ["cat", "dog", "emu", "fox", "gnu", "hen", "owl", "yak"]
TINY = ["num_layers = 1", "d_model = 16", "d_ff = 32", "num_heads = 4", "d_kv = 4", "dropout_rate = 0.0",
        "utils.get_variable_dtype.master_dtype = 'float32'",
        "utils.get_variable_dtype.activation_dtype = 'float32'"]


@pytest.fixture
def tiny_gin():
  """The packaged defaults with a tiny encoder-decoder; cleared afterwards."""
  gin.clear_config()
  utils.FLAGS.unparse_flags()
  utils.FLAGS(["test"] + [f"--gin_param={b}" for b in TINY], known_only=True)
  utils.parse_gin_defaults_and_flags(finalize_config=False)
  yield
  gin.clear_config()
  utils.FLAGS.unparse_flags()


def _ids(word: str) -> list:
  ids = VOCAB.encode(word) + [1]
  return ids + [0] * (LENGTHS["inputs"] - len(ids))


def copy_dataset(sequence_length, vocabulary, dataset_split):
  """The copy task: each word is its own target (a train_dataset_fn)."""
  del sequence_length, vocabulary, dataset_split
  ids = np.array([_ids(w) for w in WORDS], np.int32)
  return tf.data.Dataset.from_tensor_slices({"inputs": ids, "targets": ids})


def exact_match(targets, predictions):
  return {"accuracy": float(np.mean([t == p for t, p in zip(targets, predictions)]))}


def copy_eval_datasets(sequence_length, vocabulary, dataset_split):
  """An eval_dataset_fn: the copy task with its texts, scored by exact match."""
  def with_texts(sequence_length=None):
    del sequence_length
    texts = tf.data.Dataset.from_tensor_slices(WORDS)
    return tf.data.Dataset.zip((copy_dataset(None, vocabulary, dataset_split), texts)).map(
        lambda ex, text: {**ex, "inputs_pretokenized": text, "targets_pretokenized": text})
  postprocess = lambda text, example=None, is_target=False: text
  return [dataset_lib.EvalDataset("copy", with_texts, postprocess, [exact_match])]


def make_estimator(model_dir, score_in_predict_mode=False):
  return utils.get_estimator(
      "bitransformer", VOCAB, "", "", str(model_dir), BATCH, LENGTHS, True, 0.01, None, 2,
      mtf.optimize.AdafactorOptimizer, None, None, None, False, None, 1, None,
      score_in_predict_mode=score_in_predict_mode)


def eval_input_fn(params):
  """The copy task in batches of params["batch_size"]."""
  return copy_dataset(None, VOCAB, "validation").batch(params["batch_size"])


@pytest.mark.slow
def test_the_originals_call_sequence_trains_resumes_evaluates_scores_decodes_and_exports(tmp_path, tiny_gin,
                                                                                         capsys):
  model_dir = tmp_path / "model"
  estimator = make_estimator(model_dir)
  assert estimator.params["batch_size"] == BATCH and estimator.model_dir == str(model_dir)
  assert estimator.config.save_checkpoints_steps == 2 and estimator.latest_checkpoint() is None

  trained = utils.train_model(estimator, VOCAB, LENGTHS, BATCH, copy_dataset, 3, None)
  assert trained["step"] == 3
  saved = checkpoints.list_checkpoints(str(model_dir))
  assert [checkpoints.get_step_from_checkpoint_path(p) for p in saved] == [2, 3]
  resumed = utils.train_model(estimator, VOCAB, LENGTHS, BATCH, copy_dataset, 5, None)
  assert resumed["step"] == 5
  assert f"Resuming from {model_dir}/model.ckpt-3 at step 3." in capsys.readouterr().out
  losses = progress.read_scalars(str(model_dir), "loss")
  assert [s for s, _ in losses] == [1, 2, 3, 4, 5] and losses[-1][1] < losses[0][1]
  assert estimator.get_variable_value("global_step") == 5

  metrics = estimator.evaluate(eval_input_fn)
  targets = np.array([_ids(w) for w in WORDS])
  assert metrics["global_step"] == 5 and metrics["num_eval_tokens"] == (targets > 0).sum()
  assert metrics["max_targets_length"] == 4
  correct = metrics["token_accuracy"] * metrics["num_eval_tokens"]   # a share of the non-padding tokens
  assert 0 <= round(correct) <= metrics["num_eval_tokens"] and abs(correct - round(correct)) < 1e-3
  np.testing.assert_allclose(metrics["loss"], -metrics["neg_log_perplexity"], rtol=1e-6)

  scorer = make_estimator(model_dir, score_in_predict_mode=True)
  log_likelihoods = utils.compute_log_likelihoods(scorer, eval_input_fn)
  assert len(log_likelihoods) == len(WORDS) and all(s < 0 for s in log_likelihoods)
  np.testing.assert_allclose(sum(log_likelihoods) / (targets > 0).sum(), metrics["neg_log_perplexity"],
                             rtol=1e-5)
  scores_file = str(tmp_path / "scores")
  scores, texts = utils.score_from_strings(
      scorer, VOCAB, "bitransformer", BATCH, LENGTHS, str(model_dir), 5, inputs=WORDS, targets=WORDS,
      score_postprocess_fn=functools.partial(utils.save_scores, scores_filename=scores_file))
  np.testing.assert_allclose(scores, log_likelihoods, rtol=1e-5)
  assert texts == WORDS
  assert open(scores_file + ".targets").read().split() == WORDS
  assert [float(x) for x in open(scores_file + ".scores").read().split()] == pytest.approx(scores, rel=1e-5)

  summary_dir = tmp_path / "eval"
  evaluated = utils.eval_model(estimator, VOCAB, LENGTHS, BATCH, "validation", str(model_dir),
                               copy_eval_datasets, str(summary_dir), 5)
  predictions = (summary_dir / "copy_5_predictions").read_text().splitlines()
  assert (summary_dir / "copy_targets").read_text().split() == WORDS
  assert evaluated == {5: {"copy": exact_match(WORDS, predictions)}}
  assert progress.read_scalars(str(summary_dir), "eval/copy/accuracy") == [(5,
                                                                            evaluated[5]["copy"]["accuracy"])]

  (tmp_path / "words.txt").write_text("\n".join(WORDS) + "\n")
  with gin.unlock_config():
    gin.bind_parameter("utils.decode_from_file.input_filename", str(tmp_path / "words.txt"))
    gin.bind_parameter("utils.decode_from_file.output_filename", str(tmp_path / "decodes"))
  decodes = utils.infer_model(estimator, VOCAB, LENGTHS, BATCH, "bitransformer", str(model_dir), 5)[5]
  assert decodes == predictions == (tmp_path / "decodes-5").read_text().splitlines()

  export_dir = utils.export_model(estimator, str(tmp_path / "export"), VOCAB, LENGTHS, "bitransformer",
                                  batch_size=BATCH)
  assert export_dir == str(tmp_path / "export" / "5")
  outputs = run_saved_model(export_dir, "outputs", inputs=WORDS[:BATCH])
  assert [o.decode() for o in outputs] == decodes[:BATCH]

  # Estimator.export_saved_model over a receiver of token ids: the predictions are infer's decodes.
  def receiver():
    ids = tf.placeholder(tf.int32, [BATCH, LENGTHS["inputs"]], name="ids")
    return estimator_lib.ServingInputReceiver({"inputs": ids}, {"ids": ids})
  generic = estimator.export_saved_model(str(tmp_path / "generic"), receiver)
  outputs = run_saved_model(generic, "outputs", ids=targets[:BATCH])
  assert [VOCAB.decode(decode_lib.clean_ids(o)) for o in outputs] == decodes[:BATCH]

  # A last batch of one example is padded with zero examples, whose scores are dropped.
  five = lambda sequence_length, vocabulary, dataset_split: copy_dataset(None, None, None).take(5)
  np.testing.assert_allclose(utils.score_from_dataset(scorer, VOCAB, BATCH, LENGTHS, str(model_dir), -1,
                                                      "validation",
                                                      score_dataset_fn=five), log_likelihoods[:5], rtol=1e-5)


def test_arguments_the_original_refuses_or_we_do_not_implement_are_named(tiny_gin, tmp_path):
  estimator = make_estimator(tmp_path)
  with pytest.raises(ValueError, match="At most one of skip_seen_data and checkpoint_input_pipeline"):
    utils.train_model(estimator, VOCAB, LENGTHS, BATCH, copy_dataset, 1, None, skip_seen_data=True,
                      checkpoint_input_pipeline=True)
  with pytest.raises(ValueError, match="exactly one of steps"):
    estimator.train(eval_input_fn)
  with pytest.raises(NotImplementedError, match="ensemble_inputs = 2"):
    utils.tpu_estimator_model_fn("lm", None, VOCAB, str(tmp_path), False, "batch:2", "batch:batch", 4,
                                 LENGTHS,
                                 True, None, 10, ensemble_inputs=2)
  with pytest.raises(ValueError, match=r"No checkpoint in .* train first"):
    list(estimator.predict(eval_input_fn))


def test_hierarchical_tiling_spec_is_accepted_and_said_to_be_ignored_off_tpu(tiny_gin, tmp_path):
  with gin.unlock_config():
    gin.bind_parameter("utils.tpu_estimator_model_fn.hierarchical_tiling_spec", [("batch", None)])
  model_fn = make_estimator(tmp_path).model_fn
  assert model_fn.hierarchical_tiling_spec == [("batch", None)]
  with pytest.warns(UserWarning, match="only maps the mesh onto TPU chips; on CPUs/GPUs it is ignored"):
    impl = model_fn.mesh_impl()
  assert isinstance(impl, mtf.placement_mesh_impl.PlacementMeshImpl)


def test_model_fn_keeps_the_features_labels_mode_params_contract(tiny_gin, tmp_path):
  model_fn = make_estimator(tmp_path).model_fn
  with tf.Graph().as_default():
    features = {"inputs": tf.ones([BATCH, 8], tf.int32), "targets": tf.ones([BATCH, 8], tf.int32),
                "targets_pretokenized": tf.constant(["x"] * BATCH)}
    spec = model_fn(features, None, estimator_lib.ModeKeys.EVAL, {"batch_size": BATCH})
    assert spec.mode == "eval" and spec.loss.dtype == tf.float32
    assert set(spec.eval_metric_ops) >= {"neg_log_perplexity", "token_accuracy", "sequence_accuracy",
                                         "mean_label", "num_eval_tokens", "max_targets_length"}
    with pytest.raises(ValueError, match="should have feature 'inputs'"):
      model_fn({"targets": features["targets"]}, None, "train", {})
    with pytest.raises(ValueError, match="expected one of"):
      model_fn(features, None, "predict", {})


def test_training_hooks_see_each_step_and_can_stop_it(tmp_path, tiny_gin):
  calls = []

  class StopAfterOneStep(tf.train.SessionRunHook):
    def begin(self):
      calls.append("begin")

    def after_create_session(self, session, coord):
      calls.append("session")

    def before_run(self, run_context):
      calls.append("before_run")
      return tf.train.SessionRunArgs(tf.constant(7))

    def after_run(self, run_context, run_values):
      calls.append(("after_run", int(run_values.results)))
      run_context.request_stop()

    def end(self, session):
      calls.append("end")

  estimator = make_estimator(tmp_path)
  batches = lambda params: copy_dataset(None, None, None).repeat().batch(params["batch_size"])
  assert estimator.train(batches, steps=3, hooks=[StopAfterOneStep()]) is estimator
  assert calls == ["begin", "session", "before_run", ("after_run", 7), "end"]
  assert estimator.train_result["step"] == 1 and estimator.latest_checkpoint().endswith("model.ckpt-1")


class EchoEstimator:
  """Predicts without a model: in score mode each example's score is minus its first target id;
  otherwise the outputs are the inputs (enough to check what the functions around predict do)."""

  def __init__(self, model_dir, score):
    self.model_dir, self.score = str(model_dir), score

  def latest_checkpoint(self):
    return checkpoints.latest_checkpoint(self.model_dir)

  def predict(self, input_fn, checkpoint_path=None):
    assert checkpoint_path in (None, self.latest_checkpoint())  # None: the latest
    with tf.Graph().as_default():
      batch = tf.data.make_one_shot_iterator(input_fn({"batch_size": BATCH})).get_next()
      with tf.Session() as session:
        while True:
          try:
            values = session.run(batch)
          except tf.errors.OutOfRangeError:
            return
          for i in range(BATCH):
            if self.score:
              yield {"targets": values["targets"][i], "scores": -float(values["targets"][i][0])}
            else:
              yield {"inputs": values["inputs"][i], "outputs": values["inputs"][i]}


@pytest.fixture
def model_dir_at_step_7(tmp_path):
  (tmp_path / "model.ckpt-7.index").write_bytes(b"")
  return tmp_path


def test_lazy_scoring_writes_tfrecord_shards_of_each_examples_text_and_score(model_dir_at_step_7):
  prefix = str(model_dir_at_step_7 / "scores")
  shards = utils.score_with_estimator_lazy(
      EchoEstimator(model_dir_at_step_7, score=True), eval_input_fn, -1, str(model_dir_at_step_7), VOCAB,
      score_postprocess_fn=functools.partial(utils.save_scores_to_tfrecords, scores_filename=prefix),
      num_examples_per_shard=3)
  assert shards == 3
  records = [tf.train.Example.FromString(r.numpy()) for i in range(3)
             for r in tf.data.TFRecordDataset(f"{prefix}_{i}.tfrecord")]
  assert [r.features.feature["target"].bytes_list.value[0].decode() for r in records] == WORDS
  scores = [r.features.feature["score"].float_list.value[0] for r in records]
  assert scores == [-float(_ids(w)[0]) for w in WORDS]


def test_save_scores_writes_scores_texts_and_lengths(tmp_path):
  results = [{"targets": np.array(_ids(w)), "scores": -1.5 * i} for i, w in enumerate(WORDS[:3], 1)]
  scores, texts = utils.save_scores(results, VOCAB, scores_filename=str(tmp_path / "s"))
  assert scores == [-1.5, -3.0, -4.5] and texts == WORDS[:3]
  assert (tmp_path / "s.scores").read_text().split() == ["-1.5", "-3", "-4.5"]
  assert (tmp_path / "s.lengths").read_text().split() == ["4", "4", "4"]  # 3 bytes and EOS
  with pytest.raises(ValueError, match="No examples were scored"):
    utils.save_scores([], VOCAB)


def test_decode_from_dataset_writes_predictions_targets_and_inputs(model_dir_at_step_7):
  out = model_dir_at_step_7 / "decodes"
  echo = EchoEstimator(model_dir_at_step_7, score=False)
  results = utils.decode_from_dataset(echo, VOCAB, "lm", BATCH, LENGTHS, infer_dataset_fn=copy_eval_datasets,
                                      decode_output_dir=str(out))
  assert results == {"copy": WORDS}
  assert (out / "copy_7_predictions").read_text().split() == WORDS
  assert (out / "copy_targets").read_text().split() == (out / "copy_inputs").read_text().split() == WORDS
  with pytest.raises(ValueError, match="decoder-only language models"):
    utils.decode_from_dataset(None, VOCAB, "bitransformer", BATCH, LENGTHS,
                              infer_dataset_fn=copy_eval_datasets, decode_output_dir=str(out))


@pytest.mark.slow
def test_model_fn_options_warm_start_filter_outer_batch_info_file_and_predict_fn(tmp_path, tiny_gin, capsys):
  """init_checkpoint with init_variable_filter loads exactly the matching variables; outer_batch_size
  2 trains; model_info_file gets the lowering's log; predict_fn replaces the scores."""
  utils.train_model(make_estimator(tmp_path / "a"), VOCAB, LENGTHS, BATCH, copy_dataset, 1, None)
  pretrained = str(tmp_path / "a" / "model.ckpt-1")
  with gin.unlock_config():
    gin.bind_parameter("tpu_estimator_model_fn.init_variable_filter", "decoder/")
    gin.bind_parameter("tpu_estimator_model_fn.outer_batch_size", 2)
    gin.bind_parameter("tpu_estimator_model_fn.model_info_file", str(tmp_path / "info.txt"))
  estimator = utils.get_estimator(
      "bitransformer", VOCAB, "", "", str(tmp_path / "b"), BATCH, LENGTHS, True, 0.01, None, 2,
      mtf.optimize.AdafactorOptimizer, None, None, None, False, None, 1, None, init_checkpoint=pretrained)
  capsys.readouterr()
  result = utils.train_model(estimator, VOCAB, LENGTHS, BATCH, copy_dataset, 1, None)
  assert result["step"] == 1 and np.isfinite(result["loss"])
  decoder_variables = [n for n, _ in tf.train.list_variables(pretrained) if "decoder/" in n]
  assert f"Initialised {len(decoder_variables)} variables from init_checkpoint" in capsys.readouterr().out
  assert "decoder/" in (tmp_path / "info.txt").read_text()

  def target_id_sum(model, features, variable_dtype):
    """The sum of the target ids (plus 0 x the model's logits, so that it reads the checkpoint)."""
    logits, _ = model.call_simple(inputs=features["inputs"], targets=features["targets"], compute_loss=False,
                                  mode="score", variable_dtype=variable_dtype)
    targets = mtf.cast(features["targets"], tf.float32)
    batch_shape = mtf.Shape(targets.shape.dims[:-1])
    unused = mtf.reduce_sum(logits, output_shape=batch_shape)
    return mtf.reduce_sum(targets, output_shape=batch_shape) + 0 * unused
  scorer = utils.get_estimator(
      "bitransformer", VOCAB, "", "", str(tmp_path / "b"), BATCH, LENGTHS, True, 0.01, None, 2,
      mtf.optimize.AdafactorOptimizer, target_id_sum, None, None, False, None, 1, None,
      score_in_predict_mode=True)
  scores = utils.compute_log_likelihoods(scorer, eval_input_fn)
  assert scores == [float(sum(_ids(w))) for w in WORDS]
