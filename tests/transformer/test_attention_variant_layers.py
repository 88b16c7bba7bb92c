"""transformer_layers attention variants against plain-TF references: talking-heads and general
bilinear attention, branched (weighted-heads) attention, transparent encoder-decoder attention,
the Synthesizer and mixture-of-experts attention."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer_layers
from tests.harness import lower_and_evaluate
from tests.layers.layer_check import check_layer
from tests.transformer.layer_context import (
    call_layer, causal_bias, make_context, model_stub, tf_attention, tf_multihead_attention, tf_project_heads,
    visibility_bias)

RNG = np.random.RandomState(3)
BATCH, LENGTH, D_MODEL = 2, 5, 8
X_SHAPE = "batch:2;length:5;d_model:8"
ENCODER_LENGTH = 4
ENCODER_SHAPE = "batch:2;memory_length:4;d_model:8"
ENCODER_IDS = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int32)


def _randn(*shape):
  return RNG.randn(*shape).astype(np.float32)


def _self_attention_build(layer, **context_kwargs):
  def build(x):
    return call_layer(layer, make_context(x, model_stub(D_MODEL), **context_kwargs), x)
  return build


def _enc_dec_build(layer):
  def build(x, encoder_output, encoder_ids):
    context = make_context(x, model_stub(D_MODEL), encoder_output=encoder_output,
                           encoder_sequence_id=encoder_ids)
    return call_layer(layer, context, x)
  return build


ENC_DEC_INPUTS = [(_randn(BATCH, LENGTH, D_MODEL), X_SHAPE),
                  (_randn(BATCH, ENCODER_LENGTH, D_MODEL), ENCODER_SHAPE),
                  (ENCODER_IDS, "batch:2;memory_length:4")]
PADDING_BIAS = visibility_bias(ENCODER_IDS != 0)[:, None, None, :]  # [b, 1, 1, m]


def tf_talking_heads(x, memory, variables, bias):
  """Talking heads with key heads h=4, softmax heads s=2, value heads v=2; x2l and m2w dynamic projections.

  As 0.1.21 computes it: no run-time 1/sqrt(d_k) on q (its initializer holds it), output kernel `y`.
  """
  q = tf.einsum("bld,dhk->blhk", x, variables["layer/q/kernel"])
  k = tf.einsum("bmd,dhk->bmhk", memory, variables["layer/k/kernel"])
  v = tf.einsum("bmd,dvk->bmvk", memory, variables["layer/v/kernel"])
  logits = tf.einsum("blhk,bmhk->blhm", q, k)
  dynamic = tf.einsum("bld,dhs->blhs", x, variables["layer/logits_dynamic_0/kernel"])
  logits = (tf.einsum("blhm,hs->blsm", logits, variables["layer/logits/kernel"])
            + tf.einsum("blhm,blhs->blsm", logits, dynamic) + bias)
  weights = tf.nn.softmax(logits)
  dynamic = tf.einsum("bmd,dsv->bmsv", memory, variables["layer/weights_dynamic_0/kernel"])
  weights = (tf.einsum("blsm,sv->blvm", weights, variables["layer/weights/kernel"])
             + tf.einsum("blsm,bmsv->blvm", weights, dynamic))
  o = tf.einsum("blvm,bmvk->blvk", weights, v)
  return tf.einsum("blvk,vkd->bld", o, variables["layer/y/kernel"])


TALKING_HEADS = dict(key_heads_dims=[("heads", 4)], softmax_heads_dims=[("softmax_heads", 2)],
                     value_heads_dims=[("value_heads", 2)], key_size=2, value_size=3,
                     dynamic_projections=["x2l", "m2w"])


def test_talking_heads_self_attention_mixes_heads_before_and_after_the_softmax():
  layer = transformer_layers.TalkingHeadsSelfAttention(**TALKING_HEADS)

  def reference(x, variables):
    return tf_talking_heads(x, x, variables, causal_bias(LENGTH)[:, None, :])
  result = check_layer(_self_attention_build(layer), reference, [(_randn(BATCH, LENGTH, D_MODEL), X_SHAPE)],
                       "batch:2;model:2", "batch:batch;heads:model")
  assert result.shapes["layer/logits/kernel"].dimension_names == ["heads", "softmax_heads"]


def test_talking_heads_enc_dec_attention_hides_encoder_padding():
  layer = transformer_layers.TalkingHeadsEncDecAttention(**TALKING_HEADS)

  def reference(x, encoder_output, encoder_ids, variables):
    return tf_talking_heads(x, encoder_output, variables, PADDING_BIAS)
  check_layer(_enc_dec_build(layer), reference, ENC_DEC_INPUTS)


@pytest.mark.parametrize("make_layer,q_fan", [
    (lambda: transformer_layers.TalkingHeadsSelfAttention(**TALKING_HEADS), D_MODEL * 2),
    (lambda: transformer_layers.GeneralBilinearSelfAttention(heads_dims=[("heads", 2)]), D_MODEL * D_MODEL),
], ids=["talking_heads", "general_bilinear"])
def test_query_scaling_lives_in_the_query_kernel_initializer(make_layer, q_fan):
  """0.1.21 draws q with variance 1 / (d_model * d_k) and does not rescale q at run time."""
  stddevs = []
  truncated_normal = tf.truncated_normal_initializer

  def recording(stddev=1.0, **kwargs):
    stddevs.append(stddev)
    return truncated_normal(stddev=stddev, **kwargs)
  with mock.patch.object(tf, "truncated_normal_initializer", recording):
    lower_and_evaluate(lambda mesh: [_self_attention_build(make_layer())(mtf.zeros(mesh, X_SHAPE))])
  assert stddevs[0] == pytest.approx(q_fan ** -0.5)  # q is the first variable made


def test_talking_heads_rejects_heads_roles_reusing_a_name_with_another_size():
  layer = transformer_layers.TalkingHeadsSelfAttention(
      key_heads_dims=[("heads", 4)], softmax_heads_dims=[("heads", 2)], value_heads_dims=[("heads", 2)])
  with pytest.raises(ValueError, match="reuse the names \\['heads'\\]"):
    lower_and_evaluate(lambda mesh: [_self_attention_build(layer)(mtf.zeros(mesh, X_SHAPE))])


def tf_bilinear(x, memory, variables, bias):
  """Bilinear attention: q = x W_q [heads, d_model], k = v = memory."""
  q = tf.einsum("bld,dhe->blhe", x, variables["layer/q/kernel"])
  weights = tf.nn.softmax(tf.einsum("blhe,bme->blhm", q, memory) + bias)
  o = tf.einsum("blhm,bme->blhe", weights, memory)
  return tf.einsum("blhe,hef->blf", o, variables["layer/y/kernel"])


def test_general_bilinear_self_attention_uses_the_input_as_keys_and_values():
  layer = transformer_layers.GeneralBilinearSelfAttention(heads_dims=[("heads", 2)])

  def reference(x, variables):
    return tf_bilinear(x, x, variables, causal_bias(LENGTH)[:, None, :])
  result = check_layer(_self_attention_build(layer), reference, [(_randn(BATCH, LENGTH, D_MODEL), X_SHAPE)],
                       "model:2", "heads:model")
  assert sorted(result.variables) == ["layer/q/kernel", "layer/y/kernel"]


def test_general_bilinear_enc_dec_attention_uses_the_encoder_output_as_keys_and_values():
  layer = transformer_layers.GeneralBilinearEncDecAttention(heads_dims=[("heads", 2)])

  def reference(x, encoder_output, encoder_ids, variables):
    return tf_bilinear(x, encoder_output, variables, PADDING_BIAS)
  check_layer(_enc_dec_build(layer), reference, ENC_DEC_INPUTS)


def tf_branched(x, memory, variables, bias, heads=2):
  """Per-head outputs projected to d_model, weighted by kappa, a shared FFN, weighted by alpha, summed."""
  def project(name):
    return tf.einsum("bld,dhk->blhk", x if name == "q" else memory, variables["layer/" + name])
  o = tf_attention(project("q"), project("k"), project("v"), bias)
  o = tf.einsum("blhk,kd->blhd", o, variables["layer/o"])

  def normalized(name):
    z = tf.nn.relu(variables["layer/" + name])
    return z / tf.reduce_sum(z + 1e-4)
  o *= normalized("kappa")[:, None]
  h = tf.nn.relu(tf.einsum("blhd,df->blhf", o, variables["layer/wi/kernel"]))
  o = tf.einsum("blhf,fd->blhd", h, variables["layer/wo/kernel"]) * normalized("alpha")[:, None]
  return tf.reduce_sum(o, axis=2)


def test_branched_self_attention_weights_per_head_branches():
  layer = transformer_layers.BranchedSelfAttention(num_heads=2, key_value_size=2)
  layer.dense_layer.hidden_size = 4

  def reference(x, variables):
    return tf_branched(x, x, variables, causal_bias(LENGTH))
  check_layer(_self_attention_build(layer), reference, [(_randn(BATCH, LENGTH, D_MODEL), X_SHAPE)],
              "batch:2;model:2", "batch:batch;heads:model")


def test_branched_enc_dec_attention_weights_per_head_branches():
  layer = transformer_layers.BranchedEncDecAttention(num_heads=2, key_value_size=2)
  layer.dense_layer.hidden_size = 4

  def reference(x, encoder_output, encoder_ids, variables):
    return tf_branched(x, encoder_output, variables, PADDING_BIAS)
  check_layer(_enc_dec_build(layer), reference, ENC_DEC_INPUTS)


def test_branched_attention_needs_one_key_value_head_per_branch():
  with pytest.raises(ValueError, match="num_memory_heads to 0"):
    transformer_layers.BranchedSelfAttention(num_heads=4, num_memory_heads=2)


def test_transparent_attention_attends_over_a_learned_mix_of_encoder_layers():
  layer = transformer_layers.TransparentEncDecAttention(
      layers_per_encoder_module=2, layers_per_decoder_module=1, encoder_num_modules=2, decoder_num_modules=2,
      num_heads=2, key_value_size=4)
  encoder_layers = _randn(5, BATCH, ENCODER_LENGTH, D_MODEL)  # embedding output + 4 layer outputs

  def build(x, encoder_outputs):
    outputs = [mtf.rename_dimension(t, "memory_length", "length")
               for t in mtf.unstack(encoder_outputs, encoder_outputs.shape.dims[0])]
    context = make_context(x, model_stub(D_MODEL), encoder_layer_outputs=outputs)
    context.layer_index = 1  # the second decoder module
    return call_layer(layer, context, x)

  def reference(x, encoder_outputs, variables):
    mix = tf.nn.softmax(variables["layer/w"], axis=0)[:, 1]  # [3 candidates]
    memory = tf.einsum("c,cbmd->bmd", mix, tf.gather(encoder_outputs, [0, 2, 4]))
    return tf_multihead_attention(x, memory, variables, "layer", 2)
  check_layer(build, reference, [(_randn(BATCH, LENGTH, D_MODEL), X_SHAPE),
                                 (encoder_layers, "layers:5;batch:2;memory_length:4;d_model:8")])


SYNTHESIZER_VARIABLES = {  # 0.1.21's variables (names and shapes) per mode; 2 heads of d_kv 2
    "random": {"kv": [8, 4], "o": [4, 8], "R": [512, 2, 512]},
    "factorized": {"kv": [8, 4], "o": [4, 8], "R1": [16, 2, 512], "R2": [16, 2, 512]},
    "dense_minus": {"q": [8, 4], "kv": [8, 4], "o": [4, 8], "pi/kernel": [2, 512]},
    "random_plus_alpha": {"q": [8, 4], "k": [8, 4], "v": [8, 4], "o": [4, 8], "R": [512, 2, 512],
                          "alpha": [1]},
    "dense_plus": {"q": [8, 4], "k": [8, 4], "v": [8, 4], "o": [4, 8], "pi/kernel": [2, 512]},
}


def _tf_synthesizer(mode: str, x, variables):
  """0.1.21's Synthesizer layer in plain TF (2 heads, causal)."""
  w = {name[len("layer/"):]: value for name, value in variables.items()}
  if "kv" in w:
    k = v = tf_project_heads(x, w["kv"], 2)
  else:
    k, v = tf_project_heads(x, w["k"], 2), tf_project_heads(x, w["v"], 2)
  q = tf_project_heads(x, w["q"], 2) if "q" in w else None
  if mode == "random":
    logits = tf.transpose(w["R"][:LENGTH, :, :LENGTH], [1, 0, 2])[None]  # [1, heads, length, memory]
  elif mode == "factorized":
    logits = tf.reduce_sum(w["R1"] * w["R2"], 0)[None, :, None, :LENGTH]
  else:
    dot = tf.einsum("blhk,bmhk->bhlm", q, k)
    dense = (tf.einsum("blhk,km->bhlm", tf.nn.relu(q), w["pi/kernel"][:, :LENGTH]) if "pi/kernel" in w
             else None)
    if mode == "dense_minus":
      logits = dense
    elif mode == "dense_plus":
      logits = dot + dense
    else:
      alpha = tf.sigmoid(w["alpha"][0])
      logits = (1 - alpha) * dot + alpha * tf.transpose(w["R"][:LENGTH, :, :LENGTH], [1, 0, 2])[None]
  logits = tf.broadcast_to(logits, [BATCH, 2, LENGTH, LENGTH])
  o = tf.einsum("bhlm,bmhk->blhk", tf.nn.softmax(logits + causal_bias(LENGTH)), v)
  return tf.einsum("blhk,hkd->bld", o, tf.reshape(w["o"], [2, 2, D_MODEL]))


