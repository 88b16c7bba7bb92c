"""transformer_layers: DenseReluDense, SelfAttention, EncDecAttention, ParallelLayer and helpers.

Each layer is checked against a plain-TF computation of the same math from the layer's own
variable values (outputs and gradients w.r.t. inputs and variables), on one processor and
under data-parallel, model-parallel and 2-D layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf2
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer_layers
from tests.harness import lower_and_evaluate
from tests.layers.layer_check import check_layer
from tests.transformer.layer_context import (
    call_layer, causal_bias, make_context, model_stub, segment_bias, tf_multihead_attention, tf_project_heads,
    visibility_bias)
from tests.transformer.model_check import gin_config

RNG = np.random.RandomState(0)
BATCH, LENGTH, D_MODEL = 2, 6, 8
X_SHAPE = "batch:2;length:6;d_model:8"
LAYOUTS = [
    ("all:1", ""),
    ("batch:2", "batch:batch"),
    ("model:4", "heads:model;d_ff:model"),
    ("batch:2;model:4", "batch:batch;heads:model;d_ff:model"),
]


def _x():
  return RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_dense_relu_dense_is_relu_x_wi_wo_under_layouts(mesh_shape, layout):
  layer = transformer_layers.DenseReluDense(hidden_size=4)

  def build(x):
    return call_layer(layer, make_context(x, model_stub(D_MODEL)), x)

  def reference(x, variables):
    h = tf.nn.relu(tf.einsum("bld,df->blf", x, variables["layer/wi/kernel"]))
    return tf.einsum("blf,fd->bld", h, variables["layer/wo/kernel"])
  check_layer(build, reference, [(_x(), X_SHAPE)], mesh_shape, layout)


def test_dense_relu_dense_gated_activations_multiply_wi_0_and_wi_1():
  layer = transformer_layers.DenseReluDense(hidden_size=4, activation=["gelu", "linear"], use_bias=True)

  def build(x):
    return call_layer(layer, make_context(x, model_stub(D_MODEL)), x)

  def reference(x, variables):
    def wi(i):
      kernel, bias = variables["layer/wi_%d/kernel" % i], variables["layer/wi_%d/bias" % i]
      return tf.einsum("bld,df->blf", x, kernel) + bias
    h = tf2.nn.gelu(wi(0), approximate=True) * wi(1)
    return tf.einsum("blf,fd->bld", h, variables["layer/wo/kernel"]) + variables["layer/wo/bias"]
  result = check_layer(build, reference, [(_x(), X_SHAPE)], "model:2", "d_ff:model")
  assert sorted(result.variables) == ["layer/wi_0/bias", "layer/wi_0/kernel", "layer/wi_1/bias",
                                      "layer/wi_1/kernel", "layer/wo/bias", "layer/wo/kernel"]


def test_dense_relu_dense_dropout_only_in_training():
  layer = transformer_layers.DenseReluDense(hidden_size=16, dropout_rate=0.5)

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(_x()), shape=X_SHAPE)
    outs = []
    for mode in ("train", "eval"):
      with tf.variable_scope("layer", reuse=tf.AUTO_REUSE):
        outs.append(layer.call(make_context(x, model_stub(D_MODEL), mode=mode), x))
    return outs
  train, evaluation = lower_and_evaluate(build)
  assert not np.allclose(train, evaluation)


# T5 buckets, computed by hand: bidirectional 32 buckets = 16 per side, 8 exact, then
# 8 + int(log(n / 8) / log(128 / 8) * 8); unidirectional: 16 exact, 16 + int(log(n / 16) / log(8) * 16).
BUCKET_CASES = [
    (True, [0, -1, -7, -8, -12, -16, -20, -32, -64, -127, -1000, 1, 12, 500],
     [0, 1, 7, 8, 9, 10, 10, 12, 14, 15, 15, 17, 25, 31]),
    (False, [5, 0, -3, -15, -16, -40, -200], [0, 0, 3, 15, 16, 23, 31]),
]


@pytest.mark.parametrize("bidirectional,relative_positions,expected", BUCKET_CASES)
def test_relative_position_bucket_matches_hand_computed_t5_buckets(bidirectional, relative_positions,
                                                                  expected):
  def build(mesh):
    rp = mtf.constant(mesh, np.array(relative_positions, np.int32),
                      mtf.Shape([mtf.Dimension("n", len(expected))]), dtype=tf.int32)
    return [transformer_layers._relative_position_bucket(rp, bidirectional=bidirectional)]
  bucket, = lower_and_evaluate(build)
  np.testing.assert_array_equal(bucket, expected)


def _np_bucket(relative_position: np.ndarray, bidirectional: bool, num_buckets: int = 32,
               max_distance: int = 128) -> np.ndarray:
  """The T5 bucket formula in NumPy (for reference biases; the exact values are tested above)."""
  n = -relative_position
  ret = np.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    ret += (n < 0) * num_buckets
    n = np.abs(n)
  else:
    n = np.maximum(n, 0)
  exact = num_buckets // 2
  large = exact + (np.log(np.maximum(n, 1).astype(np.float32) / exact) / np.log(max_distance / exact)
                   * (num_buckets - exact)).astype(np.int32)  # only used where n >= exact
  return ret + np.where(n < exact, n, np.minimum(large, num_buckets - 1))


HEADS, D_KV = 4, 2


# With d_model split, the attention itself would run replicated over `model`; a model that knows
# its layout lets attention.py split it there too (maybe_reshape_attention_input_for_2d_sharding).
D_MODEL_SPLIT = ("batch:2;model:4", "batch:batch;d_model:model")


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS + [D_MODEL_SPLIT])
def test_self_attention_matches_causal_multihead_attention_with_relative_bias(mesh_shape, layout):
  layer = transformer_layers.SelfAttention(num_heads=HEADS, key_value_size=D_KV,
                                           relative_attention_type="bias")
  positions = np.arange(LENGTH)
  buckets = _np_bucket(positions[None, :] - positions[:, None], bidirectional=False)
  model = model_stub(D_MODEL, layout=layout, mesh_shape=mesh_shape)

  def build(x):
    return call_layer(layer, make_context(x, model), x)

  def reference(x, variables):
    relative = tf.gather(variables["layer/relative_attention_bias"], buckets, axis=1)  # [h, l, m]
    return tf_multihead_attention(x, x, variables, "layer", HEADS, causal_bias(LENGTH) + relative)
  result = check_layer(build, reference, [(_x(), X_SHAPE)], mesh_shape, layout)
  assert result.shapes["layer/q"] == mtf.Shape([mtf.Dimension("d_model", D_MODEL),
                                                mtf.Dimension("heads", HEADS * D_KV)])
  assert result.shapes["layer/relative_attention_bias"].to_integer_list == [HEADS, 32]


def test_self_attention_bidirectional_with_packed_sequences_in_graph_and_eager_modes():
  sequence_id = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
  layer = transformer_layers.SelfAttention(num_heads=HEADS, key_value_size=D_KV)
  x = _x()

  def build(mesh):
    xt = mtf.import_tf_tensor(mesh, tf.constant(x), shape=X_SHAPE)
    ids = mtf.import_tf_tensor(mesh, tf.constant(sequence_id), shape="batch:2;length:6")
    model = model_stub(D_MODEL, fully_autoregressive=False)
    context = make_context(xt, model, causal=False, sequence_id=ids)
    y = call_layer(layer, context, xt)
    names[:] = [v.name for v in mesh.graph.trainable_variables]
    return [y] + [v.outputs[0] for v in mesh.graph.trainable_variables]
  names = []
  for mode in ("graph", "eager"):
    values = lower_and_evaluate(build, "batch:2", "batch:batch", mode=mode)
    with tf.Graph().as_default(), tf.Session() as sess:
      variables = {name: tf.constant(v) for name, v in zip(names, values[1:])}
      expected = sess.run(tf_multihead_attention(tf.constant(x), tf.constant(x), variables, "layer", HEADS,
                                                 segment_bias(sequence_id, sequence_id)))
    np.testing.assert_allclose(values[0], expected, rtol=1e-4, atol=1e-4)


def test_self_attention_multi_query_shares_one_key_value_head():
  layer = transformer_layers.SelfAttention(num_heads=HEADS, num_memory_heads=1, key_value_size=D_KV,
                                           relative_attention_type="bias_shared")
  positions = np.arange(LENGTH)
  buckets = _np_bucket(positions[None, :] - positions[:, None], bidirectional=False)

  def build(x):
    return call_layer(layer, make_context(x, model_stub(D_MODEL)), x)

  def reference(x, variables):
    q = tf.reshape(tf.einsum("bld,de->ble", x, variables["layer/q"]), [BATCH, LENGTH, HEADS, D_KV])
    k = tf.einsum("bmd,dk->bmk", x, variables["layer/k"])
    v = tf.einsum("bmd,dk->bmk", x, variables["layer/v"])
    bias = causal_bias(LENGTH) + tf.gather(variables["layer/relative_attention_bias"], buckets, axis=1)
    weights = tf.nn.softmax(tf.einsum("blhk,bmk->bhlm", q, k) + bias)
    o = tf.einsum("bhlm,bmk->blhk", weights, v)
    return tf.einsum("blhk,hkd->bld", o, tf.reshape(variables["layer/o"], [HEADS, D_KV, D_MODEL]))
  result = check_layer(build, reference, [(_x(), X_SHAPE)], "model:4", "heads:model")
  assert result.shapes["layer/k"].to_integer_list == [D_MODEL, D_KV]


def test_contextual_relative_attention_adds_q_times_per_bucket_embedding():
  layer = transformer_layers.SelfAttention(
      num_heads=2, key_value_size=D_KV, relative_attention_type="contextual",
      relative_attention_num_buckets=8)
  positions = np.arange(LENGTH)
  buckets = _np_bucket(positions[None, :] - positions[:, None], bidirectional=False, num_buckets=8)

  def build(x):
    return call_layer(layer, make_context(x, model_stub(D_MODEL)), x)

  def reference(x, variables):
    q = tf.reshape(tf.einsum("bld,de->ble", x, variables["layer/q"]), [BATCH, LENGTH, 2, D_KV])
    per_bucket = tf.einsum("blhk,hkn->bhln", q, variables["layer/relative_attention_ak/kernel"])
    relative = tf.einsum("bhln,lmn->bhlm", per_bucket, np.eye(8, dtype=np.float32)[buckets])
    k = tf.reshape(tf.einsum("bld,de->ble", x, variables["layer/k"]), [BATCH, LENGTH, 2, D_KV])
    v = tf.reshape(tf.einsum("bld,de->ble", x, variables["layer/v"]), [BATCH, LENGTH, 2, D_KV])
    weights = tf.nn.softmax(tf.einsum("blhk,bmhk->bhlm", q, k) + causal_bias(LENGTH) + relative)
    o = tf.einsum("bhlm,bmhk->blhk", weights, v)
    return tf.einsum("blhk,hkd->bld", o, tf.reshape(variables["layer/o"], [2, D_KV, D_MODEL]))
  check_layer(build, reference, [(_x(), X_SHAPE)])


def test_unknown_relative_attention_type_or_attention_func_is_rejected():
  with pytest.raises(ValueError, match="relative_attention_type 'rotary'"):
    transformer_layers.SelfAttention(relative_attention_type="rotary")
  with pytest.raises(ValueError, match="attention_func 'linear'"):
    transformer_layers.SelfAttention(attention_func="linear")
  with pytest.raises(ValueError, match="num_memory_heads=3 must divide num_heads=8"):
    lower_and_evaluate(lambda mesh: [call_layer(transformer_layers.SelfAttention(num_memory_heads=3),
                                                make_context(mtf.zeros(mesh, X_SHAPE), model_stub(D_MODEL)),
                                                mtf.zeros(mesh, X_SHAPE))])


def test_num_heads_that_the_layout_cannot_split_names_dimension_and_mesh_dim():
  layer = transformer_layers.SelfAttention(num_heads=3, key_value_size=4)

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(_x()), shape=X_SHAPE)
    return [call_layer(layer, make_context(x, model_stub(D_MODEL)), x)]
  with pytest.raises(ValueError, match=r"'heads' \(size 3\).*mesh dimension 'model' \(size 4\)"):
    lower_and_evaluate(build, "model:4", "heads:model")


ENCODER_LENGTH = 5
ENCODER_SHAPE = "batch:2;memory_length:5;d_model:8"


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS[:1] + LAYOUTS[3:])
def test_enc_dec_attention_attends_over_encoder_output_within_segments(mesh_shape, layout):
  decoder_ids = np.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 0, 0]], np.int32)
  encoder_ids = np.array([[1, 1, 2, 2, 2], [1, 1, 1, 0, 0]], np.int32)
  layer = transformer_layers.EncDecAttention(num_heads=HEADS, key_value_size=D_KV)

  def build(x, encoder_output, ids, enc_ids):
    context = make_context(x, model_stub(D_MODEL), sequence_id=ids, encoder_output=encoder_output,
                           encoder_sequence_id=enc_ids)
    return call_layer(layer, context, x)

  def reference(x, encoder_output, ids, enc_ids, variables):
    bias = segment_bias(decoder_ids, encoder_ids)
    return tf_multihead_attention(x, encoder_output, variables, "layer", HEADS, bias)
  encoder_output = RNG.randn(BATCH, ENCODER_LENGTH, D_MODEL).astype(np.float32)
  check_layer(build, reference, [(_x(), X_SHAPE), (encoder_output, ENCODER_SHAPE),
                                 (decoder_ids, "batch:2;length:6"), (encoder_ids, "batch:2;memory_length:5")],
              mesh_shape, layout)


def test_enc_dec_attention_rejects_encoder_output_of_another_width():
  layer = transformer_layers.EncDecAttention(num_heads=2, key_value_size=2)

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(_x()), shape=X_SHAPE)
    memory = mtf.zeros(mesh, "batch:2;memory_length:5;d_model:4")
    return [call_layer(layer, make_context(x, model_stub(D_MODEL), encoder_output=memory), x)]
  with pytest.raises(ValueError, match="d_model.*same d_model"):
    lower_and_evaluate(build)


def test_relative_position_spans_measures_positions_in_sentinel_spans():
  # vocab 10, 2 sentinels (8, 9): inputs "3 4 <9> 5 6 <8>", targets "<9> 7 7 <8> 2".
  encoder_inputs = np.array([[3, 4, 9, 5, 6, 8]], np.int32)
  decoder_inputs = np.array([[9, 7, 7, 8, 2]], np.int32)
  # encoder positions 0 0 1 2 2 3; decoder positions 1 1 1 3 3.
  expected = np.array([[0, 0, 1, 2, 2, 3]]) - np.array([[1], [1], [1], [3], [3]])

  def build(mesh):
    enc = mtf.import_tf_tensor(mesh, tf.constant(encoder_inputs), shape="batch:1;memory_length:6")
    dec = mtf.import_tf_tensor(mesh, tf.constant(decoder_inputs), shape="batch:1;length:5")
    context = make_context(mtf.zeros(mesh, "batch:1;length:5;d_model:2"), model_stub(2, output_vocab_size=10),
                           inputs=dec, encoder_inputs=enc)
    rp = transformer_layers.relative_position_spans(context, num_sentinels=2)
    return [mtf.transpose(rp, mtf.Shape(dec.shape.dims + enc.shape.dims[1:]))]
  spans, = lower_and_evaluate(build)
  np.testing.assert_array_equal(spans[0], expected)


def test_parallel_layer_sums_its_layers_each_in_its_own_scope():
  layer = transformer_layers.ParallelLayer(layer_classes=(
      transformer_layers.DenseReluDense, transformer_layers.SelfAttention))
  layer.layer_classes[0].hidden_size = 4
  layer.layer_classes[1].key_value_size = 2

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(_x()), shape=X_SHAPE)
    context = make_context(x, model_stub(D_MODEL))
    y = call_layer(layer, context, x)
    parts = [call_layer(sublayer, context, x, "layer/parallel_layer_%d" % i)  # the same variables again
             for i, sublayer in enumerate(layer.layer_classes)]
    return [y, parts[0] + parts[1], mtf.constant(mesh, len(mesh.graph.trainable_variables), dtype=tf.int32)]
  y, expected, num_variables = lower_and_evaluate(build, "model:4", "heads:model;d_ff:model")
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
  assert num_variables == 6  # wi, wo, q, k, v, o


def test_layers_are_gin_configurable_by_short_and_full_module_name():
  with gin_config(["transformer_layers.SelfAttention.num_heads = 3",
                   "mesh_tensorflow.transformer.transformer_layers.DenseReluDense.hidden_size = 7",
                   "transformer_layers.LocalSelfAttention.radius = 5"]):
    assert transformer_layers.SelfAttention().num_heads == 3
    assert transformer_layers.DenseReluDense().hidden_size == 7
    assert transformer_layers.LocalSelfAttention().radius == 5



def _local_bias(length: int, radius: int, fully_autoregressive: bool) -> np.ndarray:
  """[length, memory_length]: memory within radius - 1 to the left (and radius to the right if not causal)."""
  relative = np.arange(length)[None, :] - np.arange(length)[:, None]
  visible = (relative > -radius) & (relative <= (0 if fully_autoregressive else radius))
  return visibility_bias(visible)


@pytest.mark.parametrize("length,fully_autoregressive,mesh_shape,layout", [
    (LENGTH, True, "batch:2;model:4", "batch:batch;heads:model"),  # masked full attention
    (LENGTH, False, "all:1", ""),
    (264, True, "batch:2", "batch:batch"),  # long: blocked attention.local_attention_1d
])
def test_local_self_attention_sees_only_a_window_of_radius(length, fully_autoregressive, mesh_shape, layout):
  radius = 3
  layer = transformer_layers.LocalSelfAttention(radius=radius, num_heads=HEADS, key_value_size=D_KV)

  def build(x):
    model = model_stub(D_MODEL, fully_autoregressive=fully_autoregressive)
    return call_layer(layer, make_context(x, model, causal=fully_autoregressive), x)

  def reference(x, variables):
    bias = _local_bias(length, radius, fully_autoregressive)
    return tf_multihead_attention(x, x, variables, "layer", HEADS, bias)
  x = RNG.randn(BATCH, length, D_MODEL).astype(np.float32)
  check_layer(build, reference, [(x, "batch:2;length:%d;d_model:8" % length)], mesh_shape, layout)


def test_hybrid_attention_func_mixes_softmax_and_doubly_normalized_weights():
  layer = transformer_layers.SelfAttention(num_heads=2, key_value_size=D_KV, attention_func="hybrid")

  def build(x):
    return call_layer(layer, make_context(x, model_stub(D_MODEL)), x)

  def reference(x, variables):
    q, k, v = [tf_project_heads(x, variables["layer/" + n], 2) for n in "qkv"]
    logits = tf.einsum("blhk,bmhk->bhlm", q, k) + causal_bias(LENGTH)
    coeff = tf.clip_by_value(variables["layer/doubly_coeff"], 0.0, 1.0)
    doubly = tf.nn.softmax(tf.nn.log_softmax(logits, axis=2), axis=3)
    weights = coeff * doubly + (1.0 - coeff) * tf.nn.softmax(logits, axis=3)
    o = tf.einsum("bhlm,bmhk->blhk", weights, v)
    return tf.einsum("blhk,hkd->bld", o, tf.reshape(variables["layer/o"], [2, D_KV, D_MODEL]))
  check_layer(build, reference, [(_x(), X_SHAPE)])


def test_enc_dec_attention_relative_bias_is_indexed_by_span_position():
  # vocab 10, sentinels 8 and 9; encoder positions (see relative_position_spans) 0 0 1 2 2,
  # decoder positions 1 1 1 3 3 3.
  encoder_inputs = np.array([[3, 4, 9, 5, 6], [3, 9, 4, 8, 5]], np.int32)
  decoder_inputs = np.array([[9, 7, 7, 8, 2, 2], [9, 7, 8, 2, 0, 0]], np.int32)
  layer = transformer_layers.EncDecAttention(num_heads=HEADS, key_value_size=D_KV,
                                             relative_attention_type="bias", relative_attention_num_buckets=8)

  def positions(ids, decoder):
    count = 2 * np.cumsum(ids >= 8, axis=1)
    return count - 1 if decoder else count - (ids >= 8)
  relative = positions(encoder_inputs, False)[:, None, :] - positions(decoder_inputs, True)[:, :, None]
  buckets = _np_bucket(relative, bidirectional=True, num_buckets=8)  # [b, l, m]

  def build(x, encoder_output, inputs, encoder_inputs):
    model = model_stub(D_MODEL, output_vocab_size=10)
    context = make_context(x, model, encoder_output=encoder_output, inputs=inputs,
                           encoder_inputs=encoder_inputs)
    return call_layer(layer, context, x)

  def reference(x, encoder_output, inputs, encoder_inputs_t, variables):
    bias = tf.transpose(tf.gather(variables["layer/relative_attention_bias"], buckets, axis=1), [1, 0, 2, 3])
    return tf_multihead_attention(x, encoder_output, variables, "layer", HEADS, bias)
  inputs = [(_x(), X_SHAPE), (RNG.randn(BATCH, 5, D_MODEL).astype(np.float32), ENCODER_SHAPE),
            (decoder_inputs, "batch:2;length:6"), (encoder_inputs, "batch:2;memory_length:5")]
  with gin_config("transformer_layers.relative_position_spans.num_sentinels = 2"):  # as a gin file would
    check_layer(build, reference, inputs, "batch:2", "batch:batch")


def test_attention_fn_is_a_property_naming_the_attention_function_as_upstream():
  """0.1.21's attention_fn is a property: hybrid_attention for attention_func='hybrid', else attention."""
  from mesh_tensorflow.transformer import attention
  assert transformer_layers.SelfAttention().attention_fn is attention.attention
  assert transformer_layers.SelfAttention(attention_func="hybrid").attention_fn is attention.hybrid_attention
  assert transformer_layers.EncDecAttention().attention_fn is attention.attention
