"""mtf.optimize.AdafactorOptimizer against a NumPy Adafactor: factored statistics, clipping, scaling."""

from __future__ import annotations

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.optimize.optimizer_check import VariableSpec, assert_values_close, eager_single_step, train
from tests.optimize.test_optimizers import evaluate_at_step


def rms(x: np.ndarray) -> float:
  return float(np.sqrt(np.mean(np.square(x))))


def pow_decay(t: int, exponent: float = 0.8) -> float:
  return 1.0 - (t + 1.0) ** -exponent


def adafactor_reference(name, w, grads, lr=0.1, decay=pow_decay, factored_axes=None, beta1=0.0,
                        clipping_threshold=1.0, multiply_by_parameter_scale=True, epsilon1=1e-30,
                        epsilon2=1e-3) -> dict:
  """Adafactor in float64; factored_axes = (axis of d0, axis of d1) or None. Returns variables + slots."""
  w = w.astype(np.float64)
  if factored_axes:
    a0, a1 = factored_axes
    vr = np.zeros(np.mean(w, axis=a0, keepdims=True).shape)
    vc = np.zeros(np.mean(w, axis=a1, keepdims=True).shape)
  else:
    v = np.zeros_like(w)
  m = np.zeros_like(w)
  for t, g in enumerate(grads):
    d = decay(t)
    g2 = np.square(g.astype(np.float64)) + epsilon1
    if factored_axes:
      vr = d * vr + (1 - d) * g2.mean(axis=a0, keepdims=True)  # averaged over d0: keeps d1
      vc = d * vc + (1 - d) * g2.mean(axis=a1, keepdims=True)  # averaged over d1: keeps d0
      x = g / np.sqrt(vr / vr.mean(axis=a1, keepdims=True)) / np.sqrt(vc)
    else:
      v = d * v + (1 - d) * g2
      x = g / np.sqrt(v)
    if clipping_threshold is not None:
      x = x / max(1.0, rms(x) / clipping_threshold)
    lr_t = lr(t) if callable(lr) else lr
    update = x * (lr_t * max(rms(w), epsilon2) if multiply_by_parameter_scale else lr_t)
    if beta1:
      m = beta1 * m + (1 - beta1) * update
      update = m
    w = w - update
  result = {name: w}
  if factored_axes:
    result[name + "_slot_vr"] = np.squeeze(vr, axis=a0)
    result[name + "_slot_vc"] = np.squeeze(vc, axis=a1)
  else:
    result[name + "_slot_v"] = v
  if beta1:
    result[name + "_slot_m"] = m
  return result


def rand(seed: int, shape) -> np.ndarray:
  return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def check_against_reference(shape: str, make_opt, reference_kwargs: dict, mesh_shape="all:1", layout="",
                            steps: int = 3, scale_grads=None):
  sizes = mtf.convert_to_shape(shape).to_integer_list
  init = rand(0, sizes)
  grads = [rand(t + 1, sizes) * (1.0 if scale_grads is None else scale_grads[t]) for t in range(steps)]
  actual = train([VariableSpec("w", shape, init, make_opt)], [{"w": g} for g in grads], mesh_shape, layout)
  assert_values_close(actual, adafactor_reference("w", init, grads, **reference_kwargs), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape,factored_axes,mesh_shape,layout", [
    ("a:8;b:4", (0, 1), "all:1", ""),
    ("a:8;b:4", (0, 1), "rows:2;cols:4", "a:rows;b:cols"),
    ("a:4;b:8;c:2", (1, 0), "all:4", "a:all"),             # d0 = b, d1 = a; c is never averaged
    ("a:4;b:8;c:2", (1, 0), "rows:2;cols:2", "b:rows;c:cols"),
])
def test_factored_second_moments_match_their_definition(shape, factored_axes, mesh_shape, layout):
  check_against_reference(
      shape, lambda: mtf.optimize.AdafactorOptimizer(learning_rate=0.1, min_dim_size_to_factor=4),
      dict(factored_axes=factored_axes), mesh_shape, layout)


