"""Mixture of experts: routing (capacity, top-k), load-balancing loss, outputs and layouts."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import moe, transformer, transformer_layers
from tests.harness import lower_and_evaluate
from tests.layers.layer_check import check_layer, run_layer
from tests.transformer.model_check import greedy_decode_and_argmax, named_layer_stack

RNG = np.random.RandomState(0)
BATCH, LENGTH, D_MODEL, NUM_EXPERTS, HIDDEN = 4, 4, 4, 4, 8
X = RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)
X_SHAPE = "batch:%d;length:%d;d_model:%d" % (BATCH, LENGTH, D_MODEL)
D_MODEL_DIM = mtf.Dimension("d_model", D_MODEL)
VDTYPE = mtf.VariableDType(tf.float32, tf.float32, tf.float32)


def _hparams(gating="top_2", **overrides):
  """Deterministic eval settings: second choices always kept, capacity 2 of a group of 4."""
  values = dict(
      moe_gating=gating, moe_num_experts=NUM_EXPERTS, moe_loss_coef=1e-2, moe_hidden_size=HIDDEN,
      moe_group_size=4, moe_min_expert_capacity=1, moe_capacity_factor_train=2.0,
      moe_capacity_factor_eval=2.0, moe_use_second_place_loss=False, moe_second_policy_train="all",
      moe_second_policy_eval="all", moe_second_threshold_train=0.2, moe_second_threshold_eval=0.2,
      moe_dropout_rate=0.0, moe_switch_policy_train="argmax", moe_switch_policy_eval="argmax",
      moe_switch_dropout=0.1, moe_switch_temperature=1.0, moe_switch_jitter=1e-2, moe_ntlb_top_k=3,
      moe_output_dim=None, moe_use_experts_attention=False, moe_z_loss=None)
  values.update(overrides)
  return moe.HParams(**values)


def _softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def _reference_routing(gates, gating, capacity, top_k=3, keep_second=None):
  """NumPy routing of one group: list of (token, expert, slot, weight-index) picks, in slot order.

  weight-index names which gate weights the pick: ("top2", k) for top-2, ("raw", expert) otherwise.
  keep_second: optional [tokens] bools, which second choices the top-2 policy keeps.
  """
  num_tokens, num_experts = gates.shape
  order = np.argsort(-gates, axis=-1, kind="stable")
  counts = np.zeros(num_experts, int)
  picks = []
  if gating == "top_2":
    for rank in (0, 1):
      for t in range(num_tokens):
        if rank == 1 and keep_second is not None and not keep_second[t]:
          continue
        e = order[t, rank]
        if counts[e] < capacity:
          picks.append((t, e, counts[e], ("top2", rank)))
        counts[e] += 1  # earlier tokens take their slot whether or not they fit
      if rank == 0:
        counts = np.minimum(counts, capacity)
    return picks
  ranks = 1 if gating == "switch" else min(top_k, num_experts)
  placed = np.zeros(num_tokens, bool)
  for rank in range(ranks):
    for t in range(num_tokens):
      e = order[t, rank]
      if not placed[t] and counts[e] < capacity:
        picks.append((t, e, counts[e], ("raw", e)))
        placed[t] = True
        counts[e] += 1
  return picks


def _balance_loss(mask, gates):
  """E^2 * mean over (group, expert) of (fraction of the group routed) * (mean gate); [g, s, e] inputs."""
  return (mask.mean(axis=1) * gates.mean(axis=1)).mean() * NUM_EXPERTS ** 2


def _routing_weights(gates, picks, num_experts):
  """[tokens, experts] combine weights (numpy) from the reference picks."""
  order = np.argsort(-gates, axis=-1, kind="stable")
  weights = np.zeros((gates.shape[0], num_experts))
  for t, e, _, (kind, k) in picks:
    if kind == "top2":
      g1, g2 = gates[t, order[t, 0]], gates[t, order[t, 1]]
      weights[t, e] = (g1 if k == 0 else g2) / (g1 + g2 + 1e-9)
    else:
      weights[t, e] = gates[t, k]
  return weights


@pytest.mark.parametrize("gating", ["top_2", "switch", "ntlb"])
def test_dispatch_and_combine_route_each_token_to_its_top_k_within_capacity(gating):
  hparams = _hparams(gating)
  group = mtf.Dimension("group", 8)
  experts = mtf.Dimension("expert_unsplit", NUM_EXPERTS)
  capacity = mtf.Dimension("expert_capacity", 2)
  x = RNG.randn(2, 8, D_MODEL).astype(np.float32)
  gating_fn = {"top_2": moe._top_2_gating, "switch": moe._switch_gating, "ntlb": moe._ntlb_gating}[gating]

  def build(mesh):
    inputs = mtf.import_tf_tensor(mesh, tf.constant(x), mtf.Shape([mtf.Dimension("batch", 2), group,
                                                                    D_MODEL_DIM]))
    dispatch, combine, loss = gating_fn(inputs, None, experts, capacity, hparams, False, VDTYPE)
    kernel = mesh.graph.all_variables[0].outputs[0]
    return [dispatch, combine, loss, kernel]

  dispatch, combine, loss, kernel = lower_and_evaluate(build)
  gates = _softmax(np.einsum("gsm,me->gse", x, kernel))
  top_k = {"top_2": 2, "switch": 1, "ntlb": 3}[gating]
  assert dispatch.shape == (2, 8, NUM_EXPERTS, 2)
  np.testing.assert_array_equal(dispatch, (combine != 0).astype(np.float32))
  assert (dispatch.sum(axis=(1, 3)) <= capacity.size).all()  # tokens per expert <= capacity
  assert (dispatch.sum(axis=1) <= 1).all()  # one token per expert slot
  assert (combine.sum(axis=(2, 3)) <= 1 + 1e-5).all()
  ranks = np.argsort(np.argsort(-gates, axis=-1), axis=-1)
  assert (ranks[combine.sum(axis=3) > 0] < top_k).all()  # only a token's top-k experts
  for g in range(2):
    picks = _reference_routing(gates[g], gating, capacity.size)
    expected = np.zeros((8, NUM_EXPERTS, 2))
    weights = _routing_weights(gates[g], picks, NUM_EXPERTS)
    for t, e, slot, _ in picks:
      expected[t, e, slot] = weights[t, e]
    np.testing.assert_allclose(combine[g], expected, rtol=1e-5, atol=1e-6)
  first_choices = np.eye(NUM_EXPERTS)[gates.argmax(-1)]  # before capacity
  np.testing.assert_allclose(loss, _balance_loss(first_choices, gates), rtol=1e-5)


def _gating_run(gating, hparams, train, x, capacity=2):
  """(dispatch, combine, loss, gate logits) of one gating call on x [2, 8, d_model]."""
  gating_fn = {"top_2": moe._top_2_gating, "switch": moe._switch_gating, "ntlb": moe._ntlb_gating}[gating]

  def build(mesh):
    inputs = mtf.import_tf_tensor(mesh, tf.constant(x), "batch:2;group:8;d_model:%d" % D_MODEL)
    dispatch, combine, loss = gating_fn(inputs, None, mtf.Dimension("expert_unsplit", NUM_EXPERTS),
                                        mtf.Dimension("expert_capacity", capacity), hparams, train, VDTYPE)
    return [dispatch, combine, loss, mesh.graph.all_variables[0].outputs[0]]

  dispatch, combine, loss, kernel = lower_and_evaluate(build)
  return dispatch, combine, loss, np.einsum("gsm,me->gse", x, kernel)


def _assert_routing_invariants(dispatch, combine, gates, top_k, capacity=2):
  np.testing.assert_array_equal(dispatch, (combine != 0).astype(np.float32))
  assert (dispatch.sum(axis=(1, 3)) <= capacity).all() and (dispatch.sum(axis=1) <= 1).all()
  assert (combine.sum(axis=(2, 3)) <= 1 + 1e-5).all()
  if top_k is not None:
    ranks = np.argsort(np.argsort(-gates, axis=-1), axis=-1)
    assert (ranks[combine.sum(axis=3) > 0] < top_k).all()


@pytest.mark.parametrize("policy", ["none", "threshold", "random"])
def test_top_2_second_place_policies(policy):
  hparams = _hparams("top_2", moe_second_policy_train=policy, moe_second_threshold_train=0.3)
  x = RNG.randn(2, 8, D_MODEL).astype(np.float32)
  dispatch, combine, _, logits = _gating_run("top_2", hparams, True, x)
  gates = _softmax(logits)
  _assert_routing_invariants(dispatch, combine, gates, 2)
  if policy == "random":  # a random subset of second choices: still within the top 2
    return
  top = -np.sort(-gates, axis=-1)
  keep_second = (top[..., 1] / (top[..., 0] + top[..., 1]) > 0.3) if policy == "threshold" else \
      np.zeros(gates.shape[:2], bool)
  for g in range(2):
    picks = _reference_routing(gates[g], "top_2", 2, keep_second=keep_second[g])
    weights = _routing_weights(gates[g], picks, NUM_EXPERTS)
    expected = np.zeros((8, NUM_EXPERTS, 2))
    for t, e, slot, _ in picks:
      expected[t, e, slot] = weights[t, e]
    np.testing.assert_allclose(combine[g], expected, rtol=1e-5, atol=1e-6)


def test_second_place_loss_adds_half_the_balance_loss_of_second_choices():
  x = RNG.randn(2, 8, D_MODEL).astype(np.float32)
  _, _, loss, logits = _gating_run("top_2", _hparams("top_2", moe_use_second_place_loss=True), False, x)
  gates = _softmax(logits)
  first = np.eye(NUM_EXPERTS)[gates.argmax(-1)]
  without_first = gates * (1 - first)
  second = np.eye(NUM_EXPERTS)[without_first.argmax(-1)]
  normalized = without_first / without_first.sum(-1, keepdims=True)
  np.testing.assert_allclose(loss, _balance_loss(first, gates) + 0.5 * _balance_loss(second, normalized),
                             rtol=1e-5)


def test_router_z_loss_is_added_to_the_gating_loss_in_training_only():
  x = RNG.randn(2, 8, D_MODEL).astype(np.float32)
  for train in (True, False):
    _, _, loss, logits = _gating_run("switch", _hparams("switch", moe_z_loss=0.5), train, x)
    gates = _softmax(logits)
    balance = _balance_loss(np.eye(NUM_EXPERTS)[gates.argmax(-1)], gates)
    z_loss = (np.log(np.exp(logits).sum(-1)) ** 2).mean()
    np.testing.assert_allclose(loss, balance + 0.5 * z_loss if train else balance, rtol=1e-5)


@pytest.mark.parametrize("policy", ["argmax", "sample", "input_jitter", "input_dropout"])
@pytest.mark.parametrize("gating", ["switch", "ntlb"])
def test_switch_policies_in_training(gating, policy):
  hparams = _hparams(gating, moe_switch_policy_train=policy, moe_switch_dropout=0.5, moe_switch_jitter=0.1)
  x = RNG.randn(2, 8, D_MODEL).astype(np.float32)
  dispatch, combine, _, logits = _gating_run(gating, hparams, True, x)
  gates = _softmax(logits)
  perturbed = policy in ("input_jitter", "input_dropout")
  # Sampled or perturbed routing may pick any expert; argmax keeps to the top choices.
  _assert_routing_invariants(dispatch, combine, gates,
                             None if perturbed or policy == "sample" else {"switch": 1, "ntlb": 3}[gating])
  if not perturbed:  # the weight of a routed token is its gate probability for the chosen expert
    weights = combine.sum(axis=3)
    routed = weights > 0
    np.testing.assert_allclose(weights[routed], gates[routed], rtol=1e-5)
    assert routed.sum() >= (4 if gating == "switch" else 8)  # capacity 2 x 4 experts x 2 groups caps it
  if policy == "argmax":
    for g in range(2):
      assert len(_reference_routing(gates[g], gating, 2)) == (combine[g] > 0).sum()


def test_expert_dropout_applies_only_in_training():
  hparams = _hparams("top_2", moe_dropout_rate=0.5)

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), X_SHAPE)
    outs = [moe.transformer_moe_layer_v1(x, D_MODEL_DIM, hparams, train, VDTYPE)[0]
            for train in (False, True)]
    return outs + [moe.transformer_moe_layer_v1(x, D_MODEL_DIM, _hparams("top_2"), False, VDTYPE)[0]]

  eval_y, train_y, no_dropout_y = lower_and_evaluate(build)
  np.testing.assert_allclose(eval_y, no_dropout_y, rtol=1e-6)
  assert np.abs(train_y - eval_y).max() > 1e-3


def test_load_balancing_loss_matches_its_formula_on_a_hand_made_case():
  group = mtf.Dimension("group", 4)
  experts = mtf.Dimension("experts", 2)
  # Group 0: all tokens to expert 0 with gate 0.9; group 1: perfectly balanced.
  mask = np.array([[[1, 0]] * 4, [[1, 0], [0, 1], [1, 0], [0, 1]]], np.float32)
  gates = np.array([[[0.9, 0.1]] * 4, [[0.5, 0.5]] * 4], np.float32)

  def build(mesh):
    shape = mtf.Shape([mtf.Dimension("batch", 2), group, experts])
    m = mtf.import_tf_tensor(mesh, tf.constant(mask), shape)
    g = mtf.import_tf_tensor(mesh, tf.constant(gates), shape)
    return [moe._load_balance_loss(m, g, group, experts)]

  (loss,) = lower_and_evaluate(build)
  # E^2 * mean over (group, expert) of density * proxy: group 0 gives (1*0.9 + 0*0.1), group 1
  # gives (0.5*0.5 + 0.5*0.5); mean over the 4 entries = 1.4 / 4; times 4 = 1.4.
  np.testing.assert_allclose(loss, 1.4, rtol=1e-6)


def test_router_z_loss_is_mean_squared_logsumexp_over_routed_tokens():
  logits = RNG.randn(2, 4, 3).astype(np.float32)
  importance = np.array([[1, 1, 0, 1], [1, 0, 0, 1]], np.float32)

  def build(mesh):
    dims = [mtf.Dimension("batch", 2), mtf.Dimension("group", 4)]
    t = mtf.import_tf_tensor(mesh, tf.constant(logits), mtf.Shape(dims + [mtf.Dimension("experts", 3)]))
    imp = mtf.import_tf_tensor(mesh, tf.constant(importance), mtf.Shape(dims))
    return [moe._router_z_loss(t, t.shape.dims[-1], imp)]

  (z,) = lower_and_evaluate(build)
  log_z = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(z, (log_z ** 2 * importance).sum() / importance.sum(), rtol=1e-5)


def _moe_reference(gating, hparams, layout="", mesh_shape=""):
  """Plain-TF MoE with the NumPy routing: sum over picks of weight * wo(relu(wi(x))) per group."""
  num_groups, group_size = moe._split_into_groups(
      BATCH * LENGTH, hparams.moe_group_size,
      mtf.tensor_dim_to_mesh_dim_size(layout, mesh_shape, mtf.Dimension("batch", BATCH)))
  capacity = moe._expert_capacity(group_size, hparams.moe_capacity_factor_eval, NUM_EXPERTS,
                                  hparams.moe_min_expert_capacity)
  scope = {"top_2": "top_2_gating", "switch": "switch_gating", "ntlb": "ntlb_gating"}[gating]

  def reference(x, variables):
    tokens = tf.reshape(x, [num_groups, group_size, D_MODEL])
    gate_kernel = variables[scope + "/kernel"]
    gates = tf.nn.softmax(tf.einsum("gsm,me->gse", tokens, gate_kernel))
    tokens_np = tf.get_static_value(x).reshape([num_groups, group_size, D_MODEL])
    gates_np = _softmax(np.einsum("gsm,me->gse", tokens_np, tf.get_static_value(gate_kernel)))
    top2 = np.zeros((num_groups, group_size, NUM_EXPERTS, 2), np.float32)
    raw = np.zeros((num_groups, group_size, NUM_EXPERTS), np.float32)
    for g in range(num_groups):
      for t, e, _, (kind, k) in _reference_routing(gates_np[g], gating, capacity, hparams.moe_ntlb_top_k):
        if kind == "top2":
          top2[g, t, e, k] = 1
        else:
          raw[g, t, e] = 1
    if gating == "top_2":
      order = np.argsort(-gates_np, axis=-1, kind="stable")
      onehots = np.eye(NUM_EXPERTS, dtype=np.float32)[order[..., :2]]  # [g, s, 2, e]
      g12 = tf.einsum("gse,gske->gsk", gates, onehots)
      g12 = g12 / (tf.reduce_sum(g12, -1, keepdims=True) + 1e-9)
      weights = tf.einsum("gsk,gsek->gse", g12, top2)
    else:
      weights = gates * raw
    h = tf.nn.relu(tf.einsum("gsm,emh->gseh", tokens, variables["wi/kernel"]))
    out = tf.einsum("gseh,ehm->gsem", h, variables["wo/kernel"])
    y = tf.einsum("gse,gsem->gsm", weights, out)
    return tf.reshape(y, [BATCH, LENGTH, D_MODEL])

  return reference


def _moe_layer(hparams, layout="", mesh_shape="", outputs=None):
  def layer(x):
    y, loss = moe.transformer_moe_layer_v1(x, D_MODEL_DIM, hparams, False, VDTYPE, layout=layout,
                                           mesh_shape=mesh_shape)
    if outputs is not None:
      outputs.append(loss)
    return y
  return layer


@pytest.mark.parametrize("gating", ["top_2", "switch", "ntlb"])
def test_moe_v1_output_and_gradients_match_reference_routing(gating):
  hparams = _hparams(gating)
  result = check_layer(_moe_layer(hparams), _moe_reference(gating, hparams), [(X, X_SHAPE)])
  assert set(result.shapes) == {gating + "_gating/kernel", "wi/kernel", "wo/kernel"}
  assert result.shapes["wi/kernel"] == mtf.Shape(
      [mtf.Dimension("experts", NUM_EXPERTS), D_MODEL_DIM, mtf.Dimension("expert_hidden", HIDDEN)])


def _assert_split_equals_single(split, single):
  """A layer run under a layout gave the one-processor run's variables, output and variable gradients."""
  for name, value in single.variables.items():
    np.testing.assert_allclose(split.variables[name], value, rtol=1e-6)
  np.testing.assert_allclose(split.y, single.y, rtol=1e-5, atol=1e-6)
  for name, grad in single.variable_grads.items():
    np.testing.assert_allclose(split.variable_grads[name], grad, rtol=1e-4, atol=1e-5)