@pytest.mark.parametrize("mode", sorted(SYNTHESIZER_VARIABLES))
def test_synthesizer_makes_0_1_21s_variables_and_attention(mode):
  """The mode decides the projections as in 0.1.21: plus = q, k, v; minus = q, kv; random/factorized = kv."""
  layer = transformer_layers.Synthesizer(num_heads=2, key_value_size=2, synthesize_mode=mode)
  result = check_layer(_self_attention_build(layer), lambda x, variables: _tf_synthesizer(mode, x, variables),
                       [(_randn(BATCH, LENGTH, D_MODEL), X_SHAPE)])
  assert {name[len("layer/"):]: shape.to_integer_list for name, shape in result.shapes.items()} == (
      SYNTHESIZER_VARIABLES[mode])


def test_synthesizer_rejects_an_unknown_mode():
  with pytest.raises(ValueError, match="synthesize_mode='dense' is not one of"):
    transformer_layers.Synthesizer(synthesize_mode="dense")


EXPERTS = dict(num_experts=1, hidden_size=4, group_size=16, capacity_factor_eval=2.0,
               switch_policy_eval="argmax", num_heads=4, key_value_size=2)


def test_experts_self_attention_projects_q_and_shared_kv_with_the_expert_layer():
  # One expert takes every token with gate probability 1, so the layer is exact attention over
  # q = relu(x wi) q_wo / sqrt(d_kv) and k = v = relu(x wi) k_wo.
  layer = transformer_layers.ExpertsSelfAttention(**EXPERTS)
  losses = []

  def build(x):
    model = model_stub(D_MODEL, layout="batch:batch", mesh_shape="batch:2")
    return call_layer(layer, make_context(x, model, losses=losses), x)

  def reference(x, variables):
    h = tf.nn.relu(tf.einsum("bld,dh->blh", x, variables["layer/wi/kernel"][0]))
    q = tf.reshape(tf.einsum("blh,he->ble", h, variables["layer/q_wo/kernel"][0]), [BATCH, LENGTH, 4, 2])
    k = tf.reshape(tf.einsum("blh,he->ble", h, variables["layer/k_wo/kernel"][0]), [BATCH, LENGTH, 4, 2])
    o = tf_attention(q * 2 ** -0.5, k, k, causal_bias(LENGTH))
    return tf.einsum("blhk,hkd->bld", o, tf.reshape(variables["layer/o"], [4, 2, D_MODEL]))
  check_layer(build, reference, [(_randn(BATCH, LENGTH, D_MODEL), X_SHAPE)], "batch:2", "batch:batch")
  assert len(losses) == 1  # the load-balancing loss



