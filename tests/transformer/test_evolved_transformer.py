"""evolved_transformer layers against plain-TF computations of 0.1.21's math, on 1 and 2 devices."""

from __future__ import annotations

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import evolved_transformer
from tests.harness import lower_and_evaluate
from tests.layers.layer_check import check_layer
from tests.transformer.layer_context import call_layer, causal_bias, make_context, model_stub, \
    tf_multihead_attention

RNG = np.random.RandomState(5)
BATCH, LENGTH, D_MODEL = 2, 12, 8
X_SHAPE = f"batch:{BATCH};length:{LENGTH};d_model:{D_MODEL}"
ENCODER_SHAPE = f"batch:{BATCH};memory_length:5;d_model:{D_MODEL}"
MESHES = [("all:1", ""), ("b:2", "batch:b")]


def _x():
  return RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)


def _build(layer, **context_kwargs):
  def build(x, *extra):
    if extra:
      context_kwargs["encoder_output"] = extra[0]
    # Input ids, all non-zero: the convolutions zero x where they are 0 (0.1.21's padding mask).
    context_kwargs.setdefault("inputs", mtf.ones(x.mesh, mtf.Shape(x.shape.dims[:2]), dtype=tf.int32))
    return call_layer(layer, make_context(x, model_stub(D_MODEL), **context_kwargs), x)
  return build


def tf_shift(x, r: int):
  """y[:, t] = x[:, t + r], zero outside the sequence."""
  if r >= 0:
    return tf.pad(x[:, r:], [[0, 0], [0, r], [0, 0]])
  return tf.pad(x[:, :LENGTH + r], [[0, 0], [-r, 0], [0, 0]])


def tf_separable(x, variables, prefix: str, min_relative_pos: int, max_relative_pos: int):
  """0.1.21's separable_conv1d: sum_r shift(x, r) * depthwise_r (+ bias), then a pointwise dense."""
  scope = prefix + "separable_conv1d/"
  depthwise = tf.add_n([
      tf_shift(x, r) * variables[scope + "depthwise_conv_hack/depthwise_dense_%d/kernel" % i]
      for i, r in enumerate(range(min_relative_pos, max_relative_pos + 1))])
  depthwise += variables[scope + "depthwise_conv_hack/depthwise_dense_0/bias"]
  return (tf.einsum("bld,de->ble", depthwise, variables[scope + "pointwise_dense/kernel"])
          + variables[scope + "pointwise_dense/bias"])


def tf_layer_norm(x, variables, prefix: str, epsilon=1e-6):
  scope = prefix + "layer_prepostprocess/layer_norm/"
  mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
  return ((x - mean) * tf.rsqrt(variance + epsilon) * variables[scope + "layer_norm_scale"]
          + variables[scope + "layer_norm_bias"])


def pad_channels(x, size: int):
  return tf.pad(x, [[0, 0], [0, 0], [0, size - int(x.shape[-1])]])


@pytest.mark.parametrize("mesh_shape,layout,mode", [MESHES[0] + ("graph",), MESHES[1] + ("graph",),
                                                    MESHES[1] + ("eager",)])
def test_gated_linear_unit_is_a_linear_half_times_a_sigmoid_half(mesh_shape, layout, mode):
  def reference(x, variables):
    def dense(i):
      scope = "layer/glu_%d/" % i
      return tf.einsum("bld,de->ble", x, variables[scope + "kernel"]) + variables[scope + "bias"]
    return dense(0) * tf.sigmoid(dense(1))
  check_layer(_build(evolved_transformer.GatedLinearUnitLayer()), reference, [(_x(), X_SHAPE)], mesh_shape,
              layout, mode=mode)


