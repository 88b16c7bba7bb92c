"""mtf.optimize: SGD, momentum and Adam updates against NumPy, slots, sharded state, schedules, gin."""

from __future__ import annotations

import functools
import types

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import session_config
from tests.optimize.optimizer_check import (
    VariableSpec, assert_values_close, eager_single_step, mesh_impl, train)

SHAPE = "a:8;b:4"
LAYOUTS = [
    ("all:1", ""),
    ("all:2", ""),                          # replicated
    ("all:4", "a:all"),                     # 1-D, weight split
    ("rows:2;cols:4", "a:rows;b:cols"),     # 2-D, both dims split (8 processors)
    ("rows:2;cols:2", "b:rows"),            # 2-D, split on one axis, replicated on the other
]


def rand(seed: int, shape=(8, 4)) -> np.ndarray:
  return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def learning_rate_at(lr, t: int) -> float:
  return lr(t) if callable(lr) else lr


# ---- NumPy references: (name, initial value, list of grads) -> {full variable name: value} ----

def sgd_reference(name, w, grads, lr):
  for t, g in enumerate(grads):
    w = w - learning_rate_at(lr, t) * g
  return {name: w}


def momentum_reference(name, w, grads, lr, momentum):
  v = np.zeros_like(w)
  for t, g in enumerate(grads):
    v = learning_rate_at(lr, t) * g + momentum * v
    w = w - v
  return {name: w, name + "_momentum_v": v}


def adam_reference(name, w, grads, lr, weight_decay=0.0, beta_1=0.9, beta_2=0.999, epsilon=1e-6):
  m, v = np.zeros_like(w), np.zeros_like(w)
  for t, g in enumerate(grads):
    m = beta_1 * m + (1 - beta_1) * g
    v = beta_2 * v + (1 - beta_2) * g * g
    update = m / (np.sqrt(v) + epsilon) + weight_decay * w
    w = w - learning_rate_at(lr, t) * update
  return {name: w, name + "/adam_m": m, name + "/adam_v": v}


def adam_with_decay():
  return mtf.optimize.AdamWeightDecayOptimizer(0.05, weight_decay_rate=0.1,
                                               exclude_from_weight_decay=["bias$"])


CASES = {
    "sgd": (lambda: mtf.optimize.SgdOptimizer(0.1), functools.partial(sgd_reference, lr=0.1)),
    "momentum": (lambda: mtf.optimize.MomentumOptimizer(0.1, 0.9),
                 functools.partial(momentum_reference, lr=0.1, momentum=0.9)),
    "adam": (adam_with_decay, functools.partial(adam_reference, lr=0.05, weight_decay=0.1)),
    "adam_bias": (adam_with_decay, functools.partial(adam_reference, lr=0.05)),  # excluded from decay
}