def _tf_expert(t, variables):
  """The one expert's output relu(t wi) wo, [batch, length, heads=4, d_kv=2]."""
  h = tf.nn.relu(tf.einsum("bld,dh->blh", t, variables["layer/wi/kernel"][0]))
  return tf.reshape(tf.einsum("blh,he->ble", h, variables["layer/wo/kernel"][0]), [BATCH, -1, 4, 2])


def _tf_output(o, variables):
  return tf.einsum("blhk,hkd->bld", o, tf.reshape(variables["layer/o"], [4, 2, D_MODEL]))


def test_experts_self_attention_kv_mode_projects_q_with_a_variable_and_kv_with_the_experts():
  """0.1.21's expert_computation="kv": q = x `q` / sqrt(d_kv) (run-time scaling), k = v = the expert."""
  layer = transformer_layers.ExpertsSelfAttention(expert_computation="kv", **EXPERTS)

  def reference(x, variables):
    q = tf_project_heads(x, variables["layer/q"], 4) * 2 ** -0.5
    kv = _tf_expert(x, variables)
    return _tf_output(tf_attention(q, kv, kv, causal_bias(LENGTH)), variables)
  model = model_stub(D_MODEL, layout="batch:batch", mesh_shape="batch:2")
  result = check_layer(lambda x: call_layer(layer, make_context(x, model), x), reference,
                       [(_randn(BATCH, LENGTH, D_MODEL), X_SHAPE)], "batch:2", "batch:batch")
  assert sorted(result.shapes) == ["layer/o", "layer/q", "layer/switch_gating/kernel", "layer/wi/kernel",
                                   "layer/wo/kernel"]


