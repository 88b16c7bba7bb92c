"""The string ends of a serving SavedModel: a request of up to batch_size strings in, one result per
string out.

The lowered mesh graph has a fixed batch; a request of n <= batch_size strings is padded with empty
strings to the batch, encoded to ids in the graph (the vocabulary's `encode_tf`), and every output
is sliced back to its first n rows. More than batch_size strings fail when run, naming the limit.
"""

from __future__ import annotations

import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer._train import decode


def request_size(texts: tf.Tensor, batch_size: int, other=None) -> tf.Tensor:
  """The number of strings in `texts` (a [None] string tensor), checked against the batch size
  (and, for a second feature `other`, checked to be equal) when the graph runs."""
  count = tf.shape(texts)[0]
  checks = [tf.debugging.assert_less_equal(
      count, batch_size, message=f"This SavedModel takes at most {batch_size} strings per request (the "
                                 f"batch size it was exported with, utils.run.batch_size); split the "
                                 f"request or export with a larger batch size. Strings sent:")]
  if other is not None:
    checks.append(tf.debugging.assert_equal(
        count, tf.shape(other)[0], message="`inputs` and `targets` must hold as many strings each:"))
  with tf.control_dependencies(checks):
    return tf.identity(count, name="request_size")


def pad_to_batch(texts: tf.Tensor, count: tf.Tensor, batch_size: int) -> tf.Tensor:
  """[count] strings -> [batch_size] strings, padded with empty strings."""
  padded = tf.concat([texts, tf.fill([batch_size - count], "")], 0)
  return tf.reshape(padded, [batch_size])


def encode_batch(vocabulary, texts: tf.Tensor, length: int, append_eos: bool, is_prompt: bool) -> tf.Tensor:
  """[batch] strings -> [batch, length] int32 ids, zero padded, cut by decode.fit_to_length."""
  def encode_one(text):
    ids = vocabulary.encode_tf(text)
    if append_eos:
      ids = tf.concat([ids, [decode.EOS_ID]], 0)
    ids = decode.fit_to_length(ids, length, is_prompt)
    return tf.pad(ids, [[0, length - tf.shape(ids)[0]]])
  ids = tf.map_fn(encode_one, texts, fn_output_signature=tf.int32)
  return tf.reshape(ids, [texts.shape[0], length])


def decode_batch(vocabulary, ids: tf.Tensor, count: tf.Tensor) -> tf.Tensor:
  """The first `count` rows of [batch, length] ids as strings (the vocabulary's `decode_tf`)."""
  return tf.map_fn(vocabulary.decode_tf, ids[:count], fn_output_signature=tf.string)