def run_cases(cases: dict, steps: int, mesh_shape="all:1", layout="", dtype=tf.float32):
  """Trains one variable per case (same initial value) on random grads; returns (actual, expected)."""
  init = rand(0)
  grads = [{name: rand(10 * t + i + 1) for i, name in enumerate(cases)} for t in range(steps)]
  specs = [VariableSpec(name, SHAPE, init, make_opt) for name, (make_opt, _) in cases.items()]
  actual = train(specs, grads, mesh_shape, layout, dtype=dtype)
  expected = {}
  for name, (_, reference) in cases.items():
    expected.update(reference(name, init, [g[name] for g in grads]))
  return actual, expected


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_updates_match_numpy_over_several_steps(mesh_shape, layout):
  actual, expected = run_cases(CASES, 3, mesh_shape, layout)
  assert_values_close(actual, expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_eager_single_step_matches_numpy(case):
  make_opt, reference = CASES[case]
  init, grad = rand(0), rand(1)
  actual = eager_single_step(VariableSpec(case, SHAPE, init, make_opt), grad, "rows:2;cols:2",
                             "a:rows;b:cols")
  assert_values_close(actual, reference(case, init, [grad]))


def test_bfloat16_variables_train_with_every_optimizer():
  cases = dict(CASES)
  cases["adafactor"] = (lambda: mtf.optimize.AdafactorOptimizer(learning_rate=0.1, min_dim_size_to_factor=4),
                        None)
  dtype = mtf.VariableDType(tf.float32, tf.bfloat16, tf.bfloat16)
  actual, expected = run_cases({k: v for k, v in cases.items() if v[1]}, 3, "rows:2;cols:2", "a:rows",
                               dtype=dtype)
  assert_values_close(actual, expected, rtol=0.02, atol=0.05)
  init = rand(0)
  bf16_adafactor = train([VariableSpec("w", SHAPE, init, cases["adafactor"][0])], [{"w": rand(1)}],
                         "rows:2;cols:2", "a:rows", dtype=dtype)
  float_adafactor = train([VariableSpec("w", SHAPE, init, cases["adafactor"][0])], [{"w": rand(1)}])
  assert sorted(bf16_adafactor) == ["w", "w_slot_vc", "w_slot_vr"]
  for name, value in float_adafactor.items():
    np.testing.assert_allclose(bf16_adafactor[name], value, rtol=0.02, atol=0.05, err_msg=name)


def test_optimizer_state_is_sharded_like_its_variable():
  """Splitting a weight over 8 processors gives each an eighth of the weight and of its slots."""
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    w = mtf.get_variable(mesh, "w", "a:8;b:4", initializer=tf.zeros_initializer())
    u = mtf.get_variable(mesh, "u", "c:256;d:128", initializer=tf.zeros_initializer())
    mtf.optimize.MomentumOptimizer(0.1, 0.9).apply_grads([w], [w.operation])
    mtf.optimize.AdamWeightDecayOptimizer(0.1).apply_grads([w], [w.operation])
    mtf.optimize.AdafactorOptimizer().apply_grads([u], [u.operation])
    # Each processor its own replica, so that every one of the 8 holds a slice on its device.
    impl = mesh_impl("rows:2;cols:4", "a:rows;b:cols;c:rows;d:cols", share_replicas=False)
    lowering = mtf.Lowering(graph, {mesh: impl}, autostack=False)
    expected_slice_shapes = {
        "w": [4, 1], "w_momentum_v": [4, 1], "w/adam_m": [4, 1], "w/adam_v": [4, 1],
        "u": [128, 32], "u_slot_vr": [32], "u_slot_vc": [128]}  # vr = u - c, vc = u - d
    for name, slice_shape in expected_slice_shapes.items():
      slices = lowering.variables[graph.name_to_variable[name]].laid_out_tensor.tensor_list
      assert [s.shape.as_list() for s in slices] == [slice_shape] * 8, name
      assert len({s.device for s in slices}) == 8, name


def test_replicated_weight_keeps_whole_slots_on_every_processor():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    w = mtf.get_variable(mesh, "w", "a:8;b:4", initializer=tf.zeros_initializer())
    mtf.optimize.AdamWeightDecayOptimizer(0.1).apply_grads([w], [w.operation])
    lowering = mtf.Lowering(graph, {mesh: mesh_impl("all:4", "")}, autostack=False)
    slices = lowering.variables[graph.name_to_variable["w/adam_m"]].laid_out_tensor.tensor_list
    assert [s.shape.as_list() for s in slices] == [[8, 4]] * 4


@pytest.mark.parametrize("make_opt,slot_names", [
    (lambda: mtf.optimize.SgdOptimizer(0.1), []),
    (lambda: mtf.optimize.MomentumOptimizer(0.1, 0.9), ["scope/w_momentum_v"]),
    (lambda: mtf.optimize.AdamWeightDecayOptimizer(0.1), ["scope/w/adam_m", "scope/w/adam_v"]),
    (lambda: mtf.optimize.AdafactorOptimizer(), ["scope/w_slot_v"]),
    (lambda: mtf.optimize.AdafactorOptimizer(beta1=0.9, min_dim_size_to_factor=2),
     ["scope/w_slot_vr", "scope/w_slot_vc", "scope/w_slot_m"]),
])
def test_slot_variables_have_checkpoint_names_and_are_untrainable(make_opt, slot_names):
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    with tf.variable_scope("scope"):
      w = mtf.get_variable(mesh, "w", "a:8;b:4")
    make_opt().apply_grads([w], [w.operation])
    assert [v.name for v in graph.all_variables] == ["scope/w"] + slot_names
    assert graph.trainable_variables == [w.operation]
    masters = [v.name for v in tf.global_variables() if v.name != "global_step:0"]
    assert sorted(masters) == sorted(n + ":0" for n in ["scope/w"] + slot_names)


def test_apply_grads_combines_assignments_and_skips_missing_gradients():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    w1 = mtf.get_variable(mesh, "w1", "a:8;b:4")
    w2 = mtf.get_variable(mesh, "w2", "a:8;b:4")
    w3 = mtf.get_variable(mesh, "w3", "a:8;b:4")
    ops = mtf.optimize.AdamWeightDecayOptimizer(0.1).apply_grads([w1, None, w3], [w1, w2, w3])
    assert sorted(op.assign_fn.__name__ for op in ops) == ["assign_slice", "assign_sub_slice"]
    assigns = [op for op in graph.operations if isinstance(op, mtf.Assign)]
    assert sorted(assigns, key=id) == sorted(ops, key=id)
    updated = {v.name for op in ops for v in op.variables}
    assert updated == {"w1", "w3", "w1/adam_m", "w1/adam_v", "w3/adam_m", "w3/adam_v"}
    assert mtf.optimize.SgdOptimizer(0.1).apply_grads([None], [w2.operation]) == []


def test_apply_grads_rejects_mismatched_lists_and_non_variables():
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  x = mtf.zeros(mesh, "a:2")
  with pytest.raises(ValueError, match="2 gradients for 1 variables"):
    mtf.optimize.SgdOptimizer(0.1).apply_grads([x, x], [x])
  with pytest.raises(ValueError, match="is not an mtf Variable"):
    mtf.optimize.SgdOptimizer(0.1).apply_grad(x, x)
  with pytest.raises(ValueError, match="apply_grad not implemented"):
    mtf.optimize.Optimizer().apply_grad(x, x)


def test_learning_rate_may_be_a_tf_or_mtf_scalar():
  init, grad = rand(0), rand(1)
  for make_lr in (lambda: tf.constant(0.1), lambda: tf.constant(0.1, tf.float64)):
    spec = VariableSpec("w", SHAPE, init, lambda make_lr=make_lr: mtf.optimize.SgdOptimizer(make_lr()))
    actual = train([spec], [{"w": grad}], "all:2", "a:all")
    np.testing.assert_allclose(actual["w"], init - 0.1 * grad, rtol=1e-6)
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  w = mtf.get_variable(mesh, "w", SHAPE, initializer=tf.constant_initializer(init))
  lr = mtf.constant(mesh, 0.1)
  (assign,) = mtf.optimize.SgdOptimizer(lr).apply_grad(
      mtf.import_tf_tensor(mesh, tf.constant(grad), mtf.convert_to_shape(SHAPE)), w.operation)
  lowering = mtf.Lowering(graph, {mesh: mesh_impl("all:1", "")})
  np.testing.assert_allclose(lowering.export_to_tf_tensor(assign.inputs[0]).numpy(), 0.1 * grad, rtol=1e-6)


def test_adam_with_multi_lr_schedule_uses_the_matching_schedule_per_variable():
  def make_opt():
    return mtf.optimize.AdamWithMultiLRSchedule(
        variable_search=["^emb", "^out"],
        alt_lr_schedules=[[0.5, 0.2], lambda step, total: 0.01 * (step + 1)], learning_rate=0.05)
  init = rand(0)
  grads = [{"emb_w": rand(t + 1), "out_w": rand(t + 5), "dense_w": rand(t + 9)} for t in range(3)]
  actual = train([VariableSpec(n, SHAPE, init, make_opt) for n in grads[0]], grads)
  expected = {}
  for name, lr in [("emb_w", 0.1), ("out_w", lambda t: 0.01 * (t + 1)), ("dense_w", 0.05)]:
    expected.update(adam_reference(name, init, [g[name] for g in grads], lr))
  assert_values_close(actual, expected)


def test_multi_lr_schedule_needs_one_schedule_per_pattern():
  with pytest.raises(ValueError, match="2 variable_search patterns but 1 alt_lr_schedules"):
    mtf.optimize.AdamWithMultiLRSchedule(variable_search=["a", "b"], alt_lr_schedules=[0.1],
                                         learning_rate=0.1)


def evaluate_at_step(step: int, fn):
  """fn() evaluated in a graph whose global step is `step`."""
  with tf.Graph().as_default():
    global_step = tf.train.get_or_create_global_step()
    value = fn()
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.assign(global_step, step))
      return sess.run(value)