LAYOUTS = [  # (mesh shape, layout, evaluation mode)
    ("all:4", "batch:all;experts:all", "eager"),
    ("batch:2;model:4", "batch:batch;experts:batch;expert_hidden:model", "graph"),
    ("batch:2;model:4", "batch:batch;d_model:model", "eager"),
]


@pytest.mark.parametrize("mesh_shape,layout,mode", LAYOUTS)
def test_moe_v1_with_experts_split_equals_one_processor(mesh_shape, layout, mode):
  hparams = _hparams("top_2")
  layer = _moe_layer(hparams, layout, mesh_shape)
  split = check_layer(layer, _moe_reference("top_2", hparams, layout, mesh_shape), [(X, X_SHAPE)],
                      mesh_shape, layout, mode)
  single = run_layer(layer, [(X, X_SHAPE)], "all:1", "", mode)
  _assert_split_equals_single(split, single)
  np.testing.assert_allclose(split.input_grads[0], single.input_grads[0], rtol=1e-4, atol=1e-5)


def test_moe_v1_with_outer_batch_replicating_experts_equals_one_processor():
  """outer_batch splits over one mesh dim (expert replicas), groups and experts over the other."""
  hparams = _hparams("switch")
  x = RNG.randn(2, 2, LENGTH, D_MODEL).astype(np.float32)
  shape = "outer_batch:2;batch:2;length:%d;d_model:%d" % (LENGTH, D_MODEL)
  mesh_shape, layout = "outer:2;inner:2", "outer_batch:outer;batch:inner;experts:inner"
  layer = _moe_layer(hparams, layout, mesh_shape)
  single = run_layer(layer, [(x, shape)], "all:1", "", "eager")
  split = run_layer(layer, [(x, shape)], mesh_shape, layout, "eager")
  _assert_split_equals_single(split, single)
  assert np.abs(single.y).sum() > 0


