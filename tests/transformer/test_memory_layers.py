"""Product-key memory: top-k product-key search against brute force, the layer against plain TF."""

from __future__ import annotations

import types

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import memory_layers
from tests.harness import MODES, lower_and_evaluate
from tests.layers.layer_check import check_layer

RNG = np.random.RandomState(0)
KEY_SIZE, N_KEYS, N_HEADS, KNN = 6, 4, 4, 3
BATCH, LENGTH, D_MODEL = 4, 2, 8
X = RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)
X_SHAPE = "batch:%d;length:%d;d_model:%d" % (BATCH, LENGTH, D_MODEL)


def test_get_indices_finds_the_best_product_keys_by_brute_force():
  keys = RNG.randn(N_HEADS, 2, N_KEYS, KEY_SIZE // 2).astype(np.float32)
  query = RNG.randn(BATCH, LENGTH, N_HEADS, 2, KEY_SIZE // 2).astype(np.float32)
  head, key = "n_heads:%d" % N_HEADS, "key:%d" % (KEY_SIZE // 2)

  def build(mesh):
    k = mtf.import_tf_tensor(mesh, tf.constant(keys), "%s;product_key:2;n_keys:%d;%s" % (head, N_KEYS, key))
    q = mtf.import_tf_tensor(mesh, tf.constant(query), "batch:%d;length:%d;%s;product_key:2;%s"
                             % (BATCH, LENGTH, head, key))
    return memory_layers.ProductKeyValueMemory(KEY_SIZE, N_KEYS, N_HEADS, KNN).get_indices(k, q)

  scores, indices = lower_and_evaluate(build)
  half = np.einsum("blhpk,hpnk->blhpn", query, keys)
  product = half[..., 0, :, None] + half[..., 1, None, :]  # [b, l, h, n1, n2]
  flat = product.reshape(BATCH, LENGTH, N_HEADS, N_KEYS * N_KEYS)
  best = np.argsort(-flat, axis=-1)[..., :KNN]
  np.testing.assert_array_equal(indices, best)
  np.testing.assert_allclose(scores, np.take_along_axis(flat, best, -1), rtol=1e-5)


def _layer_norm(x, scale, bias, epsilon=1e-6):
  mean = tf.reduce_mean(x, -1, keepdims=True)
  variance = tf.reduce_mean(tf.square(x - mean), -1, keepdims=True)
  return (x - mean) * tf.rsqrt(variance + epsilon) * scale + bias


def _reference(x, variables):
  """The memory layer in plain TF: query, layer norm, product-key top-k, softmax-weighted values."""
  query = tf.einsum("bld,dhpk->blhpk", x, variables["query/kernel"]) + variables["query/bias"]
  query = _layer_norm(query, variables["layer_prepostprocess/layer_norm/layer_norm_scale"],
                      variables["layer_prepostprocess/layer_norm/layer_norm_bias"])
  half_scores = tf.einsum("blhpk,hpnk->blhpn", query, variables["keys"])
  top_scores, top_indices = tf.math.top_k(half_scores, KNN)  # [b, l, h, 2, knn]
  pair_scores = top_scores[..., 0, :, None] + top_scores[..., 1, None, :]
  pair_indices = top_indices[..., 0, :, None] * N_KEYS + top_indices[..., 1, None, :]
  shape = [BATCH, LENGTH, N_HEADS, KNN * KNN]
  scores, best = tf.math.top_k(tf.reshape(pair_scores, shape), KNN)
  indices = tf.gather(tf.reshape(pair_indices, shape), best, batch_dims=3)
  weights = tf.nn.softmax(scores)
  return tf.einsum("blhn,blhnd->bld", weights, tf.gather(variables["values"], indices))


def _context(mesh, variable_dtype):
  return types.SimpleNamespace(mesh=mesh, variable_dtype=variable_dtype)


def _layer(variable_dtype=mtf.VariableDType(tf.float32, tf.float32, tf.float32)):
  memory = memory_layers.ProductKeyValueMemory(key_size=KEY_SIZE, n_keys=N_KEYS, n_heads=N_HEADS, knn=KNN)
  return lambda x: memory.call(_context(x.mesh, variable_dtype), x)


@pytest.mark.parametrize("mesh_shape,layout,mode", [
    ("all:1", "", "graph"),
    ("all:4", "batch:all", "eager"),
    ("batch:2;model:4", "batch:batch;n_heads:model", "graph"),
    ("batch:2;model:4", "batch:batch;n_values:model", "graph"),
])
def test_memory_layer_output_and_gradients_match_tf(mesh_shape, layout, mode):
  result = check_layer(_layer(), _reference, [(X, X_SHAPE)], mesh_shape, layout, mode)
  assert {k: s.to_integer_list for k, s in result.shapes.items()} == {
      "keys": [N_HEADS, 2, N_KEYS, KEY_SIZE // 2], "values": [N_KEYS ** 2, D_MODEL],
      "query/kernel": [D_MODEL, N_HEADS, 2, KEY_SIZE // 2], "query/bias": [N_HEADS, 2, KEY_SIZE // 2],
      "layer_prepostprocess/layer_norm/layer_norm_scale": [KEY_SIZE // 2],
      "layer_prepostprocess/layer_norm/layer_norm_bias": [KEY_SIZE // 2]}


@pytest.mark.parametrize("mode", MODES)
def test_memory_layer_accepts_a_plain_tf_dtype_as_variable_dtype(mode):
  layer = _layer(tf.float32)
  (y,) = lower_and_evaluate(lambda mesh: [layer(mtf.import_tf_tensor(mesh, tf.constant(X), X_SHAPE))],
                            mode=mode)
  assert y.shape == X.shape and np.isfinite(y).all()


def test_knn_larger_than_n_keys_is_rejected():
  with pytest.raises(ValueError, match="knn=6 must be in"):
    memory_layers.ProductKeyValueMemory(key_size=4, n_keys=5, n_heads=1, knn=6)
