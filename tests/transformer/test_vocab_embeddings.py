"""Vocab embeddings: factorised, adaptive, mixture of softmaxes and Mixtape against plain TF."""

from __future__ import annotations

import types
from unittest import mock

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer, transformer_layers, vocab_embeddings
from tests.harness import lower_and_evaluate
from tests.layers.layer_check import check_layer, shape_keyed_initializer
from tests.transformer.model_check import gin_config

RNG = np.random.RandomState(0)
VOCAB, D_MODEL = 8, 4
VOCAB_DIM = mtf.Dimension("vocab", VOCAB)
MODEL_DIM = mtf.Dimension("d_model", D_MODEL)
VDTYPE = mtf.VariableDType(tf.float32, tf.float32, tf.float32)
HIDDEN = RNG.randn(4, 3, D_MODEL).astype(np.float32)
HIDDEN_SHAPE = "batch:4;length:3;d_model:%d" % D_MODEL
IDS = np.array([[0, 3, 7], [5, 1, 4], [2, 6, 0], [7, 7, 1]], np.int32)
IDS_SHAPE = "batch:4;length:3"
EVAL = types.SimpleNamespace(train=False, mode="eval")
LAYOUTS = [
    ("all:1", ""),
    ("all:4", "batch:all"),
    ("all:4", "vocab:all"),
    ("batch:2;model:4", "batch:batch;d_model:model"),
]


def _build(cls, **kwargs):
  def make(mesh):
    return cls(mesh, VOCAB_DIM, MODEL_DIM, VDTYPE, "embedding", None, **kwargs)
  return make


def _logits_layer(make, context=EVAL):
  return lambda hidden: make(hidden.mesh).hidden_to_logits(hidden, context)


def _embedding_values(make, ids=IDS):
  def build(mesh):
    embedding = make(mesh)
    out = embedding.ids_to_embedding(mtf.import_tf_tensor(mesh, tf.constant(ids), IDS_SHAPE), None)
    return [out] + [v.outputs[0] for v in mesh.graph.all_variables]
  values = lower_and_evaluate(build)
  return values[0], values[1:]


def test_factorized_embedding_and_logits_with_fixed_initial_values():
  factor1 = np.arange(VOCAB * 2, dtype=np.float32).reshape(VOCAB, 2) / 10
  factor2 = np.array([[1, 0, 2, 0], [0, 1, 0, -1]], np.float32)
  values = {(VOCAB, 2): factor1, (2, D_MODEL): factor2}
  with mock.patch.object(tf, "random_normal_initializer", return_value=shape_keyed_initializer(values)):
    make = _build(vocab_embeddings.FactorizedVocabEmbedding, inner_dimension_size=2)
    embedded, _ = _embedding_values(make)

    def build(mesh):
      hidden = mtf.import_tf_tensor(mesh, tf.constant(HIDDEN), HIDDEN_SHAPE)
      return [make(mesh).hidden_to_logits(hidden, None)]

    (logits,) = lower_and_evaluate(build)
  np.testing.assert_allclose(embedded, factor1[IDS] @ factor2, rtol=1e-6)
  np.testing.assert_allclose(logits, HIDDEN / 2 @ factor2.T @ factor1.T, rtol=1e-5)


def test_factorized_embedding_with_an_upstream_style_mock_initializer():
  """Upstream's tests patch tf.random_normal_initializer to return a MagicMock called as (shape, dtype)."""
  def initialize(shape, dtype):
    values = {(3, 1): [[1], [2], [3]], (1, 2): [[1, 2]]}
    return tf.reshape(tf.constant(values[tuple(shape)], dtype=dtype), shape)

  initializer = mock.MagicMock(side_effect=initialize)
  with mock.patch.object(tf, "random_normal_initializer", return_value=initializer):
    def build(mesh):
      ids = mtf.import_tf_tensor(mesh, tf.constant([0, 1, 2, 1]), "length:4")
      embedding = vocab_embeddings.FactorizedVocabEmbedding(
          mesh, mtf.Dimension("vocab", 3), mtf.Dimension("model", 2), VDTYPE, "embedding", None,
          inner_dimension_size=1)
      return [embedding.ids_to_embedding(ids, None)]

    (embedded,) = lower_and_evaluate(build)
  np.testing.assert_allclose(embedded, [[1, 2], [2, 4], [3, 6], [2, 4]])


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_factorized_logits_and_gradients_match_tf(mesh_shape, layout):
  make = _build(vocab_embeddings.FactorizedVocabEmbedding, inner_dimension_size=2)

  def reference(hidden, variables):
    return tf.einsum("bld,id,vi->blv", hidden * D_MODEL ** -0.5, variables["embedding2"],
                     variables["embedding1"])

  result = check_layer(_logits_layer(make), reference, [(HIDDEN, HIDDEN_SHAPE)], mesh_shape, layout)
  assert result.shapes["embedding1"].to_integer_list == [VOCAB, 2]
  assert result.shapes["embedding2"].to_integer_list == [2, D_MODEL]
  np.testing.assert_allclose(np.std(result.variables["embedding1"]), 2 ** -0.25, rtol=0.6)


