"""The driver never loses a checkpoint and never fails silently: each mistake a user can make with
`utils.run` is refused before training, or said out loud, naming the culprit."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._lowering import layout_check

from mesh_tensorflow.transformer import utils
from mesh_tensorflow.transformer._train import arguments, checkpoints, guards, inputs
from mesh_tensorflow.transformer._train import checkpoint_selection
from mesh_tensorflow.transformer._utils.gin_config import packaged_gin_dir
from tests.transformer import shared_runs, tiny_run
from tests.transformer.tiny_run import run

# One worker runs the modules reading shared_runs.py's training, so it is done once.
pytestmark = [pytest.mark.xdist_group("tiny_transformer_run"), pytest.mark.slow]

trained = shared_runs.trained  # the shared 6-step run (a fixture)


def files_of(model_dir) -> dict:
  """name -> size of every file in model_dir."""
  return {f: os.path.getsize(os.path.join(model_dir, f)) for f in sorted(os.listdir(model_dir))}


def train(model_dir, corpus_glob, *bindings, **kwargs):
  tiny_run.configure_gin(corpus_glob, tiny_run.TWO_DEVICES + list(bindings))
  return run(model_dir, "train", **kwargs)


# ---- data loss ----

def test_resuming_a_deeper_models_checkpoints_is_refused_and_every_checkpoint_is_kept(tmp_path, corpus):
  train(tmp_path, corpus, "num_layers = 2", "utils.run.train_steps = 6")
  before = files_of(tmp_path)
  with pytest.raises(checkpoints.CheckpointMismatchError,
                     match=r"model.ckpt-6 holds \d+ variables the model does not have, "
                           r"e.g. \['transformer/block_001"):
    train(tmp_path, corpus, "num_layers = 1", "utils.run.train_steps = 9",
          "utils.run.keep_checkpoint_max = 1")
  assert files_of(tmp_path) == before


def test_a_shallower_models_checkpoints_are_refused_too(tmp_path, corpus, trained):
  model_dir = shared_runs.copy_model_dir(trained, tmp_path / "model")
  with pytest.raises(checkpoints.CheckpointMismatchError, match=r"lacks \d+ of the model's variables"):
    train(model_dir, corpus, "num_layers = 2", "utils.run.train_steps = 9")


@pytest.mark.parametrize("binding, message", [
    ("utils.run.keep_checkpoint_max = -1", r"keep_checkpoint_max = -1 \(int\): expected None or 0"),
    ("utils.run.train_steps = '6'", r"utils.run.train_steps = '6' \(str\): expected a positive int"),
    ("utils.run.save_checkpoints_steps = 0", r"utils.run.save_checkpoints_steps = 0 .*positive int"),
    ("utils.run.iterations_per_loop = 2.5", r"utils.run.iterations_per_loop = 2.5 \(float\)"),
    ("utils.run.sequence_length = {'targets': 0}", r"sequence_length = \{'targets': 0\}"),
    ("utils.run.batch_size = ('tokens_per_batch', 8)",
     r"batch_size = \('tokens_per_batch', 8\) gives 0 sequences per batch.*length 16"),
    ("utils.run.vocabulary = None", r"utils.run.vocabulary = None: expected a vocabulary object"),
    ("utils.run.ensemble_inputs = 2", r"utils.run.ensemble_inputs = 2: ensemble inputs is not implemented"),
    ("utils.run.eval_checkpoint_step = 'latest'", r"eval_checkpoint_step = 'latest' \(str\)"),
])
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, corpus, binding, message):
  with pytest.raises(arguments.RunArgumentError, match=message):
    train(tmp_path / "model", corpus, binding)
  assert not (tmp_path / "model").exists()


def test_a_variable_filter_matching_nothing_is_refused(tmp_path, corpus):
  with pytest.raises(ValueError, match=r"variable_filter 'no_such_variable' matches none of the model's \d+ "
                                       r"trainable variables \(e.g. \['transformer/"):
    train(tmp_path, corpus, "utils.run.variable_filter = 'no_such_variable'")


def test_a_layout_rule_naming_no_dimension_of_the_model_warns_with_the_closest_name(tmp_path, corpus):
  with pytest.warns(mtf.LayoutRuleWarning, match=r"Layout rule dff:model names tensor dimension 'dff', which "
                                                  r"no tensor of this graph has: did you mean 'd_ff'\?"):
    train(tmp_path, corpus, "utils.run.layout_rules = 'batch:batch;dff:model'", "utils.run.train_steps = 1")


def test_the_shipped_layouts_name_no_likely_typo_for_the_models_they_come_with():
  """Shipped layout files name dimensions some models lack (experts, outer_batch): no warning."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  names = ["batch", "outer_batch", "length", "d_model", "d_ff", "heads", "d_kv", "vocab", "memory_length"]
  for name in names:
    mtf.zeros(mesh, mtf.Shape([mtf.Dimension(name, 8)]))
  layouts = sorted(pathlib.Path(packaged_gin_dir()).rglob("*.gin"))
  assert layouts
  for path in layouts:
    rules = re.search(r"layout_rules\s*=\s*[\"'](.*?)[\"']", path.read_text())
    if rules:
      assert not layout_check.misspelled_rules("model:2;batch:2", rules.group(1), set(names)), path


