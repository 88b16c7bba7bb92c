"""MoE gatings top_n, switch_max, expert_selection and use_second_place_expert_prob (0.1.21).

Each gating's dispatch / combine / loss is compared with a NumPy version of 0.1.21's math on a
tiny eval-mode input; the layers also run on a 4-device mesh (equal to one device) and train.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import moe
from tests.harness import cpu_devices, lower_and_evaluate, session_config
from tests.layers.layer_check import run_layer
from tests.transformer.model_check import gin_config, train_losses
from tests.transformer.test_moe import (D_MODEL, NUM_EXPERTS, VDTYPE, X, X_SHAPE, _balance_loss, _hparams,
                                        _softmax)

GROUP = 8
XG = np.random.RandomState(1).randn(2, GROUP, D_MODEL).astype(np.float32)
PADDING = np.ones((2, GROUP), np.float32)
PADDING[0, 5:] = 0.0
PADDING[1, 7] = 0.0


def _gating(gating, hparams, train=False, capacity=2, importance=None):
  """A build function: (dispatch, combine, loss, gate kernel) of one gating call on XG."""
  experts = mtf.Dimension("expert_unsplit", NUM_EXPERTS)
  capacity_dim = mtf.Dimension("expert_capacity", capacity)

  def build(mesh):
    inputs = mtf.import_tf_tensor(mesh, tf.constant(XG), "batch:2;group:%d;d_model:%d" % (GROUP, D_MODEL))
    kwargs = {}
    if importance is not None:
      kwargs["importance"] = mtf.import_tf_tensor(mesh, tf.constant(importance), "batch:2;group:%d" % GROUP)
    if gating == "expert_selection":
      kwargs["group_size_dim"] = inputs.shape.dims[1]
    fn = getattr(moe, "_%s_gating" % gating)
    dispatch, combine, loss = fn(inputs=inputs, outer_expert_dims=None, experts_dim=experts,
                                 expert_capacity_dim=capacity_dim, hparams=hparams, train=train,
                                 variable_dtype=VDTYPE, **kwargs)
    return [dispatch, combine, loss, mesh.graph.all_variables[0].outputs[0]]
  return build


def _run_gating(gating, hparams, **kwargs):
  dispatch, combine, loss, kernel = lower_and_evaluate(_gating(gating, hparams, **kwargs))
  return dispatch, combine, loss, np.einsum("gsm,me->gse", XG, kernel)


def _top_capacity(scores, capacity):
  """Indices of the `capacity` largest scores (first index on ties, as tf.math.top_k)."""
  return np.argsort(-scores, kind="stable")[:capacity]


@pytest.mark.parametrize("padded", [False, True])
def test_switch_max_experts_keep_their_highest_gate_tokens(padded):
  importance = PADDING if padded else None
  dispatch, combine, loss, logits = _run_gating("switch_max", _hparams("switch_max"), importance=importance)
  gates = _softmax(logits)
  routed = np.ones((2, GROUP)) if importance is None else (importance == 1.0)
  choice = np.eye(NUM_EXPERTS)[gates.argmax(-1)]  # [g, s, e]
  masked = choice * gates.max(-1, keepdims=True) * routed[..., None]
  expected = np.zeros((2, NUM_EXPERTS, 2, GROUP))
  for g in range(2):
    for e in range(NUM_EXPERTS):
      for slot, t in enumerate(_top_capacity(masked[g, :, e], 2)):
        expected[g, e, slot, t] = masked[g, t, e]
  np.testing.assert_allclose(combine, expected, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(dispatch, (expected != 0).astype(np.float32))
  # 0.1.21: density and proxy over all tokens, each group's term scaled by its routed fraction.
  expected_loss = (choice.mean(1) * gates.mean(1) * routed.mean(1)[:, None]).mean() * NUM_EXPERTS ** 2
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_expert_selection_experts_pick_tokens_by_softmax_over_the_group(padded):
  importance = PADDING if padded else None
  dispatch, combine, loss, logits = _run_gating("expert_selection", _hparams("expert_selection"),
                                                importance=importance, capacity=3)
  if importance is not None:
    logits = logits - 1e9 * (importance == 0.0)[..., None]
  probs = np.exp(logits - logits.max(1, keepdims=True))
  probs /= probs.sum(1, keepdims=True)  # softmax over the group, per expert
  expected_dispatch = np.zeros((2, NUM_EXPERTS, 3, GROUP))
  for g in range(2):
    for e in range(NUM_EXPERTS):
      for slot, t in enumerate(_top_capacity(probs[g, :, e], 3)):
        expected_dispatch[g, e, slot, t] = 1.0
  experts_per_token = np.maximum(expected_dispatch.sum(axis=(1, 2)), 1.0)  # [g, s]
  expected_combine = (expected_dispatch * probs.transpose(0, 2, 1)[:, :, None, :]
                      / experts_per_token[:, None, None, :])
  np.testing.assert_array_equal(dispatch, expected_dispatch)
  np.testing.assert_allclose(combine, expected_combine, rtol=1e-5, atol=1e-7)
  mean_prob = probs.mean(-1)
  true_group_size = np.full((2, 1), GROUP) if importance is None else importance.sum(1, keepdims=True)
  if importance is not None:
    mean_prob = mean_prob * (importance == 1.0)
  np.testing.assert_allclose(loss, (mean_prob ** 2 * true_group_size).mean() * GROUP, rtol=1e-5)


def _top_n_reference(gates, n, capacity, threshold=None):
  """One group's top-n combine [s, e, c]: rank-r choices take slots after all rank r-1 ones."""
  order = np.argsort(-gates, axis=-1, kind="stable")[:, :n]
  top = np.take_along_axis(gates, order, -1)
  weights = top / (top.sum(-1, keepdims=True) + 1e-9)
  counts = np.zeros(gates.shape[1], int)
  combine = np.zeros(gates.shape + (capacity,))
  for rank in range(n):
    for t in range(gates.shape[0]):
      if rank > 0 and threshold is not None and not weights[t, rank] > threshold:
        continue
      e = order[t, rank]
      if counts[e] < capacity:
        combine[t, e, counts[e]] = weights[t, rank]
      counts[e] += 1  # a dropped token still took its place in the order
    counts = np.minimum(counts, capacity)
  return combine