def test_experts_enc_dec_attention_takes_keys_and_values_from_the_encoder_output():
  # "q": q = relu(x wi) wo / sqrt(d_kv) from the expert layer; k = v = encoder_output kv.
  layer = transformer_layers.ExpertsEncDecAttention(expert_computation="q", **EXPERTS)

  def reference(x, encoder_output, encoder_ids, variables):
    kv = tf_project_heads(encoder_output, variables["layer/kv"], 4)
    return _tf_output(tf_attention(_tf_expert(x, variables) * 2 ** -0.5, kv, kv, PADDING_BIAS), variables)
  check_layer(_enc_dec_build(layer), reference, ENC_DEC_INPUTS)


def test_experts_enc_dec_attention_kv_mode_runs_the_experts_on_the_encoder_output():
  layer = transformer_layers.ExpertsEncDecAttention(expert_computation="kv", **EXPERTS)

  def reference(x, encoder_output, encoder_ids, variables):
    q = tf_project_heads(x, variables["layer/q"], 4) * 2 ** -0.5
    kv = _tf_expert(encoder_output, variables)
    return _tf_output(tf_attention(q, kv, kv, PADDING_BIAS), variables)
  check_layer(_enc_dec_build(layer), reference, ENC_DEC_INPUTS)


def test_experts_attention_expert_computation_is_checked():
  """0.1.21's default "qkv" makes an enc-dec layer's keys from the decoder input (0.1.21 fails there)."""
  assert transformer_layers.ExpertsEncDecAttention().expert_computation == "qkv"
  with pytest.raises(ValueError, match="expert_computation='qkv' computes the keys from the decoder input"):
    check_layer(_enc_dec_build(transformer_layers.ExpertsEncDecAttention(**EXPERTS)), None, ENC_DEC_INPUTS)
  with pytest.raises(ValueError, match="expert_computation='k' is not 'qkv'"):
    transformer_layers.ExpertsSelfAttention(expert_computation="k")