def test_momentum_slot_follows_beta1():
  check_against_reference(
      "a:8;b:4",
      lambda: mtf.optimize.AdafactorOptimizer(learning_rate=0.1, beta1=0.9, min_dim_size_to_factor=4),
      dict(factored_axes=(0, 1), beta1=0.9), "all:2", "b:all")


@pytest.mark.parametrize("shape,kwargs", [
    ("a:8;b:4", {}),                                        # dims below min_dim_size_to_factor=128
    ("a:8", {"min_dim_size_to_factor": 1}),                 # 1-D: nothing to factor
    ("a:8;b:4", {"min_dim_size_to_factor": 1, "factored": False}),
])
def test_small_or_unfactored_variables_keep_a_full_second_moment(shape, kwargs):
  check_against_reference(shape, lambda: mtf.optimize.AdafactorOptimizer(learning_rate=0.1, **kwargs), {},
                          "all:2", "a:all")


def test_factored_dims_are_the_two_largest_non_stacked_dims():
  with tf.Graph().as_default():
    opt = mtf.optimize.AdafactorOptimizer(min_dim_size_to_factor=4, stacked_dim_names=["stacked"])
    shape = mtf.convert_to_shape
    assert opt._factored_dims(shape("a:4;b:8;c:2")) == [mtf.Dimension("b", 8), mtf.Dimension("a", 4)]
    assert opt._factored_dims(shape("a:4;b:4")) == [mtf.Dimension("a", 4), mtf.Dimension("b", 4)]
    assert opt._factored_dims(shape("stacked:16;a:4;b:8")) == [mtf.Dimension("b", 8), mtf.Dimension("a", 4)]
    assert opt._factored_dims(shape("stacked:16;a:8")) is None
    assert opt._factored_dims(shape("a:8;b:3")) is None
    assert opt._factored_dims(shape("a:8")) is None


@pytest.mark.parametrize("clipping_threshold", [None, 1.0, 0.5, 0.25])
def test_clipping_bounds_the_rms_of_the_normalised_update(clipping_threshold):
  # At step 0 the decay rate is 0, so v = g² and x = g / |g| = ±1: rms(x) = 1.
  init, grad = rand(0, [8, 4]), rand(1, [8, 4])
  actual = train([VariableSpec("w", "a:8;b:4", init, lambda: mtf.optimize.AdafactorOptimizer(
      learning_rate=0.1, clipping_threshold=clipping_threshold))], [{"w": grad}])
  factor = 1.0 if clipping_threshold is None else min(1.0, clipping_threshold)
  np.testing.assert_allclose(actual["w"], init - 0.1 * rms(init) * factor * np.sign(grad), rtol=1e-5)
  check_against_reference("a:8;b:4", lambda: mtf.optimize.AdafactorOptimizer(
      learning_rate=0.1, clipping_threshold=clipping_threshold, min_dim_size_to_factor=4),
      dict(factored_axes=(0, 1), clipping_threshold=clipping_threshold), scale_grads=[1.0, 30.0, 0.01])


def test_parameter_scale_multiplies_the_step_by_the_variable_rms_with_a_floor():
  grad = rand(1, [8, 4])
  small, zero = rand(0, [8, 4]) * 0.01, np.zeros([8, 4], np.float32)
  specs = [VariableSpec(name, "a:8;b:4", init, lambda: mtf.optimize.AdafactorOptimizer(
      learning_rate=0.1, exclude_from_parameter_scale=["unscaled"]))
           for name, init in [("small", small), ("zero", zero), ("unscaled_w", small)]]
  absolute = VariableSpec("absolute", "a:8;b:4", small, lambda: mtf.optimize.AdafactorOptimizer(
      learning_rate=0.1, multiply_by_parameter_scale=False))
  actual = train(specs + [absolute], [{name: grad for name in ("small", "zero", "unscaled_w", "absolute")}])
  step = np.sign(grad)
  np.testing.assert_allclose(actual["small"], small - 0.1 * rms(small) * step, rtol=1e-5)
  np.testing.assert_allclose(actual["zero"], zero - 0.1 * 1e-3 * step, rtol=1e-5)
  np.testing.assert_allclose(actual["unscaled_w"], small - 0.1 * step, rtol=1e-5)
  np.testing.assert_allclose(actual["absolute"], small - 0.1 * step, rtol=1e-5)


