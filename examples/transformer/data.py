"""Datasets of the bundled Transformer example, gin-configurable, needing no download.

* Language modelling on English text: by default the documentation topics that ship inside
  every CPython (`pydoc_data.topics`, about 465 KB), or your own files (`text_files`). The text is
  cut into windows of `sequence_length["targets"]` bytes; every 20th window is held out.
* A sequence-transduction task for an encoder-decoder: reverse (or sort) a random digit string.

Each `*_dataset` has utils.run's dataset_fn signature (sequence_length, vocabulary,
dataset_split) and returns unbatched examples; each `*_eval_datasets` returns EvalDatasets.
"""

from __future__ import annotations

import glob
from typing import Optional

import gin
import numpy as np
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import dataset as dataset_lib
from mesh_tensorflow.transformer import vocabulary as vocabulary_lib

HELDOUT_EVERY = 20  # window i is held out when i % HELDOUT_EVERY == HELDOUT_EVERY - 1
SHUFFLE_SEED = 1234


@gin.configurable
def byte_vocabulary() -> vocabulary_lib.ByteVocabulary:
  """UTF-8 bytes as tokens (no vocabulary file): `utils.run.vocabulary = @data.byte_vocabulary()`."""
  return vocabulary_lib.ByteVocabulary()


def read_corpus(text_files: Optional[str] = None) -> str:
  """The text of the files matching glob `text_files` (sorted), else of pydoc_data.topics."""
  if text_files:
    paths = sorted(glob.glob(text_files))
    if not paths:
      raise ValueError(f"text_files={text_files!r} matches no file.")
    return "\n\n".join(open(p, encoding="utf-8", errors="replace").read() for p in paths)
  from pydoc_data import topics
  return "\n\n".join(topics.topics[name] for name in sorted(topics.topics))


def text_windows(text: str, vocabulary, length: int, dataset_split: str) -> np.ndarray:
  """[num_windows, length] int32 ids: consecutive windows of the encoded text in one split."""
  ids = np.asarray(vocabulary.encode(text), np.int32)
  windows = ids[:len(ids) // length * length].reshape(-1, length)
  heldout = np.arange(len(windows)) % HELDOUT_EVERY == HELDOUT_EVERY - 1
  if dataset_split == "train":
    return windows[~heldout]
  if dataset_split in ("validation", "test", "eval"):
    return windows[heldout]
  raise ValueError(f"dataset_split {dataset_split!r}: use 'train' or 'validation'.")


@gin.configurable
def text_lm_dataset(sequence_length, vocabulary, dataset_split, text_files: Optional[str] = None,
                    shuffle: bool = True) -> tf.data.Dataset:
  """{"targets": [length]} byte windows of the corpus; the train split is shuffled (seeded)."""
  windows = text_windows(read_corpus(text_files), vocabulary, sequence_length["targets"], dataset_split)
  ds = tf.data.Dataset.from_tensor_slices({"targets": windows})
  if shuffle and dataset_split == "train":
    ds = ds.shuffle(len(windows), seed=SHUFFLE_SEED)
  return ds


@gin.configurable
def text_lm_eval_datasets(sequence_length, vocabulary, dataset_split) -> list:
  """The held-out windows as one EvalDataset named "heldout" (for perplexity_eval)."""
  fn = lambda: text_lm_dataset(sequence_length, vocabulary, dataset_split, shuffle=False)
  return [dataset_lib.EvalDataset(name="heldout", dataset_fn=fn, postprocess_fn=None, metric_fns=[])]


def transduction_examples(task: str, num_examples: int, min_length: int, max_length: int, seed: int) -> list:
  """[(input string, target string)] of random digit strings and their reversal (or sorting)."""
  rng = np.random.RandomState(seed)
  examples = []
  for _ in range(num_examples):
    digits = "".join(rng.choice(list("0123456789"), size=rng.randint(min_length, max_length + 1)))
    target = digits[::-1] if task == "reverse" else "".join(sorted(digits))
    examples.append((digits, target))
  return examples


def _encode_pairs(pairs: list, vocabulary, length: int) -> dict:
  """{"inputs", "targets"}: [n, length] int32, each string encoded, EOS-terminated, zero padded."""
  arrays = {k: np.zeros([len(pairs), length], np.int32) for k in ("inputs", "targets")}
  for i, pair in enumerate(pairs):
    for key, text in zip(("inputs", "targets"), pair):
      ids = vocabulary.encode(text) + [1]
      arrays[key][i, :len(ids)] = ids
  return arrays


@gin.configurable
def transduction_dataset(sequence_length, vocabulary, dataset_split, task: str = "reverse",
                         min_length: int = 3, max_length: int = 10, num_train_examples: int = 50000,
                         num_eval_examples: int = 200) -> tf.data.Dataset:
  """Digit strings and their reversal (task "reverse") or sorted digits (task "sort")."""
  if task not in ("reverse", "sort"):
    raise ValueError(f"task {task!r}: use 'reverse' or 'sort'.")
  if max_length + 1 > min(sequence_length["inputs"], sequence_length["targets"]):
    raise ValueError(f"max_length {max_length} + EOS does not fit sequence_length {sequence_length}.")
  train = dataset_split == "train"
  pairs = transduction_examples(task, num_train_examples if train else num_eval_examples, min_length,
                                max_length, seed=0 if train else 1)
  arrays = _encode_pairs(pairs, vocabulary, max(sequence_length.values()))
  ds = tf.data.Dataset.from_tensor_slices(arrays)
  return ds.shuffle(len(pairs), seed=SHUFFLE_SEED) if train else ds


def exact_match(targets: list, predictions: list) -> dict:
  return {"exact_match": float(np.mean([t == p for t, p in zip(targets, predictions)]))}


@gin.configurable
def transduction_eval_datasets(sequence_length, vocabulary, dataset_split) -> list:
  """The held-out transduction examples, scored by exact match of the decoded string."""
  fn = lambda: transduction_dataset(sequence_length, vocabulary, "validation")
  return [dataset_lib.EvalDataset(name="transduction", dataset_fn=fn, postprocess_fn=None,
                                  metric_fns=[exact_match])]
