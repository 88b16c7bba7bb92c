"""Streaming eval metrics in the tf.metrics style: (value, update_op) over a local accumulator variable."""

from __future__ import annotations

import tensorflow.compat.v1 as tf


def _accumulator(name: str | None, default_name: str, values):
  with tf.variable_scope(name, default_name, [values]):
    return tf.get_variable("accum", shape=[], dtype=tf.float32, trainable=False,
                           collections=[tf.GraphKeys.LOCAL_VARIABLES], initializer=tf.zeros_initializer())


def metric_sum(values, name: str | None = None, **kwargs):
  """Running sum of `values` (cast to float32): returns (total, update_op)."""
  del kwargs  # tf.metrics-style extras (weights, ...) are not used
  accum = _accumulator(name, "metric_sum", values)
  return accum, tf.assign_add(accum, tf.reduce_sum(tf.cast(values, tf.float32)))


def metric_max(values, name: str | None = None, **kwargs):
  """Running maximum of `values` (cast to float32; starts at 0): returns (max, update_op)."""
  del kwargs  # tf.metrics-style extras (weights, ...) are not used
  accum = _accumulator(name, "metric_max", values)
  return accum, tf.assign(accum, tf.maximum(accum, tf.reduce_max(tf.cast(values, tf.float32))))