def test_compute_lr_for_step_evaluates_each_kind_of_schedule():
  def rates():
    rates = mtf.optimize.compute_lr_for_step(
        schedules=[None, 0.3, lambda step, total: step / total, [2.0, lambda step, total: step]],
        learning_rate=tf.constant(0.1), train_steps=10)
    return [tf.convert_to_tensor(r, tf.float32) for r in rates]
  np.testing.assert_allclose(evaluate_at_step(5, rates), [0.1, 0.3, 0.5, 10.0], rtol=1e-6)


def test_product_learning_rate_multiplies_factors_with_offset():
  rate = mtf.optimize.product_learning_rate(
      7.0, 10, factors=[0.5, lambda step, total: step, lambda step, total: total], offset=2)
  assert rate == 0.5 * 5 * 8


def test_decay_rates_follow_their_formulas():
  step = 4
  pow_rate = evaluate_at_step(step, lambda: mtf.optimize.adafactor_decay_rate_pow(0.8, offset=1))
  np.testing.assert_allclose(pow_rate, 1 - (step - 1 + 1) ** -0.8, rtol=1e-6)
  adam_rate = evaluate_at_step(step, lambda: mtf.optimize.adafactor_decay_rate_adam(0.9))
  t = step + 1
  np.testing.assert_allclose(adam_rate, 0.9 * (1 - 0.9 ** (t - 1)) / (1 - 0.9 ** t), rtol=1e-6)
  assert evaluate_at_step(0, lambda: mtf.optimize.adafactor_decay_rate_adam(0.9)) == 0.0