@pytest.mark.parametrize("layer_cls", ["SelfAttention", "EncDecAttention"])
def test_z_loss_coeff_adds_the_mean_squared_log_normalizer_of_the_logits_in_training(layer_cls):
  """0.1.21's attention z-loss: z_loss_coeff * mean(logsumexp(logits over memory)**2 * nonpadding)."""
  heads, coeff = 2, 0.1
  layer = getattr(transformer_layers, layer_cls)(num_heads=heads, key_value_size=4, z_loss_coeff=coeff)
  x, encoder = _randn(BATCH, LENGTH, D_MODEL), _randn(BATCH, ENCODER_LENGTH, D_MODEL)
  sequence_id = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int32)

  def build(mesh):
    xt = mtf.import_tf_tensor(mesh, tf.constant(x), shape=X_SHAPE)
    ids = mtf.import_tf_tensor(mesh, tf.constant(sequence_id), shape="batch:2;length:5")
    extra = {}
    if layer_cls == "EncDecAttention":
      extra["encoder_output"] = mtf.import_tf_tensor(mesh, tf.constant(encoder), shape=ENCODER_SHAPE)
    context = make_context(xt, model_stub(D_MODEL), mode="train", sequence_id=ids, **extra)
    call_layer(layer, context, xt)
    eval_context = make_context(xt, model_stub(D_MODEL), sequence_id=ids, **extra)
    call_layer(layer, eval_context, xt)
    assert eval_context.losses == []
    z_loss, = context.losses
    return [z_loss] + [v.outputs[0] for v in mesh.graph.trainable_variables]
  z_loss, wq, wk, *_ = lower_and_evaluate(build)
  memory = encoder if layer_cls == "EncDecAttention" else x
  logits = np.einsum("blhd,bmhd->bhlm", (x @ wq).reshape(BATCH, LENGTH, heads, 4),
                     (memory @ wk).reshape(BATCH, -1, heads, 4))
  if layer_cls == "SelfAttention":  # causal and segment masks
    visible = (np.arange(LENGTH)[:, None] >= np.arange(LENGTH)[None, :])[None, None]
    visible = visible & (sequence_id[:, None, :, None] == sequence_id[:, None, None, :])
    logits = np.where(visible, logits, logits - 1e9)
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  expected = coeff * np.mean(log_z ** 2 * (sequence_id != 0)[:, None, :])
  np.testing.assert_allclose(z_loss, expected, rtol=1e-4)


