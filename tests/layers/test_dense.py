"""mtf.layers dense family: dense, kernels and initializers, unit scaling, dense_product, dense_relu_dense."""

from __future__ import annotations

from unittest import mock

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, lower_and_evaluate, mesh_and_layout
from tests.layers.layer_check import check_layer, import_inputs, run_layer, shape_keyed_initializer

SIZES = {"batch": 4, "length": 2, "io": 4, "hidden": 8}
RNG = np.random.RandomState(0)
X = RNG.randn(4, 2, 4).astype(np.float32)
X_SHAPE = "batch:4;length:2;io:4"
IO = mtf.Dimension("io", 4)
HIDDEN = mtf.Dimension("hidden", 8)


@pytest.fixture(autouse=True)
def _clear_gin():
  yield
  gin.clear_config()


def _dense_reference(activation=None, use_bias=True, scope="dense"):
  def reference(x, variables):
    y = tf.einsum("blc,ch->blh", x, variables[scope + "/kernel"])
    if use_bias:
      y += variables[scope + "/bias"]
    return activation(y) if activation else y
  return reference


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), use_bias=st.booleans(), mode=st.sampled_from(MODES))
def test_dense_matches_tf_with_gradients_under_any_layout(data, use_bias, mode):
  mesh_shape, layout = data.draw(mesh_and_layout(SIZES))
  check_layer(
      lambda x: mtf.layers.dense(x, HIDDEN, reduced_dims=[IO], activation=mtf.relu, use_bias=use_bias,
                                 name="dense"),
      _dense_reference(tf.nn.relu, use_bias), [(X, X_SHAPE)], mesh_shape, layout, mode)


@pytest.mark.parametrize("mode", MODES)
def test_dense_with_expert_and_several_reduced_and_new_dims_matches_einsum(mode):
  expert = mtf.Dimension("expert", 2)
  new_dims = [mtf.Dimension("h1", 2), mtf.Dimension("h2", 4)]
  x = RNG.randn(2, 4, 3, 4).astype(np.float32)

  def reference(x, variables):
    return (tf.einsum("ebcd,ecdhk->ebhk", x, variables["dense/kernel"]) + variables["dense/bias"][:, None])

  result = check_layer(
      lambda x: mtf.layers.dense(x, new_dims, reduced_dims=x.shape.dims[-2:], expert_dims=[expert],
                                 name="dense"),
      reference, [(x, "expert:2;batch:4;c:3;io:4")], "rows:2;cols:2", "expert:rows;h2:cols", mode)
  assert result.shapes["dense/kernel"] == mtf.Shape([expert, mtf.Dimension("c", 3), IO] + new_dims)
  assert result.shapes["dense/bias"] == mtf.Shape([expert] + new_dims)


@pytest.mark.parametrize("mode", MODES)
def test_dense_renames_a_reduced_dim_that_is_also_a_new_dim(mode):
  result = check_layer(lambda x: mtf.layers.dense(x, IO, reduced_dims=[IO], use_bias=False, name="dense"),
                       lambda x, variables: tf.einsum("blc,ch->blh", x, variables["dense/kernel"]),
                       [(X, X_SHAPE)], "all:2", "io:all", mode)
  assert result.shapes["dense/kernel"] == mtf.Shape([mtf.Dimension("_io", 4), IO])


@pytest.mark.parametrize("mesh_shape,layout", [("all:1", ""), ("all:2", "batch:all"),
                                               ("all:2", "length:all")])
def test_dense_to_a_new_size_of_the_same_name_keeps_both_names_as_in_0_1_21(mesh_shape, layout):
  """io=4 -> io=2: the kernel is [io=4, io=2] (one name, two Dimensions); values and gradients."""
  io_2 = mtf.Dimension("io", 2)
  result = check_layer(lambda x: mtf.layers.dense(x, io_2, reduced_dims=[IO], use_bias=False, name="dense"),
                       lambda x, variables: tf.einsum("blc,ch->blh", x, variables["dense/kernel"]),
                       [(X, X_SHAPE)], mesh_shape, layout, "graph")
  assert result.shapes["dense/kernel"] == mtf.Shape([IO, io_2])