def test_make_optimizer_builds_sgd_and_adafactor_from_hparams():
  hparams = types.SimpleNamespace(
      optimizer="SGD", optimizer_adafactor_decay_type="pow", optimizer_adafactor_memory_exponent=0.8,
      optimizer_adafactor_beta2=0.999, optimizer_adafactor_multiply_by_parameter_scale=False,
      optimizer_adafactor_beta1=0.0, optimizer_adafactor_clipping_threshold=1.0,
      optimizer_adafactor_factored=True)
  with tf.Graph().as_default():
    sgd = mtf.optimize.make_optimizer(hparams, 0.3)
    assert isinstance(sgd, mtf.optimize.SgdOptimizer) and sgd.lr == 0.3
    for decay_type in ("pow", "Adam"):
      hparams.optimizer, hparams.optimizer_adafactor_decay_type = "Adafactor", decay_type
      adafactor = mtf.optimize.make_optimizer(hparams, 0.3)
      assert isinstance(adafactor, mtf.optimize.AdafactorOptimizer)
    hparams.optimizer_adafactor_decay_type = "linear"
    with pytest.raises(ValueError, match="unknown optimizer_adafactor_decay_type"):
      mtf.optimize.make_optimizer(hparams, 0.3)
    hparams.optimizer = "Adagrad"
    with pytest.raises(ValueError, match="Unknown Optimizer"):
      mtf.optimize.make_optimizer(hparams, 0.3)


def test_optimizers_are_gin_configurable_under_the_public_module():
  try:
    gin.parse_config([
        "mesh_tensorflow.optimize.SgdOptimizer.learning_rate = 0.25",
        "optimize.MomentumOptimizer.momentum = 0.5",
        "AdamWeightDecayOptimizer.learning_rate = 0.125",
    ])
    assert mtf.optimize.SgdOptimizer().lr == 0.25
    assert mtf.optimize.MomentumOptimizer(learning_rate=0.1).momentum == 0.5
    assert mtf.optimize.AdamWeightDecayOptimizer().learning_rate == 0.125
  finally:
    gin.clear_config()