PROMPT_LENGTH, PROMPT_HIDDEN, TASKS = 3, 4, 2
TASK_IDS = np.array([[1] * LENGTH, [0] * LENGTH], np.int32)  # [batch, length]: each example's task


def _tf_layer_norm(t, scale, bias):
  mean, variance = tf.nn.moments(t, axes=[-1], keepdims=True)
  return (t - mean) * tf.math.rsqrt(variance + 1e-6) * scale + bias


@pytest.mark.parametrize("scope,share", [("decoder", False), ("encoder", True)])
def test_self_attention_hyperprompts_prepend_task_prompt_keys_and_values(scope, share):
  """0.1.21's MTL-Prompt: keys/values of each example's task prompts, seen by every query."""
  layer = transformer_layers.SelfAttention(
      num_heads=2, key_value_size=2, hyperprompt_mtlshare=share, hyperprompt_hidden_dim=PROMPT_HIDDEN,
      hyperprompt_task_num=TASKS, **{f"hyperprompt_length_{scope}": PROMPT_LENGTH})
  causal = scope == "decoder"

  def build(x, prompts, task_ids):
    context = make_context(x, model_stub(D_MODEL), causal=causal)
    context.cache["task-id"] = task_ids
    context.shared_params = {scope: {"prompts": prompts}}
    return call_layer(layer, context, x, scope=scope)

  def reference(x, prompts, task_ids, variables):
    w = {name[len(scope) + 1:]: value for name, value in variables.items()}
    ln = "prompts_layernorm/layer_norm/layer_norm_"
    normed = _tf_layer_norm(prompts, w[ln + "scale"], w[ln + "bias"])  # [task, prompt, d_model]

    def prompt_projection(kind):
      up, down = w[f"prompt/w_{kind}_up"], w[f"prompt/w_{kind}_down"]
      if share:
        hidden = tf.nn.relu(tf.einsum("tpd,dh->tph", normed, up))
        projected = tf.einsum("tph,hnk->tpnk", hidden, down)
      else:
        hidden = tf.nn.relu(tf.einsum("tpd,tdh->tph", normed, up))
        projected = tf.einsum("tph,thnk->tpnk", hidden, down)
      return tf.gather(projected, task_ids[:, 0])  # [batch, prompt, heads, d_kv]
    q, k, v = [tf_project_heads(x, w[n], 2) for n in "qkv"]
    k = tf.concat([prompt_projection("k"), k], 1)
    v = tf.concat([prompt_projection("v"), v], 1)
    visible = np.ones([LENGTH, PROMPT_LENGTH + LENGTH], bool)
    if causal:
      visible[:, PROMPT_LENGTH:] = np.arange(LENGTH)[:, None] >= np.arange(LENGTH)[None, :]
    o = tf_attention(q, k, v, visibility_bias(visible))
    return tf.einsum("blhk,hkd->bld", o, tf.reshape(w["o"], [2, 2, D_MODEL]))
  prompts = _randn(TASKS, PROMPT_LENGTH, D_MODEL)
  prompts_shape = f"task_num:{TASKS};memory_length:{PROMPT_LENGTH};d_model:8"
  result = check_layer(build, reference, [(_randn(BATCH, LENGTH, D_MODEL), X_SHAPE), (prompts, prompts_shape),
                                          (TASK_IDS, "batch:2;length:5")])
  task_dims = [] if share else [TASKS]
  assert result.shapes[scope + "/prompt/w_k_up"].to_integer_list == task_dims + [D_MODEL, PROMPT_HIDDEN]
  assert result.shapes[scope + "/prompt/w_v_down"].to_integer_list == task_dims + [PROMPT_HIDDEN, 2, 2]