def test_a_layout_splitting_a_name_the_kernel_holds_with_two_sizes_says_so():
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), shape=X_SHAPE)
    return [mtf.layers.dense(x, mtf.Dimension("io", 2), reduced_dims=[IO], name="dense")]
  with pytest.raises(ValueError, match="holds 'io' with two sizes.*leave 'io' unsplit"):
    lower_and_evaluate(build, "all:2", "io:all")


def test_dense_without_reduced_dims_reduces_the_last_dim():
  result = check_layer(lambda x: mtf.layers.dense(x, HIDDEN), _dense_reference(), [(X, X_SHAPE)])
  assert result.shapes["dense/kernel"] == mtf.Shape([IO, HIDDEN])


def test_dense_variables_live_in_the_named_scope_and_default_scope_is_dense():
  def layers(x):
    mtf.layers.dense(x, HIDDEN, reduced_dims=[IO], name="wi")
    return mtf.layers.dense(x, HIDDEN, reduced_dims=[IO])
  result = run_layer(layers, [(X, X_SHAPE)], grads=False)
  assert list(result.variables) == ["wi/kernel", "wi/bias", "dense/kernel", "dense/bias"]


def test_dense_reduced_dim_missing_from_input_raises():
  with pytest.raises(ValueError, match="reduced_dims .* are not dims of the input"):
    run_layer(lambda x: mtf.layers.dense(x, HIDDEN, reduced_dims=[mtf.Dimension("other", 4)]),
              [(X, X_SHAPE)], grads=False)


@pytest.mark.parametrize("mode", MODES)
def test_dense_gets_its_kernel_through_the_patched_public_module_attribute(mode):
  kernel = np.arange(32, dtype=np.float32).reshape(4, 8) / 10

  def fake_kernel_weights(x, new_dims, reduced_dims, expert_dims, kernel_initializer, name=None,
                          variable_dtype=None, master_dtype=tf.float32, slice_dtype=tf.float32):
    return mtf.import_tf_tensor(x.mesh, tf.constant(kernel), mtf.Shape(reduced_dims + new_dims))

  with mock.patch.object(mtf.layers, "get_dense_kernel_weights", autospec=True,
                         side_effect=fake_kernel_weights) as patched:
    result = run_layer(lambda x: mtf.layers.dense(x, HIDDEN, reduced_dims=[IO], use_bias=False),
                       [(X, X_SHAPE)], mode=mode, grads=False)
  assert patched.call_count == 1
  np.testing.assert_allclose(result.y, X @ kernel, rtol=1e-5)
  assert result.variables == {}


def test_a_patch_of_the_public_kernel_function_reaches_the_layer_module_and_is_undone():
  from mesh_tensorflow._layers import dense as dense_module

  original = dense_module.get_dense_kernel_weights
  with mock.patch.object(mtf.layers, "get_dense_kernel_weights") as patched:
    assert dense_module.get_dense_kernel_weights is patched
  assert mtf.layers.get_dense_kernel_weights is original and dense_module.get_dense_kernel_weights is original


@pytest.mark.parametrize("mode", MODES)
def test_dense_uses_given_kernel_weights_and_creates_only_the_bias(mode):
  kernel = RNG.randn(4, 8).astype(np.float32)
  result = run_layer(
      lambda x, k: mtf.layers.dense(x, HIDDEN, reduced_dims=[IO], kernel_weights=k, name="d"),
      [(X, X_SHAPE), (kernel, "io:4;hidden:8")], mode=mode)
  np.testing.assert_allclose(result.y, X @ kernel + result.variables["d/bias"], rtol=1e-5)
  assert list(result.variables) == ["d/bias"]


@pytest.mark.parametrize("scale,mode,fan",
                         [(1.0, "fan_in", 4 * 3), (2.0, "fan_out", 8), (3.0, "fan_avg", (12 + 8) / 2)])