def test_default_rates_depend_on_the_global_step():
  lr_kwargs = dict(lr=lambda t: min(1.0 / np.sqrt(t + 1.0), 0.01))
  check_against_reference("a:8;b:4", lambda: mtf.optimize.AdafactorOptimizer(min_dim_size_to_factor=4),
                          dict(factored_axes=(0, 1), **lr_kwargs))
  for step, expected in [(0, 0.01), (99, 0.01), (39999, 0.005)]:
    lr = evaluate_at_step(step, lambda: mtf.optimize.AdafactorOptimizer()._learning_rate)
    assert np.isclose(lr, expected)
    decay = evaluate_at_step(step, lambda: mtf.optimize.AdafactorOptimizer()._decay_rate)
    assert np.isclose(decay, pow_decay(step))
  absolute_lr = evaluate_at_step(
      0, lambda: mtf.optimize.AdafactorOptimizer(multiply_by_parameter_scale=False)._learning_rate)
  assert np.isclose(absolute_lr, 0.01 * 0.05)


def test_gin_configures_the_default_decay_and_unit_scaling_learning_rate():
  try:
    gin.parse_config(["adafactor_decay_rate_pow.exponent = 0.5",
                      "mesh_tensorflow.layers.unit_scaling_convention.value = True"])
    decay = evaluate_at_step(3, lambda: mtf.optimize.AdafactorOptimizer()._decay_rate)
    assert np.isclose(decay, 1 - 4 ** -0.5)
    absolute_lr = evaluate_at_step(
        0, lambda: mtf.optimize.AdafactorOptimizer(multiply_by_parameter_scale=False)._learning_rate)
    assert np.isclose(absolute_lr, 0.01)
  finally:
    gin.clear_config()


def test_eager_single_step_matches_numpy():
  init, grad = rand(0, [8, 4]), rand(1, [8, 4])
  spec = VariableSpec("w", "a:8;b:4", init, lambda: mtf.optimize.AdafactorOptimizer(
      learning_rate=0.1, beta1=0.5, decay_rate=0.0, min_dim_size_to_factor=4))
  actual = eager_single_step(spec, grad, "rows:2;cols:2", "a:rows;b:cols")
  assert_values_close(actual, adafactor_reference("w", init, [grad], factored_axes=(0, 1), beta1=0.5),
                      rtol=1e-4)


def test_adafactor_with_multi_lr_schedule_uses_the_matching_schedule_per_variable():
  def make_opt():
    return mtf.optimize.AdafactorWithMultiLRSchedule(
        variable_search=["^emb"], alt_lr_schedules=[[0.5, lambda step, total: step + 1.0]], learning_rate=0.1)
  init = rand(0, [8, 4])
  grads = [{"emb": rand(t + 1, [8, 4]), "dense": rand(t + 5, [8, 4])} for t in range(3)]
  actual = train([VariableSpec(n, "a:8;b:4", init, make_opt) for n in ("emb", "dense")], grads)
  expected = adafactor_reference("emb", init, [g["emb"] for g in grads], lr=lambda t: 0.5 * (t + 1))
  expected.update(adafactor_reference("dense", init, [g["dense"] for g in grads], lr=0.1))
  assert_values_close(actual, expected, rtol=1e-4, atol=1e-6)