def test_self_attention_hyperprompts_need_the_task_ids():
  layer = transformer_layers.SelfAttention(num_heads=2, key_value_size=2, hyperprompt_length_decoder=2,
                                           hyperprompt_hidden_dim=4)
  with pytest.raises(ValueError, match=r"set context.cache\['task-id'\]"):
    lower_and_evaluate(lambda mesh: [call_layer(
        layer, make_context(mtf.zeros(mesh, X_SHAPE), model_stub(D_MODEL)), mtf.zeros(mesh, X_SHAPE),
        scope="decoder")])


HYPERNET = {  # context.shared_params["decoder"] of a HyperPrompt client: name -> (shape, dims)
    "task_raw_embedding": ((TASKS, 5), "task_num:2;task_emb:5"),
    "layer_embedding": ((3, 2), "layers:3;task_emb:2"),
    "task_projector_layer_one": ((7, 6), "task_emb:7;task_hidden:6"),
    "task_projector_layer_two": ((6, 4), "task_hidden:6;task_final:4"),
    "hypernet_w_k_up": ((4, D_MODEL, PROMPT_HIDDEN), "task_final:4;d_model:8;prefix_hidden:4"),
    "hypernet_w_v_up": ((4, D_MODEL, PROMPT_HIDDEN), "task_final:4;d_model:8;prefix_hidden:4"),
    "hypernet_w_k_down": ((4, PROMPT_HIDDEN, 2, 2), "task_final:4;prefix_hidden:4;heads:2;d_kv:2"),
    "hypernet_w_v_down": ((4, PROMPT_HIDDEN, 2, 2), "task_final:4;prefix_hidden:4;heads:2;d_kv:2"),
}


