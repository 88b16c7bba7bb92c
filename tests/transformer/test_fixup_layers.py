"""fixup_layers: Fixup-initialized layers and sublayers against plain-TF references (1 and 2 devices)."""

from __future__ import annotations

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import fixup_layers
from tests.harness import lower_and_evaluate
from tests.layers.layer_check import check_layer, run_layer
from tests.transformer.layer_context import call_layer, causal_bias, make_context, model_stub, \
    tf_multihead_attention

RNG = np.random.RandomState(7)
BATCH, LENGTH, D_MODEL, D_FF, HEADS, D_KV = 2, 4, 8, 16, 2, 4
NUM_BLOCKS = 10
X_SHAPE = f"batch:{BATCH};length:{LENGTH};d_model:{D_MODEL}"
ENCODER_SHAPE = f"batch:{BATCH};memory_length:3;d_model:{D_MODEL}"
MESHES = [("all:1", ""), ("b:2", "batch:b")]


def _x():
  return RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)


def _build(layer_or_fn, **context_kwargs):
  def build(x, *extra):
    if extra:
      context_kwargs["encoder_output"] = extra[0]
    context = make_context(x, model_stub(D_MODEL), **context_kwargs)
    if callable(layer_or_fn) and not hasattr(layer_or_fn, "call"):
      with tf.variable_scope("layer"):
        return layer_or_fn(x, None, context)
    return call_layer(layer_or_fn, context, x)
  return build


@pytest.mark.parametrize("mesh_shape,layout,mode", [MESHES[0] + ("graph",), MESHES[1] + ("graph",),
                                                    MESHES[1] + ("eager",)])
def test_dense_relu_dense_fixup_shifts_the_hidden_layer_and_starts_with_zero_output(mesh_shape, layout, mode):
  layer = fixup_layers.DenseReluDenseFixup(hidden_size=D_FF, num_blocks=NUM_BLOCKS)

  def reference(x, variables):
    h = tf.nn.relu(tf.einsum("bld,df->blf", x, variables["layer/wi/kernel"])) + variables["layer/shift"]
    return tf.einsum("blf,fd->bld", h, variables["layer/wo/kernel"])
  result = check_layer(_build(layer), reference, [(_x(), X_SHAPE)], mesh_shape, layout, mode=mode)
  assert sorted(result.variables) == ["layer/shift", "layer/wi/kernel", "layer/wo/kernel"]
  assert result.shapes["layer/shift"].to_integer_list == [1]
  np.testing.assert_array_equal(result.variables["layer/wo/kernel"], 0.0)
  np.testing.assert_array_equal(result.y, 0.0)  # a zero-initialized branch: the residual carries x
  assert np.abs(result.variable_grads["layer/wo/kernel"]).max() > 0  # ... and it trains


def _uniform_limit(variance_scale: float, fan: float) -> float:
  return (3.0 * variance_scale / fan) ** 0.5


@pytest.mark.parametrize("default_init,limit", [
    ("he", _uniform_limit(2.0 / NUM_BLOCKS, D_MODEL)),
    ("glorot", _uniform_limit(1.0 / NUM_BLOCKS, (D_MODEL + D_FF) / 2)),
])
def test_dense_relu_dense_fixup_up_projection_is_variance_scaled_by_one_over_num_blocks(default_init, limit):
  layer = fixup_layers.DenseReluDenseFixup(hidden_size=D_FF, num_blocks=NUM_BLOCKS, default_init=default_init)
  wi = run_layer(_build(layer), [(_x(), X_SHAPE)], grads=False).variables["layer/wi/kernel"]
  assert np.abs(wi).max() <= limit and np.abs(wi).max() > 0.8 * limit  # Uniform(-limit, limit), 128 draws


def test_unknown_default_init_is_rejected():
  with pytest.raises(ValueError, match="default_init='xavier' is not supported"):
    fixup_layers.DenseReluDenseFixup(num_blocks=2, default_init="xavier")


def _self_attention_fixup(**kwargs):
  return fixup_layers.SelfAttentionFixup(num_blocks=NUM_BLOCKS, num_heads=HEADS, key_value_size=D_KV,
                                         fold_scaling_into_initializer=False, **kwargs)


def _renamed(variables: dict, prefix: str) -> dict:
  return {prefix + "/" + name: variables[prefix + "/" + name + "_fixup"] for name in ("q", "k", "v", "o")}


