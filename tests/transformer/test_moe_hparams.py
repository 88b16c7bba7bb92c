"""moe.set_default_moe_hparams and GPT-Neo's call sequence into transformer_moe_layer_v1 / v2.

GPT-Neo (built on mtf 0.1.18) makes its own HParams-like object, calls set_default_moe_hparams,
overrides some values with add_hparam and calls transformer_moe_layer_v1 on its activations.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import moe
from tests.harness import lower_and_evaluate
from tests.transformer.layer_context import make_context, model_stub
from tests.transformer.model_check import train_losses

BATCH, LENGTH, D_MODEL = 4, 4, 8
X = np.random.RandomState(0).randn(BATCH, LENGTH, D_MODEL).astype(np.float32)
X_SHAPE = f"batch:{BATCH};length:{LENGTH};d_model:{D_MODEL}"
ORIGINAL_DEFAULTS = {
    "moe_num_experts": 16, "moe_loss_coef": 1e-2, "moe_gating": "top_2", "moe_capacity_factor_train": 1.25,
    "moe_capacity_factor_eval": 2.0, "moe_capacity_factor_second_level": 1.0, "moe_hidden_size": 4096,
    "moe_group_size": 1024, "moe_use_second_place_loss": 0, "moe_second_policy_train": "random",
    "moe_second_policy_eval": "random", "moe_second_threshold_train": 0.2, "moe_second_threshold_eval": 0.2,
}


class ClientHParams:
  """A client's own HParams-like object: add_hparam refuses names it already has (as tf HParams)."""

  def __init__(self):
    self.added = []

  def add_hparam(self, name, value):
    if hasattr(self, name):
      raise ValueError(f"hyperparameter {name} already exists")
    self.added.append(name)
    setattr(self, name, value)


def test_set_default_moe_hparams_adds_the_original_defaults_through_add_hparam():
  hparams = ClientHParams()
  moe.set_default_moe_hparams(hparams)
  assert {name: getattr(hparams, name) for name in ORIGINAL_DEFAULTS} == ORIGINAL_DEFAULTS
  # moe_num_experts and moe_loss_coef are plain attributes, the rest go through add_hparam.
  assert sorted(hparams.added) == sorted(set(ORIGINAL_DEFAULTS) - {"moe_num_experts", "moe_loss_coef"})


def test_moe_hparams_add_hparam_overrides_like_the_original():
  hparams = moe.HParams()
  moe.set_default_moe_hparams(hparams)
  hparams.add_hparam("moe_num_experts", 4)
  assert hparams.moe_num_experts == 4 and hparams.moe_gating == "top_2"


def _gpt_neo_hparams(**moe_params):
  """GPT-Neo's sequence: defaults, its two extra hparams, then its model's moe_params."""
  hparams = moe.HParams()
  moe.set_default_moe_hparams(hparams)
  hparams.add_hparam("moe_min_expert_capacity", 1)
  hparams.add_hparam("moe_use_experts_attention", False)
  overrides = dict(moe_num_experts=4, moe_hidden_size=16, moe_group_size=8, moe_dropout_rate=0.0)
  overrides.update(moe_params)
  for name, value in overrides.items():
    hparams.add_hparam(name, value)
  return hparams


def _gpt_neo_moe_v1(mesh, mesh_shape, layout, train=True):
  x = mtf.import_tf_tensor(mesh, tf.constant(X), shape=X_SHAPE)
  output, aux_loss = moe.transformer_moe_layer_v1(
      x, x.shape[-1], _gpt_neo_hparams(), train=train, mesh_shape=mesh_shape, layout=layout,
      activation="relu", variable_dtype=mtf.VariableDType(tf.float32), num_microbatches=1)
  return x, output, aux_loss


def _gpt_neo_moe_v1_values(mesh_shape, layout):
  def build(mesh):
    x, output, aux_loss = _gpt_neo_moe_v1(mesh, mtf.convert_to_shape(mesh_shape), layout, train=False)
    assert output.shape == x.shape
    assert aux_loss.shape.dims == []
    return [output, aux_loss]
  return lower_and_evaluate(build, mesh_shape, layout)


@pytest.fixture(scope="module")
def one_processor_moe_v1():
  return _gpt_neo_moe_v1_values("all:1", "")