def test_self_attention_hyperprompt_mode_generates_the_prompt_projections_per_task_and_layer():
  """use_hyperprompt: the projections come from a hypernetwork of the task and layer (layer_002) embedding."""
  layer = transformer_layers.SelfAttention(num_heads=2, key_value_size=2, use_hyperprompt=True,
                                           hyperprompt_length_decoder=PROMPT_LENGTH,
                                           hyperprompt_hidden_dim=PROMPT_HIDDEN, hyperprompt_task_num=TASKS)

  def build(x, prompts, task_ids, *hypernet):
    context = make_context(x, model_stub(D_MODEL))
    context.cache["task-id"] = task_ids
    context.shared_params = {"decoder": dict(prompts=prompts, **dict(zip(HYPERNET, hypernet)))}
    with tf.variable_scope("decoder"):
      return call_layer(layer, context, x, scope="layer_002")

  def reference(x, prompts, task_ids, *hypernet, variables):
    w = {name[len("decoder/layer_002/"):]: value for name, value in variables.items()}
    h = dict(zip(HYPERNET, hypernet))

    def layer_norm(t, name):
      scope = name + "/layer_norm/layer_norm_"
      return _tf_layer_norm(t, w[scope + "scale"], w[scope + "bias"])
    rows = tf.tile(h["layer_embedding"][2:3], [TASKS, 1])
    task_hidden = tf.nn.relu(tf.concat([h["task_raw_embedding"], rows], 1) @ h["task_projector_layer_one"])
    task = layer_norm(task_hidden @ h["task_projector_layer_two"], "prompt_task_embed_layernorm")
    normed = layer_norm(prompts, "prompts_layernorm")

    def prompt_projection(kind):
      up = tf.einsum("tf,fdh->tdh", task, h[f"hypernet_w_{kind}_up"])
      down = tf.einsum("tf,fhnk->thnk", task, h[f"hypernet_w_{kind}_down"])
      projected = tf.einsum("tph,thnk->tpnk", tf.nn.relu(tf.einsum("tpd,tdh->tph", normed, up)), down)
      return tf.gather(projected, task_ids[:, 0])
    q, k, v = [tf_project_heads(x, w[n], 2) for n in "qkv"]
    k = tf.concat([prompt_projection("k"), k], 1)
    v = tf.concat([prompt_projection("v"), v], 1)
    visible = np.ones([LENGTH, PROMPT_LENGTH + LENGTH], bool)
    visible[:, PROMPT_LENGTH:] = np.arange(LENGTH)[:, None] >= np.arange(LENGTH)[None, :]
    o = tf_attention(q, k, v, visibility_bias(visible))
    return tf.einsum("blhk,hkd->bld", o, tf.reshape(w["o"], [2, 2, D_MODEL]))
  hypernet = [(_randn(*shape) * 0.5, dims) for shape, dims in HYPERNET.values()]
  prompts = (_randn(TASKS, PROMPT_LENGTH, D_MODEL), "task_num:2;memory_length:3;d_model:8")
  check_layer(build, reference, [(_randn(BATCH, LENGTH, D_MODEL), X_SHAPE), prompts,
                                 (TASK_IDS[:, :1], "batch:2;one:1")] + hypernet)
