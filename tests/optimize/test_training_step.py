"""The step Adafactor's default rates follow: an explicit step, or the global step (warned when stuck)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._optimize import step as step_module
from tests.harness import session_config
from tests.optimize.optimizer_check import VariableSpec, assert_values_close, mesh_impl, train
from tests.optimize.test_adafactor import adafactor_reference, pow_decay, rand
from tests.optimize.test_optimizers import evaluate_at_step

STUCK = "the global step is still"


@pytest.fixture(autouse=True)
def warnings_logged():
  """TF logs warnings (a script run earlier in the process may have raised the verbosity)."""
  verbosity = tf.logging.get_verbosity()
  tf.logging.set_verbosity(tf.logging.WARN)
  yield
  tf.logging.set_verbosity(verbosity)


def hand_written_loop(steps: int, increment: bool) -> None:
  """Trains w[a, b] with a default AdafactorOptimizer for `steps` session runs (graph mode)."""
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    w = mtf.get_variable(mesh, "w", "a:8;b:4", initializer=tf.constant_initializer(rand(0, [8, 4])))
    loss = mtf.reduce_sum(mtf.square(w))
    grads = mtf.gradients([loss], [w])
    updates = mtf.optimize.AdafactorOptimizer().apply_grads(grads, graph.trainable_variables)
    lowering = mtf.Lowering(graph, {mesh: mesh_impl("all:2", "a:all")})
    train_op = tf.group([lowering.lowered_operation(u) for u in updates])
    if increment:
      with tf.control_dependencies([train_op]):
        train_op = tf.assign_add(tf.train.get_or_create_global_step(), 1)
    init = [tf.global_variables_initializer(), lowering.copy_masters_to_slices()]
    with tf.Session(config=session_config()) as sess:
      for op in init:
        sess.run(op)
      for _ in range(steps):
        sess.run(train_op)


def test_a_loop_that_never_increments_the_global_step_warns_once(caplog):
  hand_written_loop(steps=4, increment=False)
  assert caplog.text.count(STUCK) == 1
  assert "still 0 at a second update" in caplog.text and "tf.assign_add" in caplog.text


def test_a_loop_that_increments_the_global_step_does_not_warn(caplog):
  hand_written_loop(steps=4, increment=True)
  assert STUCK not in caplog.text


def test_eager_updates_at_an_unchanged_global_step_warn_once(caplog, monkeypatch):
  monkeypatch.setattr(step_module, "_eager_watches", {})
  global_step = tf.train.get_or_create_global_step()
  global_step.assign(10)
  mtf.optimize.AdafactorOptimizer()
  global_step.assign_add(1)
  mtf.optimize.AdafactorOptimizer()
  assert STUCK not in caplog.text
  for _ in range(3):
    mtf.optimize.AdafactorOptimizer()
  assert caplog.text.count(STUCK) == 1 and "still 11" in caplog.text


@pytest.mark.parametrize("step", [7, 7.0, "tensor"])
def test_an_explicit_step_sets_the_default_rates(step):
  def rates():
    given = tf.constant(7, tf.int64) if step == "tensor" else step
    opt = mtf.optimize.AdafactorOptimizer(multiply_by_parameter_scale=False, step=given)
    return opt._decay_rate, opt._learning_rate
  decay, lr = evaluate_at_step(0, rates)  # the global step (0) is not what they follow
  assert np.isclose(decay, pow_decay(7))
  assert np.isclose(lr, 0.05 * min(1 / np.sqrt(8.0), 0.01))


def test_training_with_an_explicit_step_matches_numpy_and_does_not_warn(caplog):
  init = rand(0, [8, 4])
  grads = [rand(t + 1, [8, 4]) for t in range(3)]
  make_opt = lambda: mtf.optimize.AdafactorOptimizer(learning_rate=0.1, min_dim_size_to_factor=4, step=7)
  actual = train([VariableSpec("w", "a:8;b:4", init, make_opt)], [{"w": g} for g in grads], "all:2", "b:all")
  expected = adafactor_reference("w", init, grads, decay=lambda t: pow_decay(7), factored_axes=(0, 1))
  assert_values_close(actual, expected, rtol=1e-4, atol=1e-6)
  assert STUCK not in caplog.text


def test_one_optimizer_with_several_schedules_reads_the_global_step_once_in_eager(caplog, monkeypatch):
  monkeypatch.setattr(step_module, "_eager_watches", {})
  mtf.optimize.AdafactorWithMultiLRSchedule(
      variable_search=["^emb", "^dense"], alt_lr_schedules=[lambda step, total: step, [0.5, lambda s, t: s]])
  assert STUCK not in caplog.text
