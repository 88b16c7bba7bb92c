"""mtf.layers embeddings: embedding_weights variables and embedding lookups."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, mesh_and_layout
from tests.layers.layer_check import check_layer, run_layer, shape_keyed_initializer

SIZES = {"batch": 4, "length": 2, "vocab": 8, "d_model": 4}
IDS = np.random.RandomState(0).randint(0, 8, size=(4, 2)).astype(np.int32)
IDS_SHAPE = "batch:4;length:2"
VOCAB = mtf.Dimension("vocab", 8)
D_MODEL = mtf.Dimension("d_model", 4)
VARIABLE_DTYPE = mtf.VariableDType(tf.float32)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), mode=st.sampled_from(MODES))
def test_embedding_gathers_rows_and_scatters_gradients_under_any_layout(data, mode):
  mesh_shape, layout = data.draw(mesh_and_layout(SIZES))
  result = check_layer(lambda ids: mtf.layers.embedding(ids, VOCAB, D_MODEL, VARIABLE_DTYPE, name="emb"),
                       lambda ids, variables: tf.gather(variables["emb"], ids), [(IDS, IDS_SHAPE)],
                       mesh_shape, layout, mode)
  assert result.shapes == {"emb": mtf.Shape([VOCAB, D_MODEL])}


@pytest.mark.parametrize("ensemble_dim", [mtf.Dimension("ensemble", 2), [mtf.Dimension("ensemble", 2)]])
def test_embedding_weights_have_leading_ensemble_dims(ensemble_dim):
  holder = {}

  def layer(ids):
    holder["w"] = mtf.layers.embedding_weights(ids.mesh, VOCAB, D_MODEL, VARIABLE_DTYPE,
                                               ensemble_dim=ensemble_dim)
    return mtf.gather(holder["w"], ids, VOCAB)
  result = run_layer(layer, [(IDS, IDS_SHAPE)], grads=False)
  assert result.shapes == {"embedding": mtf.Shape([mtf.Dimension("ensemble", 2), VOCAB, D_MODEL])}
  # gather puts the indices' dims first: [batch, length, ensemble, d_model].
  np.testing.assert_allclose(result.y, np.moveaxis(result.variables["embedding"][:, IDS], 0, 2))


def test_embedding_weights_default_to_random_normal_initializer_looked_up_at_call_time():
  table = np.arange(32, dtype=np.float32).reshape(8, 4)
  with mock.patch.object(tf, "random_normal_initializer", autospec=True,
                         return_value=shape_keyed_initializer({(8, 4): table})) as patched:
    result = run_layer(lambda ids: mtf.layers.embedding(ids, VOCAB, D_MODEL, VARIABLE_DTYPE),
                       [(IDS, IDS_SHAPE)], grads=False)
  patched.assert_called_once_with()
  np.testing.assert_array_equal(result.y, table[IDS])


@pytest.mark.parametrize("mode", MODES)
def test_embedding_in_bfloat16_activations_returns_bfloat16_rows(mode):
  variable_dtype = mtf.VariableDType(tf.float32, tf.bfloat16, tf.bfloat16)
  result = run_layer(lambda ids: mtf.layers.embedding(ids, VOCAB, D_MODEL, variable_dtype, name="emb"),
                     [(IDS, IDS_SHAPE)], "all:2", "vocab:all", mode, grads=False)
  assert result.y.dtype == tf.bfloat16.as_numpy_dtype
  np.testing.assert_array_equal(result.y, result.variables["emb"][IDS])
