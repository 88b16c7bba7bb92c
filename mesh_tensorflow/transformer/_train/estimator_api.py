"""0.1.21's estimator-era functions of transformer.utils, with its signatures and gin names.

T5's MtfModel and other clients call these with the estimator `get_estimator` returns:
train_model, eval_model, infer_model, decode, decode_from_file, decode_from_dataset,
compute_log_likelihoods, score_with_estimator(_lazy), score_from_strings, score_from_dataset,
save_scores(_to_tfrecords) and export_model. Differences from upstream, all deliberate:
decodes are `str` (upstream yielded bytes where the vocabulary detokenized in the graph); the
training data position always resumes with the global step (as with skip_seen_data=True); the
default `score_postprocess_fn` returns the list of scores (upstream required a binding);
`score_from_strings.inputs` defaults to None (targets only); targets are scored with their EOS
when score_eos, for language models too; and these functions return what they produced
(decodes, scores, metrics, the training result) where upstream returned None.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from typing import Callable, Iterator, Optional, Sequence

import gin
import numpy as np
import tensorflow as tf2  # tf2.data.Dataset: the base class of v1 and v2 datasets
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import dataset as dataset_lib
from mesh_tensorflow.transformer import vocabulary as vocabulary_lib
from mesh_tensorflow.transformer._train import decode as decode_lib
from mesh_tensorflow.transformer._train import estimator as estimator_lib
from mesh_tensorflow.transformer._train import export, id_checks, inputs, loop, model_fn, progress
from mesh_tensorflow.transformer._train.checkpoints import get_step_from_checkpoint_path
from mesh_tensorflow.transformer._utils import GIN_MODULE
from mesh_tensorflow.transformer._train.checkpoint_selection import get_checkpoint_iterator
from mesh_tensorflow.transformer._utils.features import (
    _filter_features, _maybe_add_pretokenized_features, _pad_rows)
from mesh_tensorflow.transformer._utils.models import build_model
from mesh_tensorflow.transformer._utils.text_files import get_inputs_from_file, write_lines_to_file


def make_estimator(model_type, vocabulary, mesh_shape, layout_rules, model_dir, batch_size, sequence_length,
                   autostack, learning_rate_schedule, keep_checkpoint_max, save_checkpoints_steps, optimizer,
                   predict_fn, variable_filter, ensemble_inputs, use_tpu, tpu_job_name, iterations_per_loop,
                   cluster, init_checkpoint=None, mesh_devices=None, score_in_predict_mode=False,
                   random_seed=loop.DEFAULT_RANDOM_SEED, transformer_model=None) -> estimator_lib.Estimator:
  """get_estimator with the graph-level seed of every graph the estimator builds (utils.run's), and
  optionally the model already built (else utils.build_model builds it)."""
  transformer_model = transformer_model or build_model(
      model_type=model_type, input_vocab_size=vocabulary_lib.inputs_vocabulary(vocabulary).vocab_size,
      output_vocab_size=vocabulary_lib.targets_vocabulary(vocabulary).vocab_size, layout_rules=layout_rules,
      mesh_shape=mesh_shape)
  fn = estimator_lib.tpu_estimator_model_fn(
      model_type=model_type, transformer_model=transformer_model, vocabulary=vocabulary, model_dir=model_dir,
      use_tpu=use_tpu, mesh_shape=mesh_shape, layout_rules=layout_rules, batch_size=batch_size,
      sequence_length=sequence_length, autostack=autostack, learning_rate_schedule=learning_rate_schedule,
      keep_checkpoint_max=keep_checkpoint_max, save_checkpoints_steps=save_checkpoints_steps,
                                            optimizer=optimizer,
      predict_fn=predict_fn, variable_filter=variable_filter, ensemble_inputs=ensemble_inputs,
      init_checkpoint=init_checkpoint, mesh_devices=mesh_devices, score_in_predict_mode=score_in_predict_mode)
  config = estimator_lib.RunConfig(model_dir=model_dir, save_checkpoints_steps=save_checkpoints_steps,
                                   keep_checkpoint_max=keep_checkpoint_max,
                                   iterations_per_loop=iterations_per_loop,
                                   tpu_job_name=tpu_job_name, cluster=cluster, tf_random_seed=random_seed)
  return estimator_lib.Estimator(fn, config)


def get_estimator(model_type, vocabulary, mesh_shape, layout_rules, model_dir, batch_size, sequence_length,
                  autostack, learning_rate_schedule, keep_checkpoint_max, save_checkpoints_steps, optimizer,
                  predict_fn, variable_filter, ensemble_inputs, use_tpu, tpu_job_name, iterations_per_loop,
                  cluster, init_checkpoint=None, mesh_devices=None,
                  score_in_predict_mode=False) -> estimator_lib.Estimator:
  """An Estimator of the transformer model_type (built by utils.build_model under gin).

  Same arguments as upstream. use_tpu (truthy) trains on the TPU `cluster` (a tpu.TpuCluster,
  from tpu.connect); the model function is utils.tpu_estimator_model_fn, so its gin bindings
  apply. The Estimator's graphs use graph-level seed 0 (utils.run.random_seed's default).
  """
  return make_estimator(model_type, vocabulary, mesh_shape, layout_rules, model_dir, batch_size,
                        sequence_length, autostack, learning_rate_schedule, keep_checkpoint_max,
                        save_checkpoints_steps, optimizer, predict_fn, variable_filter, ensemble_inputs,
                        use_tpu,
                        tpu_job_name, iterations_per_loop, cluster, init_checkpoint, mesh_devices,
                        score_in_predict_mode)


def train_model(estimator, vocabulary, sequence_length, batch_size, train_dataset_fn, train_steps,
                ensemble_inputs,
                dataset_split="train", skip_seen_data=False, seen_data_init_step=0,
                checkpoint_input_pipeline=False) -> Optional[dict]:
  """Trains to global step train_steps on train_dataset_fn(sequence_length=, vocabulary=, dataset_split=).

  The examples are checked against the model first (features, lengths, id ranges). A resumed
  run starts the data after the batches the checkpointed steps consumed, less
  seen_data_init_step, whatever skip_seen_data says (upstream's skip_seen_data=True);
  checkpoint_input_pipeline (the same effect upstream) may not be combined with skip_seen_data.
  Returns the training loop's {"step", "loss", "first_step_seconds"}.
  """
  if skip_seen_data and checkpoint_input_pipeline:
    raise ValueError("At most one of skip_seen_data and checkpoint_input_pipeline may be set.")
  if ensemble_inputs is not None:
    raise NotImplementedError(f"train_model(ensemble_inputs={ensemble_inputs!r}): ensemble inputs are not "
                              f"implemented; leave utils.run.ensemble_inputs None.")
  if train_dataset_fn is None:
    raise ValueError("mode 'train' needs utils.run.train_dataset_fn.")
  dataset_fn = functools.partial(train_dataset_fn, sequence_length=sequence_length, vocabulary=vocabulary,
                                 dataset_split=dataset_split)
  vocab_sizes = {"targets": vocabulary_lib.targets_vocabulary(vocabulary).vocab_size}
  if not model_fn.is_unitransformer(estimator.model_fn.transformer_model):
    vocab_sizes["inputs"] = vocabulary_lib.inputs_vocabulary(vocabulary).vocab_size
  inputs.check_training_dataset(dataset_fn, batch_size, sequence_length, vocab_sizes)
  first_step = seen_data_init_step + 1  # the global step the data's first batch feeds
  id_check = id_checks.IdCheck(vocab_sizes, lambda bad: f"the batch of step {first_step + bad.good_before}")
  skipped = id_checks.SkippedBatchesHook(id_check, first_step, estimator.model_dir)
  source = f"train_dataset_fn {id_checks.function_name(train_dataset_fn)} (split {dataset_split!r})"

  def input_fn(params):
    del params
    dataset = dataset_fn().map(_filter_features).repeat().batch(batch_size, drop_remainder=True)
    dataset = id_check.apply(dataset, source)
    latest = estimator.latest_checkpoint()
    steps_to_skip = (get_step_from_checkpoint_path(latest) - seen_data_init_step) if latest else 0
    if steps_to_skip > 0:
      dataset = dataset.skip(steps_to_skip)
    skipped.resume_after(max(steps_to_skip, 0))
    return dataset.prefetch(2)

  try:
    estimator.train(input_fn=input_fn, max_steps=train_steps,
                    hooks=None if estimator.model_fn.use_tpu else [skipped])
  except tf.errors.InvalidArgumentError:
    if id_check.stopped_at is None:
      raise
    raise id_check.error() from None
  return dict(estimator.train_result or {}, skipped_bad_id_batches=len(skipped.reported))


def _call_dataset_fn(dataset_fn: Callable, sequence_length) -> tf.data.Dataset:
  """EvalDataset.dataset_fn(sequence_length=...) where it takes that argument, else dataset_fn()."""
  parameters = inspect.signature(dataset_fn).parameters
  if "sequence_length" in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
    return dataset_fn(sequence_length=sequence_length)
  return dataset_fn()


def _padded_batches(dataset: tf.data.Dataset, batch_size: int, sequence_length: dict) -> tf.data.Dataset:
  """Model features of each example padded (or cut) to their length, in batches of exactly batch_size
  (the last one filled with all-zero examples)."""
  dataset = dataset.map(_filter_features)
  lengths = {k: sequence_length[k.split("_")[0]] for k in dataset.element_spec}
  dataset = dataset_lib.trim_and_pad_dataset(dataset, lengths)
  return dataset_lib.trim_and_pad_dataset(dataset.batch(batch_size), batch_size)


def _combined_input_fn(datasets: Sequence, batch_size: int, sequence_length: dict,
                       check_for_metrics: bool = False, id_check: Optional[id_checks.IdCheck] = None,
                       source: str = "") -> Callable:
  """An input_fn of the EvalDatasets' examples one after the other (those with metric_fns if
  check_for_metrics), in padded batches (checked by id_check, if given, as from `source`)."""
  def input_fn(params):
    del params
    combined = None
    for eval_dataset in datasets:
      if not check_for_metrics or eval_dataset.metric_fns:
        ds = _call_dataset_fn(eval_dataset.dataset_fn, sequence_length)
        combined = ds if combined is None else combined.concatenate(ds)
    batches = _padded_batches(combined, batch_size, sequence_length)
    return batches if id_check is None else id_check.apply(batches, source)
  return input_fn


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@gin.configurable(module=GIN_MODULE)
def decode(estimator, input_fn, vocabulary, checkpoint_path=None) -> Iterator[str]:
  """Yields the decoded string of each example of input_fn (ids cut at the first EOS)."""
  targets_vocab = vocabulary_lib.targets_vocabulary(vocabulary)
  inputs_vocab = vocabulary_lib.inputs_vocabulary(vocabulary)
  for i, result in enumerate(estimator.predict(input_fn, checkpoint_path=checkpoint_path)):
    output = targets_vocab.decode(decode_lib.clean_ids(result["outputs"]))
    yield output
    if i & (i - 1) == 0:  # log every power of 2
      tf.logging.info("decoded %d: %s", i, inputs_vocab.decode(decode_lib.clean_ids(result["inputs"])))
      tf.logging.info("            -> %s", output)


@gin.configurable(module=GIN_MODULE)
def compute_log_likelihoods(estimator, input_fn, checkpoint_path=None) -> list:
  """The log-likelihood of each example of input_fn (an estimator in score_in_predict_mode)."""
  return [float(r["scores"] if isinstance(r, dict) else r)
          for r in estimator.predict(input_fn, checkpoint_path=checkpoint_path)]


def _encode_rows(texts: Sequence[str], vocab, length: int, batch_size: int, append_id: int,
                 is_prompt: bool = False) -> np.ndarray:
  """Each text's ids (+ append_id unless 0), cut by decode.fit_to_length and zero-padded to
  length; rows repeated up to a whole number of batches."""
  rows = [decode_lib.fit_to_length(vocab.encode(t.strip()) + ([append_id] if append_id else []), length,
                                   is_prompt) for t in texts]
  return _pad_rows(rows, batch_size, length)


def _batches_input_fn(arrays: dict, batch_size: int, repeats: int = 1) -> Callable:
  """An input_fn of the rows of arrays ({feature: [n, length]}), each `repeats` times, in batches."""
  def input_fn(params):
    del params
    dataset = tf.data.Dataset.from_tensor_slices(arrays)
    if repeats > 1:
      dataset = dataset.flat_map(lambda x: tf.data.Dataset.from_tensors(x).repeat(repeats))
    return dataset.batch(batch_size, drop_remainder=True)
  return input_fn


@gin.configurable(module=GIN_MODULE)
def decode_from_file(estimator, vocabulary, model_type, batch_size, sequence_length, checkpoint_path=None,
                     input_filename=gin.REQUIRED, output_filename=gin.REQUIRED, eos_id=1, repeats=1) -> list:
  """Decodes each line of input_filename (`repeats` times) into `output_filename-<step>`; returns them.

  Encoder-decoder inputs end with eos_id and keep their first sequence_length["inputs"] ids;
  language-model prompts keep their last sequence_length["targets"] - 1 ids.
  """
  texts = get_inputs_from_file(input_filename)
  if not texts:
    raise ValueError(f"{input_filename} (utils.decode_from_file.input_filename) has no lines to decode: "
                     f"write one input per line.")
  lm = model_type == "lm" or model_fn.is_unitransformer(estimator.model_fn.transformer_model)
  ids = _encode_rows(texts, vocabulary_lib.inputs_vocabulary(vocabulary),
                     sequence_length["targets" if lm else "inputs"], batch_size, 0 if lm else eos_id,
                     is_prompt=lm)
  step = get_step_from_checkpoint_path(checkpoint_path or estimator.latest_checkpoint())
  decodes = list(decode(estimator, _batches_input_fn({"inputs": ids}, batch_size, repeats), vocabulary,
                        checkpoint_path=checkpoint_path))[:len(texts) * repeats]
  path = "%s-%d" % (output_filename, step)
  write_lines_to_file(decodes, path)
  print(f"Wrote {len(decodes)} decodes to {path}.")
  return decodes


@gin.configurable(module=GIN_MODULE)
def decode_from_dataset(estimator, vocabulary, model_type, batch_size, sequence_length, checkpoint_path=None,
                        infer_dataset_fn=gin.REQUIRED, dataset_split="validation",
                        decode_output_dir=gin.REQUIRED) -> dict:
  """Decodes the inputs of infer_dataset_fn's EvalDatasets (language models only) and writes
  `<name>_<step>_predictions`, `<name>_targets` and `<name>_inputs` to decode_output_dir.

  Returns {dataset name: predictions}. Batches holding ids outside the vocabulary stop the decoding
  or, with bad_id_batches.skip, are left out of every file (id_checks).
  """
  if model_type != "lm":
    raise ValueError(f"decode_from_dataset supports decoder-only language models (model_type 'lm'), not "
                     f"{model_type!r}.")
  infer_datasets = infer_dataset_fn(sequence_length=sequence_length, vocabulary=vocabulary,
                                    dataset_split=dataset_split)
  step = get_step_from_checkpoint_path(checkpoint_path or estimator.latest_checkpoint())
  id_check = id_checks.IdCheck(id_checks.vocab_sizes(vocabulary), lambda bad: (
      f"batch {bad.index + 1} of decode_from_dataset at checkpoint step {step}"))
  source = f"infer_dataset_fn {id_checks.function_name(infer_dataset_fn)} (split {dataset_split!r})"
  decodes = list(decode(estimator, _combined_input_fn(infer_datasets, batch_size, sequence_length,
                                                      id_check=id_check, source=source),
                        vocabulary, checkpoint_path=checkpoint_path))
  skipped = {bad.index for bad in id_check.bad}
  results, position = {}, 0
  for infer_dataset in infer_datasets:
    examples = list(inputs.iterate_examples(lambda d=infer_dataset: _call_dataset_fn(d.dataset_fn,
                                                                                   sequence_length)))
    examples, position = ([ex for i, ex in enumerate(examples, position) if i // batch_size not in skipped],
                          position + len(examples))
    examples = _maybe_add_pretokenized_features(examples, vocabulary)
    predictions, decodes = decodes[:len(examples)], decodes[len(examples):]
    name = infer_dataset.name
    write_lines_to_file(predictions, os.path.join(decode_output_dir, f"{name}_{step}_predictions"))
    targets = [_postprocess(infer_dataset, _text(ex["targets_pretokenized"]), ex, is_target=True)
               for ex in examples]
    write_lines_to_file(targets, os.path.join(decode_output_dir, f"{name}_targets"))
    write_lines_to_file([_text(ex["inputs_pretokenized"]) for ex in examples if "inputs_pretokenized" in ex],
                        os.path.join(decode_output_dir, f"{name}_inputs"))
    results[name] = predictions
  return results


def _postprocess(eval_dataset, text: str, example: dict, is_target: bool = False):
  """eval_dataset.postprocess_fn(text, example=, is_target=) as upstream calls it (identity if None)."""
  if eval_dataset.postprocess_fn is None:
    return text
  if is_target:
    return eval_dataset.postprocess_fn(text, example=example, is_target=True)
  return eval_dataset.postprocess_fn(text, example=example)


@gin.configurable(module=GIN_MODULE)
def save_scores(results, vocabulary, scores_filename=None, save_example_text=True):
  """Scores of scored examples, written to `<scores_filename>.scores` (and .targets, .lengths,
  .inputs with save_example_text) when scores_filename is given.

  Returns:
    scores; with save_example_text (scores, targets) or (scores, inputs, targets) texts.
  """
  if not results:
    raise ValueError("No examples were scored.")
  scores = [float(r["scores"]) for r in results]
  if scores_filename is not None:
    write_lines_to_file(["%g" % s for s in scores], scores_filename + ".scores")
  if not save_example_text:
    return scores
  results = _maybe_add_pretokenized_features(results, vocabulary)
  targets = [_text(r.get("targets_pretokenized", r["targets"])) for r in results]
  lengths = [int(np.argmax(np.asarray(r["targets"]) == 0)) if (np.asarray(r["targets"]) == 0).any()
             else len(r["targets"]) for r in results]
  if scores_filename is not None:
    write_lines_to_file(targets, scores_filename + ".targets")
    write_lines_to_file(lengths, scores_filename + ".lengths")
  if "inputs" not in results[0]:
    return scores, targets
  texts = [_text(r.get("inputs_pretokenized", r["inputs"])) for r in results]
  if scores_filename is not None:
    write_lines_to_file(texts, scores_filename + ".inputs")
  return scores, texts, targets


@gin.configurable(module=GIN_MODULE)
def save_scores_to_tfrecords(results, vocabulary, scores_filename, shard_idx=0, save_ids_only=False) -> str:
  """Writes one tf.train.Example (input, target, score) per result to
  `<scores_filename>_<shard_idx>.tfrecord`; returns that path."""
  results = _maybe_add_pretokenized_features(results, vocabulary)
  path = "%s_%d.tfrecord" % (scores_filename, shard_idx)
  with tf.io.TFRecordWriter(path) as writer:
    for r in results:
      text = _text(r.get("targets_neg_pretokenized", r.get("inputs_pretokenized", "")))
      if save_ids_only:
        text = text.split(" ", 1)[0]
      features = {"input": tf.train.Feature(bytes_list=tf.train.BytesList(value=[text.encode("utf-8")])),
                  "target": tf.train.Feature(bytes_list=tf.train.BytesList(
                      value=[_text(r.get("targets_pretokenized", "")).encode("utf-8")])),
                  "score": tf.train.Feature(float_list=tf.train.FloatList(value=[float(r.get("scores",
                                                                                             0.0))]))}
      writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())
  return path


def _scores_only(results, vocabulary) -> list:
  """The default score_postprocess_fn: the list of scores."""
  del vocabulary
  return [float(r["scores"]) for r in results]


def _scored_results(estimator, input_fn, checkpoint_path: str) -> Iterator[dict]:
  for result in estimator.predict(input_fn, checkpoint_path=checkpoint_path):
    if "scores" not in result:
      raise ValueError("Scoring needs an estimator made with get_estimator(..., score_in_predict_mode=True); "
                       "this one decodes.")
    yield result


def _one_checkpoint(eval_checkpoint_step, model_dir: str) -> str:
  paths = get_checkpoint_iterator(eval_checkpoint_step, model_dir)
  path = next(iter(paths), None)
  if path is None:
    raise ValueError(f"No checkpoint in {model_dir} to score (eval_checkpoint_step="
                     f"{eval_checkpoint_step!r}); train first.")
  return path


@gin.configurable(module=GIN_MODULE)
def score_with_estimator(estimator, input_fn, eval_checkpoint_step, model_dir, vocabulary,
                         score_postprocess_fn=save_scores, num_examples=None):
  """score_postprocess_fn(results, vocabulary) of the examples of input_fn, scored at the
  checkpoint eval_checkpoint_step selects; trailing padding examples are dropped."""
  results = list(_scored_results(estimator, input_fn, _one_checkpoint(eval_checkpoint_step, model_dir)))
  if num_examples is None:
    padding = next((i for i, r in enumerate(reversed(results)) if np.asarray(r["targets"]).any()),
                   len(results))
    num_examples = len(results) - padding
  return score_postprocess_fn(results[:num_examples], vocabulary)


@gin.configurable(module=GIN_MODULE)
def score_with_estimator_lazy(estimator, input_fn, eval_checkpoint_step, model_dir, vocabulary,
                              score_postprocess_fn=save_scores_to_tfrecords, num_examples=None,
                              num_examples_per_shard=100000) -> int:
  """Scores input_fn's examples as they come, handing score_postprocess_fn(results, vocabulary,
  shard_idx=) one shard of num_examples_per_shard results at a time; returns the shard count."""
  results, shard_idx = [], 0
  for i, result in enumerate(_scored_results(estimator, input_fn,
                                             _one_checkpoint(eval_checkpoint_step, model_dir))):
    if num_examples is not None and i >= num_examples:
      break
    results.append(result)
    if num_examples_per_shard and len(results) >= num_examples_per_shard:
      score_postprocess_fn(results, vocabulary, shard_idx=shard_idx)
      results, shard_idx = [], shard_idx + 1
  if results:
    score_postprocess_fn(results, vocabulary, shard_idx=shard_idx)
    shard_idx += 1
  return shard_idx


@gin.configurable(module=GIN_MODULE)
def score_from_strings(estimator, vocabulary, model_type, batch_size, sequence_length, model_dir,
                       eval_checkpoint_step, inputs=None, targets=gin.REQUIRED,
                       score_postprocess_fn=_scores_only,
                       eos_id=1, score_eos=True, score_with_estimator_fn=score_with_estimator):
  """Log-likelihood of each target string (given its input string for encoder-decoders).

  inputs / targets: lists of strings, or paths of text files (one string per line). With more
  targets than inputs, each input is repeated for len(targets) // len(inputs) consecutive
  targets; one target is scored against every input.
  """
  if isinstance(inputs, str):
    inputs = get_inputs_from_file(inputs)
  if isinstance(targets, str):
    targets = get_inputs_from_file(targets)
  if inputs is not None:
    if len(inputs) < len(targets):
      if len(targets) % len(inputs):
        raise ValueError(f"len(inputs) must divide len(targets), got {len(inputs)} and {len(targets)}.")
      repeats = len(targets) // len(inputs)
      inputs = [inputs[i // repeats] for i in range(len(targets))]
    elif len(targets) < len(inputs):
      if len(targets) != 1:
        raise ValueError(f"Expected one target string for {len(inputs)} inputs, got {len(targets)}.")
      targets = targets * len(inputs)
    if model_fn.is_unitransformer(estimator.model_fn.transformer_model):
      raise NotImplementedError("score_from_strings: scoring targets after an unscored prefix (inputs) is "
                                "not implemented for language models; pass the targets only.")
  arrays = {"targets": _encode_rows(targets, vocabulary_lib.targets_vocabulary(vocabulary),
                                    sequence_length["targets"], batch_size, eos_id if score_eos else 0)}
  if inputs is not None:
    arrays["inputs"] = _encode_rows(inputs, vocabulary_lib.inputs_vocabulary(vocabulary),
                                    sequence_length["inputs"],
                                    batch_size, eos_id)
  return score_with_estimator_fn(estimator, _batches_input_fn(arrays, batch_size), eval_checkpoint_step,
                                 model_dir,
                                 vocabulary, score_postprocess_fn, len(targets))


@gin.configurable(module=GIN_MODULE)
def score_from_dataset(estimator, vocabulary, batch_size, sequence_length, model_dir, eval_checkpoint_step,
                       dataset_split, score_dataset_fn=None, score_postprocess_fn=_scores_only,
                       score_with_estimator_fn=score_with_estimator):
  """Log-likelihood of each example of score_dataset_fn(sequence_length=, vocabulary=,
  dataset_split=): a list of EvalDatasets (their scores concatenated) or one finite dataset."""
  if score_dataset_fn is None:
    raise ValueError("score_from_dataset needs utils.score_from_dataset.score_dataset_fn.")
  dataset_fn = functools.partial(score_dataset_fn, sequence_length=sequence_length, vocabulary=vocabulary,
                                 dataset_split=dataset_split)
  with tf.Graph().as_default():  # datasets are built again inside the scoring graph
    datasets = dataset_fn()
  if isinstance(datasets, tf2.data.Dataset):
    datasets = [dataset_lib.EvalDataset(dataset_split, dataset_fn, None, [])]
  return score_with_estimator_fn(estimator, _combined_input_fn(datasets, batch_size, sequence_length),
                                 eval_checkpoint_step, model_dir, vocabulary, score_postprocess_fn)


@gin.configurable(module=GIN_MODULE)
def infer_model(estimator, vocabulary, sequence_length, batch_size, model_type, model_dir,
                eval_checkpoint_step,
                checkpoint_paths=None, decode_fn=decode_from_file) -> dict:
  """decode_fn at each checkpoint (checkpoint_paths, else those eval_checkpoint_step selects);
  returns {step: what decode_fn returned}."""
  if checkpoint_paths is None:
    checkpoint_paths = get_checkpoint_iterator(eval_checkpoint_step, model_dir)
  return {get_step_from_checkpoint_path(path): decode_fn(
      estimator, vocabulary=vocabulary, model_type=model_type, batch_size=batch_size,
      sequence_length=sequence_length, checkpoint_path=path) for path in checkpoint_paths}


def eval_model(estimator, vocabulary, sequence_length, batch_size, dataset_split, model_dir, eval_dataset_fn,
               eval_summary_dir, eval_checkpoint_step, eval_with_score=False, output_eval_examples=True,
               eval_dir_suffix=None, score_with_estimator_fn=score_with_estimator) -> dict:
  """Decodes (or, eval_with_score, scores) eval_dataset_fn's EvalDatasets with metric_fns at each
  checkpoint and writes their metrics `eval/<name>/<metric>` to TensorBoard in eval_summary_dir.

  estimator may be a function returning one (upstream's estimator_fn, given sequence_length when
  that is None: then it is the longest example's). output_eval_examples writes the targets,
  inputs and `<name>_<step>_predictions` next to the summaries. Returns {step: {name: metrics}}.
  """
  if eval_dataset_fn is None:
    raise ValueError("Must provide eval_dataset_fn through gin for eval (utils.run.eval_dataset_fn).")
  if sequence_length is None and not callable(estimator):
    raise ValueError("A callable must be passed for the estimator when automatically computing the sequence "
                     "length.")
  datasets = [dataset_lib.EvalDataset(*d) for d in eval_dataset_fn(
      sequence_length=sequence_length, vocabulary=vocabulary, dataset_split=dataset_split) if d.metric_fns]
  if not datasets:
    tf.logging.info("All provided EvalDatasets have metric_fns=[]; eval is not possible.")
    return {}
  summary_dir = eval_summary_dir or os.path.join(model_dir, f"{dataset_split}_eval")
  if eval_dir_suffix is not None:
    summary_dir += f"_{eval_dir_suffix}"
  examples, targets, longest = {}, {}, {"inputs": 0, "targets": 0}
  for d in datasets:
    examples[d.name] = _maybe_add_pretokenized_features(
        list(inputs.iterate_examples(lambda d=d: _call_dataset_fn(d.dataset_fn, sequence_length))),
                                                        vocabulary)
    for key in longest:
      longest[key] = max([longest[key]] + [len(ex[key]) for ex in examples[d.name] if key in ex])
    targets[d.name] = [_postprocess(d, _text(ex["targets_pretokenized"]), ex, is_target=True)
                       for ex in examples[d.name]]
    if output_eval_examples:
      write_lines_to_file(targets[d.name], os.path.join(summary_dir, f"{d.name}_targets"))
      write_lines_to_file([_text(ex["inputs_pretokenized"]) for ex in examples[d.name]
                           if "inputs_pretokenized" in ex], os.path.join(summary_dir, f"{d.name}_inputs"))
  if sequence_length is None:
    sequence_length = longest
    estimator = functools.partial(estimator, sequence_length=sequence_length)
  if callable(estimator):
    estimator = estimator()
  input_fn = _combined_input_fn(datasets, batch_size, sequence_length, check_for_metrics=True)
  writer = progress.summary_writer(summary_dir)
  results = {}
  for path in get_checkpoint_iterator(eval_checkpoint_step, model_dir):
    step = get_step_from_checkpoint_path(path)
    total = sum(len(e) for e in examples.values())
    if eval_with_score:
      outputs = list(score_with_estimator_fn(estimator, input_fn, step, model_dir, vocabulary,
                                             num_examples=total)[0])
    else:
      outputs = list(decode(estimator, input_fn, vocabulary, path))
    results[step] = {}
    for d in datasets:
      predictions = [_postprocess(d, out, ex) for out, ex in zip(outputs, examples[d.name])]
      outputs = outputs[len(examples[d.name]):]
      if output_eval_examples:
        write_lines_to_file(predictions, os.path.join(summary_dir, f"{d.name}_{step}_predictions"))
      metrics = {}
      for metric_fn in d.metric_fns:
        metrics.update(metric_fn(targets[d.name], predictions))
      progress.write_scalars(writer, step, {f"eval/{d.name}/{k}": v for k, v in metrics.items()
                                            if not math.isnan(v)})
      results[step][d.name] = metrics
    if outputs and len(outputs) != -total % batch_size:
      raise ValueError(f"{len(outputs)} padded outputs, {-total % batch_size} expected.")
  writer.close()
  return results


def export_model(estimator, export_dir, vocabulary, sequence_length, model_type, eval_with_score=False,
                 batch_size=1,
                 checkpoint_path=None) -> str:
  """A SavedModel of the checkpoint (default: the latest) in export_dir/<step>, serving string
  requests of up to batch_size: decodes, or (eval_with_score) log-likelihoods; returns its path."""
  del model_type  # the estimator's model says it
  checkpoint_path = checkpoint_path or estimator.latest_checkpoint()
  if checkpoint_path is None:
    raise ValueError(f"No checkpoint to export in {estimator.model_dir}: train first.")
  runner = estimator.runner(batch_size=batch_size, sequence_length=sequence_length)
  return export.export_model(runner, vocabulary, checkpoint_path, export_dir, eval_with_score)