def test_gpt_neo_call_sequence_routes_every_token_on_one_processor(one_processor_moe_v1):
  output, aux_loss = one_processor_moe_v1
  assert output.shape == X.shape and np.all(np.isfinite(output))
  # Top-2 routing of 2 groups of 8 tokens among 4 experts, eval capacity 4 a group and expert:
  # every token reaches an expert here, so no output row is zero.
  assert np.all(np.abs(output).max(axis=-1) > 0)
  assert np.isfinite(aux_loss) and aux_loss > 0


@pytest.mark.parametrize("mesh_shape,layout", [("b:2", "batch:b"), ("e:4", "experts:e"),
                                               ("b:2;e:2", "batch:b;experts:e")])
def test_gpt_neo_call_sequence_gives_the_one_processor_values_under_any_layout(
    mesh_shape, layout, one_processor_moe_v1):
  """The groups (2 of 8 tokens) are the same on these meshes, so the layout changes nothing."""
  output, aux_loss = _gpt_neo_moe_v1_values(mesh_shape, layout)
  expected_output, expected_aux_loss = one_processor_moe_v1
  np.testing.assert_allclose(output, expected_output, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(aux_loss, expected_aux_loss, rtol=1e-5)


def test_gpt_neo_moe_layer_v1_trains():
  """A regression loss through the GPT-Neo-built MoE layer (plus its aux loss) falls under SGD."""
  target = np.tanh(X[..., ::-1]).copy()

  def build_loss(mesh):
    _, output, aux_loss = _gpt_neo_moe_v1(mesh, mtf.convert_to_shape("b:2"), "batch:b")
    y = mtf.import_tf_tensor(mesh, tf.constant(target), shape=X_SHAPE)
    return mtf.reduce_mean(mtf.square(output - y)) + aux_loss
  losses = train_losses(build_loss, steps=6, mesh_shape="b:2", layout="batch:b", learning_rate=0.5)
  assert losses[-1] < losses[0] * 0.9, losses


def test_gpt_neo_style_call_with_a_named_output_dim_and_a_tf_dtype():
  """One GPT-Neo model passes output_dim=Dimension("moe_out", n_embd) and variable_dtype=tf.float32."""
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), shape=X_SHAPE)
    output, _ = moe.transformer_moe_layer_v1(
        x, mtf.Dimension("moe_out", D_MODEL), _gpt_neo_hparams(), train=True, mesh_shape="b:2",
        layout="batch:b", variable_dtype=tf.float32)
    assert output.shape.dimension_names == ["batch", "length", "moe_out"]
    return [output]
  output, = lower_and_evaluate(build, "b:2", "batch:b")
  assert output.shape == X.shape


def test_set_default_moe_hparams_then_a_two_level_moe_layer_v2():
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), shape=X_SHAPE)
    hparams = _gpt_neo_hparams(moe_num_experts=[2, 2])
    output, aux_loss = moe.transformer_moe_layer_v2(
        x, x.shape[-1], hparams, train=False, variable_dtype=mtf.VariableDType(tf.float32))
    assert output.shape == x.shape
    return [output, aux_loss]
  output, aux_loss = lower_and_evaluate(build)
  assert output.shape == X.shape and np.all(np.isfinite(output)) and np.isfinite(aux_loss)


EMBEDDINGS = np.random.RandomState(1).randn(BATCH, LENGTH, D_MODEL).astype(np.float32)


