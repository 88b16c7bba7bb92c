"""transformer/attention.py against plain-TF / NumPy references, on one processor and sharded over data,
heads, length and 2-D layouts (outputs and gradients), plus the 0.1.18 calling conventions."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import attention
from tests.harness import assert_allclose, assert_op_matches_tf, lower_and_evaluate

B, L, M, H, K, V = 4, 4, 4, 4, 2, 3
KEY, VALUE = mtf.Dimension("d_k", K), mtf.Dimension("d_v", V)
MEMORY = mtf.Dimension("memory_length", M)
F32 = mtf.VariableDType(tf.float32)


def _qkv(seed=0, length=L, memory=M):
  rng = np.random.RandomState(seed)
  q = rng.randn(B, length, H, K).astype(np.float32)
  k = rng.randn(B, memory, H, K).astype(np.float32)
  v = rng.randn(B, memory, H, V).astype(np.float32)
  return q, k, v


def _reference(q, k, v, bias=None, extra_logit=None):
  """softmax(q.k + bias) . v in plain TF; q [b, l, h, k], k [b, m, h, k], bias [l, m]."""
  logits = tf.einsum("blhk,bmhk->blhm", q, k)
  if bias is not None:
    logits += bias[None, :, None, :]
  if extra_logit is not None:
    log_z = tf.reduce_logsumexp(tf.concat([logits, tf.fill(tf.shape(logits[..., :1]), extra_logit)], -1), -1)
    weights = tf.exp(logits - log_z[..., None])
  else:
    weights = tf.nn.softmax(logits, axis=-1)
  return tf.einsum("blhm,bmhv->blhv", weights, v)


LAYOUTS = [("all:1", ""), ("all:4", "batch:all"), ("all:4", "heads:all"), ("all:2", "length:all"),
           ("rows:2;cols:4", "batch:rows;heads:cols")]


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_attention_matches_tf_with_bias_and_extra_logit_under_every_layout(mesh_shape, layout):
  q, k, v = _qkv()
  bias = np.triu(np.full((L, M), -1e9, np.float32), 1)  # causal
  assert_op_matches_tf(
      lambda q, k, v, bias: attention.attention(q, k, v, MEMORY, KEY, VALUE, bias=bias, extra_logit=0.5),
      lambda q, k, v, bias: _reference(q, k, v, bias, extra_logit=0.5),
      [(q, "batch:4;length:4;heads:4;d_k:2"), (k, "batch:4;memory_length:4;heads:4;d_k:2"),
       (v, "batch:4;memory_length:4;heads:4;d_v:3"), (bias, "length:4;memory_length:4")],
      mesh_shape, layout, rtol=1e-4, atol=1e-5)


def test_attention_matches_tf_in_eager_mode():
  q, k, v = _qkv(9)
  assert_op_matches_tf(
      lambda q, k, v: attention.attention(q, k, v, MEMORY, KEY, VALUE), _reference,
      [(q, "batch:4;length:4;heads:4;d_k:2"), (k, "batch:4;memory_length:4;heads:4;d_k:2"),
       (v, "batch:4;memory_length:4;heads:4;d_v:3")], "all:4", "heads:all", mode="eager", rtol=1e-4)


def _attention_output(context, dropout_rate):
  q, k, v = _qkv(1)

  def build(mesh):
    qt, kt, vt = [mtf.import_tf_tensor(mesh, tf.constant(a), s) for a, s in [
        (q, "batch:4;length:4;heads:4;d_k:2"), (k, "batch:4;memory_length:4;heads:4;d_k:2"),
        (np.ones_like(v), "batch:4;memory_length:4;heads:4;d_v:3")]]
    return [attention.attention(qt, kt, vt, MEMORY, KEY, VALUE, dropout_rate=dropout_rate, context=context)]
  return lower_and_evaluate(build)[0]


def test_attention_dropout_follows_context_train_and_always_applies_without_context():
  plain = _attention_output(None, 0.0)
  assert_allclose(plain, np.ones_like(plain), rtol=1e-5)  # weights sum to 1, v = 1
  assert_allclose(_attention_output(SimpleNamespace(train=False), 0.5), plain, rtol=1e-5)
  for context in (None, SimpleNamespace(train=True)):  # None: release 0.1.18 behaviour
    dropped = _attention_output(context, 0.5)
    assert not np.allclose(dropped, plain)
    assert_allclose(dropped.mean(), 1.0, rtol=0.3)  # kept weights are scaled by 2


def _local_reference_mask(length, radius, fully_autoregressive, sequence_id):
  pos = np.arange(length)
  relative = pos[None, :] - pos[:, None]  # [query, memory]
  visible = (relative > -radius) & (relative <= (0 if fully_autoregressive else radius))
  return visible[None] & (sequence_id[:, :, None] == sequence_id[:, None, :])  # [batch, query, memory]


@pytest.mark.parametrize("fully_autoregressive", [True, False])
@pytest.mark.parametrize("mesh_shape,layout", [("all:1", ""), ("all:4", "length:all"),
                                               ("rows:2;cols:4", "batch:rows;heads:cols")])
def test_local_attention_1d_matches_a_masked_reference(fully_autoregressive, mesh_shape, layout):
  length, radius = 8, 2
  q, k, v = _qkv(2, length, length)
  sequence_id = np.array([[1] * 5 + [2] * 3] * 2 + [[1] * 8] * 2, np.int32)
  mask = _local_reference_mask(length, radius, fully_autoregressive, sequence_id)
  bias = np.where(mask, 0.0, -1e9).astype(np.float32)
  length_dim = mtf.Dimension("length", length)

  def mtf_fn(q, k, v, sequence_id):
    return attention.local_attention_1d(q, k, v, length_dim, KEY, VALUE,
                                        fully_autoregressive=fully_autoregressive, length_dim_num_splits=4,
                                        radius=radius, sequence_id=sequence_id)

  def tf_fn(q, k, v, sequence_id):
    logits = tf.einsum("blhk,bmhk->blhm", q, k) + bias[:, :, None, :]
    return tf.einsum("blhm,bmhv->blhv", tf.nn.softmax(logits, axis=-1), v)
  assert_op_matches_tf(mtf_fn, tf_fn, [
      (q, "batch:4;length:8;heads:4;d_k:2"), (k, "batch:4;length:8;heads:4;d_k:2"),
      (v, "batch:4;length:8;heads:4;d_v:3"), (sequence_id, "batch:4;length:8")],
      mesh_shape, layout, rtol=1e-4, atol=1e-5)


def test_local_attention_1d_read_write_priorities_make_it_causal():
  length, radius = 8, 3
  q, k, _ = _qkv(3, length, length)
  mask = _local_reference_mask(length, radius, True, np.ones((B, length), np.int32))
  bias = np.where(mask, 0.0, -1e9).astype(np.float32)
  length_dim = mtf.Dimension("length", length)
  key_as_value = mtf.Dimension("d_k", K)

  def mtf_fn(q, k):
    priority = mtf.range(q.mesh, length_dim, tf.int32)
    return attention.local_attention_1d(q, k, None, length_dim, KEY, key_as_value, fully_autoregressive=False,
                                        radius=radius, write_priority=priority, read_priority=priority)

  def tf_fn(q, k):
    logits = tf.einsum("blhk,bmhk->blhm", q, k) + bias[:, :, None, :]
    return tf.einsum("blhm,bmhk->blhk", tf.nn.softmax(logits, axis=-1), k)
  assert_op_matches_tf(mtf_fn, tf_fn, [(q, "batch:4;length:8;heads:4;d_k:2"),
                                       (k, "batch:4;length:8;heads:4;d_k:2")])


TWO_D = SimpleNamespace(train=False, model=SimpleNamespace(layout="heads:cols;d_model:rows",
                                                           mesh_shape="rows:2;cols:4"))


def test_2d_sharding_reshape_splits_an_idle_mesh_dimension_and_keeps_results():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  q = mtf.zeros(mesh, "batch:4;length:4;heads:4;d_k:2")
  k = mtf.zeros(mesh, "batch:4;memory_length:4;heads:4;d_k:2")
  bias = mtf.zeros(mesh, "length:4;memory_length:4")
  q2, k2, v2, bias2 = attention.maybe_reshape_attention_input_for_2d_sharding(TWO_D, q, k, k, bias, [KEY])
  # heads uses "cols"; rows is idle, so batch's low bits become a d_model dimension split over rows.
  assert q2.shape == mtf.convert_to_shape("batch:2;d_model:2;length:4;heads:4;d_k:2")
  assert k2.shape.dimension_names == ["batch", "d_model", "memory_length", "heads", "d_k"] and bias2 is bias
  one_d = SimpleNamespace(model=SimpleNamespace(layout="batch:all", mesh_shape="all:8"))
  assert attention.maybe_reshape_attention_input_for_2d_sharding(one_d, q, k, k, None, [KEY])[0] is q
  assert attention.maybe_reshape_attention_input_for_2d_sharding(None, q, k, k, None, [KEY])[0] is q
  q, k, v = _qkv(4)
  assert_op_matches_tf(
      lambda q, k, v: attention.attention(q, k, v, MEMORY, KEY, VALUE, context=TWO_D), _reference,
      [(q, "batch:4;length:4;heads:4;d_k:2"), (k, "batch:4;memory_length:4;heads:4;d_k:2"),
       (v, "batch:4;memory_length:4;heads:4;d_v:3")], "rows:2;cols:4", "heads:cols;d_model:rows", rtol=1e-4)


def _hybrid_reference(q, k, v, coeff):
  logits = tf.einsum("blhk,bmhk->blhm", q, k)
  upper = tf.nn.softmax(logits, axis=-1)
  doubly = tf.nn.softmax(tf.nn.log_softmax(logits, axis=1), axis=-1)
  return tf.einsum("blhm,bmhv->blhv", coeff * doubly + (1 - coeff) * upper, v)


def test_hybrid_attention_mixes_softmax_and_doubly_normalised_weights():
  q, k, v = _qkv(5)

  def mtf_fn(q, k, v):
    context = SimpleNamespace(mesh=q.mesh, variable_dtype=F32, train=False)
    return attention.hybrid_attention(q, k, v, context, MEMORY, KEY, VALUE)
  assert_op_matches_tf(mtf_fn, lambda q, k, v: _hybrid_reference(q, k, v, 0.5),
                       [(q, "batch:4;length:4;heads:4;d_k:2"), (k, "batch:4;memory_length:4;heads:4;d_k:2"),
                        (v, "batch:4;memory_length:4;heads:4;d_v:3")], "all:4", "heads:all", rtol=1e-4)


def _softmax(logits):
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


SYNTHETIC_CASES = {  # mode: (variables {name: shape}, logits [b, l, h, m] from (q, k, variables))
    "random": ({"R": [6, H, 6]}, lambda q, k, w: np.broadcast_to(w["R"][None, :L, :, :M], (B, L, H, M))),
    "factorized": ({"R1": [3, H, 512], "R2": [3, H, 512]}, lambda q, k, w: np.broadcast_to(
        (w["R1"] * w["R2"]).sum(0)[:, :M], (B, L, H, M))),
    "dense_minus": ({"pi/kernel": [K, 6]}, lambda q, k, w: np.maximum(q, 0) @ w["pi/kernel"][:, :M]),
    "random_plus_alpha": ({"R": [512, H, 512], "alpha": [1]}, lambda q, k, w: (
        (1 - _sigmoid(w["alpha"])) * np.einsum("blhk,bmhk->blhm", q, k)
        + _sigmoid(w["alpha"]) * w["R"][None, :L, :, :M])),
    "dense_plus": ({"pi/kernel": [K, 512]}, lambda q, k, w: (
        np.einsum("blhk,bmhk->blhm", q, k) + np.maximum(q, 0) @ w["pi/kernel"][:, :M])),
}


def _sigmoid(a):
  return 1 / (1 + np.exp(-a))


@pytest.mark.parametrize("mode", sorted(SYNTHETIC_CASES))
def test_synthetic_attention_makes_0_1_21s_variables_and_logits(mode):
  """"random"/"factorized" take q only for its length (the layer passes x [batch, length, d_model])."""
  q, k, v = _qkv(6)
  x = np.random.RandomState(7).randn(B, L, 3).astype(np.float32)
  table_only = mode in ("random", "factorized")
  shapes, logits_fn = SYNTHETIC_CASES[mode]
  holder = {}

  def build(mesh):
    context = SimpleNamespace(mesh=mesh, variable_dtype=F32, train=False, mode="eval")
    qt = (mtf.import_tf_tensor(mesh, tf.constant(x), "batch:4;length:4;d_model:3") if table_only
          else mtf.import_tf_tensor(mesh, tf.constant(q), "batch:4;length:4;heads:4;d_k:2"))
    kt = mtf.import_tf_tensor(mesh, tf.constant(k), "batch:4;memory_length:4;heads:4;d_k:2")
    vt = mtf.import_tf_tensor(mesh, tf.constant(v), "batch:4;memory_length:4;heads:4;d_v:3")
    out = attention.synthetic_attention(qt, kt, vt, MEMORY, KEY, VALUE, synthesize_mode=mode,
                                        factorized_dim=3, max_length=6, context=context)
    holder["shapes"] = {var.name: var.shape.to_integer_list for var in mesh.graph.all_variables}
    holder["out_dims"] = out.shape.dimension_names
    return [out] + [var.outputs[0] for var in mesh.graph.all_variables]
  out, *values = lower_and_evaluate(build)
  assert holder["shapes"] == shapes
  assert holder["out_dims"] == ["batch", "length", "heads", "d_v"]
  if mode == "random_plus_alpha":
    assert values[-1] == 0  # sigmoid(0) = 0.5 at the start
  weights = _softmax(logits_fn(q, k, dict(zip(shapes, values))))
  assert_allclose(out, np.einsum("blhm,bmhv->blhv", weights, v), rtol=1e-4, atol=1e-5)


def test_synthetic_attention_rejects_unknown_modes():
  with pytest.raises(ValueError, match="synthesize_mode='factorized_plus_alpha' is not one of"):
    attention.synthetic_attention(None, None, None, MEMORY, KEY, VALUE,
                                  synthesize_mode="factorized_plus_alpha")


def test_visibility_mask_to_attention_bias_is_zero_or_minus_1e9():
  def build(mesh):
    visible = mtf.import_tf_tensor(mesh, tf.constant([True, False]), "x:2")
    return [attention.visibility_mask_to_attention_bias(visible, tf.float32)]
  assert_allclose(lower_and_evaluate(build)[0], [0.0, -1e9])


# ---- AttentionParams ----

D_MODEL = mtf.Dimension("d_model", 64)
HEADS = mtf.Dimension("heads", 4)
D_KV = mtf.Dimension("d_kv", 8)


def _params_run(combine_dims=True, shared_kv=False, **kwargs):
  x_np = np.random.RandomState(7).randn(2, 3, 64).astype(np.float32)
  holder = {}

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(x_np), "batch:2;length:3;d_model:64")
    params = attention.AttentionParams(mesh, D_MODEL, D_MODEL, D_MODEL, D_KV, D_KV, [HEADS], [HEADS], F32,
                                       combine_dims=combine_dims, shared_kv=shared_kv, **kwargs)
    q = params.compute_q(x)
    k = params.compute_kv(x) if shared_kv else params.compute_k(x)
    out = params.compute_output(q, output_shape=x.shape)
    holder["shapes"] = {v.name: v.shape.to_string for v in mesh.graph.all_variables}
    return [q, k, out] + [v.outputs[0] for v in mesh.graph.all_variables]
  q, k, out, *variables = lower_and_evaluate(build)
  return x_np, q, k, out, dict(zip(holder["shapes"], variables)), holder["shapes"]


def test_attention_params_combined_variables_and_projections():
  x, q, k, out, variables, shapes = _params_run()
  assert shapes == {"q": "Shape[d_model=64, heads=32]", "k": "Shape[d_model=64, heads=32]",
                    "v": "Shape[d_model=64, heads=32]", "o": "Shape[heads=32, d_model=64]"}
  assert_allclose(q, (x @ variables["q"]).reshape(2, 3, 4, 8), rtol=1e-4, atol=1e-5)
  assert_allclose(k, (x @ variables["k"]).reshape(2, 3, 4, 8), rtol=1e-4, atol=1e-5)
  assert_allclose(out, q.reshape(2, 3, 32) @ variables["o"], rtol=1e-4, atol=1e-5)
  # Initial stddevs: q d_model^-0.5 * d_kv^-0.5 (folded scaling), k/v d_model^-0.5, o (heads*d_kv)^-0.5.
  for name, stddev in [("q", 64 ** -0.5 * 8 ** -0.5), ("k", 64 ** -0.5), ("o", 32 ** -0.5)]:
    assert_allclose(variables[name].std(), stddev, rtol=0.15)


def test_attention_params_uncombined_shared_kv_and_unfolded_scaling():
  x, q, k, out, variables, shapes = _params_run(combine_dims=False, shared_kv=True,
                                                fold_scaling_into_initializer=False)
  assert shapes == {"q": "Shape[d_model=64, heads=4, d_kv=8]", "kv": "Shape[d_model=64, heads=4, d_kv=8]",
                    "o": "Shape[heads=4, d_kv=8, d_model=64]"}
  assert_allclose(q, np.einsum("bld,dhk->blhk", x, variables["q"]) / np.sqrt(8), rtol=1e-4, atol=1e-5)
  assert_allclose(k, np.einsum("bld,dhk->blhk", x, variables["kv"]), rtol=1e-4, atol=1e-5)
  assert_allclose(out, np.einsum("blhk,hkd->bld", q, variables["o"]), rtol=1e-4, atol=1e-5)
  assert_allclose(variables["q"].std(), 64 ** -0.5, rtol=0.15)


def test_attention_params_argument_errors():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  with pytest.raises(ValueError, match="shared_kv needs key_dim == value_dim"):
    attention.AttentionParams(mesh, D_MODEL, D_MODEL, D_MODEL, D_KV, VALUE, [HEADS], [HEADS], F32,
                              shared_kv=True)
  params = attention.attention_params_simple(mesh, D_MODEL, D_KV, HEADS, F32)
  assert (params.q_dims, params.o_dims) == ([HEADS, D_KV], [HEADS, D_KV])
  with pytest.raises(ValueError, match="needs shared_kv=True"):
    params.compute_kv(None)
  assert attention._combined_dim([HEADS, D_KV]) == mtf.Dimension("heads", 32)
  mesh = mtf.Mesh(mtf.Graph(), "m")
  kept = attention.AttentionParams(mesh, D_MODEL, D_MODEL, D_MODEL, D_KV, D_KV, [HEADS], [HEADS], F32,
                                   keep_query_heads_dims=True)
  o = mtf.zeros(mesh, mtf.Shape([mtf.Dimension("batch", 2), HEADS, D_KV]))
  assert kept.compute_output(o).shape == mtf.Shape([mtf.Dimension("batch", 2), HEADS, D_MODEL])
  for kwargs, message in [({"combine_dims": False, "shared_kv": True}, "combine_dims=True"),
                          ({"shared_kv": False}, "shared_kv=True"),
                          ({"shared_kv": True, "expert_computation": "k"}, "expert_computation='k'")]:
    with pytest.raises(ValueError, match=message):
      attention.ExpertsAttentionParams(mesh, D_MODEL, D_MODEL, D_MODEL, D_KV, D_KV, [HEADS], [HEADS], F32,
                                       **kwargs)


# ---- release 0.1.18 calling conventions ----

def test_program_written_for_release_0_1_18_runs():
  """0.1.18 code: attention(...) without a context, mtf.dropout(x, rate=, noise_shape=, name=)."""
  q, k, v = _qkv(8)

  def build(mesh):
    qt = mtf.import_tf_tensor(mesh, tf.constant(q), "batch:4;length:4;heads:4;d_k:2")
    kt = mtf.import_tf_tensor(mesh, tf.constant(k), "batch:4;memory_length:4;heads:4;d_k:2")
    vt = mtf.import_tf_tensor(mesh, tf.constant(v), "batch:4;memory_length:4;heads:4;d_v:3")
    out = attention.attention(qt, kt, vt, MEMORY, KEY, VALUE, dropout_rate=0.0)
    dropped = mtf.dropout(out, rate=0.5, noise_shape=out.shape - out.shape.dims[1], name="legacy_dropout")
    return [out, dropped]
  out, dropped = lower_and_evaluate(build, "all:4", "batch:all")
  with tf.Graph().as_default(), tf.Session() as sess:
    expected = sess.run(_reference(tf.constant(q), tf.constant(k), tf.constant(v)))
  assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
  kept = dropped != 0
  assert 0 < kept.mean() < 1 and (kept == kept[:, :1]).all()  # one mask along length
  assert_allclose(dropped[kept], 2 * out[kept], rtol=1e-5)
