"""universal_transformer.UTLayerStack: basic, ACT and highway recurrences against plain-TF references.

The references follow 0.1.21's math step by step with the variables the stack made (read back
by name), on a 2-device mesh; gradients are compared too (check_layer).
"""

from __future__ import annotations

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer_layers, universal_transformer
from tests.layers.layer_check import check_layer, run_layer
from tests.transformer.layer_context import make_context, model_stub

RNG = np.random.RandomState(11)
BATCH, LENGTH, D_MODEL, D_FF = 2, 3, 4, 8
X_SHAPE = f"batch:{BATCH};length:{LENGTH};d_model:{D_MODEL}"
MESH = ("b:2", "batch:b")
NORM = "stack/layer_prepostprocess/layer_norm/"


def _settings(**overrides):
  settings = dict(
      act_type="basic", recurrence_type="basic", act_max_steps=2, act_epsilon=0.01, num_rec_steps=2,
      num_inrecurrence_layers=1, position_start_index=None, add_or_concat_timing_signal="add",
      step_timing_signal_type="learned", add_position_timing_signal=False, add_step_timing_signal=False,
      mix_with_transformer_before_ut=False, mix_with_transformer_after_ut=False, gates_inputs="s",
      gate_ffn_layer="dense", use_gated_transformer=False, gating_type="highway")
  settings.update(overrides)
  return settings


def _stack(**overrides):
  ffn = transformer_layers.DenseReluDense(hidden_size=D_FF)
  ffn.set_name("ffn")
  return universal_transformer.UTLayerStack([ffn], **_settings(**overrides))


def _build(stack, mode="eval"):
  def build(x):
    context = make_context(x, model_stub(D_MODEL), mode=mode)
    with tf.variable_scope("stack"):
      return stack.call(context, x)
  return build


def tf_layer_norm(x, variables, scope=NORM):
  mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
  return (x - mean) * tf.rsqrt(variance + 1e-6) * variables[scope + "layer_norm_scale"] + variables[
      scope + "layer_norm_bias"]


def tf_ffn_pass(x, variables):
  """One vanilla pass of the named DenseReluDense: x + relu(norm(x) wi) wo."""
  h = tf_layer_norm(x, variables, "stack/ffn/layer_prepostprocess/layer_norm/")
  h = tf.nn.relu(tf.einsum("bld,df->blf", h, variables["stack/ffn/DenseReluDense/wi/kernel"]))
  return x + tf.einsum("blf,fd->bld", h, variables["stack/ffn/DenseReluDense/wo/kernel"])


def _dense_scopes(variables, prefix: str) -> list:
  """The `prefix + dense*` scopes in creation order (dense, dense_1, ...)."""
  names = sorted({n[len(prefix):].split("/")[0] for n in variables if n.startswith(prefix + "dense")},
                 key=lambda s: int(s.split("_")[1]) if "_" in s else 0)
  return [prefix + name + "/" for name in names]


def _x():
  return RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_basic_recurrence_reuses_one_set_of_layer_weights_with_a_learned_step_signal(mode):
  stack = _stack(add_step_timing_signal=True, num_rec_steps=3)

  def reference(x, variables):
    embedding = variables["stack/layer_embedding"] * D_MODEL ** 0.5
    for step in range(3):
      x = tf_ffn_pass(x + embedding[step], variables)
    return tf_layer_norm(x, variables)
  result = check_layer(_build(stack), reference, [(_x(), X_SHAPE)], *MESH, mode=mode)
  assert sorted(result.variables) == sorted([
      "stack/ffn/layer_prepostprocess/layer_norm/layer_norm_scale",
      "stack/ffn/layer_prepostprocess/layer_norm/layer_norm_bias", "stack/ffn/DenseReluDense/wi/kernel",
      "stack/ffn/DenseReluDense/wo/kernel", "stack/layer_embedding", NORM + "layer_norm_scale",
      NORM + "layer_norm_bias"])
  assert result.shapes["stack/layer_embedding"].to_integer_list == [3, D_MODEL]


def test_vanilla_passes_before_and_after_the_recurrence():
  stack = _stack(num_rec_steps=1, mix_with_transformer_before_ut=True, mix_with_transformer_after_ut=True,
                 num_vanilla_transformer_layers=2)

  def reference(x, variables):
    for _ in range(5):  # 2 before, 1 step, 2 after: all the same weights
      x = tf_ffn_pass(x, variables)
    return tf_layer_norm(x, variables)
  check_layer(_build(stack), reference, [(_x(), X_SHAPE)])


def test_act_weights_each_step_by_its_halting_probability_and_the_remainder():
  stack = _stack(recurrence_type="act", act_max_steps=2, act_epsilon=0.3)

  def reference(x, variables):
    ponder = _dense_scopes(variables, "stack/sigmoid_activation_for_pondering/")
    halting = remainders = tf.zeros(x.shape)
    previous = tf.zeros(x.shape)
    state = x
    for step in range(3):
      scope = ponder[min(step, len(ponder) - 1)]
      p = tf.sigmoid(tf.einsum("bld,de->ble", state, variables[scope + "kernel"]) + variables[scope + "bias"])
      running = tf.cast(halting < 1.0, tf.float32)
      reached = halting + p * running
      new_halted = tf.cast(reached > 0.7, tf.float32) * running
      running = tf.cast(reached <= 0.7, tf.float32) * running
      halting += p * running
      remainders += new_halted * (1 - halting)
      halting += new_halted * remainders
      weights = p * running + new_halted * remainders
      state = tf_ffn_pass(state, variables)
      previous = state * weights + previous * (1 - weights)
    return tf_layer_norm(previous, variables)
  result = check_layer(_build(stack), reference, [(_x(), X_SHAPE)], *MESH)
  assert any(name.startswith("stack/sigmoid_activation_for_pondering/") for name in result.variables)