def test_encoder_convolutional_layer_sums_a_dense_and_a_conv_branch_then_a_separable_conv():
  layer = evolved_transformer.EncoderConvolutionalLayer(d_model=D_MODEL, dropout_rate=0.1)

  def reference(x, variables):
    hidden = 4 * D_MODEL
    left = tf.nn.relu(tf.einsum("bld,dh->blh", x, variables["layer/conv1x1/dense/kernel"]))
    kernel = variables["layer/conv3x1/conv2d/kernel"][0]  # [3, d_model, d_model / 2]
    right = tf.nn.relu(tf.nn.conv1d(x, kernel, 1, "SAME"))  # 0.1.21's Conv1DLayer: centred filter
    h = tf_layer_norm(left + pad_channels(right, hidden), variables, "layer/")
    return pad_channels(tf_separable(h, variables, "layer/sep_conv9x1/", -4, 4), D_MODEL)
  result = check_layer(_build(layer), reference, [(_x(), X_SHAPE)], *MESHES[1])  # eval: no dropout
  assert result.shapes["layer/conv1x1/dense/kernel"].to_integer_list == [D_MODEL, 4 * D_MODEL]
  assert result.shapes["layer/sep_conv9x1/separable_conv1d/pointwise_dense/kernel"].to_integer_list == [
      4 * D_MODEL, D_MODEL // 2]


def test_decoder_convolutional_layer_is_causal_separable_convolutions():
  layer = evolved_transformer.DecoderConvolutionalLayer(d_model=D_MODEL, dropout_rate=0.1)

  def reference(x, variables):
    left = tf.nn.relu(tf_separable(x, variables, "layer/sep_conv11x1/", -10, 0))
    right = pad_channels(tf_separable(x, variables, "layer/sep_conv7x1_1/", -6, 0), 2 * D_MODEL)
    h = tf_layer_norm(left + right, variables, "layer/")
    return tf_separable(h, variables, "layer/sep_conv7x1_2/", -6, 0)
  check_layer(_build(layer), reference, [(_x(), X_SHAPE)], *MESHES[1])


@pytest.mark.parametrize("mesh_shape,layout", [("all:1", ""), ("model:2", "heads:model")])
def test_decoder_attention_layer_sums_self_attention_and_enc_dec_attention(mesh_shape, layout):
  with gin.unlock_config():
    gin.bind_parameter("transformer_layers.SelfAttention.key_value_size", 2)
  layer = evolved_transformer.DecoderAttentionLayer(base_num_heads=2)
  encoder = RNG.randn(BATCH, 5, D_MODEL).astype(np.float32)

  def reference(x, encoder_output, variables):
    left = tf_multihead_attention(x, x, variables, "layer/self_attention", heads=4, bias=causal_bias(LENGTH))
    right = tf_multihead_attention(x, encoder_output, variables, "layer/enc_dec_attention", heads=2)
    return left + right
  result = check_layer(_build(layer), reference, [(_x(), X_SHAPE), (encoder, ENCODER_SHAPE)], mesh_shape,
                       layout)
  assert result.shapes["layer/self_attention/q"].to_integer_list == [D_MODEL, 4 * 2]
  assert result.shapes["layer/enc_dec_attention/q"].to_integer_list == [D_MODEL, 2 * 2]


def test_dropout_is_shared_along_the_length_and_only_in_training():
  x = np.ones((BATCH, LENGTH, D_MODEL), np.float32)

  def build(mesh):
    xt = mtf.import_tf_tensor(mesh, tf.constant(x), shape=X_SHAPE)
    context = make_context(xt, model_stub(D_MODEL), mode="train")
    eval_context = make_context(xt, model_stub(D_MODEL))
    return [evolved_transformer._dropout(xt, context, 0.5),
            evolved_transformer._dropout(xt, eval_context, 0.5)]
  dropped, kept = lower_and_evaluate(build)
  np.testing.assert_array_equal(kept, x)
  assert set(np.unique(dropped)) <= {0.0, 2.0} and 0 < np.mean(dropped == 0) < 1
  np.testing.assert_array_equal(dropped, np.broadcast_to(dropped[:, :1], dropped.shape))


def test_padding_to_fewer_channels_is_rejected():
  with pytest.raises(ValueError, match="cannot pad the channels dim .*d_model.* to size 4"):
    lower_and_evaluate(lambda mesh: [evolved_transformer._pad_channels_dim(mtf.zeros(mesh, X_SHAPE), 4)])


def test_layers_are_gin_configurable_under_their_names():
  gin.parse_config("""
      EncoderConvolutionalLayer.d_model = 8
      EncoderConvolutionalLayer.dropout_rate = 0.0
      DecoderConvolutionalLayer.d_model = 8
      DecoderConvolutionalLayer.dropout_rate = 0.0
      DecoderAttentionLayer.base_num_heads = 2
      layers = [@evolved_transformer.GatedLinearUnitLayer()]
  """)
  assert evolved_transformer.EncoderConvolutionalLayer()._conv3x1.output_size == 4
  assert evolved_transformer.DecoderConvolutionalLayer()._sep_conv11x1.output_size == 16
  assert evolved_transformer.DecoderAttentionLayer()._self_attention.num_heads == 4
  assert isinstance(gin.query_parameter("%layers")[0].scoped_configurable_fn(),
                    evolved_transformer.GatedLinearUnitLayer)
