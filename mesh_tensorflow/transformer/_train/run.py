"""`utils.run`: the gin-configured driver of every mode, on our own session loop (no estimator).

Modes: train, perplexity_eval, eval, score_eval, infer, score_from_strings, score_from_dataset,
export_infer, export_score (and the deprecated export == export_infer). Arguments and gin names
are upstream's (`utils.run.*`); `tpu_job_name`, `tpu`, `gcp_project` and `tpu_zone` name a TPU.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Callable, Optional

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import dataset as dataset_lib, learning_rate_schedules
from mesh_tensorflow.transformer import vocabulary as vocabulary_lib
from mesh_tensorflow.transformer._train import arguments, checkpoints, decode, export, inputs, loop, model_fn
from mesh_tensorflow.transformer._train import eval as eval_lib
from mesh_tensorflow.transformer._train import tpu as tpu_lib
from mesh_tensorflow.transformer._utils import GIN_MODULE
from mesh_tensorflow.transformer._utils.checkpoint_selection import get_checkpoint_iterator
from mesh_tensorflow.transformer._utils.mesh_sizes import (
    auto_train_steps, compute_batch_size, get_variable_dtype)
from mesh_tensorflow.transformer._utils.models import build_model

MODES = ("train", "perplexity_eval", "eval", "score_eval", "infer", "score_from_strings",
         "score_from_dataset", "export_score", "export_infer", "export")


def check_mode(mode: str, dataset_split: str) -> None:
  if mode not in MODES:
    raise ValueError(f"Unknown mode {mode!r} (utils.run.mode); expected one of: {', '.join(MODES)}.")
  if mode == "train" and dataset_split != "train":
    raise ValueError(f"mode 'train' trains on dataset_split 'train', not {dataset_split!r}; set "
                     f"utils.run.dataset_split = 'train' or pick an eval mode.")


def train_model(config: loop.TrainConfig, model, vocabulary, sequence_length: dict,
                train_dataset_fn: Optional[Callable], dataset_split: str, variable_dtype,
                print_fn: Callable = print, trainer: Callable = loop.train) -> dict:
  """The default `utils.run.train_model_fn`: builds the training dataset and runs the loop
  (`trainer`: loop.train on CPUs/GPUs, tpu.train on a TPU)."""
  if train_dataset_fn is None:
    raise ValueError("mode 'train' needs utils.run.train_dataset_fn.")
  dataset_fn = functools.partial(train_dataset_fn, sequence_length=sequence_length, vocabulary=vocabulary,
                                 dataset_split=dataset_split)
  vocab_sizes = {"targets": vocabulary_lib.targets_vocabulary(vocabulary).vocab_size}
  if not model_fn.is_unitransformer(model):
    vocab_sizes["inputs"] = vocabulary_lib.inputs_vocabulary(vocabulary).vocab_size
  inputs.check_training_dataset(dataset_fn, config.batch_size, sequence_length, vocab_sizes)
  return trainer(model, dataset_fn, config, variable_dtype, print_fn)


@gin.configurable(module=GIN_MODULE)
def decode_from_file(runner, vocabulary, checkpoint_path: str, input_filename: str = gin.REQUIRED,
                     output_filename: str = gin.REQUIRED, repeats: int = 1) -> list:
  """The "infer" mode: decodes each line of input_filename into `output_filename-<step>`."""
  return decode.decode_from_file(runner, vocabulary_lib.inputs_vocabulary(vocabulary),
                                 vocabulary_lib.targets_vocabulary(vocabulary), checkpoint_path,
                                 input_filename, output_filename, repeats)


@gin.configurable(module=GIN_MODULE)
def score_from_strings(runner, vocabulary, checkpoint_path: str, inputs=None, targets=gin.REQUIRED,
                       scores_filename: Optional[str] = None) -> list:
  """Log-likelihood of each target string (given its input string, for encoder-decoders)."""
  targets_vocab = vocabulary_lib.targets_vocabulary(vocabulary)
  inputs_vocab = vocabulary_lib.inputs_vocabulary(vocabulary)
  inputs = inputs if inputs is not None else [""] * len(targets)
  eos = [decode.EOS_ID]
  examples = [{"inputs": inputs_vocab.encode(i) + eos, "targets": targets_vocab.encode(t) + eos}
              for i, t in zip(inputs, targets)]
  scores = eval_lib.score_examples(runner, examples, checkpoint_path)
  eval_lib.save_scores(scores, scores_filename)
  return scores


@gin.configurable(module=GIN_MODULE)
def score_from_dataset(runner, vocabulary, checkpoint_path: str, dataset_split: str,
                       score_dataset_fn: Optional[Callable] = None,
                       train_dataset_fn: Optional[Callable] = None,
                       scores_filename: Optional[str] = None) -> list:
  """Log-likelihood of each example of a finite dataset (score_dataset_fn, else train_dataset_fn)."""
  dataset_fn = score_dataset_fn or train_dataset_fn
  if dataset_fn is None:
    raise ValueError("mode 'score_from_dataset' needs utils.score_from_dataset.score_dataset_fn or "
                     "utils.run.train_dataset_fn.")
  dataset_fn = functools.partial(dataset_fn, sequence_length=runner.sequence_length, vocabulary=vocabulary,
                                 dataset_split=dataset_split)
  scores = eval_lib.score_examples(runner, list(inputs.iterate_examples(dataset_fn)), checkpoint_path)
  eval_lib.save_scores(scores, scores_filename)
  return scores


def _eval_datasets(eval_dataset_fn, train_dataset_fn, sequence_length, vocabulary, dataset_split) -> list:
  """EvalDataset-like objects (name, dataset_fn, postprocess_fn, metric_fns) for the eval modes."""
  if eval_dataset_fn is not None:
    return list(eval_dataset_fn(sequence_length=sequence_length, vocabulary=vocabulary,
                                dataset_split=dataset_split))
  if train_dataset_fn is None:
    raise ValueError("perplexity_eval needs utils.run.eval_dataset_fn or utils.run.train_dataset_fn.")
  tf.logging.warning("No eval_dataset_fn: evaluating on train_dataset_fn's %r split.", dataset_split)
  fn = functools.partial(train_dataset_fn, sequence_length=sequence_length, vocabulary=vocabulary,
                         dataset_split=dataset_split)
  return [dataset_lib.EvalDataset(name=dataset_split, dataset_fn=fn, postprocess_fn=None, metric_fns=[])]


def _checkpoints_to_evaluate(step, model_dir: str):
  """get_checkpoint_iterator's paths; with step None a generator that waits for new checkpoints
  (continuous evaluation, as upstream), else a non-empty list."""
  paths = get_checkpoint_iterator(step, model_dir)
  if isinstance(paths, list) and not paths:
    raise ValueError(f"No checkpoint in {model_dir} to evaluate (eval_checkpoint_step={step!r}); "
                     f"train first.")
  return paths


def _resolve_batch_size(batch_size, sequence_length, mesh_shape, layout_rules) -> int:
  if isinstance(batch_size, int):
    return batch_size
  return compute_batch_size(sequence_length, mesh_shape, layout_rules, batch_size)


@gin.configurable(module=GIN_MODULE)
def run(tpu_job_name, tpu, gcp_project, tpu_zone, model_dir, model_type="bitransformer", vocabulary=None,
        train_dataset_fn=None, eval_dataset_fn=None, dataset_split="train", autostack=True,
        eval_checkpoint_step=None, export_checkpoint_step=None, export_path="", mode="train",
        iterations_per_loop=100, save_checkpoints_steps=5000, keep_checkpoint_max=None, eval_summary_dir=None,
        batch_size=("tokens_per_replica", 2048), train_steps=auto_train_steps, total_run_steps=None,
        sequence_length=None, mesh_shape=gin.REQUIRED, mesh_devices=None, layout_rules=gin.REQUIRED,
        learning_rate_schedule=None, optimizer=None, predict_fn=None, variable_filter=None,
        perplexity_eval_steps=100, init_checkpoint=None, ensemble_inputs=None, train_model_fn=train_model,
        skip_seen_data=False, seen_data_init_step=0, output_eval_examples=True,
        checkpoint_input_pipeline=False, random_seed=loop.DEFAULT_RANDOM_SEED):
  """Runs one mode of a Transformer with the gin-configured model, data, mesh and layout.

  Same arguments as upstream's `utils.run`. Differences, all because there is no estimator:
  training is our session loop (`loop.train`), so the input position always resumes with the
  global step (`skip_seen_data` / `checkpoint_input_pipeline` need not be set; `seen_data_init_step`
  still offsets it); `train_model_fn` has the signature of `train_model` here (with `trainer`); with
  `tpu` set, training runs on the TPU (`tpu.train`: SimdMeshImpl in tpu.replicate, infeed, host
  checkpoints) after `tpu.connect` checks the TPU answers, and other modes are refused. Returns
  what the mode produced (train: final step and loss; perplexity_eval: a list of result dicts;
  eval: metrics; infer: decodes; score_*: scores; export_*: the export directory).

  One argument is ours: `random_seed` (default 0), the graph-level seed of every graph the run
  builds. Initial weights, dropout masks and sampling noise follow it, so two runs (and a run
  resumed from a checkpoint) draw the same values under every layout; None draws differently
  in each run.

  Every argument is checked before anything is built (RunArgumentError names the binding and
  what it must be); `predict_fn`, `ensemble_inputs` and `output_eval_examples` are not implemented
  and must keep their defaults.
  """
  del skip_seen_data, checkpoint_input_pipeline  # the data position always resumes (see above)
  check_mode(mode, dataset_split)
  arguments.check_run_arguments(
      model_dir=model_dir, train_steps=train_steps, total_run_steps=total_run_steps,
      iterations_per_loop=iterations_per_loop, save_checkpoints_steps=save_checkpoints_steps,
      keep_checkpoint_max=keep_checkpoint_max, perplexity_eval_steps=perplexity_eval_steps,
      seen_data_init_step=seen_data_init_step, batch_size=batch_size, sequence_length=sequence_length,
      eval_checkpoint_step=eval_checkpoint_step, export_checkpoint_step=export_checkpoint_step,
      autostack=autostack, random_seed=random_seed)
  arguments.check_not_implemented(predict_fn=predict_fn, ensemble_inputs=ensemble_inputs,
                                  output_eval_examples=output_eval_examples)
  trainer = loop.train
  if tpu:
    if mode != "train":
      raise NotImplementedError(
          f"tpu={tpu!r}: mode {mode!r} does not run on TPUs in this release, only 'train'. Checkpoints "
          f"do not depend on the mesh: run {mode!r} on CPUs/GPUs (leave --tpu unset).")
    cluster = tpu_lib.connect(tpu, tpu_zone, gcp_project, tpu_job_name)  # before any graph is built
    trainer = functools.partial(tpu_lib.train, cluster=cluster,
                                hierarchical_tiling_spec=tpu_lib.hierarchical_tiling_spec())
  if isinstance(sequence_length, int) or sequence_length is None:
    sequence_length = {"inputs": sequence_length or 512, "targets": sequence_length or 512}
  mesh_shape, layout_rules = mtf.convert_to_shape(mesh_shape), mtf.convert_to_layout_rules(layout_rules)
  mesh_devices = model_fn.mesh_devices_or_default(mesh_shape, mesh_devices)
  requested_batch_size, batch_size = batch_size, _resolve_batch_size(batch_size, sequence_length, mesh_shape,
                                                                     layout_rules)
  arguments.check_batch_size(batch_size, requested_batch_size, sequence_length)
  if callable(train_steps):
    train_steps = train_steps(batch_size, sequence_length)
  if isinstance(learning_rate_schedule, list):
    learning_rate_schedule = functools.partial(learning_rate_schedules.product_learning_rate,
                                               factors=learning_rate_schedule)
  if callable(learning_rate_schedule):
    learning_rate_schedule = functools.partial(learning_rate_schedule,
                                               total_train_steps=total_run_steps or train_steps)
  arguments.check_vocabulary(vocabulary)
  model = build_model(model_type=model_type,
                      input_vocab_size=vocabulary_lib.inputs_vocabulary(vocabulary).vocab_size,
                      output_vocab_size=vocabulary_lib.targets_vocabulary(vocabulary).vocab_size,
                      layout_rules=layout_rules, mesh_shape=mesh_shape)
  variable_dtype = get_variable_dtype()
  runner = loop.ModelRunner(model=model, mesh_shape=mesh_shape, layout_rules=layout_rules,
                            batch_size=batch_size, sequence_length=sequence_length,
                            variable_dtype=variable_dtype, mesh_devices=mesh_devices, autostack=autostack,
                            random_seed=random_seed)
  summary_dir = eval_summary_dir or os.path.join(model_dir, "%s_eval" % dataset_split)

  if mode == "train":
    config = loop.TrainConfig(
        model_dir=model_dir, batch_size=batch_size, train_steps=train_steps, mesh_shape=mesh_shape,
        layout_rules=layout_rules, mesh_devices=mesh_devices, iterations_per_loop=iterations_per_loop,
        save_checkpoints_steps=save_checkpoints_steps, keep_checkpoint_max=keep_checkpoint_max,
        autostack=autostack, learning_rate_schedule=learning_rate_schedule, optimizer=optimizer,
        variable_filter=_variable_filter(variable_filter), init_checkpoint=init_checkpoint,
        seen_data_init_step=seen_data_init_step, random_seed=random_seed)
    return train_model_fn(config, model, vocabulary, sequence_length, train_dataset_fn, dataset_split,
                          variable_dtype, trainer=trainer)
  if mode in ("export", "export_infer", "export_score"):
    path = (checkpoints.latest_checkpoint(model_dir) if export_checkpoint_step is None
            else checkpoints.checkpoint_path(model_dir, export_checkpoint_step))
    if path is None or not tf.io.gfile.exists(path + ".index"):
      saved = [checkpoints.get_step_from_checkpoint_path(p) for p in checkpoints.list_checkpoints(model_dir)]
      raise ValueError(f"No checkpoint to export in {model_dir} (utils.run.export_checkpoint_step = "
                       f"{export_checkpoint_step!r}; saved steps: {saved}): train first, or pick a "
                       f"saved step.")
    return export.export_model(runner, vocabulary, path, export_path or os.path.join(model_dir, "export"),
                               score=(mode == "export_score"))
  paths = _checkpoints_to_evaluate(eval_checkpoint_step, model_dir)
  if mode == "perplexity_eval":
    datasets = _eval_datasets(eval_dataset_fn, train_dataset_fn, sequence_length, vocabulary, dataset_split)
    return eval_lib.perplexity_eval(runner, [(d.name, d.dataset_fn) for d in datasets], paths, summary_dir,
                                    max_batches=perplexity_eval_steps)
  if mode == "eval":
    datasets = _eval_datasets(eval_dataset_fn, train_dataset_fn, sequence_length, vocabulary, dataset_split)
    return {loop.checkpoint_step(p): decode.eval_decodes(runner, datasets, vocabulary_lib.targets_vocabulary(
        vocabulary), p, summary_dir) for p in paths}
  if mode == "score_eval":
    datasets = _eval_datasets(eval_dataset_fn, train_dataset_fn, sequence_length, vocabulary, dataset_split)
    return {(loop.checkpoint_step(p), d.name): eval_lib.score_examples(
        runner, list(inputs.iterate_examples(d.dataset_fn)), p) for p in paths for d in datasets}
  if mode == "infer":
    return {loop.checkpoint_step(p): decode_from_file(runner, vocabulary, p) for p in paths}
  if mode == "score_from_strings":
    return {loop.checkpoint_step(p): score_from_strings(runner, vocabulary, p) for p in paths}
  return {loop.checkpoint_step(p): score_from_dataset(runner, vocabulary, p, dataset_split,
                                                      train_dataset_fn=train_dataset_fn) for p in paths}


def _variable_filter(variable_filter) -> Optional[Callable]:
  """A predicate on variable names from a regex string (upstream's form) or a callable."""
  if variable_filter is None or callable(variable_filter):
    return variable_filter
  return _NameFilter(variable_filter)


class _NameFilter:
  """Whether a regex is found in a variable name; shows as the regex in messages."""

  def __init__(self, pattern: str):
    self._pattern = re.compile(pattern)

  def __call__(self, name: str) -> bool:
    return bool(self._pattern.search(name))

  def __repr__(self) -> str:
    return repr(self._pattern.pattern)