def test_moe_v1_padding_is_not_routed_and_outputs_zero():
  hparams = _hparams("top_2")
  nonpadding = np.ones((BATCH, LENGTH), np.float32)
  nonpadding[:, -1] = 0

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), X_SHAPE)
    mask = mtf.import_tf_tensor(mesh, tf.constant(nonpadding), "batch:%d;length:%d" % (BATCH, LENGTH))
    y, _ = moe.transformer_moe_layer_v1(x, D_MODEL_DIM, hparams, False, VDTYPE, nonpadding=mask)
    return [y]

  (y,) = lower_and_evaluate(build)
  np.testing.assert_array_equal(y[:, -1], 0)
  assert np.abs(y[:, :-1]).sum() > 0


def _context(mode, model, mesh, length_dim, losses=None):
  return transformer.Context(model=model, mesh=mesh, batch_dims=[mtf.Dimension("batch", BATCH)],
                             length_dim=length_dim, variable_dtype=VDTYPE, mode=mode, losses=losses)


def _model():
  stack = transformer.LayerStack([moe.MoE1D()], sublayers_initial=[], sublayers_per_layer=[],
                                 sublayers_final=[])
  return transformer.Unitransformer(layer_stack=stack, d_model=D_MODEL, input_vocab_size=8,
                                    output_vocab_size=8, autoregressive=True, max_length=LENGTH)


