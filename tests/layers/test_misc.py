"""mtf.layers misc: multiplicative jitter, reversible residual blocks, gradient clipping, annealed dropout."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import MODES, cpu_devices, lower_and_evaluate, session_config
from tests.layers.layer_check import import_inputs, run_layer, shape_keyed_initializer

RNG = np.random.RandomState(0)
X = RNG.randn(4, 8).astype(np.float32)
X_SHAPE = "batch:4;io:8"


@pytest.mark.parametrize("mode", MODES)
def test_multiplicative_jitter_scales_by_noise_within_epsilon(mode):
  ones = np.ones((4, 8), np.float32)
  y = run_layer(lambda x: mtf.layers.multiplicative_jitter(x, epsilon=0.1), [(ones, X_SHAPE)], "all:2",
                "io:all", mode, grads=False).y
  assert np.all((y >= 0.9) & (y <= 1.1)) and len(np.unique(y)) > 1


def test_multiplicative_jitter_with_zero_epsilon_is_the_identity():
  def build(mesh):
    (x,) = import_inputs(mesh, [(X, X_SHAPE)])
    assert mtf.layers.multiplicative_jitter(x, epsilon=0) is x
    return [x]
  lower_and_evaluate(build)


# ---- reversible residual blocks ----

KERNELS = [RNG.randn(8, 8).astype(np.float32) / 3 for _ in range(2)]


def _revnet(recompute_grads):
  def f(i):
    io = mtf.Dimension("io", 8)
    init = shape_keyed_initializer({(8, 8): KERNELS[i]})
    return lambda t: mtf.tanh(mtf.layers.dense(mtf.rename_dimension(t, "io", "io_in"), io,
                                               reduced_dims=[mtf.Dimension("io_in", 8)],
                                               kernel_initializer=init, name="f%d" % i))

  def layer(x1, x2):
    x1_backwards = x2_backwards = None
    for i in range(2):
      x1, x1_backwards, x2, x2_backwards = mtf.layers.reversible_half_residual_and_swap(
          x1, x1_backwards, x2, x2_backwards, f(i), recompute_grads=recompute_grads)
    return mtf.stack([x1, x2], "pair")
  return layer


@pytest.mark.parametrize("mesh_shape,layout", [("all:1", ""), ("rows:2;cols:2", "batch:rows;io:cols")])
@pytest.mark.parametrize("mode", MODES)
def test_reversible_blocks_recomputing_activations_give_the_plain_gradients(mesh_shape, layout, mode):
  inputs = [(X, X_SHAPE), (RNG.randn(4, 8).astype(np.float32), X_SHAPE)]
  plain = run_layer(_revnet(False), inputs, mesh_shape, layout, mode)
  recomputed = run_layer(_revnet(True), inputs, mesh_shape, layout, mode)
  x1, x2 = inputs[0][0], inputs[1][0]
  y1 = x1 + np.tanh(x2 @ KERNELS[0] + plain.variables["f0/bias"])
  np.testing.assert_allclose(plain.y, [y1, x2 + np.tanh(y1 @ KERNELS[1])], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(recomputed.y, plain.y, rtol=1e-6)
  for actual, expected in zip(recomputed.input_grads, plain.input_grads):
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
  assert list(recomputed.variable_grads) == ["f0/kernel", "f0/bias", "f1/kernel", "f1/bias"]
  for name, expected in plain.variable_grads.items():
    np.testing.assert_allclose(recomputed.variable_grads[name], expected, rtol=1e-4, atol=1e-5)


# ---- activation gradient clipping ----

@pytest.mark.parametrize("clip,scale", [(0.25, None), (100.0, 1.0)])
@pytest.mark.parametrize("mode", MODES)
def test_clip_activation_gradient_is_identity_forward_and_clips_gradient_rms(clip, scale, mode):
  result = run_layer(lambda x: mtf.layers.clip_activation_gradient(x, clip_rms_norm=clip), [(X, X_SHAPE)],
                     "all:2", "batch:all", mode)
  np.testing.assert_allclose(result.y, X)
  w = result.w
  rms = np.sqrt(np.mean(w ** 2))
  expected_scale = clip / rms if scale is None else scale
  np.testing.assert_allclose(result.input_grads[0], w * expected_scale, rtol=1e-5)


def test_clip_activation_gradient_without_norm_returns_its_input():
  def build(mesh):
    (x,) = import_inputs(mesh, [(X, X_SHAPE)])
    assert mtf.layers.clip_activation_gradient(x) is x
    return [x]
  lower_and_evaluate(build)


def test_summary_for_clip_activation_gradient_records_largest_per_example_gradient_rms():
  w = RNG.randn(4, 8).astype(np.float32)
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    x, w_t = import_inputs(mesh, [(X, X_SHAPE), (w, X_SHAPE)])
    y = mtf.layers.summary_for_clip_activation_gradient(x, name="grad_rms", batch_dims=[x.shape.dims[0]])
    (dx,) = mtf.gradients([mtf.reduce_sum(y * w_t)], [x])
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "batch:all", cpu_devices(2))
    lowering = mtf.Lowering(graph, {mesh: impl})
    fetches = [lowering.export_to_tf_tensor(t) for t in (y, dx)]
    summaries = tf.get_collection(mtf.utils.SCALAR_SUMMARIES_COLLECTION_KEY)
    assert [name for name, _ in summaries] == ["grad_rms"]
    with tf.Session(config=session_config()) as sess:
      y_value, dx_value, rms = sess.run(fetches + [summaries[0][1]])
  np.testing.assert_allclose(y_value, X)
  np.testing.assert_allclose(dx_value, w)
  np.testing.assert_allclose(rms, np.sqrt(np.mean(w ** 2, axis=1)).max(), rtol=1e-5)


# ---- annealed dropout ----

ONES = np.ones((64, 8), np.float32)


def _annealed(step, is_training=True, init_rate=0.5):
  def layer(x):
    if step is not None:
      tf.get_variable("global_step", initializer=tf.constant(step, tf.int64), trainable=False,
                      collections=[tf.GraphKeys.GLOBAL_VARIABLES, tf.GraphKeys.GLOBAL_STEP])
    return mtf.layers.annealed_dropout(x, is_training, start_step=10, end_step=20, init_rate=init_rate)
  return layer


@pytest.mark.parametrize("step,keep_prob", [(0, 0.5), (15, 0.75), (30, 1.0)])
def test_annealed_dropout_keep_prob_rises_linearly_from_1_minus_init_rate_to_1(step, keep_prob):
  y = run_layer(_annealed(step), [(ONES, "batch:64;io:8")], grads=False).y
  kept = y[y != 0]
  np.testing.assert_allclose(kept, 1 / keep_prob, rtol=1e-6)
  assert abs(kept.size / y.size - keep_prob) < 0.1


@pytest.mark.parametrize("mode", MODES)
def test_annealed_dropout_at_the_default_global_step_uses_the_initial_rate(mode):
  y = run_layer(_annealed(None), [(ONES, "batch:64;io:8")], "all:2", "batch:all", mode, grads=False).y
  assert set(np.unique(y)) == {0.0, 2.0}


@pytest.mark.parametrize("is_training,init_rate", [(False, 0.5), (True, None)])
def test_annealed_dropout_is_the_identity_when_not_training_or_without_rate(is_training, init_rate):
  def build(mesh):
    (x,) = import_inputs(mesh, [(X, X_SHAPE)])
    assert _annealed(None, is_training, init_rate)(x) is x
    return [x]
  lower_and_evaluate(build)
