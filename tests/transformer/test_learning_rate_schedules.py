"""Every learning-rate schedule against its formula, for a tf step (graph mode) and a python int step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import learning_rate_schedules as lrs
from tests.transformer.model_check import gin_config

TOTAL = 1000
STEPS = [0, 1, 50, 99, 100, 101, 500, 899, 900, 950, 1000]


def _noam(step, warmup=100, fraction=0.1, multiplier=2.0, offset=10):
  s = step - offset
  return multiplier / math.sqrt(max(s, warmup)) * min(1.0, (TOTAL - s) / (TOTAL * fraction))


def _slanted(step, cut_fraction=0.2, ratio=8, max_lr=0.5, start=100):
  cut = math.floor((TOTAL - start) * cut_fraction)
  s = step - start
  p = s / cut if s < cut else 1 - (s - cut) / (cut * (1 / cut_fraction - 1))
  return max_lr * (1 + p * (ratio - 1)) / ratio


# (schedule called as fn(step, total_train_steps), reference formula of the step)
CASES = {
    "linear_decay_fraction": (lambda s, t: lrs.linear_decay(s, t, steps_or_fraction=0.1),
                              lambda s: min(1.0, (TOTAL - s) / 100)),
    "linear_decay_steps": (lambda s, t: lrs.linear_decay(s, t, steps_or_fraction=400),
                           lambda s: min(1.0, (TOTAL - s) / 400)),
    "linear_warmup_steps": (lambda s, t: lrs.linear_warmup(s, t, steps_or_fraction=100),
                            lambda s: min(1.0, s / 100)),
    "linear_warmup_fraction": (lambda s, t: lrs.linear_warmup(s, t, steps_or_fraction=0.5),
                               lambda s: min(1.0, s / 500)),
    "truncated_rsqrt": (lambda s, t: lrs.truncated_rsqrt(s, t, warmup_steps=100),
                        lambda s: 1 / math.sqrt(max(s, 100))),
    "constant": (lambda s, t: lrs.constant(s, t, value=0.25), lambda s: 0.25),
    "constant_learning_rate": (lambda s, t: lrs.constant_learning_rate(s, t, learning_rate=0.03),
                               lambda s: 0.03),
    "linear_decay_learning_rate": (
        lambda s, t: lrs.linear_decay_learning_rate(s, t, initial_lr=0.01, offset=200),
        lambda s: 0.01 * min(1.0, (TOTAL - s) / (TOTAL - 200))),
    "noam": (lambda s, t: lrs.learning_rate_schedule_noam(s, t, warmup_steps=100, linear_decay_fraction=0.1,
                                                          multiplier=2.0, offset=10), _noam),
    "noam_without_total": (lambda s, t: lrs.learning_rate_schedule_noam(s, None, warmup_steps=100),
                           lambda s: 1 / math.sqrt(max(s, 100))),
    "slanted_triangular": (lambda s, t: lrs.slanted_triangular(
        s, t, cut_fraction=0.2, ratio=8, max_learning_rate=0.5, start_step=100), _slanted),
    "product": (lambda s, t: lrs.product_learning_rate(
        s, t, factors=[lambda a, b: lrs.linear_warmup(a, b, steps_or_fraction=100),
                       lambda a, b: lrs.truncated_rsqrt(a, b, warmup_steps=100)], offset=20),
                lambda s: min(1.0, (s - 20) / 100) / math.sqrt(max(s - 20, 100))),
}


def _evaluate(values):
  with tf.Session() as sess:
    return sess.run([tf.convert_to_tensor(v, tf.float32) for v in values])


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_matches_formula_for_tf_step_in_graph_mode(name):
  schedule, formula = CASES[name]
  with tf.Graph().as_default():
    step = tf.placeholder(tf.int64, [])
    rate = tf.convert_to_tensor(schedule(step, TOTAL), tf.float32)
    with tf.Session() as sess:
      actual = [sess.run(rate, {step: s}) for s in STEPS]
  np.testing.assert_allclose(actual, [formula(s) for s in STEPS], rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_matches_formula_for_python_int_step(name):
  schedule, formula = CASES[name]
  with tf.Graph().as_default():
    actual = _evaluate([schedule(s, TOTAL) for s in STEPS])
  np.testing.assert_allclose(actual, [formula(s) for s in STEPS], rtol=1e-5)


def test_linear_decay_learning_rate_upstream_values():
  """initial_lr until `offset`, then linear to 0 at total_train_steps (upstream's test values)."""
  with tf.Graph().as_default():
    actual = _evaluate([lrs.linear_decay_learning_rate(s, 2000, initial_lr=0.01, offset=1000)
                        for s in (0, 500, 1000, 1500, 2000)])
  np.testing.assert_allclose(actual, [0.01, 0.01, 0.01, 0.005, 0.0], atol=1e-9)


def test_schedules_are_gin_configurable_under_their_module_name():
  with gin_config("learning_rate_schedules.constant_learning_rate.learning_rate = 0.5"):
    assert lrs.constant_learning_rate(3, 10) == 0.5