def test_moe1d_incremental_positions_equal_the_full_sequence_call():
  mode = "graph"
  layer = moe.MoE1D(num_experts=NUM_EXPERTS, hidden_size=HIDDEN, group_size=4, capacity_factor_eval=4.0,
                    second_policy_eval="all", min_expert_capacity=4)
  model = _model()
  length_dim = mtf.Dimension("length", LENGTH)

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), X_SHAPE)
    losses = []
    full = layer.call(_context("eval", model, mesh, length_dim, losses), x)
    steps = []
    for i in range(LENGTH):
      x_i = mtf.gather(x, i, length_dim)
      steps.append(layer.call(_context("incremental", model, mesh, length_dim), x_i))
    return [full, mtf.stack(steps, "length", axis=1), losses[0]]

  full, incremental, loss = lower_and_evaluate(build, mode=mode)
  assert full.shape == X.shape
  np.testing.assert_allclose(incremental, full, rtol=1e-5, atol=1e-6)
  assert loss > 0


def test_moe1d_experts_attention_returns_q_and_k_projections():
  layer = moe.MoE1D(num_experts=2, hidden_size=HIDDEN, group_size=4, use_experts_attention=True,
                    output_dim=mtf.Dimension("d_model", 6), second_policy_eval="all")
  model = _model()

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), X_SHAPE)
    q, k = layer.call(_context("eval", model, mesh, mtf.Dimension("length", LENGTH)), x)
    assert q.shape.to_integer_list == [BATCH, LENGTH, 6] == k.shape.to_integer_list
    names = {v.name for v in mesh.graph.all_variables}
    assert names == {"k_wo/kernel", "top_2_gating/kernel", "wi/kernel", "q_wo/kernel"}
    return [q - k]

  (diff,) = lower_and_evaluate(build)
  assert np.abs(diff).max() > 0  # two different projections