# ---- the dataset contract, checked on the first batch ----

def _dataset(examples: dict, batched: bool = False):
  def dataset_fn(sequence_length, vocabulary, dataset_split):
    del sequence_length, vocabulary, dataset_split
    ds = tf.data.Dataset.from_tensor_slices(examples)
    return ds.batch(2) if batched else ds
  return dataset_fn


_PADDED = np.full([16, 16], 7, np.int32)


@pytest.mark.parametrize("dataset_fn, message", [
    (_dataset({"targets": _PADDED + 300}), r"'targets' holds ids from 307 to 307 .* vocabulary has 259 ids"),
    (_dataset({"targets": np.array(["some text"] * 16)}), r"feature 'targets' holds strings: encode them"),
    (_dataset({"targets": _PADDED}, batched=True), r"feature 'targets' has shape \(None, 16\).*unbatched"),
    (_dataset({"targets": _PADDED[:, :12]}),
     r"feature 'targets' has lengths \[12\] .*sequence_length\['targets'\] is 16: pad"),
    (_dataset({"text": _PADDED}), r"lack the feature\(s\) \['targets'\].*they have \['text'\]"),
    (_dataset({"targets": _PADDED[:0]}), r"yields no examples"),
])
def test_a_dataset_breaking_the_contract_is_refused_naming_the_feature(tmp_path, corpus, dataset_fn, message):
  with pytest.raises(inputs.DatasetContractError, match=r"utils.run.train_dataset_fn's .*" + message):
    train(tmp_path, corpus, train_dataset_fn=dataset_fn)


# ---- said out loud ----

def test_an_unsaved_eval_step_names_the_checkpoint_used_instead(tmp_path, corpus, capsys, trained):
  model_dir = shared_runs.copy_model_dir(trained, tmp_path / "model")
  tiny_run.configure_gin(corpus, tiny_run.TWO_DEVICES + ["utils.run.eval_checkpoint_step = 4",
                                                         "utils.run.dataset_split = 'validation'"])
  run(model_dir, "perplexity_eval")
  assert f"No checkpoint at step 4 in {model_dir} (saved steps: [3, 6]); using the closest, " \
         f"{model_dir}/model.ckpt-3." in capsys.readouterr().out


def test_an_incomplete_checkpoint_is_skipped_with_a_message(tmp_path, corpus, capsys, trained):
  model_dir = shared_runs.copy_model_dir(trained, tmp_path / "model")
  (model_dir / "model.ckpt-9.data-00000-of-00001").write_bytes(b"cut short")
  train(model_dir, corpus, "utils.run.train_steps = 7")
  out = capsys.readouterr().out
  assert f"Skipping {model_dir}/model.ckpt-9: its data files have no model.ckpt-9.index" in out
  assert f"Resuming from {model_dir}/model.ckpt-6 at step 6." in out


def test_a_truncated_data_file_is_named(tmp_path, corpus, trained):
  model_dir = shared_runs.copy_model_dir(trained, tmp_path / "model")
  data = model_dir / "model.ckpt-6.data-00000-of-00001"
  data.write_bytes(data.read_bytes()[:100])
  with pytest.raises(checkpoints.CheckpointCorruptError,
                     match=r"Checkpoint .*model.ckpt-6 cannot be read.*model.ckpt-6.data-00000-of-00001"):
    train(model_dir, corpus, "utils.run.train_steps = 9")


def test_waiting_for_checkpoints_says_what_it_waits_for(tmp_path, monkeypatch, capsys):
  class Waited(Exception):
    pass

  def sleep(seconds):
    raise Waited(seconds)
  monkeypatch.setattr(checkpoint_selection.time, "sleep", sleep)
  with pytest.raises(Waited):
    next(iter(utils.get_checkpoint_iterator(None, str(tmp_path))))
  assert re.search(rf"Waiting for a checkpoint after step 0 in {tmp_path} \(looking every 30 s\). Stop with "
                   rf"Ctrl-C, or set eval_checkpoint_step", capsys.readouterr().out)


