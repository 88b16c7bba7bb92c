"""Batches holding ids outside the vocabulary after the first: the driver stops, or skips them."""

from __future__ import annotations

import os

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import dataset, main
from mesh_tensorflow.transformer._train import checkpoints, estimator_api, id_checks, progress
from tests.transformer import shared_runs, tiny_run
from tests.transformer.tiny_run import run

pytestmark = [pytest.mark.xdist_group("tiny_transformer_run"), pytest.mark.slow]

trained = shared_runs.trained  # the shared 6-step run (a fixture)

BATCH, LENGTH, VOCAB = 8, 16, 259  # tiny_run's batch and length; the byte vocabulary's size
BAD_ID = 1000


def _batches(count: int, bad: int | None = None) -> np.ndarray:
  """count batches of clean ids (the same ones every call); batch `bad` (0 first) holds BAD_ID once."""
  ids = np.random.RandomState(0).randint(2, VOCAB, size=[count, BATCH, LENGTH]).astype(np.int32)
  if bad is not None:
    ids[bad, 3, 2] = BAD_ID
  return ids


def dataset_of(batches: np.ndarray):
  def batches_dataset_fn(sequence_length, vocabulary, dataset_split):
    del sequence_length, vocabulary, dataset_split
    return tf.data.Dataset.from_tensor_slices({"targets": batches.reshape(-1, LENGTH)})
  return batches_dataset_fn


def train(model_dir, corpus, batches: np.ndarray, steps: int, *bindings):
  tiny_run.configure_gin(corpus, tiny_run.TWO_DEVICES + ["utils.run.save_checkpoints_steps = 1",
                                                         f"utils.run.train_steps = {steps}", *bindings])
  return run(model_dir, "train", train_dataset_fn=dataset_of(batches))


def saved_steps(model_dir) -> list:
  return [checkpoints.get_step_from_checkpoint_path(p) for p in checkpoints.list_checkpoints(str(model_dir))]


def test_a_bad_third_batch_stops_training_at_step_3_and_nothing_of_step_3_is_saved(tmp_path, corpus):
  with pytest.raises(id_checks.BadIdsError) as raised:
    train(tmp_path, corpus, _batches(4, bad=2), 6)
  assert main.one_line_error(raised.value) == (
      "Error (BadIdsError): Refused the batch of step 3 before it was used: feature 'targets' holds id "
      "1000, outside the targets vocabulary of 259 ids (0 to 258), from train_dataset_fn "
      "dataset_of.<locals>.batches_dataset_fn (split 'train'). Re-encode that data with "
      "utils.run.vocabulary, or set bad_id_batches.skip = True (gin) to skip such batches. (--traceback "
      "shows where it was raised)")
  assert saved_steps(tmp_path) == [1, 2]


def test_skipping_trains_on_without_the_bad_batch_and_counts_it(tmp_path, corpus, capsys):
  skipping = train(tmp_path / "skip", corpus, _batches(5, bad=2), 4, "bad_id_batches.skip = True")
  out = capsys.readouterr().out
  clean = train(tmp_path / "clean", corpus, np.delete(_batches(5), 2, axis=0), 4)
  assert skipping["skipped_bad_id_batches"] == 1 and clean["skipped_bad_id_batches"] == 0
  losses = progress.read_scalars(str(tmp_path / "skip"), "loss")
  assert [s for s, _ in losses] == [1, 2, 3, 4]
  clean_losses = progress.read_scalars(str(tmp_path / "clean"), "loss")
  np.testing.assert_allclose([v for _, v in losses], [v for _, v in clean_losses], rtol=1e-6)
  assert progress.read_scalars(str(tmp_path / "skip"), id_checks.SKIPPED_TAG) == [(3, 1.0)]
  assert "Skipped a batch at step 3: feature 'targets' holds id 1000" in out
  assert ("Skipped 1 batch(es) holding ids outside the vocabulary (bad_id_batches.skip), e.g. (feature, id): "
          "('targets', 1000).") in out


def test_a_resumed_skipping_run_reads_what_an_uninterrupted_one_reads_and_counts_no_batch_twice(tmp_path,
                                                                                                   corpus):
  uninterrupted = train(tmp_path / "whole", corpus, _batches(5, bad=2), 5, "bad_id_batches.skip = True")
  first = train(tmp_path / "resumed", corpus, _batches(5, bad=2), 3, "bad_id_batches.skip = True")
  second = train(tmp_path / "resumed", corpus, _batches(5, bad=2), 5, "bad_id_batches.skip = True")
  assert (uninterrupted["skipped_bad_id_batches"], first["skipped_bad_id_batches"],
          second["skipped_bad_id_batches"]) == (1, 1, 0)
  whole, resumed = (progress.read_scalars(str(tmp_path / d), "loss") for d in ("whole", "resumed"))
  assert [s for s, _ in resumed] == [1, 2, 3, 4, 5]
  np.testing.assert_allclose([v for _, v in resumed], [v for _, v in whole], rtol=1e-6)


def test_skipping_stops_after_max_skipped_in_a_row(tmp_path, corpus):
  batches = _batches(5, bad=1)
  batches[2, 0, 0] = BAD_ID
  in_a_row = r"^2 batches in a row hold ids outside the vocabulary \(bad_id_batches.max_skipped_in_a_row\)"
  with pytest.raises(id_checks.BadIdsError, match=in_a_row):
    train(tmp_path, corpus, batches, 4, "bad_id_batches.skip = True",
          "bad_id_batches.max_skipped_in_a_row = 2")
  assert saved_steps(tmp_path) == [1]