def test_variance_scaling_initializer_uses_truncated_normal_with_stddev_sqrt_scale_over_fan(scale, mode, fan):
  reduced = [IO, mtf.Dimension("c", 3)]
  with mock.patch.object(tf, "truncated_normal_initializer", autospec=True) as patched:
    init = mtf.layers.VarianceScalingInitializer(scale, mode)(reduced, [HIDDEN])
  patched.assert_called_once_with(stddev=pytest.approx((scale / fan) ** 0.5))
  assert init is patched.return_value


def test_variance_scaling_initializer_uniform_limits_are_sqrt3_stddev():
  with mock.patch.object(tf, "random_uniform_initializer", autospec=True) as patched:
    mtf.layers.VarianceScalingInitializer(distribution="uniform")([IO], [HIDDEN])
  limit = 3.0 ** 0.5 * 0.5
  patched.assert_called_once_with(minval=pytest.approx(-limit), maxval=pytest.approx(limit))


def test_variance_scaling_initializer_fan_of_no_dims_is_one():
  with mock.patch.object(tf, "truncated_normal_initializer", autospec=True) as patched:
    mtf.layers.VarianceScalingInitializer(4.0)([], [])
  patched.assert_called_once_with(stddev=pytest.approx(2.0))


@pytest.mark.parametrize("kwargs,match", [({"mode": "fan_sideways"}, "mode='fan_sideways'"),
                                          ({"distribution": "cauchy"}, "distribution='cauchy'")])
def test_variance_scaling_initializer_rejects_unknown_mode_or_distribution(kwargs, match):
  with pytest.raises(ValueError, match=match):
    mtf.layers.VarianceScalingInitializer(**kwargs)([IO], [HIDDEN])


def test_unit_scaling_gives_unit_variance_and_only_allows_fan_in():
  gin.bind_parameter("mesh_tensorflow.layers.unit_scaling_convention.value", True)
  with mock.patch.object(tf, "truncated_normal_initializer", autospec=True) as patched:
    mtf.layers.VarianceScalingInitializer(2.0)([IO], [HIDDEN])
  patched.assert_called_once_with(stddev=pytest.approx(2.0 ** 0.5))
  with pytest.raises(ValueError, match="unit-scaling"):
    mtf.layers.VarianceScalingInitializer(mode="fan_avg")([IO], [HIDDEN])


@pytest.mark.parametrize("unit_scaling", [False, True])
def test_us_einsum_scales_by_inverse_sqrt_of_reduced_size_only_under_unit_scaling(unit_scaling):
  gin.bind_parameter("mesh_tensorflow.layers.unit_scaling_convention.value", unit_scaling)
  k = RNG.randn(4, 8).astype(np.float32)

  def build(mesh):
    x, w = import_inputs(mesh, [(X, X_SHAPE), (k, "io:4;hidden:8")])
    return [mtf.layers.us_einsum([x, w], reduced_dims=[IO])]
  (y,) = lower_and_evaluate(build)
  np.testing.assert_allclose(y, X @ k * (0.5 if unit_scaling else 1.0), rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_dense_product_multiplies_one_dense_per_activation(mode):
  def reference(x, variables):
    gelu = tf.einsum("blc,ch->blh", x, variables["ff_0/kernel"])
    gelu = 0.5 * gelu * (1 + tf.tanh((2 / np.pi) ** 0.5 * (gelu + 0.044715 * gelu ** 3)))
    return gelu * tf.einsum("blc,ch->blh", x, variables["ff_1/kernel"])

  result = check_layer(
      lambda x: mtf.layers.dense_product(x, [IO], HIDDEN, ["gelu", "linear"], name="ff", use_bias=False),
      reference, [(X, X_SHAPE)], "rows:2;cols:2", "batch:rows;hidden:cols", mode)
  assert list(result.variables) == ["ff_0/kernel", "ff_1/kernel"]


def test_dense_product_with_one_factor_uses_the_plain_name():
  result = check_layer(lambda x: mtf.layers.dense_product(x, [IO], HIDDEN, name="wi"),
                       _dense_reference(scope="wi"), [(X, X_SHAPE)])
  assert list(result.variables) == ["wi/kernel", "wi/bias"]


def test_dense_product_rejects_unknown_activation_name():
  with pytest.raises(ValueError, match="'no_such_fn' is not an mtf function"):
    run_layer(lambda x: mtf.layers.dense_product(x, [IO], HIDDEN, "no_such_fn"), [(X, X_SHAPE)])


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), mode=st.sampled_from(MODES))
def test_dense_relu_dense_matches_tf_under_any_layout(data, mode):
  mesh_shape, layout = data.draw(mesh_and_layout(SIZES))

  def reference(x, variables):
    h = tf.nn.relu(tf.einsum("blc,ch->blh", x, variables["dense_relu_dense/wi/kernel"]))
    return tf.einsum("blh,hc->blc", h, variables["dense_relu_dense/wo/kernel"])

  result = check_layer(
      lambda x: mtf.layers.dense_relu_dense(x, HIDDEN, is_training=False, name="dense_relu_dense"),
      reference, [(X, X_SHAPE)], mesh_shape, layout, mode)
  assert result.shapes["dense_relu_dense/wo/kernel"] == mtf.Shape([HIDDEN, IO])