@pytest.mark.parametrize("mode", ["concat", "add_stop_grad", "embed_only"])
def test_moe_word_embed_mode_routes_on_the_token_embeddings(mode):
  """0.1.21's moe_word_embed_mode: the router sees [x, e], x + e or e alone; the experts still see x."""
  hparams = _gpt_neo_hparams(moe_gating="switch", moe_switch_policy_eval="argmax",
                             moe_capacity_factor_eval=4.0, moe_word_embed_mode=mode)
  names = []

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), shape=X_SHAPE)
    embeddings = mtf.import_tf_tensor(mesh, tf.constant(EMBEDDINGS), shape=X_SHAPE)
    output, _ = moe.transformer_moe_layer_v1(
        x, x.shape[-1], hparams, train=False, variable_dtype=mtf.VariableDType(tf.float32),
        token_embeddings=embeddings)
    names.extend(v.name for v in mesh.graph.trainable_variables)
    return [output] + [v.outputs[0] for v in mesh.graph.trainable_variables]
  output, *values = lower_and_evaluate(build)
  variables = dict(zip(names, values))
  gate_kernel, = [v for n, v in variables.items() if n.endswith("gating/kernel")]
  wi, = [v for n, v in variables.items() if n.endswith("wi/kernel")]
  wo, = [v for n, v in variables.items() if n.endswith("wo/kernel")]
  x, e = X.reshape(-1, D_MODEL), EMBEDDINGS.reshape(-1, D_MODEL)
  gate_inputs = {"concat": np.concatenate([x, e], -1), "add_stop_grad": x + e, "embed_only": e}[mode]
  assert gate_kernel.shape == (gate_inputs.shape[-1], 4)
  logits = gate_inputs @ gate_kernel
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  chosen = probs.argmax(-1)
  expected = np.stack([probs[t, i] * np.maximum(x[t] @ wi[i], 0) @ wo[i] for t, i in enumerate(chosen)])
  np.testing.assert_allclose(output.reshape(-1, D_MODEL), expected, rtol=1e-4, atol=1e-5)


def test_moe_word_embed_mode_is_checked_and_needs_the_embeddings():
  with pytest.raises(ValueError, match="moe_word_embed_mode='mean' is not one of"):
    moe.MoE1D(word_embed_mode="mean")
  layer = moe.MoE1D(num_experts=2, hidden_size=4, moe_gating="switch", word_embed_mode="add")

  def build_layer(mesh):
    x = mtf.zeros(mesh, X_SHAPE)
    return [layer.call(make_context(x, model_stub(D_MODEL, layout="", mesh_shape="")), x)]
  with pytest.raises(ValueError, match="context.input_embeddings is None"):
    lower_and_evaluate(build_layer)
  hparams = _gpt_neo_hparams(moe_gating="switch", moe_word_embed_mode="add")
  with pytest.raises(ValueError, match="needs token_embeddings shaped like the inputs"):
    lower_and_evaluate(lambda mesh: list(moe.transformer_moe_layer_v1(
        mtf.zeros(mesh, X_SHAPE), mtf.Dimension("d_model", D_MODEL), hparams, train=False,
        variable_dtype=mtf.VariableDType(tf.float32))))


def test_a_unitransformer_hands_its_token_embeddings_to_a_word_embed_moe_layer():
  """0.1.21's Unitransformer sets context.input_embeddings, so MoE1D(word_embed_mode=...) builds in one."""
  from mesh_tensorflow.transformer import transformer
  layer = moe.MoE1D(num_experts=2, hidden_size=4, moe_gating="switch", word_embed_mode="add")
  layer.set_name("layer_000")
  model = transformer.Unitransformer(layer_stack=transformer.LayerStack([layer]), d_model=D_MODEL,
                                     input_vocab_size=8, output_vocab_size=8, autoregressive=True,
                                     max_length=LENGTH, vocab_divisor=8)
  ids = np.arange(BATCH * LENGTH).reshape(BATCH, LENGTH).astype(np.int32) % 7 + 1

  def build(mesh):
    inputs = mtf.import_tf_tensor(mesh, tf.constant(ids), f"batch:{BATCH};length:{LENGTH}")
    logits, loss = model.call_simple(inputs, inputs, True, mode="eval",
                                     variable_dtype=mtf.VariableDType(tf.float32))
    return [logits, loss]

  logits, loss = lower_and_evaluate(build)
  assert logits.shape == (BATCH, LENGTH, 8) and np.isfinite(logits).all() and np.isfinite(loss)


def test_moe2d_and_hparams_take_their_arguments_where_upstream_does():
  """Positional calls written for 0.1.21 bind the same values: MoE2D(x, y, loss_coef, hidden, group)."""
  hparams = moe.MoE2D(2, 3, 0.5, 16, 8)._hparams  # pylint: disable=protected-access
  bound = (hparams.moe_num_experts, hparams.moe_loss_coef, hparams.moe_hidden_size, hparams.moe_group_size)
  assert bound == ([2, 3], 0.5, 16, 8)
  bag = moe.HParams()
  bag.add_hparam(k="moe_gating", v="switch")
  assert bag.moe_gating == "switch"
