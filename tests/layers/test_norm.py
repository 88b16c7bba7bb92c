"""mtf.layers normalisation: layer_norm and batch_norm (batch statistics, moving statistics, updates)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, cpu_devices, mesh_and_layout, session_config
from tests.layers.layer_check import check_layer, import_inputs, run_layer

SIZES = {"batch": 4, "length": 2, "io": 4}
X = np.random.RandomState(0).randn(4, 2, 4).astype(np.float32) * 3 + 1
X_SHAPE = "batch:4;length:2;io:4"
IO = mtf.Dimension("io", 4)


def _layer_norm_reference(x, variables, epsilon=1e-6):
  mean, variance = tf.nn.moments(x, axes=[2], keepdims=True)
  scope = "layer_prepostprocess/layer_norm/"
  return ((x - mean) * tf.rsqrt(variance + epsilon) * variables[scope + "layer_norm_scale"]
          + variables[scope + "layer_norm_bias"])


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), mode=st.sampled_from(MODES))
def test_layer_norm_matches_tf_with_gradients_under_any_layout(data, mode):
  mesh_shape, layout = data.draw(mesh_and_layout(SIZES))
  result = check_layer(lambda x: mtf.layers.layer_norm(x, IO), _layer_norm_reference, [(X, X_SHAPE)],
                       mesh_shape, layout, mode)
  assert result.shapes == {"layer_prepostprocess/layer_norm/layer_norm_scale": mtf.Shape([IO]),
                           "layer_prepostprocess/layer_norm/layer_norm_bias": mtf.Shape([IO])}


def test_layer_norm_output_has_zero_mean_and_unit_variance_over_dim_at_init():
  y = run_layer(lambda x: mtf.layers.layer_norm(x, IO, name="ln"), [(X, X_SHAPE)], grads=False).y
  np.testing.assert_allclose(y.mean(axis=2), 0, atol=1e-5)
  np.testing.assert_allclose(y.var(axis=2), 1, atol=1e-4)


def test_layer_norm_dim_missing_from_input_raises():
  with pytest.raises(ValueError, match="dim .* is not in the input"):
    run_layer(lambda x: mtf.layers.layer_norm(x, mtf.Dimension("io", 5)), [(X, X_SHAPE)])


@pytest.mark.parametrize("mode", MODES)
def test_layer_norm_in_bfloat16_is_close_to_float32(mode):
  result = run_layer(
      lambda x: mtf.cast(mtf.layers.layer_norm(mtf.cast(x, tf.bfloat16), IO), tf.float32),
      [(X, X_SHAPE)], "all:2", "batch:all", mode)
  mean = X.mean(axis=2, keepdims=True)
  expected = (X - mean) / np.sqrt(X.var(axis=2, keepdims=True) + 1e-6)
  np.testing.assert_allclose(result.y, expected, rtol=5e-2, atol=5e-2)
  assert all(v.dtype == tf.bfloat16.as_numpy_dtype for v in result.variables.values())


@pytest.mark.parametrize("start,end,axes", [(0, -1, (0, 1)), (0, 1, (0,)), (1, 3, (1, 2))])
@pytest.mark.parametrize("mode", MODES)
def test_batch_norm_training_normalizes_exactly_with_batch_statistics(start, end, axes, mode):
  def layer(x):
    y, update_ops = mtf.layers.batch_norm(x, is_training=True, momentum=0.9, epsilon=1e-9,
                                          dims_idx_start=start, dims_idx_end=end, name="bn")
    assert [op.name for op in update_ops] == ["bn/bn/bn_mean_update", "bn/bn/bn_var_update"]
    return y

  result = run_layer(layer, [(X, X_SHAPE)], "rows:2;cols:2", "batch:rows;io:cols", mode)
  mean = X.mean(axis=axes, keepdims=True)
  expected = (X - mean) / np.sqrt(X.var(axis=axes, keepdims=True) + 1e-9)
  np.testing.assert_allclose(result.y, expected, rtol=1e-4, atol=1e-5)
  stats_shape = mtf.Shape([d for i, d in enumerate(mtf.convert_to_shape(X_SHAPE).dims)
                           if i not in range(3)[start:end]])
  assert result.shapes == {f"bn/{n}": stats_shape for n in
                           ["batch_norm_scale", "batch_norm_bias", "bn_moving_mean", "bn_moving_variance"]}


@pytest.mark.parametrize("mode", MODES)
def test_batch_norm_gradient_matches_tf(mode):
  def reference(x, variables):
    mean, variance = tf.nn.moments(x, axes=[0, 1], keepdims=True)
    return (x - mean) * tf.rsqrt(variance + 1e-9) * variables["bn/batch_norm_scale"] + variables[
        "bn/batch_norm_bias"]

  check_layer(lambda x: mtf.layers.batch_norm(x, True, 0.9, name="bn")[0], reference, [(X, X_SHAPE)],
              "all:2", "batch:all", mode)


@pytest.mark.parametrize("mode", MODES)
def test_batch_norm_inference_uses_moving_statistics_and_has_no_updates(mode):
  def layer(x):
    y, update_ops = mtf.layers.batch_norm(x, is_training=False, momentum=0.9, name="bn")
    assert update_ops == []
    return y

  result = run_layer(layer, [(X, X_SHAPE)], "all:2", "io:all", mode, grads=False)
  moving_mean = result.variables["bn/bn_moving_mean"]
  assert np.all(result.variables["bn/bn_moving_variance"] == 1) and np.any(moving_mean != 0)
  np.testing.assert_allclose(result.y, (X - moving_mean) / np.sqrt(1 + 1e-9), rtol=1e-5, atol=1e-5)


def test_batch_norm_init_zero_starts_scale_at_zero_and_moving_stats_are_untrainable():
  result = run_layer(lambda x: mtf.layers.batch_norm(x, True, 0.9, init_zero=True, name="bn")[0],
                     [(X, X_SHAPE)])
  assert np.all(result.variables["bn/batch_norm_scale"] == 0) and np.all(result.y == 0)
  assert sorted(result.variable_grads) == ["bn/batch_norm_bias", "bn/batch_norm_scale"]


def test_batch_norm_update_ops_move_statistics_by_momentum():
  momentum = 0.75
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    (x,) = import_inputs(mesh, [(X, X_SHAPE)])
    _, update_ops = mtf.layers.batch_norm(x, True, momentum, name="bn")
    variables = {v.name: v for v in graph.all_variables}
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "batch:all", cpu_devices(2))
    lowering = mtf.Lowering(graph, {mesh: impl})
    moving = [lowering.export_to_tf_tensor(variables["bn/" + n].outputs[0])
              for n in ["bn_moving_mean", "bn_moving_variance"]]
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      old_mean, old_var = sess.run(moving)
      sess.run([lowering.lowered_operation(op) for op in update_ops])
      new_mean, new_var = sess.run(moving)
  np.testing.assert_allclose(new_mean, momentum * old_mean + (1 - momentum) * X.mean(axis=(0, 1)),
                             rtol=1e-5)
  np.testing.assert_allclose(new_var, momentum * old_var + (1 - momentum) * X.var(axis=(0, 1)),
                             rtol=1e-5)


@pytest.mark.parametrize("dim_name,axis", [("io", 2), ("batch", 0)])
def test_corr_is_numpy_pearson_correlation_over_the_other_dims(dim_name, axis):
  dim = mtf.Dimension(dim_name, SIZES[dim_name])
  outputs = []
  result = run_layer(lambda x: outputs.append(mtf.layers.corr(x, dim)) or outputs[-1], [(X, X_SHAPE)],
                     grads=False)
  samples = np.moveaxis(X, axis, -1).reshape(-1, SIZES[dim_name])
  np.testing.assert_allclose(result.y, np.corrcoef(samples, rowvar=False), rtol=1e-5, atol=1e-6)
  assert outputs[0].shape == mtf.convert_to_shape(f"{dim_name}_1:{dim.size};{dim_name}_2:{dim.size}")


def test_corr_dim_missing_from_input_raises():
  with pytest.raises(ValueError, match="corr: dim .*io.* is not in the input"):
    run_layer(lambda x: mtf.layers.corr(x, mtf.Dimension("io", 5)), [(X, X_SHAPE)])