@pytest.mark.parametrize("mesh_shape,layout", [("all:1", ""), ("b:2;model:2", "batch:b;heads:model")])
def test_self_attention_fixup_is_multihead_attention_over_fixup_variables(mesh_shape, layout):
  def reference(x, variables):
    return tf_multihead_attention(x * D_KV ** -0.5, x, _renamed(variables, "layer"), "layer", HEADS,
                                  bias=causal_bias(LENGTH))
  result = check_layer(_build(_self_attention_fixup()), reference, [(_x(), X_SHAPE)], mesh_shape, layout)
  assert sorted(result.variables) == ["layer/k_fixup", "layer/o_fixup", "layer/q_fixup", "layer/v_fixup"]
  np.testing.assert_array_equal(result.variables["layer/o_fixup"], 0.0)
  glorot_limit = _uniform_limit(NUM_BLOCKS ** (-1 / 3), (D_MODEL + HEADS * D_KV) / 2)
  assert 0.7 * glorot_limit < np.abs(result.variables["layer/q_fixup"]).max() <= glorot_limit


def test_self_attention_fixup_with_shared_kv_makes_kv_fixup():
  result = run_layer(_build(_self_attention_fixup(shared_kv=True)), [(_x(), X_SHAPE)], grads=False)
  assert sorted(result.variables) == ["layer/kv_fixup", "layer/o_fixup", "layer/q_fixup"]


def test_self_attention_fixup_refuses_folded_scaling_and_unit_scaling():
  layer = fixup_layers.SelfAttentionFixup(num_blocks=NUM_BLOCKS, num_heads=HEADS, key_value_size=D_KV)
  with pytest.raises(ValueError, match="fold_scaling_into_initializer = False"):
    lower_and_evaluate(lambda mesh: [_build(layer)(mtf.zeros(mesh, X_SHAPE))])
  gin.bind_parameter("unit_scaling_convention.value", True)
  with pytest.raises(ValueError, match="not compatible with the unit-scaling convention"):
    lower_and_evaluate(lambda mesh: [_build(_self_attention_fixup())(mtf.zeros(mesh, X_SHAPE))])


def test_enc_dec_attention_fixup_keeps_the_ordinary_projections():
  layer = fixup_layers.EncDecAttentionFixup(num_heads=HEADS, key_value_size=D_KV)
  encoder = RNG.randn(BATCH, 3, D_MODEL).astype(np.float32)

  def reference(x, encoder_output, variables):
    return tf_multihead_attention(x, encoder_output, variables, "layer", HEADS)
  inputs = [(_x(), X_SHAPE), (encoder, ENCODER_SHAPE)]
  result = check_layer(_build(layer), reference, inputs, "b:2", "batch:b")
  assert sorted(result.variables) == ["layer/k", "layer/o", "layer/q", "layer/v"]


@pytest.mark.parametrize("sublayer,name,initial,reference", [
    (fixup_layers.sublayer_fixup_scale, "layer/fixup_scale_weight", 1.0, lambda x, w: x * w),
    (fixup_layers.sublayer_fixup_shift, "layer/fixup_bias", 0.0, lambda x, w: x + w),
])
def test_sublayer_fixup_scale_and_shift_are_trainable_scalars(sublayer, name, initial, reference):
  result = check_layer(_build(sublayer), lambda x, variables: reference(x, variables[name]),
                       [(_x(), X_SHAPE)], "b:2", "batch:b")
  assert list(result.variables) == [name]
  np.testing.assert_array_equal(result.variables[name], [initial])
  assert result.variable_grads[name].shape == (1,)


def test_get_single_scalar_bias_takes_the_dtype_of_x():
  def build(mesh):
    bias = fixup_layers.get_single_scalar_bias(mtf.zeros(mesh, X_SHAPE, dtype=tf.float32), "shift")
    assert bias.shape.to_integer_list == [1] and bias.dtype == tf.float32
    return [bias]
  np.testing.assert_array_equal(lower_and_evaluate(build)[0], [0.0])


def test_fixup_layers_are_gin_configurable_under_their_names():
  gin.parse_config("""
      SelfAttentionFixup.num_blocks = 6
      SelfAttentionFixup.fold_scaling_into_initializer = False
      DenseReluDenseFixup.num_blocks = 6
      DenseReluDenseFixup.hidden_size = 32
      stack/LayerStack.sublayers_per_layer = [@sublayer_fixup_shift, @sublayer_fixup_scale]
  """)
  assert fixup_layers.SelfAttentionFixup().num_blocks == 6
  assert fixup_layers.DenseReluDenseFixup().hidden_size == 32
  shift, scale = gin.query_parameter("stack/LayerStack.sublayers_per_layer")
  assert (shift.scoped_configurable_fn, scale.scoped_configurable_fn) == (
      fixup_layers.sublayer_fixup_shift, fixup_layers.sublayer_fixup_scale)