def test_moe2d_layouts_equal_one_processor():
  mode = "eager"
  hparams = moe.MoE2D(expert_x=2, expert_y=2, hidden_size=HIDDEN, group_size=4, capacity_factor_eval=2.0,
                      second_policy_eval="all", min_expert_capacity=2)._hparams
  x = RNG.randn(2, 2, LENGTH, D_MODEL).astype(np.float32)
  shape = "outer_batch:2;batch:2;length:%d;d_model:%d" % (LENGTH, D_MODEL)
  layout = "outer_batch:a;batch:b;expert_x:b;expert_y:a"
  mesh_shape = "a:2;b:2"

  def layer(t):
    y, _ = moe.transformer_moe_layer_v2(t, D_MODEL_DIM, hparams, False, VDTYPE, layout=layout,
                                        mesh_shape=mesh_shape)
    return y

  single = run_layer(layer, [(x, shape)], "all:1", "", mode)
  split = run_layer(layer, [(x, shape)], mesh_shape, layout, mode)
  assert sorted(single.shapes) == ["inner_gating/kernel", "outer_gating/kernel", "wi/kernel", "wo/kernel"]
  _assert_split_equals_single(split, single)
  assert np.abs(single.y).sum() > 0


def test_moe2d_with_one_expert_per_level_is_a_dense_relu_dense():
  """With expert_x = expert_y = 1 and ample capacity every token reaches the one expert with weight 1."""
  hparams = moe.MoE2D(expert_x=1, expert_y=1, hidden_size=HIDDEN, group_size=16, capacity_factor_eval=1.0,
                      capacity_factor_second_level=1.0, second_policy_eval="none",
                      min_expert_capacity=1)._hparams

  def layer(t):
    return moe.transformer_moe_layer_v2(t, D_MODEL_DIM, hparams, False, VDTYPE)[0]

  def reference(x, variables):
    h = tf.nn.relu(tf.einsum("blm,mh->blh", x, variables["wi/kernel"][0, 0]))
    return tf.einsum("blh,hm->blm", h, variables["wo/kernel"][0, 0])

  check_layer(layer, reference, [(X, X_SHAPE)])