def test_an_empty_infer_input_is_refused(tmp_path, corpus, trained):
  model_dir = shared_runs.copy_model_dir(trained, tmp_path / "model")
  empty = tmp_path / "prompts.txt"
  empty.write_text("")
  tiny_run.configure_gin(corpus, tiny_run.TWO_DEVICES + [
      f"utils.decode_from_file.input_filename = '{empty}'",
      f"utils.decode_from_file.output_filename = '{tmp_path / 'decodes'}'",
      "utils.run.eval_checkpoint_step = -1"])
  with pytest.raises(ValueError, match=rf"{empty} \(utils.decode_from_file.input_filename\) has no lines"):
    run(model_dir, "infer")


def test_export_without_a_checkpoint_names_the_model_dir(tmp_path, corpus):
  tiny_run.configure_gin(corpus, tiny_run.TWO_DEVICES)
  with pytest.raises(ValueError, match=rf"No checkpoint to export in {tmp_path} "
                                       rf"\(utils.run.export_checkpoint_step = None; saved steps: \[\]\)"):
    run(tmp_path, "export_infer")


# ---- stopping, and two runs on one model_dir ----

def start_long_run(model_dir, corpus_glob, ignore_sigint: bool = False) -> subprocess.Popen:
  """A run of 10000 steps (a checkpoint every 5000) in a subprocess, once it has trained a step; with
  `ignore_sigint` it starts with SIGINT ignored, as a child of pytest-xdist's workers does."""
  command = tiny_run.main_command(str(model_dir), corpus_glob, tiny_run.TWO_DEVICES + [
      "utils.run.train_steps = 10000", "utils.run.save_checkpoints_steps = 5000"])
  ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
  process = subprocess.Popen(command, cwd=tiny_run.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, preexec_fn=ignore)
  for line in process.stdout:
    if line.startswith("First training step done"):
      return process
  raise AssertionError(f"the run ended before its first step: {process.wait()}")


def stop(process: subprocess.Popen, signum) -> tuple:
  """Sends `signum` to a run; returns (its exit status, its output after the first step)."""
  process.send_signal(signum)
  out = process.stdout.read()
  return process.wait(timeout=120), out


def test_a_stop_by_sigint_exits_nonzero_even_where_sigint_was_ignored_at_start():
  """The stop request's resend, in this process: with SIGINT ignored (as a parent's SIG_IGN leaves it
  in pytest-xdist's workers) the resent signal does nothing, so resend exits with 128 + SIGINT."""
  original = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    with guards.stop_requests() as request:
      os.kill(os.getpid(), signal.SIGINT)
    assert request.signum == signal.SIGINT
    with pytest.raises(SystemExit) as exited:
      request.resend()
  finally:
    signal.signal(signal.SIGINT, original)
  assert exited.value.code == 128 + signal.SIGINT


def assert_stopped_and_saved(model_dir, signum, returncode: int, out: str) -> int:
  """The run exited non-zero, said at which step it stopped and saved that step; returns the step."""
  assert returncode != 0, out[-3000:]
  match = re.search(rf"Stopped by {signum.name} at step (\d+): saved (\S+model.ckpt-(\d+))\. Run the same "
                    rf"command again to resume\.", out)
  assert match, out[-3000:]
  assert match.group(1) == match.group(3) and int(match.group(1)) >= 1
  assert checkpoints.latest_checkpoint(str(model_dir)) == match.group(2)
  return int(match.group(1))


def test_a_stop_by_sigint_saves_the_last_step_and_says_so(tmp_path, corpus):
  """Started with SIGINT ignored (the case the resend above guards), a stop by SIGINT still saves and
  exits with 128 + SIGINT."""
  process = start_long_run(tmp_path, corpus, ignore_sigint=True)
  returncode, out = stop(process, signal.SIGINT)
  assert_stopped_and_saved(tmp_path, signal.SIGINT, returncode, out)
  assert returncode == 128 + signal.SIGINT


def test_a_second_run_on_a_model_dir_in_use_is_refused_and_a_stop_by_sigterm_saves_the_last_step(
    tmp_path, corpus):
  """While a run trains, a second run on its model_dir is refused naming the first; SIGTERM then
  stops the first, which saves its last step and says so; after it the directory is free and its
  checkpoint restores."""
  first = start_long_run(tmp_path, corpus)
  try:
    with pytest.raises(guards.ModelDirInUseError,
                       match=rf"{tmp_path} is in use by another training run \(pid {first.pid} on "):
      train(tmp_path, corpus, "utils.run.train_steps = 3")
  finally:
    returncode, out = stop(first, signal.SIGTERM)
  stopped_at = assert_stopped_and_saved(tmp_path, signal.SIGTERM, returncode, out)
  result = train(tmp_path, corpus, f"utils.run.train_steps = {stopped_at + 1}")
  assert result["step"] == stopped_at + 1