def test_the_source_of_a_text_line_dataset_is_its_file(tmp_path):
  path = os.path.join(tmp_path, "shard-00003.txt")
  with tf.Graph().as_default():
    dataset = tf.data.TextLineDataset([path]).map(lambda line: {"targets": tf.strings.bytes_split(line)})
    assert id_checks.describe_source(dataset.batch(2), "fallback") == f"file {path}"
    assert id_checks.describe_source(tf.data.Dataset.range(3), "train_dataset_fn f (split 'train')") == \
        "train_dataset_fn f (split 'train')"


def perplexity_eval(model_dir, corpus, batches: np.ndarray, *bindings) -> dict:
  tiny_run.configure_gin(corpus, tiny_run.TWO_DEVICES + ["utils.run.eval_checkpoint_step = 6",
                                                         "utils.run.perplexity_eval_steps = 10", *bindings])
  [result] = run(model_dir, "perplexity_eval", train_dataset_fn=dataset_of(batches), eval_dataset_fn=None,
                 dataset_split="validation")
  return result


def test_a_bad_eval_batch_stops_perplexity_eval_naming_the_batch(tmp_path, corpus, trained):
  model_dir = shared_runs.copy_model_dir(trained, tmp_path / "model")
  with pytest.raises(id_checks.BadIdsError, match=(
      r"^Refused batch 3 of perplexity_eval 'validation' at checkpoint step 6 before it was used: feature "
      r"'targets' holds id 1000, outside the targets vocabulary of 259 ids \(0 to 258\), from eval dataset "
      r"'validation' \(dataset_of.<locals>.batches_dataset_fn\)\. Re-encode")):
    perplexity_eval(model_dir, corpus, _batches(4, bad=2))


def test_skipping_in_perplexity_eval_equals_an_eval_without_the_bad_batch(tmp_path, corpus, trained, capsys):
  model_dir = shared_runs.copy_model_dir(trained, tmp_path / "model")
  skipping = perplexity_eval(model_dir, corpus, _batches(4, bad=2), "bad_id_batches.skip = True")
  assert "Skipped 1 batch(es) holding ids outside the vocabulary" in capsys.readouterr().out
  clean = perplexity_eval(model_dir, corpus, np.delete(_batches(4), 2, axis=0))
  assert skipping["skipped_bad_id_batches"] == 1 and clean["skipped_bad_id_batches"] == 0
  assert skipping["examples"] == clean["examples"] == 3 * BATCH
  assert skipping["loss"] == pytest.approx(clean["loss"], rel=1e-6)
  assert progress.read_scalars(str(model_dir / "validation_eval"), "validation/skipped_bad_id_batches") == \
      [(6, 1.0)]


def infer(model_dir, corpus, batches: np.ndarray, *bindings) -> list:
  """decode_from_dataset's predictions of the prompts `batches` (their first 4 ids) at step 6."""
  tiny_run.configure_gin(corpus, tiny_run.TWO_DEVICES + ["utils.run.eval_checkpoint_step = 6", *bindings])
  prompts = batches.reshape(-1, LENGTH).copy()
  prompts[:, 4:] = 0

  def prompts_dataset_fn(sequence_length, vocabulary, dataset_split):
    del sequence_length, vocabulary, dataset_split
    return [dataset.EvalDataset("prompts", lambda: tf.data.Dataset.from_tensor_slices(
        {"inputs": prompts, "targets": prompts}), None, [])]
  gin.bind_parameter("utils.infer_model.decode_fn", estimator_api.decode_from_dataset)
  gin.bind_parameter("utils.decode_from_dataset.infer_dataset_fn", prompts_dataset_fn)
  gin.bind_parameter("utils.decode_from_dataset.decode_output_dir", str(model_dir / "decodes"))
  return run(model_dir, "infer")[6]["prompts"]


def test_a_bad_infer_batch_stops_decoding_naming_the_batch(tmp_path, corpus, trained):
  model_dir = shared_runs.copy_model_dir(trained, tmp_path / "model")
  with pytest.raises(id_checks.BadIdsError, match=(
      r"^Refused batch 2 of decode_from_dataset at checkpoint step 6 before it was used: feature 'inputs' "
      r"holds id 1000, outside the inputs vocabulary of 259 ids \(0 to 258\), from infer_dataset_fn "
      r"infer.<locals>.prompts_dataset_fn \(split 'validation'\)\.")):
    infer(model_dir, corpus, _batches(3, bad=1))


def test_skipping_in_infer_decodes_as_without_the_bad_batch(tmp_path, corpus, trained):
  model_dir = shared_runs.copy_model_dir(trained, tmp_path / "model")
  skipping = infer(model_dir, corpus, _batches(3, bad=1), "bad_id_batches.skip = True")
  clean = infer(model_dir, corpus, np.delete(_batches(3), 1, axis=0))
  assert len(skipping) == 2 * BATCH and skipping == clean and len(set(clean)) > 1
  assert (model_dir / "decodes" / "prompts_inputs").read_text().count("\n") == 2 * BATCH