def test_adaptive_embedding_uses_each_clusters_table_and_concatenates_logits():
  clusters = [{"token_count": 3, "embedding_size": D_MODEL}, {"token_count": 5, "embedding_size": 2}]
  make = _build(vocab_embeddings.AdaptiveVocabEmbedding, clusters=clusters)
  embedded, variables = _embedding_values(make)
  head, tail1, tail2 = variables  # embedding_0 [3, d], embedding_11 [5, 2], embedding_12 [2, d]
  assert head.shape == (3, D_MODEL) and tail1.shape == (5, 2) and tail2.shape == (2, D_MODEL)
  table = np.concatenate([head, tail1 @ tail2])
  np.testing.assert_allclose(embedded, table[IDS], rtol=1e-5, atol=1e-6)

  def reference(hidden, variables):
    head_logits = tf.einsum("bld,vd->blv", hidden * D_MODEL ** -0.5, variables["embedding_0"])
    tail_logits = tf.einsum("bld,id,vi->blv", hidden * D_MODEL ** -0.5, variables["embedding_12"],
                            variables["embedding_11"])
    return tf.concat([head_logits, tail_logits], -1)

  check_layer(_logits_layer(make), reference, [(HIDDEN, HIDDEN_SHAPE)])


def test_adaptive_embedding_rejects_clusters_not_covering_the_vocabulary():
  with pytest.raises(ValueError, match=r"token counts \[3, 4\] sum to 7, not to the vocab size 8"):
    _embedding_values(_build(vocab_embeddings.AdaptiveVocabEmbedding, clusters=[
        {"token_count": 3, "embedding_size": 4}, {"token_count": 4, "embedding_size": 2}]))


def _mos_reference(hidden, variables):
  hidden = hidden * D_MODEL ** -0.5
  prior = tf.nn.log_softmax(tf.einsum("bld,kd->blk", hidden, variables["embedding_mixture_weights"]))
  contexts = tf.tanh(tf.einsum("blc,kcd->blkd", hidden, variables["embedding_context_weights"]))
  component = tf.nn.log_softmax(
      tf.einsum("blkd,vd->blkv", contexts, variables["embedding_embedding_weights"]))
  return tf.reduce_logsumexp(prior[..., None] + component, axis=2)


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_mixture_of_softmaxes_logits_and_gradients_match_tf(mesh_shape, layout):
  make = _build(vocab_embeddings.MixtureOfSoftmaxes, num_softmaxes=3)
  result = check_layer(_logits_layer(make), _mos_reference, [(HIDDEN, HIDDEN_SHAPE)], mesh_shape, layout)
  assert result.shapes["embedding_context_weights"].to_integer_list == [3, D_MODEL, D_MODEL]
  np.testing.assert_allclose(np.exp(result.y).sum(-1), 1.0, rtol=1e-5)  # a normalised distribution


def test_mixture_of_softmaxes_embeds_with_its_table():
  embedded, variables = _embedding_values(_build(vocab_embeddings.MixtureOfSoftmaxes, num_softmaxes=2))
  np.testing.assert_allclose(embedded, variables[0][IDS])


def _sigmoid_tree(gate_logits):
  """[..., 3] -> [..., 4] gate weights."""
  s = tf.sigmoid(gate_logits)
  return tf.stack([s[..., 0] * s[..., 1], s[..., 0] * (1 - s[..., 1]),
                   (1 - s[..., 0]) * s[..., 2], (1 - s[..., 0]) * (1 - s[..., 2])], -1)


def _mixtape_reference(frequent: int, extra_ids: int):
  """The Mixtape formulas in plain TF, with the vocabulary reordered sentinels-first by index."""
  order = list(range(VOCAB - extra_ids, VOCAB)) + list(range(VOCAB - extra_ids))  # position -> token

  def reference(hidden, variables):
    v = lambda name: variables["embedding_" + name]
    h = hidden * D_MODEL ** -0.5
    contexts = tf.tanh(tf.einsum("blc,kcd->blkd", h, v("context_weights")) + v("context_weights_bias"))
    component_logits = tf.einsum("blkd,vd->blkv", contexts, v("embedding_weights"))  # token order
    shared = tf.einsum("bld,kd->blk", h, v("prior_gates_vector"))  # u_k . h
    prior = tf.tanh(tf.einsum("bld,ked->blke", h, v("prior_weights")) + v("prior_weights_bias"))
    frequent_gate_logits = (tf.einsum("blke,fe->blfk", prior, v("prior_vocab_vector"))
                            + v("prior_bias") + shared[:, :, None, :])  # [b, l, frequent, 3]
    columns = []
    for position, token in enumerate(order):
      gate_logits = frequent_gate_logits[:, :, position] if position < frequent else shared
      columns.append((token, tf.reduce_sum(_sigmoid_tree(gate_logits) * component_logits[..., token], -1)))
    return tf.stack([c for _, c in sorted(columns, key=lambda tc: tc[0])], -1)

  return reference


