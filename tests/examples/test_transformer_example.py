"""The bundled Transformer example (examples/transformer/train.py) at tiny settings."""

from __future__ import annotations

import os
import re

import gin
import pytest

from examples.transformer import data, train
from mesh_tensorflow.transformer import utils
from mesh_tensorflow.transformer import vocabulary as vocabulary_lib
from mesh_tensorflow.transformer._train import progress

pytestmark = pytest.mark.slow  # trains and decodes the example end to end

TINY_MODEL = ["num_layers = 1", "d_model = 16", "d_ff = 32", "num_heads = 8", "d_kv = 2"]
TINY_LM = TINY_MODEL + ["utils.run.sequence_length = {'inputs': 16, 'targets': 16}",
                        "Unitransformer.max_length = 16", "utils.run.batch_size = 8"]


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
  monkeypatch.setattr(train, "configure_logging", lambda verbose: None)  # keep pytest's log settings
  yield
  gin.clear_config()
  utils.FLAGS.unparse_flags()


def params(bindings):
  return [arg for b in bindings for arg in ("--gin_param", b)]


def test_the_language_model_learns_evaluates_samples_and_draws_its_loss_curve(tmp_path, capsys):
  tiny = TINY_LM + ["utils.run.iterations_per_loop = 1", "utils.run.perplexity_eval_steps = 2"]
  summary = train.main(["--model_dir", str(tmp_path), "--train_steps", "12"] + params(tiny))
  out = capsys.readouterr().out
  assert "mesh 'batch:2,model:4'" in out  # the shipped layout file's mesh
  losses = [loss for _, loss in progress.read_scalars(str(tmp_path), "loss")]
  assert summary["train"]["step"] == len(losses) == 12
  # It learns: the training loss (6.17 nats at step 1, 4.05 at step 12 here) falls by a quarter, and
  # held-out text (5.63 bits per byte here) is far more predictable than a uniform byte model's 8 bits.
  assert losses[-1] < 0.75 * losses[0], losses
  assert summary["bits_per_byte"] < 6.5
  assert re.search(r"held-out bits per byte: [\d.]+ \(step 12, [\d,]+ held-out bytes\)", out)
  assert len(re.findall(r"^greedy: ", out, re.M)) == len(re.findall(r"^sampled: ", out, re.M)) == 3
  try:
    import matplotlib  # noqa: F401
    assert os.path.getsize(tmp_path / "loss_curve.png") > 1000
    assert "loss_curve.png (1 held-out point)" in out  # the evaluation at step 12
    assert train.loss_curve_series(str(tmp_path))["held-out"][0][0] == 12
  except ImportError:
    assert "matplotlib is not installed" in out


def test_the_reverse_task_reports_the_exact_match_of_its_decoded_held_out_strings(tmp_path, capsys):
  """README's exact match of 1.000 takes 1000 steps (minutes); two steps of a width-16 model reverse
  no string, and the reported exact match is the share of decodes that equal their targets."""
  tiny = TINY_MODEL + ["utils.run.batch_size = 8", "data.transduction_dataset.num_eval_examples = 8",
                       "data.transduction_dataset.num_train_examples = 64"]  # 2 steps read 16
  summary = train.main(["--task", "reverse", "--model_dir", str(tmp_path), "--train_steps", "2"]
                       + params(tiny))
  written = tmp_path / "validation_eval"
  inputs, targets, predictions = ((written / name).read_text().splitlines()
                                  for name in ("transduction_inputs", "transduction_targets",
                                               "transduction_2_predictions"))
  assert len(inputs) == len(targets) == len(predictions) == 8
  assert targets == [s[::-1] for s in inputs]
  assert summary["exact_match"] == sum(p == t for p, t in zip(predictions, targets)) / 8 == 0.0
  assert f"held-out exact match: {summary['exact_match']:.3f}" in capsys.readouterr().out


def test_three_layouts_give_the_same_losses(tmp_path, capsys):
  result = train.main(["--compare_layouts", "3", "--model_dir", str(tmp_path)] + params(TINY_LM))
  assert sorted(result["curves"]) == sorted(train.LAYOUTS)
  assert all(len(curve) == 3 for curve in result["curves"].values())
  assert result["max_difference"] < 1e-5
  assert "largest loss difference between layouts over 3 steps" in capsys.readouterr().out


def test_text_is_split_into_train_and_every_twentieth_window_held_out():
  vocabulary = vocabulary_lib.ByteVocabulary()
  text = "".join(chr(ord("a") + i % 26) for i in range(40 * 8))
  train_windows = data.text_windows(text, vocabulary, 8, "train")
  heldout = data.text_windows(text, vocabulary, 8, "validation")
  assert train_windows.shape == (38, 8) and heldout.shape == (2, 8)
  assert vocabulary.decode(heldout[0].tolist()) == text[19 * 8:20 * 8]
  with pytest.raises(ValueError, match="dataset_split 'dev'"):
    data.text_windows(text, vocabulary, 8, "dev")


def test_transduction_targets_reverse_or_sort_their_inputs():
  for task, fn in (("reverse", lambda s: s[::-1]), ("sort", lambda s: "".join(sorted(s)))):
    pairs = data.transduction_examples(task, 20, 3, 10, seed=0)
    assert all(t == fn(i) and 3 <= len(i) <= 10 and i.isdigit() for i, t in pairs)


def test_help_shows_the_readme_command_and_describes_task_and_model_dir(capsys):
  with pytest.raises(SystemExit) as raised:
    train.parse_args(["--help"])
  assert raised.value.code == 0
  out = " ".join(capsys.readouterr().out.split())
  assert out.startswith("usage: python -m examples.transformer.train ")
  assert "--task {lm,reverse} lm: byte-level language model" in out
  assert "rerunning with the same one resumes (default: /tmp/mtf_example_<task>)" in out