@pytest.mark.parametrize("n,policy,second_place_loss", [(3, "all", False), (3, "threshold", True),
                                                        (2, "all", False)])
def test_top_n_routes_n_renormalised_choices_in_rank_order(n, policy, second_place_loss):
  hparams = _hparams("top_n", moe_top_n_num_experts_per_token=n, moe_second_policy_eval=policy,
                     moe_second_threshold_eval=0.25, moe_use_second_place_loss=second_place_loss)
  dispatch, combine, loss, logits = _run_gating("top_n", hparams, capacity=3)
  gates = _softmax(logits)
  threshold = 0.25 if policy == "threshold" else None
  expected = np.stack([_top_n_reference(gates[g], n, 3, threshold) for g in range(2)])
  np.testing.assert_allclose(combine, expected, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(dispatch, (expected != 0).astype(np.float32))
  order = np.argsort(-gates, axis=-1, kind="stable")
  expected_loss = _balance_loss(np.eye(NUM_EXPERTS)[order[..., 0]], gates)
  if second_place_loss:  # 0.1.21: third choices against the gates left after the top two
    left = gates * (1.0 - np.eye(NUM_EXPERTS)[order[..., 0]] - np.eye(NUM_EXPERTS)[order[..., 1]])
    expected_loss += 0.5 * _balance_loss(np.eye(NUM_EXPERTS)[order[..., 2]],
                                         left / (left.sum(-1, keepdims=True) + 1e-9))
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


def test_top_n_and_capacity_misuse_fail_at_construction():
  with pytest.raises(ValueError, match="top_n_num_experts_per_token=2"):
    lower_and_evaluate(_gating("top_n", _hparams("top_n", moe_top_n_num_experts_per_token=2,
                                                 moe_use_second_place_loss=True)))
  for gating in ("switch_max", "expert_selection"):
    with pytest.raises(ValueError, match="expert capacity 9 exceeds the group size 8"):
      lower_and_evaluate(_gating(gating, _hparams(gating), capacity=9))


@pytest.mark.parametrize("gating", ["switch", "ntlb", "switch_max"])
def test_second_place_expert_prob_one_routes_every_token_to_its_second_expert_in_training(gating):
  hparams = _hparams(gating, moe_use_second_place_expert_prob=1.0, moe_use_second_place_expert_prob_temp=None)
  _, combine, _, logits = _run_gating(gating, hparams, train=True, capacity=GROUP)
  gates = _softmax(logits)
  order = np.argsort(-gates, axis=-1, kind="stable")
  expected = np.zeros_like(gates)  # the top logit masked out: softmax over the other experts
  second = np.take_along_axis(gates, order[..., 1:2], -1)[..., 0]
  np.put_along_axis(expected, order[..., 1:2], (second / (1.0 - gates.max(-1)))[..., None], -1)
  weights = combine.sum(-1) if gating != "switch_max" else combine.sum(2).transpose(0, 2, 1)
  np.testing.assert_allclose(weights, expected, rtol=1e-4, atol=1e-6)
  _, eval_combine, _, _ = _run_gating(gating, hparams, train=False, capacity=GROUP)  # eval ignores it
  eval_weights = eval_combine.sum(-1) if gating != "switch_max" else eval_combine.sum(2).transpose(0, 2, 1)
  np.testing.assert_array_equal(eval_weights.argmax(-1), order[..., 0])


def _evaluate_twice(build):
  """Two runs of the same lowered graph in one session (random ops draw anew each run)."""
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    outputs = build(mesh)
    lowering = mtf.Lowering(graph, {mesh: mtf.placement_mesh_impl.PlacementMeshImpl(
        mtf.convert_to_shape("all:1"), "", cpu_devices(1))})
    tf_outputs = [lowering.export_to_tf_tensor(x) for x in outputs]
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      return sess.run(tf_outputs), sess.run(tf_outputs)


@pytest.mark.parametrize("prob,temp", [(0.5, None), (1.0, 1.0)])
def test_second_place_expert_choice_is_redrawn_each_training_step(prob, temp):
  hparams = _hparams("switch", moe_use_second_place_expert_prob=prob,
                     moe_use_second_place_expert_prob_temp=temp)
  (_, first, _, kernel), (_, again, _, _) = _evaluate_twice(_gating("switch", hparams, train=True,
                                                                    capacity=GROUP))
  top = _softmax(np.einsum("gsm,me->gse", XG, kernel)).argmax(-1)
  experts_first, experts_again = first.sum(-1).argmax(-1), again.sum(-1).argmax(-1)
  assert (experts_first != experts_again).any()
  if temp is not None:  # a sampled non-top expert that keeps the whole (renormalised) gate
    assert (experts_first != top).all() and (experts_again != top).all()
    np.testing.assert_allclose(first.sum(axis=(2, 3)), 1.0, rtol=1e-5)


def test_moe1d_binds_the_original_parameters_in_their_positions():
  names = list(inspect.signature(moe.MoE1D.__init__).parameters)
  assert names[-4:] == ["word_embed_mode", "use_second_place_expert_prob",
                        "use_second_place_expert_prob_temp", "top_n_num_experts_per_token"]
  with gin_config(["MoE1D.moe_gating = 'top_n'", "MoE1D.top_n_num_experts_per_token = 2",
                   "MoE1D.use_second_place_expert_prob = 0.3",
                   "MoE1D.use_second_place_expert_prob_temp = 2.0"]):
    hparams = moe.MoE1D()._hparams  # pylint: disable=protected-access
  assert (hparams.moe_gating, hparams.moe_top_n_num_experts_per_token) == ("top_n", 2)
  assert hparams.moe_use_second_place_expert_prob == 0.3
  assert hparams.moe_use_second_place_expert_prob_temp == 2.0
  assert moe.MoE1D()._hparams.moe_top_n_num_experts_per_token == 3  # pylint: disable=protected-access


def _layer_hparams(gating):
  return _hparams(gating, moe_group_size=4, moe_top_n_num_experts_per_token=3)


@pytest.mark.parametrize("gating", ["top_n", "switch_max", "expert_selection"])
def test_new_gatings_on_four_devices_equal_one_device(gating):
  def layer(x):
    return moe.transformer_moe_layer_v1(x, x.shape.dims[-1], _layer_hparams(gating), False, VDTYPE,
                                        layout="batch:all;experts:all", mesh_shape="all:4")[0]
  split = run_layer(layer, [(X, X_SHAPE)], "all:4", "batch:all;experts:all")
  single = run_layer(layer, [(X, X_SHAPE)], "all:1", "")
  np.testing.assert_allclose(split.y, single.y, rtol=1e-5, atol=1e-6)
  assert np.abs(single.y).max() > 0.0
  for name, grad in single.variable_grads.items():
    np.testing.assert_allclose(split.variable_grads[name], grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gating", ["top_n", "switch_max", "expert_selection"])
def test_new_gatings_train(gating):
  target = np.tanh(X[..., ::-1]).copy()

  def build_loss(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), shape=X_SHAPE)
    y, aux_loss = moe.transformer_moe_layer_v1(x, x.shape.dims[-1], _layer_hparams(gating), True, VDTYPE,
                                               layout="batch:b", mesh_shape="b:2")
    error = y - mtf.import_tf_tensor(mesh, tf.constant(target), X_SHAPE)
    return mtf.reduce_mean(mtf.square(error)) + aux_loss
  losses = train_losses(build_loss, steps=6, mesh_shape="b:2", layout="batch:b", learning_rate=0.5)
  assert losses[-1] < losses[0] * 0.9, losses