@pytest.mark.parametrize("extra_ids,fraction", [(0, 0.5), (2, 0.25), (0, 0.0), (3, 1.0)])
def test_mixtape_logits_and_gradients_match_tf(extra_ids, fraction):
  make = _build(vocab_embeddings.Mixtape, gate_embedding_size=3, extra_ids=extra_ids,
                frequent_token_fraction=fraction)
  result = check_layer(_logits_layer(make), _mixtape_reference(int(fraction * VOCAB), extra_ids),
                       [(HIDDEN, HIDDEN_SHAPE)])
  expected_shapes = {
      "embedding_embedding_weights": [VOCAB, D_MODEL], "embedding_context_weights": [4, D_MODEL, D_MODEL],
      "embedding_context_weights_bias": [4, D_MODEL], "embedding_prior_weights": [3, 3, D_MODEL],
      "embedding_prior_weights_bias": [3, 3], "embedding_prior_vocab_vector": [int(fraction * VOCAB), 3],
      "embedding_prior_gates_vector": [3, D_MODEL], "embedding_prior_bias": [int(fraction * VOCAB), 3]}
  assert {k: s.to_integer_list for k, s in result.shapes.items()} == expected_shapes


@pytest.mark.parametrize("mesh_shape,layout,mode", [LAYOUTS[1] + ("eager",), LAYOUTS[3] + ("graph",)])
def test_mixtape_under_layouts_matches_tf(mesh_shape, layout, mode):
  make = _build(vocab_embeddings.Mixtape, gate_embedding_size=3, extra_ids=2, frequent_token_fraction=0.5)
  check_layer(_logits_layer(make), _mixtape_reference(4, 2), [(HIDDEN, HIDDEN_SHAPE)], mesh_shape, layout,
              mode)


def test_mixtape_with_vocab_split_fails_at_lowering_naming_the_rule():
  """Mixtape splits the vocab dim into frequent and rare tokens, so it must be whole per processor."""
  make = _build(vocab_embeddings.Mixtape, gate_embedding_size=3, frequent_token_fraction=0.5)
  with pytest.raises(ValueError, match="Remove the layout rule vocab:all"):
    check_layer(_logits_layer(make), _mixtape_reference(4, 0), [(HIDDEN, HIDDEN_SHAPE)], *LAYOUTS[2])


def test_mixtape_noise_and_dropout_apply_only_in_training():
  make = _build(vocab_embeddings.Mixtape, gate_embedding_size=3, dropout_rate=0.5, noise_std_dev=1.0)

  def build(mesh):
    embedding = make(mesh)
    hidden = mtf.import_tf_tensor(mesh, tf.constant(HIDDEN), HIDDEN_SHAPE)
    train = types.SimpleNamespace(train=True, mode="train")
    return [embedding.hidden_to_logits(hidden, EVAL), embedding.hidden_to_logits(hidden, EVAL),
            embedding.hidden_to_logits(hidden, train)]

  eval_1, eval_2, train = lower_and_evaluate(build)
  np.testing.assert_array_equal(eval_1, eval_2)
  assert np.abs(train - eval_1).max() > 1e-3


def test_mixtape_rejects_bad_fractions():
  with pytest.raises(ValueError, match="frequent_token_fraction=1.5"):
    _embedding_values(_build(vocab_embeddings.Mixtape, gate_embedding_size=3, frequent_token_fraction=1.5))


@pytest.mark.parametrize("binding,names", [
    ("get_vocab_embedding_cls.cls = @vocab_embeddings.FactorizedVocabEmbedding\n"
     "vocab_embeddings.FactorizedVocabEmbedding.inner_dimension_size = 2",
     {"embedding1", "embedding2"}),
    ("get_vocab_embedding_cls.cls = @vocab_embeddings.MixtureOfSoftmaxes\n"
     "vocab_embeddings.MixtureOfSoftmaxes.num_softmaxes = 2",
     {"embedding_embedding_weights", "embedding_mixture_weights", "embedding_context_weights"}),
])
def test_gin_selects_the_vocab_embedding_of_a_unitransformer(binding, names):
  with gin_config("import mesh_tensorflow.transformer.vocab_embeddings\n" + binding):
    layer = transformer_layers.DenseReluDense(hidden_size=8)
    layer.set_name("layer_000")
    model = transformer.Unitransformer(
        layer_stack=transformer.LayerStack([layer]), d_model=D_MODEL, input_vocab_size=VOCAB,
        output_vocab_size=VOCAB, autoregressive=True, max_length=3, vocab_divisor=VOCAB,
        shared_embedding_and_softmax_weights=True)

    def build(mesh):
      ids = mtf.import_tf_tensor(mesh, tf.constant(IDS), IDS_SHAPE)
      logits, loss = model.call_simple(ids, ids, True, mode="eval", variable_dtype=VDTYPE)
      found = {v.name.split("/")[-1] for v in mesh.graph.all_variables if v.name.count("/") == 1}
      assert names <= found, found
      return [logits, loss]

    logits, loss = lower_and_evaluate(build)
  assert logits.shape == (4, 3, VOCAB) and np.isfinite(loss)