def test_bad_gating_names_fail_at_construction():
  with pytest.raises(ValueError, match="moe_gating='top_3'"):
    moe.MoE1D(moe_gating="top_3")
  with pytest.raises(ValueError, match="moe_second_policy_train='sometimes'"):
    moe.MoE1D(second_policy_train="sometimes")
  with pytest.raises(ValueError, match="moe_switch_policy_eval='coin'"):
    moe.MoE1D(switch_policy_eval="coin")


def test_split_into_groups_makes_groups_a_multiple_of_the_mesh_split():
  assert moe._split_into_groups(64, 16, 1) == (4, 16)
  assert moe._split_into_groups(64, 64, 8) == (8, 8)
  assert moe._split_into_groups(48, 10, 2) == (4, 12)  # 48 // 10 = 4 groups
  assert moe._split_into_groups(48, 10, 8) == (8, 6)
  with pytest.raises(ValueError, match="mesh_dim_size=4"):
    moe._split_into_groups(6, 2, 4)


def test_greedy_decoding_through_moe_agrees_with_full_forward_passes():
  """first_part + incremental steps (MoE on one position per step) pick each position's argmax
  of a full forward pass over the decoded sequence."""
  mode = "graph"
  layers = [transformer_layers.SelfAttention(num_heads=2, key_value_size=2),
            moe.MoE1D(num_experts=NUM_EXPERTS, hidden_size=HIDDEN, group_size=4, capacity_factor_eval=4.0,
                      second_policy_eval="all")]
  model = transformer.Unitransformer(
      layer_stack=named_layer_stack(layers), d_model=D_MODEL, input_vocab_size=8, output_vocab_size=8,
      autoregressive=True, max_length=LENGTH, vocab_divisor=8)

  def build(mesh):
    partial = mtf.zeros(mesh, mtf.Shape([mtf.Dimension("batch", BATCH), mtf.Dimension("length", LENGTH)]),
                        tf.int32)
    return greedy_decode_and_argmax(model, partial, VDTYPE, stop_at_token=None, has_partial_sequences=False)

  decoded, argmax = lower_and_evaluate(build, mode=mode)
  np.testing.assert_array_equal(decoded, argmax)
  assert len(np.unique(decoded)) > 1


