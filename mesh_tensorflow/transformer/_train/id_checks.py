"""Ids outside the vocabulary, caught in every batch the driver reads (train, perplexity_eval, infer).

0.1.21's gather and one_hot turn an out-of-range id into an all-zero row (mtf ops keep that for
direct use), so a batch of data encoded with another vocabulary would train or score silently.
The driver checks each batch as it leaves the input pipeline: a few comparisons per id in the
graph, and a Python call only for a bad batch, to record it. By default a bad batch stops the run
before the step that would read it (`BadIdsError` names the feature, the step, the id, the
vocabulary size and the source). With `bad_id_batches.skip = True` (gin) such batches are dropped
from the input, counted and reported, and `max_skipped_in_a_row` of them in a row stop the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Optional

import gin
import numpy as np
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import vocabulary as vocabulary_lib
from mesh_tensorflow.transformer._train import progress
from mesh_tensorflow.transformer._train.skip_policy import SkipPolicy, skip_policy
from mesh_tensorflow.transformer._utils import GIN_MODULE

SKIPPED_TAG = "skipped_bad_id_batches"  # TensorBoard scalar: the batches this run skipped so far
SHOWN_EXAMPLES = 5  # skipped batches reported one by one; the end of the run gives the count
_GOOD, _SKIP, _STOP = 0, 1, 2  # the verdict on one batch


class BadIdsError(ValueError):
  """A batch holds an id outside its feature's vocabulary."""


@gin.configurable("bad_id_batches", module=GIN_MODULE)
def bad_id_policy(skip: bool = False, max_skipped_in_a_row: int = 10) -> SkipPolicy:
  """What the driver does with a batch holding ids outside the vocabulary: stop (default), or skip it."""
  return skip_policy("bad_id_batches", "bad batches", skip, max_skipped_in_a_row)


@dataclasses.dataclass(frozen=True)
class BadBatch:
  index: int  # the batch's position in the checked stream, 0 first
  good_before: int  # how many batches of the stream before it passed (the steps they fed)
  feature: str
  bad_id: int


def first_bad_id(batch: dict, vocab_sizes: dict) -> Optional[tuple]:
  """(feature, id) of the first id of batch outside [0, vocab_sizes[feature]), or None."""
  for feature, size in vocab_sizes.items():
    if feature in batch:
      ids = np.asarray(batch[feature]).reshape(-1)
      bad = np.flatnonzero((ids < 0) | (ids >= size))
      if bad.size:
        return feature, int(ids[bad[0]])
  return None


def vocab_sizes(vocabulary) -> dict:
  """{feature: the size of its vocabulary} of utils.run.vocabulary (one, or an (inputs, targets) pair)."""
  return {"inputs": vocabulary_lib.inputs_vocabulary(vocabulary).vocab_size,
          "targets": vocabulary_lib.targets_vocabulary(vocabulary).vocab_size}


def _static_strings(tensor) -> list:
  """The constant strings a tensor holds (through reshapes), else []."""
  value = tf.get_static_value(tensor)
  if value is None and tensor.op.type in ("Reshape", "Identity") and tensor.op.inputs:
    return _static_strings(tensor.op.inputs[0])
  return [] if value is None else [v.decode() if isinstance(v, bytes) else str(v) for v in np.ravel(value)]


def dataset_files(dataset) -> list:
  """The files a text-line or TFRecord dataset inside `dataset` reads, where they are constants."""
  files = []
  filenames = getattr(dataset, "_filenames", None)
  for tensor in getattr(filenames, "_tensors", []):
    files += _static_strings(tensor)
  for source in dataset._inputs():
    files += [f for f in dataset_files(source) if f not in files]
  return files


def function_name(fn: Callable) -> str:
  """A dataset function's name (through functools.partial), for messages."""
  fn = getattr(fn, "func", fn)
  return getattr(fn, "__qualname__", repr(fn))


def source_of(dataset_fn: Callable, fallback: str) -> str:
  """describe_source of the dataset dataset_fn() builds (in a graph of its own)."""
  with tf.Graph().as_default():
    return describe_source(dataset_fn(), fallback)


def describe_source(dataset, fallback: str) -> str:
  """The file (or files) the dataset reads, else `fallback` (e.g. the dataset fn and its split)."""
  files = dataset_files(dataset)
  if len(files) == 1:
    return f"file {files[0]}"
  if files:
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    return f"one of the files {', '.join(files[:3])}{more}"
  return fallback


