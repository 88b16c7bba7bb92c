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

from mesh_tensorflow.transformer._utils.features import _filter_features


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