def test_experts_enc_dec_attention_gets_a_single_moe_query_projection():
  """ExpertsEncDecAttention computes only q with experts (k=v from the encoder: variable `kv`)."""
  layer = transformer_layers.ExpertsEncDecAttention(num_heads=2, key_value_size=2, num_experts=2,
                                                    hidden_size=8, group_size=4, expert_computation="q")
  layer.set_name("layer_000")
  model = transformer.Unitransformer(layer_stack=transformer.LayerStack([layer]), d_model=D_MODEL,
                                     input_vocab_size=8, output_vocab_size=8, autoregressive=True,
                                     max_length=LENGTH, vocab_divisor=8)
  memory = RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)

  def build(mesh):
    ids = mtf.import_tf_tensor(mesh, tf.constant(np.ones((BATCH, LENGTH), np.int32)), "batch:4;length:4")
    encoder_output = mtf.import_tf_tensor(mesh, tf.constant(memory), "batch:4;memory_length:4;d_model:4")
    logits, loss = model.call_simple(ids, ids, True, mode="eval", variable_dtype=VDTYPE,
                                     encoder_output=encoder_output,
                                     encoder_sequence_id=mtf.ones(mesh, "batch:4;memory_length:4", tf.int32))
    names = {v.name.split("ExpertsEncDecAttention/")[-1] for v in mesh.graph.all_variables
             if "ExpertsEncDecAttention" in v.name}
    assert names == {"kv", "o", "switch_gating/kernel", "wi/kernel", "wo/kernel"}
    return [logits, loss]

  logits, loss = lower_and_evaluate(build)
  assert np.isfinite(logits).all() and np.isfinite(loss)


def test_moe2d_layer_in_a_unitransformer_adds_its_loss():
  layer = moe.MoE2D(expert_x=2, expert_y=2, hidden_size=HIDDEN, group_size=4, second_policy_train="all")
  layer.set_name("layer_000")
  model = transformer.Unitransformer(layer_stack=transformer.LayerStack([layer]), d_model=D_MODEL,
                                     input_vocab_size=8, output_vocab_size=8, autoregressive=True,
                                     max_length=LENGTH, vocab_divisor=8, z_loss=0.0)
  ids = np.arange(BATCH * LENGTH).reshape(BATCH, LENGTH).astype(np.int32) % 7 + 1

  def build(mesh):
    t = mtf.import_tf_tensor(mesh, tf.constant(ids), "batch:4;length:4")
    totals = []
    for coef in (0.0, 1.0):  # the same variables (reused by name), with and without the MoE loss
      layer._hparams.moe_loss_coef = coef
      totals.append(model.call_simple(t, t, True, mode="train", variable_dtype=VDTYPE)[1])
    return totals

  without_moe_loss, with_moe_loss = lower_and_evaluate(build)
  assert with_moe_loss - without_moe_loss > 0.1  # the outer and inner balance losses
