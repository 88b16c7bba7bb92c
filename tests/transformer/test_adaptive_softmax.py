"""Adaptive softmax: embeddings, full log-probabilities and the cluster-wise loss against NumPy/TF."""

from __future__ import annotations

import types

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import adaptive_softmax, transformer, transformer_layers
from tests.harness import lower_and_evaluate
from tests.layers.layer_check import check_layer

RNG = np.random.RandomState(0)
VOCAB, D_MODEL, BATCH, LENGTH = 8, 4, 4, 4
VOCAB_DIM = mtf.Dimension("vocab", VOCAB)
MODEL_DIM = mtf.Dimension("d_model", D_MODEL)
VDTYPE = mtf.VariableDType(tf.float32, tf.float32, tf.float32)
HIDDEN = RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)
HIDDEN_SHAPE = "batch:%d;length:%d;d_model:%d" % (BATCH, LENGTH, D_MODEL)
# Head: ids 0-2 (+2 placeholders); tail 1: ids 3-5 factorised through 2; tail 2: ids 6-7.
CLUSTERS = [{"token_count": 3}, {"token_count": 3, "embedding_size": 2}, {"token_count": 2}]
TARGETS = np.array([[1, 4, 6, 0], [3, 5, 2, 7], [6, 7, 6, 1], [4, 3, 5, 0]], np.int32)
TARGETS_SHAPE = "batch:%d;length:%d" % (BATCH, LENGTH)
DENOMINATOR = 13.0
DECODER = types.SimpleNamespace(z_loss=0.0, loss_denominator=lambda targets, num_microbatches: DENOMINATOR)


def _context(mode, embedding=None):
  return types.SimpleNamespace(mode=mode, train=mode == "train", activation_dtype=tf.float32,
                               num_microbatches=1, shared_params={"embedding": embedding})


def _make(mesh, clusters=CLUSTERS):
  return adaptive_softmax.AdaptiveSoftmaxVocabEmbedding(mesh, VOCAB_DIM, MODEL_DIM, VDTYPE, "embedding", None,
                                                       clusters=clusters)


def _log_probs_reference(hidden, variables):
  """log p(token) = log p_head(cluster) + log p_tail(token | cluster), in plain TF."""
  h = hidden * D_MODEL ** -0.5
  head = tf.nn.log_softmax(tf.einsum("bld,vd->blv", h, variables["embedding_0"]))
  tail1 = tf.nn.log_softmax(
      tf.einsum("bld,id,vi->blv", h, variables["embedding_12"], variables["embedding_11"]))
  tail2 = tf.nn.log_softmax(tf.einsum("bld,vd->blv", h, variables["embedding_2"]))
  return tf.concat([head[..., :3], head[..., 3:4] + tail1, head[..., 4:5] + tail2], -1)


def test_clusters_create_head_with_placeholders_and_factorised_tails():
  mesh = mtf.Mesh(mtf.Graph(), "my_mesh")
  _make(mesh)
  shapes = {v.name: v.shape.to_integer_list for v in mesh.graph.all_variables}
  assert shapes == {"embedding_0": [5, D_MODEL], "embedding_11": [3, 2], "embedding_12": [2, D_MODEL],
                    "embedding_2": [2, D_MODEL]}


def test_ids_to_embedding_uses_each_clusters_table_and_never_the_placeholders():
  def build(mesh):
    embedding = _make(mesh)
    ids = mtf.import_tf_tensor(mesh, tf.constant(TARGETS), TARGETS_SHAPE)
    return [embedding.ids_to_embedding(ids, None)] + [v.outputs[0] for v in mesh.graph.all_variables]

  embedded, head, tail1, tail1_proj, tail2 = lower_and_evaluate(build)
  table = np.concatenate([head[:3], tail1 @ tail1_proj, tail2])
  np.testing.assert_allclose(embedded, table[TARGETS], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh_shape,layout", [("all:1", ""), ("all:4", "batch:all"),
                                               ("batch:2;model:4", "batch:batch;d_model:model")])
def test_eval_logits_are_the_factorised_log_probabilities(mesh_shape, layout):
  def layer(hidden):
    return _make(hidden.mesh).hidden_to_logits(hidden, _context("eval"))

  result = check_layer(layer, _log_probs_reference, [(HIDDEN, HIDDEN_SHAPE)], mesh_shape, layout)
  np.testing.assert_allclose(np.exp(result.y).sum(-1), 1.0, rtol=1e-5)


def test_train_mode_logits_are_the_hidden_state():
  def build(mesh):
    hidden = mtf.import_tf_tensor(mesh, tf.constant(HIDDEN), HIDDEN_SHAPE)
    return [_make(mesh).hidden_to_logits(hidden, _context("train"))]

  np.testing.assert_array_equal(lower_and_evaluate(build)[0], HIDDEN)


