"""Vocabularies: strings <-> token ids, in Python and as TensorFlow ops.

Every vocabulary reserves id 0 for padding (PAD) and id 1 for end-of-sequence (EOS). `decode` stops
at the first EOS and drops padding, so a decoded model output reads as text.

`ByteVocabulary` needs no files or downloads (the bundled example uses it). `TFDSVocabulary` wraps a
tensorflow_datasets text encoder; tensorflow_datasets is imported only by `get_tfds_vocabulary`.
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

import gin
import numpy as np
import tensorflow.compat.v1 as tf

PAD_ID = 0
EOS_ID = 1


def import_optional(module_name: str, pip_name: str, needed_by: str) -> Any:
  """Imports an optional dependency, or raises ImportError naming the package to install."""
  try:
    return importlib.import_module(module_name)
  except ImportError as e:
    raise ImportError(
        f"{needed_by} needs the optional package {pip_name!r}, which is not installed; "
        f"install it with `pip install {pip_name}`") from e


def strip_special_ids(ids: Sequence[int]) -> list[int]:
  """The ids before the first EOS, without PAD."""
  ids = [int(i) for i in ids]
  if EOS_ID in ids:
    ids = ids[:ids.index(EOS_ID)]
  return [i for i in ids if i != PAD_ID]


class Vocabulary:
  """Base class: vocab_size, encode/decode in Python and encode_tf/decode_tf as TF ops.

  Args:
    extra_ids: number of sentinel ids appended after the regular vocabulary.
  """

  def __init__(self, extra_ids: int = 0):
    self._extra_ids = extra_ids

  @property
  def extra_ids(self) -> int:
    return self._extra_ids

  @property
  def vocab_size(self) -> int:
    raise NotImplementedError(f"{type(self).__name__} must define vocab_size")

  def encode(self, s: str) -> list[int]:
    raise NotImplementedError(f"{type(self).__name__} must define encode")

  def decode(self, ids: Sequence[int]) -> str:
    raise NotImplementedError(f"{type(self).__name__} must define decode")

  def encode_tf(self, s: tf.Tensor) -> tf.Tensor:
    """A scalar tf.string -> 1-D int32 ids (no EOS appended). Default: the Python encoder via py_function."""
    ids = tf.py_function(lambda x: np.array(self.encode(x.numpy().decode("utf-8")), np.int32), [s], tf.int32)
    ids.set_shape([None])
    return ids

  def decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
    """1-D int ids -> a scalar tf.string. Default: the Python decoder via py_function."""
    s = tf.py_function(lambda x: self.decode(x.numpy().tolist()), [ids], tf.string)
    s.set_shape([])
    return s


class ByteVocabulary(Vocabulary):
  """UTF-8 bytes as tokens: byte b has id b + num_reserved_ids (ids 0=PAD, 1=EOS, 2=UNK reserved).

  Needs no vocabulary file. encode_tf/decode_tf are pure TF ops (no py_function), so datasets using
  them run in parallel and serialize into graphs.

  Example:
    v = ByteVocabulary()
    v.encode("hi") == [107, 108]; v.decode([107, 108, 1, 0]) == "hi"
  """

  num_reserved_ids = 3

  @property
  def vocab_size(self) -> int:
    return 256 + self.num_reserved_ids + self.extra_ids

  def encode(self, s: str) -> list[int]:
    return [b + self.num_reserved_ids for b in s.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    data = bytes(i - self.num_reserved_ids for i in strip_special_ids(ids)
                 if self.num_reserved_ids <= i < 256 + self.num_reserved_ids)
    return data.decode("utf-8", errors="ignore")

  def encode_tf(self, s: tf.Tensor) -> tf.Tensor:
    return tf.cast(tf.io.decode_raw(s, tf.uint8), tf.int32) + self.num_reserved_ids

  def decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
    """Ids [..., length] -> strings [...]: the bytes before the first EOS; reserved and extra ids dropped."""
    ids = tf.cast(ids, tf.int32)
    before_eos = tf.equal(tf.cumsum(tf.cast(tf.equal(ids, EOS_ID), tf.int32), axis=-1), 0)
    byte_ids = ids - self.num_reserved_ids
    keep = tf.logical_and(before_eos, tf.logical_and(byte_ids >= 0, byte_ids < 256))
    table = tf.constant([bytes([b]) for b in range(256)] + [b""])
    return tf.strings.reduce_join(tf.gather(table, tf.where_v2(keep, byte_ids, 256)), axis=-1)


class TFDSVocabulary(Vocabulary):
  """A tensorflow_datasets text encoder, its ids shifted by +1 so that id 1 is free for EOS.

  Args:
    tfds_encoder: any object with `vocab_size`, `encode(str)` and `decode(ids)` whose id 0 is padding,
      such as `tfds.deprecated.text.SubwordTextEncoder`.
  """

  def __init__(self, tfds_encoder: Any, extra_ids: int = 0):
    super().__init__(extra_ids)
    self._tfds_encoder = tfds_encoder

  @property
  def vocab_size(self) -> int:
    return self._tfds_encoder.vocab_size + 1 + self.extra_ids

  def encode(self, s: str) -> list[int]:
    return [i + 1 for i in self._tfds_encoder.encode(s)]

  def decode(self, ids: Sequence[int]) -> str:
    return self._tfds_encoder.decode([i - 1 for i in strip_special_ids(ids)])


@gin.configurable
def get_tfds_vocabulary(dataset_name: str = gin.REQUIRED) -> TFDSVocabulary:
  """The TFDSVocabulary of a tensorflow_datasets dataset's supervised target feature."""
  tfds = import_optional("tensorflow_datasets", "tensorflow-datasets", "get_tfds_vocabulary")
  info = tfds.builder(dataset_name).info
  # Assumes the inputs (if any) and the targets share one vocabulary.
  return TFDSVocabulary(info.features[info.supervised_keys[1]].encoder)


def inputs_vocabulary(vocabulary: Vocabulary | tuple) -> Vocabulary:
  """The inputs vocabulary: the first of an (inputs, targets) pair, else the vocabulary itself."""
  if isinstance(vocabulary, tuple):
    return vocabulary[0]
  return vocabulary


def targets_vocabulary(vocabulary: Vocabulary | tuple) -> Vocabulary:
  """The targets vocabulary: the second of an (inputs, targets) pair, else the vocabulary itself."""
  if isinstance(vocabulary, tuple):
    return vocabulary[1]
  return vocabulary


def feature_vocabulary(vocabulary: Vocabulary | tuple, feature_key: str) -> Vocabulary:
  """The vocabulary of feature "inputs" or "targets" (pairs are (inputs, targets))."""
  return inputs_vocabulary(vocabulary) if feature_key == "inputs" else targets_vocabulary(vocabulary)
