"""mtf.layers losses: softmax / sigmoid cross-entropy and weights_nonzero."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, assert_op_matches_tf, lower_and_evaluate, mesh_and_layout
from tests.layers.layer_check import import_inputs

RNG = np.random.RandomState(0)
SIZES = {"batch": 4, "length": 2, "vocab": 8}
LOGITS = RNG.randn(4, 2, 8).astype(np.float32) * 3
LOGITS_SHAPE = "batch:4;length:2;vocab:8"
IDS = RNG.randint(0, 8, size=(4, 2)).astype(np.int32)
_EXP = np.exp(RNG.randn(4, 2, 8))
# SOFT is [vocab, batch, length]: distributions over the vocabulary, in another dim order than logits.
SOFT = np.transpose(_EXP / _EXP.sum(-1, keepdims=True), (2, 0, 1)).astype(np.float32)
VOCAB = mtf.Dimension("vocab", 8)


def _tf_xent_with_z_loss(z_loss):
  def fn(logits, ids):
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=ids, logits=logits)
    return loss + z_loss * tf.square(tf.reduce_logsumexp(logits, axis=-1))
  return fn


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), z_loss=st.sampled_from([0.0, 1e-2]), mode=st.sampled_from(MODES))
def test_softmax_cross_entropy_with_class_ids_matches_tf_under_any_layout(data, z_loss, mode):
  mesh_shape, layout = data.draw(mesh_and_layout(SIZES))
  assert_op_matches_tf(
      lambda logits, ids: mtf.layers.softmax_cross_entropy_with_logits(logits, ids, VOCAB, z_loss=z_loss),
      _tf_xent_with_z_loss(z_loss), [(LOGITS, LOGITS_SHAPE), (IDS, "batch:4;length:2")], mesh_shape, layout,
      mode, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_softmax_cross_entropy_with_soft_targets_in_another_dim_order_matches_tf(mode):
  def tf_fn(logits, soft):
    return tf.nn.softmax_cross_entropy_with_logits_v2(labels=tf.transpose(soft, [1, 2, 0]), logits=logits)
  assert_op_matches_tf(lambda logits, soft: mtf.layers.softmax_cross_entropy_with_logits(logits, soft, VOCAB),
                       tf_fn, [(LOGITS, LOGITS_SHAPE), (SOFT, "vocab:8;batch:4;length:2")],
                       "rows:2;cols:2", "vocab:rows;batch:cols", mode, rtol=1e-4, atol=1e-4)


def _build_xent(targets, targets_shape, vocab_dim=VOCAB):
  def build(mesh):
    logits, t = import_inputs(mesh, [(LOGITS, LOGITS_SHAPE), (targets, targets_shape)])
    return [mtf.layers.softmax_cross_entropy_with_logits(logits, t, vocab_dim)]
  return build


@pytest.mark.parametrize("targets,targets_shape,vocab_dim,match", [
    (IDS, "batch:4;length:2", mtf.Dimension("vocab", 9), "vocab_dim .* is not a dim of logits"),
    (IDS[:, 0], "batch:4", VOCAB, "integer .* targets .* must have the dims of logits"),
    (SOFT[:, :, 0], "vocab:8;batch:4", VOCAB, "soft targets .* must have the same dims as logits"),
])
def test_softmax_cross_entropy_rejects_mismatched_dims(targets, targets_shape, vocab_dim, match):
  with pytest.raises(ValueError, match=match):
    lower_and_evaluate(_build_xent(targets, targets_shape, vocab_dim))


@pytest.mark.parametrize("mode", MODES)
def test_sigmoid_cross_entropy_matches_tf(mode):
  labels = RNG.uniform(size=(4, 2, 8)).astype(np.float32)
  assert_op_matches_tf(mtf.layers.sigmoid_cross_entropy_with_logits,
                       lambda x, z: tf.nn.sigmoid_cross_entropy_with_logits(labels=z, logits=x),
                       [(LOGITS, LOGITS_SHAPE), (labels, LOGITS_SHAPE)], "all:4", "vocab:all", mode)


def test_sigmoid_cross_entropy_rejects_different_shapes():
  def build(mesh):
    logits, labels = import_inputs(mesh, [(LOGITS, LOGITS_SHAPE), (SOFT, "vocab:8;batch:4;length:2")])
    return [mtf.layers.sigmoid_cross_entropy_with_logits(logits, labels)]
  with pytest.raises(ValueError, match="must have the same shape"):
    lower_and_evaluate(build)


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_weights_nonzero_of_int_targets_is_float_indicator_with_no_variables(dtype, mode):
  ids = np.array([[3, 0], [0, 0], [1, 7], [0, 2]], np.int32)
  holder = {}

  def build(mesh):
    (t,) = import_inputs(mesh, [(ids, "batch:4;length:2")])
    w = mtf.layers.weights_nonzero(t, dtype=dtype)
    holder.update(dtype=w.dtype, op=w.operation.name, variables=mesh.graph.all_variables)
    return [w]
  (w,) = lower_and_evaluate(build, "all:2", "batch:all", mode)
  assert holder == {"dtype": dtype, "op": "weights_nonzero", "variables": []}
  np.testing.assert_array_equal(w, (ids != 0).astype(dtype.as_numpy_dtype))