def test_highway_recurrence_mixes_state_and_transformed_state_with_a_learned_gate():
  stack = _stack(recurrence_type="highway", num_rec_steps=2, gates_inputs="st")

  def reference(x, variables):
    gates = _dense_scopes(variables, "stack/")
    state = x
    for step in range(2):
      transformed = tf_ffn_pass(state, variables)
      gate_in = tf.concat([tf_layer_norm(t, variables) for t in (state, transformed)], -1)
      kernel, bias = variables[gates[step] + "kernel"], variables[gates[step] + "bias"]
      gate = tf.sigmoid(tf.einsum("ble,ed->bld", gate_in, kernel) + bias)
      state = state * (1 - gate) + transformed * gate
    return tf_layer_norm(state, variables)
  result = check_layer(_build(stack), reference, [(_x(), X_SHAPE)], *MESH)
  assert result.shapes[_dense_scopes(result.variables, "stack/")[0] + "kernel"].to_integer_list == [
      2 * D_MODEL, D_MODEL]


@pytest.mark.parametrize("gating_type", ["highway", "gru"])
def test_gated_transformer_layers_build_and_train(gating_type):
  stack = _stack(use_gated_transformer=True, gating_type=gating_type, num_rec_steps=1)
  result = run_layer(_build(stack, mode="train"), [(_x(), X_SHAPE)])
  assert result.y.shape == (BATCH, LENGTH, D_MODEL) and np.all(np.isfinite(result.y))
  gate_grads = [g for name, g in result.variable_grads.items() if "DenseReluDense/dense" in name]
  assert gate_grads and all(np.abs(g).max() > 0 for g in gate_grads)


@pytest.mark.parametrize("overrides,message", [
    (dict(recurrence_type="lstm"), "recurrence_type='lstm' is not supported"),
    (dict(add_or_concat_timing_signal="concat"), "add_or_concat_timing_signal='concat'"),
    (dict(add_step_timing_signal=True, step_timing_signal_type="sinusoid"), "step_timing_signal_type"),
    (dict(recurrence_type="highway", gate_ffn_layer="dense_relu_dense"), "gate_ffn_layer"),
    (dict(use_gated_transformer=True, gating_type="lstm"), "gating_type='lstm'"),
])
def test_options_that_cannot_build_are_rejected_when_the_stack_is_made(overrides, message):
  with pytest.raises(ValueError, match=message):
    _stack(**overrides)


def test_position_timing_signal_is_sinusoids_of_the_positions():
  stack = _stack()

  def build(x):
    context = make_context(x, model_stub(D_MODEL))
    return stack.add_position_timing_signal_func(context, x, step=0)

  def reference(x, variables):
    position = np.arange(LENGTH, dtype=np.float32)[:, None]
    inv_timescales = np.exp(np.arange(2, dtype=np.float32) * -np.log(1e4))  # 2 timescales: 1 and 1e-4
    scaled = position * inv_timescales
    return x + np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1)
  check_layer(build, reference, [(_x(), X_SHAPE)])


def test_ut_layer_stack_is_gin_configurable_under_its_name():
  gin.parse_config("""
      UTLayerStack.act_type = "basic"
      UTLayerStack.recurrence_type = "basic"
      UTLayerStack.act_max_steps = 4
      UTLayerStack.act_epsilon = 0.01
      UTLayerStack.num_rec_steps = 3
      UTLayerStack.num_inrecurrence_layers = 1
      UTLayerStack.position_start_index = None
      UTLayerStack.add_or_concat_timing_signal = "add"
      UTLayerStack.step_timing_signal_type = "learned"
      UTLayerStack.add_position_timing_signal = False
      UTLayerStack.add_step_timing_signal = True
      UTLayerStack.mix_with_transformer_before_ut = False
      UTLayerStack.mix_with_transformer_after_ut = False
      UTLayerStack.gates_inputs = "i"
      UTLayerStack.gate_ffn_layer = "dense"
      UTLayerStack.use_gated_transformer = False
      UTLayerStack.gating_type = "highway"
  """)
  stack = universal_transformer.UTLayerStack([transformer_layers.DenseReluDense()])
  assert (stack.num_rec_steps, stack.num_layers) == (3, 1)
  result = run_layer(_build(stack), [(_x(), X_SHAPE)], grads=False)
  assert result.shapes["stack/layer_embedding"].to_integer_list == [3, D_MODEL]
  assert mtf.Shape(result.shapes["stack/DenseReluDense/wi/kernel"].dims).to_integer_list == [D_MODEL, 4096]
