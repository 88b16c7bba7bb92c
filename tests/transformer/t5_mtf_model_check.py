"""T5's own `t5.models.MtfModel.finetune` fine-tunes a model_dir `convert from_hf` wrote, on this package.

Against t5 0.9.4 and seqio 0.0.20 in .t5deps/ (scripts/setup_t5.sh). Not a test_ file: the suite never
imports T5 (it brings jax); test_t5_mtf_model.py runs this file under pytest in a subprocess whose
PYTHONPATH adds .t5deps/.
"""

from __future__ import annotations

import glob
import json
import types

import gin
import numpy as np
import pytest
import tensorflow as tf2
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer.convert import cli, mtf_checkpoints
from tests.transformer import convert_fixtures as fixtures

TASK = "mtf_tests_reverse_bytes"
INPUTS, TARGETS = "abcdefg", "gfedcba"   # 7 bytes + EOS = 8 ids each: one example fills each row
LENGTH, BATCH, STEPS = 8, 2, 3
Z_LOSS = 1e-4   # Unitransformer.z_loss's default: training adds it to the cross-entropy


@pytest.fixture
def t5_models():
  """t5.models, imported with tf.estimator lent for the import: gin.tf (which MtfModel imports)
  subclasses tf.estimator.SessionRunHook, and tf.estimator is gone from TF 2.16 on; that class was
  tf.compat.v1.train.SessionRunHook, which TF still has."""
  lent = not hasattr(tf2, "estimator")
  if lent:
    tf2.estimator = types.SimpleNamespace(SessionRunHook=tf.train.SessionRunHook)
  try:
    import t5.models
    yield t5.models
  finally:
    if lent:
      del tf2.estimator


@pytest.fixture
def byte_task(t5_models):
  """A seqio Task of the one example INPUTS -> TARGETS (in memory), in seqio's ByteVocabulary."""
  import seqio
  vocabulary = seqio.ByteVocabulary()

  def source(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices({"inputs": [INPUTS], "targets": [TARGETS]})

  features = {k: seqio.Feature(vocabulary, add_eos=True) for k in ("inputs", "targets")}
  preprocessors = [seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim]
  seqio.TaskRegistry.add(TASK, source=seqio.FunctionDataSource(source, splits=["train"]),
                         preprocessors=preprocessors, output_features=features)
  yield vocabulary
  seqio.TaskRegistry.remove(TASK)
  gin.clear_config()   # MtfModel parses the pretrained model_dir's operative config into gin's


def hf_training_loss(hf_dir, vocabulary) -> float:
  """What our training step computes for the example with HF's T5: the mean cross-entropy of the
  targets (all LENGTH positions real) plus Z_LOSS times the mean squared log-normaliser."""
  import torch
  import transformers
  model = transformers.T5ForConditionalGeneration.from_pretrained(str(hf_dir)).eval()
  inputs, labels = (torch.tensor([vocabulary.encode(text) + [1]]) for text in (INPUTS, TARGETS))
  with torch.no_grad():
    logits = model(input_ids=inputs, labels=labels).logits.double()[0]
  log_z = torch.logsumexp(logits, dim=-1)
  cross_entropy = log_z - logits.gather(1, labels[0][:, None])[:, 0]
  return float(cross_entropy.mean() + Z_LOSS * (log_z ** 2).mean())


def logged_losses(model_dir) -> dict:
  """{step: loss} of the training events in model_dir."""
  losses = {}
  for path in glob.glob(f"{model_dir}/events.out.tfevents.*"):
    for event in tf.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == "loss":
          losses[event.step] = float(tf2.make_ndarray(value.tensor) if value.HasField("tensor")
                                     else value.simple_value)
  return losses


def model_variables(prefix) -> dict:
  reader = mtf_checkpoints.Reader(str(prefix))
  checkpoint = tf.train.load_checkpoint(str(prefix))
  return {name: checkpoint.get_tensor(name) for name in reader.model_variables()}


def test_mtf_model_finetune_starts_from_the_converted_weights_and_trains_them(tmp_path, t5_models, byte_task):
  # A T5 v1.1 (gated GELU, untied logits) in bytes: 256 + PAD, EOS, UNK = 259 ids, padded to 260.
  fixtures.hf_native_model(tmp_path / "hf", False, "gated-gelu", vocab_size=260)
  (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
  converted, tuned = tmp_path / "converted", tmp_path / "tuned"
  assert cli.main(["from_hf", "--hf_dir", str(tmp_path / "hf"), "--model_dir", str(converted)]) == 0

  model = t5_models.MtfModel(model_dir=str(tuned), tpu=None, mesh_shape="batch:2",
                             mesh_devices=["cpu:0", "cpu:1"], batch_size=BATCH,
                             sequence_length={"inputs": LENGTH, "targets": LENGTH},
                             save_checkpoints_steps=STEPS, iterations_per_loop=1)
  model.finetune(mixture_or_task_name=TASK, finetune_steps=STEPS, pretrained_model_dir=str(converted))

  # It trained STEPS steps on from the converted checkpoint's step 0 ...
  latest = tf.train.latest_checkpoint(str(tuned))
  assert latest == str(tuned / f"model.ckpt-{STEPS}")
  assert tf.train.load_checkpoint(latest).get_tensor("global_step") == STEPS
  losses = logged_losses(tuned)
  assert sorted(losses) == list(range(1, STEPS + 1))
  # ... its first step computed the loss HF's T5 gives the converted weights (a random start would not) ...
  np.testing.assert_allclose(losses[1], hf_training_loss(tmp_path / "hf", byte_task), rtol=1e-5)
  # ... and training on it lowered that loss, moving every converted weight, kept with its name and shape.
  assert losses[STEPS] < losses[1]
  start, end = model_variables(converted / "model.ckpt-0"), model_variables(latest)
  assert sorted(end) == sorted(start)
  for name in start:
    assert end[name].shape == start[name].shape, name
    assert not np.allclose(end[name], start[name]), name
  assert "DenseReluDense.activation = ['gelu', 'linear']" in (tuned / "operative_config.gin").read_text()