class IdCheck:
  """Checks the batches of one input against vocab_sizes ({feature: size}) and records the bad ones.

  `where(bad)` names the BadBatch `bad` by the step that would read it, e.g. "the batch of step 3".
  """

  def __init__(self, vocab_sizes: dict, where: Callable[[BadBatch], str],
               policy: Optional[SkipPolicy] = None):
    self.vocab_sizes = dict(vocab_sizes)
    self.where = where
    self.policy = policy or bad_id_policy()
    self.source = "the input"
    self.bad: list = []  # BadBatch, in stream order
    self.stopped_at: Optional[BadBatch] = None
    self._in_a_row = 0

  def verdict(self, index: int, batch: dict) -> int:
    """Records batch (a bad one) and says whether to skip it or stop."""
    found = first_bad_id(batch, self.vocab_sizes)
    if found is None:
      return _GOOD
    bad = BadBatch(int(index), int(index) - len(self.bad), *found)
    self._in_a_row = self._in_a_row + 1 if self.bad and self.bad[-1].index == bad.index - 1 else 1
    self.bad.append(bad)
    if not self.policy.skip or self._in_a_row >= self.policy.max_skipped_in_a_row:
      self.stopped_at = self.stopped_at or bad
      return _STOP
    return _SKIP

  def apply(self, dataset, fallback_source: str):
    """The batched dataset of feature dicts, each batch checked (bad ones dropped when skipping)."""
    self.source = describe_source(dataset, fallback_source)
    features = [f for f in self.vocab_sizes if f in dataset.element_spec]
    tf.add_to_collection(_COLLECTION, self)

    def record(index, *ids):
      return self.verdict(int(index), {f: v.numpy() for f, v in zip(features, ids)})

    def check(index, batch):
      ids = [batch[f] for f in features]
      outside = [tf.reduce_any((v < 0) | (v >= self.vocab_sizes[f])) for f, v in zip(features, ids)]
      verdict = tf.cond(tf.reduce_any(outside), lambda: tf.py_function(record, [index] + ids, tf.int32),
                        lambda: tf.constant(_GOOD))
      assertion = tf.debugging.Assert(tf.not_equal(verdict, _STOP), [_MARK])
      with tf.control_dependencies([assertion]):
        return {k: tf.identity(v) for k, v in batch.items()}, tf.equal(verdict, _GOOD)

    checked = dataset.enumerate().map(check)
    if self.policy.skip:
      checked = checked.filter(lambda batch, good: good)
    return checked.map(lambda batch, good: batch)

  def describe(self, bad: BadBatch) -> str:
    size = self.vocab_sizes[bad.feature]
    return (f"feature {bad.feature!r} holds id {bad.bad_id}, outside the {bad.feature} vocabulary of {size} "
            f"ids (0 to {size - 1}), from {self.source}")

  def error(self) -> BadIdsError:
    """The error of the batch that stopped the input (stopped_at must be set)."""
    bad = self.stopped_at
    if self.policy.skip:
      return BadIdsError(
          f"{self.policy.max_skipped_in_a_row} batches in a row hold ids outside the vocabulary "
          f"(bad_id_batches.max_skipped_in_a_row); stopped at {self.where(bad)}: {self.describe(bad)}. "
          f"The data was encoded with another vocabulary than utils.run.vocabulary.")
    return BadIdsError(
        f"Refused {self.where(bad)} before it was used: {self.describe(bad)}. Re-encode "
        f"that data with utils.run.vocabulary, or set bad_id_batches.skip = True (gin) to skip such batches.")

  def numpy_batches(self, batches: Iterator, source: str) -> Iterator:
    """The (batch, num_real) pairs of numpy batches from source that pass the check (raises at a stop)."""
    self.source = source
    with contextlib.closing(batches):  # a reader's graph context ends before the error passes through it
      for index, (batch, num_real) in enumerate(batches):
        verdict = self.verdict(index, batch)
        if verdict == _STOP:
          break
        if verdict == _GOOD:
          yield batch, num_real
    if self.stopped_at is not None:
      raise self.error()

  def summary(self, skipped: list) -> str:
    """The count of skipped batches and a few of their (feature, id)."""
    shown = ", ".join(f"({b.feature!r}, {b.bad_id})" for b in skipped[:SHOWN_EXAMPLES])
    return (f"Skipped {len(skipped)} batch(es) holding ids outside the vocabulary (bad_id_batches.skip), "
            f"e.g. (feature, id): {shown}.")


_COLLECTION = "mesh_tensorflow_id_checks"  # the IdChecks of a graph's input pipelines
_MARK = "Batch holds ids outside the vocabulary"


def bad_ids_error(error: tf.errors.OpError, graph) -> Optional[BadIdsError]:
  """The BadIdsError behind an error of an input pipeline in graph, if its id check stopped it."""
  if _MARK in str(error):
    for check in graph.get_collection(_COLLECTION):
      if check.stopped_at is not None:
        return check.error()
  return None


class SkippedBatchesHook(tf.train.SessionRunHook):
  """Reports the batches a training input skips, at the step that read the next batch instead.

  first_step: the global step the stream's first batch feeds. Bad batches among those a resumed
  run's checkpoint consumed were reported by the run that skipped them.
  """

  def __init__(self, check: IdCheck, first_step: int, model_dir: str, print_fn: Callable = print):
    self._check = check
    self._first_step = first_step
    self.resume_after(0)
    self._model_dir = model_dir
    self._print = print_fn
    self._writer = None
    self.reported: list = []

  def resume_after(self, batches_to_skip: int) -> None:
    """The stream's first batches_to_skip good batches fed the steps the checkpoint holds."""
    self._resumed = batches_to_skip
    self._step = self._first_step + batches_to_skip - 1  # the checkpoint's step

  def after_run(self, run_context, run_values):
    del run_context, run_values
    self._step += 1
    new = [b for b in self._check.bad if self._resumed <= b.good_before <= self._step - self._first_step
           and b not in self.reported]
    for bad in new:
      self.reported.append(bad)
      if len(self.reported) <= SHOWN_EXAMPLES:
        self._print(f"Skipped a batch at step {self._step}: {self._check.describe(bad)}; step {self._step} "
                    f"read the next batch; {len(self.reported)} skipped so far.")
    if new:
      self._writer = self._writer or progress.summary_writer(self._model_dir)
      progress.write_scalars(self._writer, self._step, {SKIPPED_TAG: len(self.reported)})

  def end(self, session):
    del session
    if self.reported:
      self._print(self._check.summary(self.reported))
    if self._writer is not None:
      self._writer.close()
