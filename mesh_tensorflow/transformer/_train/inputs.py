"""Input pipelines: repeated training batches that resume where they stopped, and numpy batches.

Training reads one batch per step from a deterministic pipeline, so the data position is a
function of the global step: a resumed run skips the batches the checkpointed steps consumed and
sees exactly what an uninterrupted run would have seen.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

import numpy as np
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer._utils.features import _MODEL_FEATURES, _filter_features


class DatasetContractError(ValueError):
  """A dataset does not yield what the driver feeds the model."""


def check_training_dataset(dataset_fn: Callable[[], tf.data.Dataset], batch_size: int, sequence_length: dict,
                           vocab_sizes: dict, name: str = "utils.run.train_dataset_fn") -> None:
  """Reads the first batch of dataset_fn() and raises DatasetContractError naming what is wrong.

  The contract: unbatched dicts holding each feature of vocab_sizes ("targets", and "inputs" for
  encoder-decoders) as a 1-D integer sequence zero-padded to sequence_length[feature], with ids in
  [0, vocab_sizes[feature]).
  """
  with tf.Graph().as_default():
    spec = dataset_fn().element_spec
  if not isinstance(spec, dict):
    raise DatasetContractError(f"{name}'s dataset yields {spec}; expected dicts of features such as "
                               f"{{'targets': int32 [length]}}.")
  missing = sorted(set(vocab_sizes) - set(spec))
  if missing:
    raise DatasetContractError(f"{name}'s examples lack the feature(s) {missing} the model reads; they "
                               f"have {sorted(spec)}.")
  features = [k for k in _MODEL_FEATURES if k in spec]
  for key in features:
    _check_feature_spec(name, key, spec[key])
  batch = list(iterate_examples(lambda: dataset_fn().take(batch_size)))
  if not batch:
    raise DatasetContractError(f"{name}'s dataset yields no examples (for this split): check its files "
                               f"and filters.")
  for key in features:
    length = sequence_length.get(key.split("_")[0])
    lengths = sorted({len(example[key]) for example in batch})
    if length is not None and lengths != [length]:
      raise DatasetContractError(
          f"{name}'s feature {key!r} has lengths {lengths[:5]} in the first batch, but "
          f"utils.run.sequence_length[{key.split('_')[0]!r}] is {length}: pad (or pack) every example to "
          f"that length, e.g. with transformer.dataset.pack_or_pad.")
  for key, vocab_size in vocab_sizes.items():
    ids = np.concatenate([example[key] for example in batch])
    if ids.min() < 0 or ids.max() >= vocab_size:
      raise DatasetContractError(
          f"{name}'s feature {key!r} holds ids from {ids.min()} to {ids.max()} in the first batch, but the "
          f"{key} vocabulary has {vocab_size} ids (0 to {vocab_size - 1}): the data was encoded with "
          f"another vocabulary than utils.run.vocabulary.")


def _check_feature_spec(name: str, key: str, spec) -> None:
  if spec.dtype == tf.string:
    raise DatasetContractError(f"{name}'s feature {key!r} holds strings: encode them to ids with the "
                               f"vocabulary first (e.g. transformer.dataset.encode_all_features).")
  if not spec.dtype.is_integer:
    raise DatasetContractError(f"{name}'s feature {key!r} is {spec.dtype.name}; expected integer ids.")
  if spec.shape.rank is not None and spec.shape.rank != 1:
    raise DatasetContractError(
        f"{name}'s feature {key!r} has shape {spec.shape}; expected one unbatched sequence per example "
        f"(rank 1). utils.run batches the examples itself: drop any .batch() from the dataset.")


def training_features(dataset: tf.data.Dataset, batch_size: int, batches_to_skip: int = 0) -> dict:
  """{feature: [batch_size, length] tensor} from the next batch of the repeated dataset.

  Call inside the training graph, with a dataset built in it; each run of a tensor that depends
  on the result reads one batch.
  """
  ds = dataset.map(_filter_features).repeat().batch(batch_size, drop_remainder=True)
  if batches_to_skip > 0:
    ds = ds.skip(batches_to_skip)
  return tf.data.make_one_shot_iterator(ds.prefetch(2)).get_next()


def iterate_examples(dataset_fn: Callable[[], tf.data.Dataset]) -> Iterator[dict]:
  """The examples of the finite dataset_fn() as dicts of numpy values (in a graph of their own)."""
  with tf.Graph().as_default():
    next_example = tf.data.make_one_shot_iterator(dataset_fn()).get_next()
    with tf.Session() as session:
      while True:
        try:
          yield session.run(next_example)
        except tf.errors.OutOfRangeError:
          return


def numpy_batches(dataset_fn: Callable[[], tf.data.Dataset], batch_size: int, lengths: dict,
                  max_batches: int | None = None) -> Iterator:
  """Yields (batch, num_real_examples): {feature: int32 array [batch_size, lengths[feature]]}.

  Reads the finite dataset_fn() once; examples are zero-padded (or cut) to `lengths` and the last
  batch is filled with all-zero examples, which count as padding everywhere (targets 0 carry no
  weight).
  """
  examples = iterate_examples(dataset_fn)
  count = 0
  while max_batches is None or count < max_batches:
    rows = list(itertools.islice(examples, batch_size))
    if not rows:
      return
    batch = {k: np.zeros([batch_size, n], np.int32) for k, n in lengths.items()}
    for i, row in enumerate(rows):
      for k, n in lengths.items():
        value = np.asarray(row[k]).reshape(-1)[:n]
        batch[k][i, :len(value)] = value
    count += 1
    yield batch, len(rows)