def _loss_reference(targets, keep=None):
  """Sum over nonzero targets of -log p(target) / DENOMINATOR, from the full log-probabilities.

  keep: optional 0/1 [batch, length] of positions whose tail-cluster term is scored.
  """
  def reference(hidden, variables):
    log_probs = _log_probs_reference(hidden, variables)
    nll = -tf.reduce_sum(log_probs * tf.one_hot(targets, VOCAB), -1)
    if keep is not None:  # dropped positions keep only the head (cluster-choice) term
      h = hidden * D_MODEL ** -0.5
      head = tf.nn.log_softmax(tf.einsum("bld,vd->blv", h, variables["embedding_0"]))
      head_target = np.where(targets >= 6, 4, np.where(targets >= 3, 3, targets))
      head_nll = -tf.reduce_sum(head * tf.one_hot(head_target, 5), -1)
      nll = tf.where(tf.constant(keep.astype(bool)), nll, head_nll)
    return tf.reduce_sum(nll * tf.cast(targets > 0, tf.float32)) / DENOMINATOR
  return reference


def _loss_layer(clusters=CLUSTERS, through_loss_fn=False):
  def layer(hidden):
    mesh = hidden.mesh
    embedding = _make(mesh, clusters)
    targets = mtf.import_tf_tensor(mesh, tf.constant(TARGETS), TARGETS_SHAPE)
    context = _context("train", embedding)
    if through_loss_fn:
      logits = embedding.hidden_to_logits(hidden, context)
      return adaptive_softmax.adaptive_softmax_loss_fn(DECODER, context, logits, targets, VOCAB_DIM)
    return embedding.compute_loss(DECODER, hidden, targets, context)
  return layer


@pytest.mark.parametrize("mesh_shape,layout", [("all:1", ""),
                                               ("batch:2;model:4", "batch:batch;d_model:model")])
def test_training_loss_equals_full_softmax_cross_entropy(mesh_shape, layout):
  check_layer(_loss_layer(through_loss_fn=True), _loss_reference(TARGETS), [(HIDDEN, HIDDEN_SHAPE)],
              mesh_shape, layout)


def test_length_projection_scores_only_the_first_in_cluster_positions():
  # Tail 1 (ids 3-5) keeps the first 2 of each row's in-cluster positions (factor 0.5 of 4).
  clusters = [CLUSTERS[0], dict(CLUSTERS[1], length_projection_factor=0.5), CLUSTERS[2]]
  keep = np.ones_like(TARGETS)
  for b in range(BATCH):
    in_cluster = [i for i in range(LENGTH) if 3 <= TARGETS[b, i] < 6]
    for i in in_cluster[2:]:
      keep[b, i] = 0
  assert keep.sum() < keep.size  # the case drops something: row 3 has three tail-1 targets
  check_layer(_loss_layer(clusters), _loss_reference(TARGETS, keep), [(HIDDEN, HIDDEN_SHAPE)])


def test_loss_fn_needs_the_adaptive_embedding_in_shared_params():
  with pytest.raises(ValueError, match="not an AdaptiveSoftmaxVocabEmbedding"):
    adaptive_softmax.adaptive_softmax_loss_fn(DECODER, _context("train"), None, None, VOCAB_DIM)


@pytest.mark.parametrize("clusters,message", [
    ([{"token_count": 3}, {"token_count": 3}], r"sum to 6, not to the vocab size 8"),
    ([{"token_count": 4}, {"token_count": 4, "length_projection_factor": 0}], r"length_projection_factor=0 "),
    ([{"token_count": 4}, {"token_count": 4, "length_projection_factor": 1.5}], r"must be in \(0, 1\]"),
])
def test_bad_clusters_raise_value_error(clusters, message):
  with pytest.raises(ValueError, match=message):
    _make(mtf.Mesh(mtf.Graph(), "my_mesh"), clusters)


def test_unitransformer_training_loss_equals_eval_cross_entropy_of_its_log_probabilities():
  """In "train" the model's logits are hidden states scored by adaptive_softmax_loss_fn; in "eval"
  they are full log-probabilities scored by the ordinary cross-entropy: the losses agree."""
  layer = transformer_layers.DenseReluDense(hidden_size=8)
  layer.set_name("layer_000")
  model = transformer.Unitransformer(
      layer_stack=transformer.LayerStack([layer]), d_model=D_MODEL, input_vocab_size=VOCAB,
      output_vocab_size=VOCAB, autoregressive=True, max_length=LENGTH, vocab_divisor=VOCAB, z_loss=0.0,
      shared_embedding_and_softmax_weights=True, loss_fn=adaptive_softmax.adaptive_softmax_loss_fn)

  def build(mesh):
    targets = mtf.import_tf_tensor(mesh, tf.constant(TARGETS), TARGETS_SHAPE)
    inputs = transformer.autoregressive_inputs(targets)
    with tf.variable_scope("transformer"):
      embedding = _make(mesh)
    losses = []
    for mode in ("train", "eval"):
      model.loss_fn = adaptive_softmax.adaptive_softmax_loss_fn if mode == "train" else None
      _, loss = model.call_simple(inputs, targets, True, mode=mode, variable_dtype=VDTYPE,
                                  shared_params={"embedding": embedding})
      losses.append(loss)
    return losses

  train_loss, eval_loss = lower_and_evaluate(build)
  np.testing.assert_allclose(train_loss, eval_loss, rtol=1e-5)
  assert train_loss > 0