def test_dense_relu_dense_dropout_only_when_training():
  ones = np.ones((4, 2, 4), np.float32)
  init = shape_keyed_initializer({(4, 8): np.ones((4, 8)), (8, 4): np.eye(8, 4)})

  def layer(training):
    def fn(x):
      with mock.patch.object(tf, "truncated_normal_initializer", return_value=init):
        return mtf.layers.dense_relu_dense(x, HIDDEN, is_training=training, dropout=0.5)
    return fn
  np.testing.assert_allclose(run_layer(layer(False), [(ones, X_SHAPE)], grads=False).y, 4 * ones)
  y = run_layer(layer(True), [(ones, X_SHAPE)], grads=False).y
  assert set(np.unique(y)) <= {0.0, 8.0} and 0 < np.count_nonzero(y) < y.size


@pytest.mark.parametrize("mode", MODES)
def test_dense_runs_in_bfloat16_with_float32_masters(mode):
  variable_dtype = mtf.VariableDType(tf.float32, tf.bfloat16, tf.bfloat16)

  # A fixed kernel keeps bfloat16 rounding (compared at 3e-2) the same on every run.
  kernel = np.random.RandomState(7).uniform(-0.5, 0.5, [4, 8]).astype(np.float32)

  def layer(x):
    return mtf.layers.dense(mtf.cast(x, tf.bfloat16), HIDDEN, reduced_dims=[IO],
                            variable_dtype=variable_dtype, activation=mtf.relu, name="dense",
                            kernel_initializer=tf.constant_initializer(kernel))

  def reference(x, variables):
    x = tf.cast(tf.cast(x, tf.bfloat16), tf.float32)
    kernel = tf.cast(variables["dense/kernel"], tf.float32)
    return tf.nn.relu(tf.einsum("blc,ch->blh", x, kernel) + tf.cast(variables["dense/bias"], tf.float32))

  result = check_layer(layer, reference, [(X, X_SHAPE)], "all:2", "batch:all", mode, rtol=3e-2, atol=3e-2)
  assert result.y.dtype == tf.bfloat16.as_numpy_dtype
  assert result.variables["dense/kernel"].dtype == tf.bfloat16.as_numpy_dtype


def test_dense_master_variables_are_float32_when_slices_are_bfloat16():
  variable_dtype = mtf.VariableDType(tf.float32, tf.bfloat16, tf.bfloat16)
  with tf.Graph().as_default():
    mesh = mtf.Mesh(mtf.Graph(), "m")
    (x,) = import_inputs(mesh, [(X, X_SHAPE)])
    y = mtf.layers.dense(mtf.cast(x, tf.bfloat16), HIDDEN, reduced_dims=[IO], variable_dtype=variable_dtype)
    assert y.dtype == tf.bfloat16
    assert {v.name: v.dtype.base_dtype for v in tf.global_variables()} == {
        "dense/kernel:0": tf.float32, "dense/bias:0": tf.float32}
