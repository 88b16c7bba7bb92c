"""`utils.run`: the gin-configured driver of every mode, on our own session loop (no estimator).

Modes: train, perplexity_eval, eval, score_eval, infer, score_from_strings, score_from_dataset,
export_infer, export_score (and the deprecated export == export_infer). Arguments and gin names
are upstream's (`utils.run.*`); `tpu_job_name`, `tpu`, `gcp_project` and `tpu_zone` name a TPU.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import dataset as dataset_lib, learning_rate_schedules
from mesh_tensorflow.transformer import vocabulary as vocabulary_lib
from mesh_tensorflow.transformer._train import arguments, checkpoints, estimator_api, loop, model_fn
from mesh_tensorflow.transformer._train import id_checks, schedule_horizon
from mesh_tensorflow.transformer._train import eval as eval_lib
from mesh_tensorflow.transformer._train import tpu as tpu_lib
from mesh_tensorflow.transformer._utils import GIN_MODULE
from mesh_tensorflow.transformer._train.checkpoint_selection import get_checkpoint_iterator
from mesh_tensorflow.transformer._utils.mesh_sizes import auto_train_steps, compute_batch_size
from mesh_tensorflow.transformer._utils.models import build_model

MODES = ("train", "perplexity_eval", "eval", "score_eval", "infer", "score_from_strings",
         "score_from_dataset", "export_score", "export_infer", "export")


def check_mode(mode: str, dataset_split: str) -> None:
  if mode not in MODES:
    raise ValueError(f"Unknown mode {mode!r} (utils.run.mode); expected one of: {', '.join(MODES)}.")
  if mode == "train" and dataset_split != "train":
    raise ValueError(f"mode 'train' trains on dataset_split 'train', not {dataset_split!r}; set "
                     f"utils.run.dataset_split = 'train' or pick an eval mode.")


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


def _score_dataset_fn(train_dataset_fn: Optional[Callable]) -> Optional[Callable]:
  """utils.score_from_dataset.score_dataset_fn when gin binds it, else train_dataset_fn (None: the
  binding is left to apply)."""
  try:
    gin.query_parameter("utils.score_from_dataset.score_dataset_fn")
    return None
  except ValueError:
    return train_dataset_fn


def _export_checkpoint(model_dir: str, export_checkpoint_step) -> str:
  path = (checkpoints.latest_checkpoint(model_dir) if export_checkpoint_step is None
          else checkpoints.checkpoint_path(model_dir, export_checkpoint_step))
  if path is None or not tf.io.gfile.exists(path + ".index"):
    saved = [checkpoints.get_step_from_checkpoint_path(p) for p in checkpoints.list_checkpoints(model_dir)]
    raise ValueError(f"No checkpoint to export in {model_dir} (utils.run.export_checkpoint_step = "
                     f"{export_checkpoint_step!r}; saved steps: {saved}): train first, or pick a saved step.")
  return path


@gin.configurable(module=GIN_MODULE)
def run(tpu_job_name, tpu, gcp_project, tpu_zone, model_dir, model_type="bitransformer", vocabulary=None,
        train_dataset_fn=None, eval_dataset_fn=None, dataset_split="train", autostack=True,
        eval_checkpoint_step=None, export_checkpoint_step=None, export_path="", mode="train",
        iterations_per_loop=100, save_checkpoints_steps=5000, keep_checkpoint_max=None, eval_summary_dir=None,
        batch_size=("tokens_per_replica", 2048), train_steps=auto_train_steps, total_run_steps=None,
        sequence_length=None, mesh_shape=gin.REQUIRED, mesh_devices=None, layout_rules=gin.REQUIRED,
        learning_rate_schedule=None, optimizer=None, predict_fn=None, variable_filter=None,
        perplexity_eval_steps=100, init_checkpoint=None, ensemble_inputs=None,
        train_model_fn=estimator_api.train_model, skip_seen_data=False, seen_data_init_step=0,
        output_eval_examples=True, checkpoint_input_pipeline=False, eval_dir_suffix=None,
        random_seed=loop.DEFAULT_RANDOM_SEED):
  """Runs one mode of a Transformer with the gin-configured model, data, mesh and layout.

  Upstream's arguments, on upstream's estimator-era functions: an Estimator (get_estimator, our
  session loop underneath) goes to `train_model_fn(estimator, vocabulary, sequence_length,
  batch_size, train_dataset_fn, train_steps, ensemble_inputs, skip_seen_data=,
  seen_data_init_step=, checkpoint_input_pipeline=)` (default utils.train_model), eval_model,
  infer_model, score_from_strings, score_from_dataset and export_model. perplexity_eval runs our
  log-likelihood evaluation (loss, perplexity and bits per token per eval dataset) instead of
  Estimator.evaluate's metrics. With `tpu` set, training runs on the TPU (tpu.train) after
  `tpu.connect` checks the TPU answers; other modes are refused there.

  The input position always resumes with the global step (less seen_data_init_step).
  Returns what the mode produced: train: {"step", "loss", "first_step_seconds"};
  perplexity_eval: a list of result dicts; eval / score_eval: {step: {dataset: metrics}};
  infer, score_from_strings, score_from_dataset: {step: decodes or scores}; export_*: the
  export directory.

  One argument is ours: `random_seed` (default 0), the graph-level seed of every graph the run
  builds. Initial weights, dropout masks and sampling noise follow it, so two runs (and a run
  resumed from a checkpoint) draw the same values under every layout; None draws differently
  in each run.

  Every argument is checked before anything is built (RunArgumentError names the binding and
  what it must be); `ensemble_inputs` is not implemented and must stay None.
  """
  check_mode(mode, dataset_split)
  arguments.check_run_arguments(
      model_dir=model_dir, train_steps=train_steps, total_run_steps=total_run_steps,
      iterations_per_loop=iterations_per_loop, save_checkpoints_steps=save_checkpoints_steps,
      keep_checkpoint_max=keep_checkpoint_max, perplexity_eval_steps=perplexity_eval_steps,
      seen_data_init_step=seen_data_init_step, batch_size=batch_size, sequence_length=sequence_length,
      eval_checkpoint_step=eval_checkpoint_step, export_checkpoint_step=export_checkpoint_step,
      autostack=autostack, random_seed=random_seed)
  arguments.check_not_implemented(ensemble_inputs=ensemble_inputs)
  cluster = None
  if tpu:
    if mode != "train":
      raise NotImplementedError(
          f"tpu={tpu!r}: mode {mode!r} does not run on TPUs in this release, only 'train'. Checkpoints "
          f"do not depend on the mesh: run {mode!r} on CPUs/GPUs (leave --tpu unset).")
    cluster = tpu_lib.connect(tpu, tpu_zone, gcp_project, tpu_job_name)  # before any graph is built
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
  estimator = estimator_api.make_estimator(
      model_type=model_type, vocabulary=vocabulary, mesh_shape=mesh_shape, layout_rules=layout_rules,
      model_dir=model_dir, batch_size=batch_size, sequence_length=sequence_length, autostack=autostack,
      learning_rate_schedule=learning_rate_schedule, keep_checkpoint_max=keep_checkpoint_max,
      save_checkpoints_steps=save_checkpoints_steps, optimizer=optimizer, predict_fn=predict_fn,
      variable_filter=variable_filter, ensemble_inputs=ensemble_inputs, use_tpu=tpu,
                                           tpu_job_name=tpu_job_name,
      iterations_per_loop=iterations_per_loop, cluster=cluster, init_checkpoint=init_checkpoint,
      mesh_devices=mesh_devices, score_in_predict_mode="score" in mode, random_seed=random_seed,
      transformer_model=model)
  common = dict(vocabulary=vocabulary, sequence_length=sequence_length, batch_size=batch_size)

  if mode == "train":
    if train_dataset_fn is None:
      raise ValueError("mode 'train' needs utils.run.train_dataset_fn.")
    # A call's total_train_steps overrides the one bound above: the check evaluates both horizons.
    schedule_horizon.check_and_record(model_dir, learning_rate_schedule, total_run_steps or train_steps,
                                      train_steps)
    result = train_model_fn(estimator, vocabulary, sequence_length, batch_size, train_dataset_fn, train_steps,
                            ensemble_inputs, skip_seen_data=skip_seen_data,
                            seen_data_init_step=seen_data_init_step,
                            checkpoint_input_pipeline=checkpoint_input_pipeline)
    return result if result is not None else estimator.train_result
  if mode in ("export", "export_infer", "export_score"):
    if mode == "export":
      tf.logging.warning("Mode 'export' is deprecated; running 'export_infer'.")
    return estimator_api.export_model(estimator, export_path or os.path.join(model_dir, "export"), vocabulary,
                                      sequence_length, model_type, eval_with_score=(mode == "export_score"),
                                      batch_size=batch_size,
                                      checkpoint_path=_export_checkpoint(model_dir, export_checkpoint_step))
  paths = _checkpoints_to_evaluate(eval_checkpoint_step, model_dir)
  if mode == "perplexity_eval":
    datasets = _eval_datasets(eval_dataset_fn, train_dataset_fn, sequence_length, vocabulary, dataset_split)
    summary_dir = eval_summary_dir or os.path.join(model_dir, "%s_eval" % dataset_split)
    if eval_dir_suffix is not None:
      summary_dir += "_%s" % eval_dir_suffix
    return eval_lib.perplexity_eval(estimator.runner(), [(d.name, d.dataset_fn) for d in datasets], paths,
                                    summary_dir, max_batches=perplexity_eval_steps,
                                    vocab_sizes=id_checks.vocab_sizes(vocabulary))
  if mode in ("eval", "score_eval"):
    return estimator_api.eval_model(
        estimator, vocabulary, sequence_length, batch_size, dataset_split, model_dir, eval_dataset_fn,
        eval_summary_dir, eval_checkpoint_step, eval_with_score=(mode == "score_eval"),
        output_eval_examples=output_eval_examples, eval_dir_suffix=eval_dir_suffix)
  if mode == "infer":
    return estimator_api.infer_model(estimator, vocabulary, sequence_length, batch_size, model_type,
                                     model_dir,
                                     eval_checkpoint_step)
  [path] = paths[:1] if isinstance(paths, list) else [next(iter(paths))]
  if mode == "score_from_strings":
    return {loop.checkpoint_step(path): estimator_api.score_from_strings(
        estimator=estimator, model_type=model_type, model_dir=model_dir,
        eval_checkpoint_step=loop.checkpoint_step(path), **common)}
  score_dataset_fn = _score_dataset_fn(train_dataset_fn)
  return {loop.checkpoint_step(path): estimator_api.score_from_dataset(
      estimator, vocabulary, batch_size, sequence_length, model_dir, loop.checkpoint_step(path),
                                                                       dataset_split,
      **({"score_dataset_fn": score_dataset_fn} if score_dataset_fn else {}))}
