"""transformer_layers convolutions: Conv1DLayer, SeparableConv1DLayer, the conv-attention family,
LocalConvAttnBlock and the Conv1D decoding-state helpers, against plain-TF references of 0.1.21's
math (full passes zero x where the input ids are 0; Conv1DLayer pads "SAME")."""

from __future__ import annotations

import collections
from unittest import mock

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer_layers
from tests.harness import lower_and_evaluate
from tests.layers.layer_check import check_layer, shape_keyed_initializer
from tests.transformer.layer_context import call_layer, make_context, model_stub

RNG = np.random.RandomState(2)
BATCH, LENGTH, D_MODEL = 2, 6, 4
X_SHAPE = "batch:2;length:6;d_model:4"
SEPARABLE = "layer/separable_conv1d/"
IDS_SHAPE = "batch:2;length:6"
# Input ids: the second sequence ends in padding (id 0), where the layers zero x.
IDS = np.array([[3, 1, 4, 1, 5, 9], [2, 6, 5, 0, 0, 0]], np.int32)


def _x():
  return RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)


def _x_and_ids():
  return [(_x(), X_SHAPE), (IDS, IDS_SHAPE)]


def tf_masked(x, ids):
  """x zeroed where the input id is 0."""
  return x * tf.cast(tf.not_equal(ids, 0), x.dtype)[..., None]


def _build(layer):
  def build(x, ids):
    return call_layer(layer, make_context(x, model_stub(D_MODEL), inputs=ids), x)
  return build


def tf_shift(x, r: int):
  """y[:, t] = x[:, t + r], zero outside the sequence."""
  if r >= 0:
    return tf.pad(x[:, r:], [[0, 0], [0, r], [0, 0]])
  return tf.pad(x[:, :LENGTH + r], [[0, 0], [-r, 0], [0, 0]])


def tf_separable(x, depthwise_kernels, variables, prefix=SEPARABLE, min_relative_pos=-2):
  """sum_r shift(x, r) * kernel_r + depthwise bias, then the pointwise dense (with bias)."""
  depthwise = tf.add_n([tf_shift(x, min_relative_pos + i) * kernel
                        for i, kernel in enumerate(depthwise_kernels)])
  depthwise += variables[prefix + "depthwise_conv_hack/depthwise_dense_0/bias"]
  return (tf.einsum("bld,de->ble", depthwise, variables[prefix + "pointwise_dense/kernel"])
          + variables[prefix + "pointwise_dense/bias"])


@pytest.mark.parametrize("mesh_shape,layout", [("all:1", ""), ("batch:2", "batch:batch")])
def test_conv1d_layer_zeroes_padding_then_convolves_with_same_padding(mesh_shape, layout):
  layer = transformer_layers.Conv1DLayer(filter_size=3, output_size=D_MODEL, activation="relu")

  def reference(x, ids, variables):
    return tf.nn.relu(tf.nn.conv1d(tf_masked(x, ids), variables["layer/conv2d/kernel"][0], stride=1,
                                   padding="SAME"))
  result = check_layer(_build(layer), reference, _x_and_ids(), mesh_shape, layout)
  assert result.shapes["layer/conv2d/kernel"].to_integer_list == [1, 3, D_MODEL, D_MODEL]


def test_conv1d_layer_with_an_even_filter_sees_one_more_later_position_than_earlier():
  """TF's "SAME" for filter_size 4: output t sees inputs t-1 .. t+2 (as 0.1.21's full pass)."""
  kernel = RNG.randn(1, 4, D_MODEL, 1).astype(np.float32)
  x, ids = _x(), np.ones([BATCH, LENGTH], np.int32)
  padded = np.pad(x, [(0, 0), (1, 2), (0, 0)])
  expected = np.stack([np.einsum("bld,ldo->bo", padded[:, t:t + 4], kernel[0]) for t in range(LENGTH)], 1)
  layer = transformer_layers.Conv1DLayer(filter_size=4, output_size=1)
  with mock.patch.object(tf, "glorot_uniform_initializer",
                         return_value=shape_keyed_initializer({kernel.shape: kernel})):
    y, = lower_and_evaluate(lambda mesh: [_build(layer)(
        mtf.import_tf_tensor(mesh, tf.constant(x), shape=X_SHAPE),
        mtf.import_tf_tensor(mesh, tf.constant(ids), shape=IDS_SHAPE))])
  np.testing.assert_allclose(y[..., 0], expected[..., 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make_layer", [
    lambda: transformer_layers.Conv1DLayer(filter_size=3, output_size=D_MODEL),
    lambda: transformer_layers.SeparableConv1DLayer(-1, 0, D_MODEL),
], ids=["conv1d", "separable"])
def test_full_passes_need_the_input_ids_for_the_padding_mask(make_layer):
  layer = make_layer()

  def build(mesh):
    x = mtf.zeros(mesh, X_SHAPE)
    return [call_layer(layer, make_context(x, model_stub(D_MODEL)), x)]
  with pytest.raises(ValueError, match="zeroes x where context.inputs == 0, but context.inputs is None"):
    lower_and_evaluate(build)


def test_conv1d_layer_takes_its_kernel_from_tf_glorot_uniform_initializer_at_call_time():
  kernel = RNG.randn(1, 2, D_MODEL, D_MODEL).astype(np.float32)
  layer = transformer_layers.Conv1DLayer(filter_size=2, output_size=D_MODEL)
  with mock.patch.object(tf, "glorot_uniform_initializer",
                         return_value=shape_keyed_initializer({kernel.shape: kernel})):
    def reference(x, ids, variables):
      return tf.nn.conv1d(tf_masked(x, ids), variables["layer/conv2d/kernel"][0], stride=1, padding="SAME")
    result = check_layer(_build(layer), reference, _x_and_ids())
  np.testing.assert_array_equal(result.variables["layer/conv2d/kernel"], kernel)


def test_separable_conv1d_layer_sums_shifted_masked_inputs_times_depthwise_kernels():
  layer = transformer_layers.SeparableConv1DLayer(min_relative_pos=-2, max_relative_pos=1,
                                                  output_size=D_MODEL)

  def reference(x, ids, variables):
    kernels = [variables[SEPARABLE + "depthwise_conv_hack/depthwise_dense_%d/kernel" % i] for i in range(4)]
    return tf_separable(tf_masked(x, ids), kernels, variables)
  check_layer(_build(layer), reference, _x_and_ids(), "batch:2", "batch:batch")


def _initializer_stddevs(build) -> list:
  """The stddevs of the truncated-normal initializers the build asks for, in order."""
  stddevs = []
  truncated_normal = tf.truncated_normal_initializer

  def recording(stddev=1.0, **kwargs):
    stddevs.append(stddev)
    return truncated_normal(stddev=stddev, **kwargs)
  with mock.patch.object(tf, "truncated_normal_initializer", recording):
    lower_and_evaluate(build)
  return stddevs


def test_separable_conv1d_depthwise_initializer_variance_is_the_scale_over_the_filter_size():
  """0.1.21: depthwise kernels VarianceScaling(scale / filter size); the pointwise one keeps its scale."""
  layer = transformer_layers.SeparableConv1DLayer(-2, 1, D_MODEL, depthwise_filter_initializer_scale=2.0,
                                                  pointwise_filter_initializer_scale=3.0)
  stddevs = _initializer_stddevs(lambda mesh: [_build(layer)(mtf.zeros(mesh, X_SHAPE),
                                                             mtf.ones(mesh, IDS_SHAPE, dtype=tf.int32))])
  assert stddevs == [pytest.approx((2.0 / 4) ** 0.5)] * 4 + [pytest.approx((3.0 / D_MODEL) ** 0.5)]


def _tiled_softmax(kernels, num_unique: int):
  """[window][repeated] kernels -> softmax over the window of each kernel tiled num_unique times."""
  stacked = tf.stack([tf.tile(k, [1] * (len(k.shape) - 1) + [num_unique]) for k in kernels], axis=-2)
  return tf.nn.softmax(stacked, axis=-2)  # [..., window, d_model]


def _lightweight_weights(x, v, num_unique=2):
  return _tiled_softmax([v["layer/lightwt_depthwise_dense_%d/kernel" % i] for i in range(4)], num_unique)


def _dynamic_weights(x, v, num_unique=2, prefix="layer/"):
  def kernel(i):
    scope = prefix + "dyn_conv_depthwise_dense_%d/" % i
    return tf.einsum("bld,dr->blr", x, v[scope + "kernel"]) + v[scope + "bias"]
  return _tiled_softmax([kernel(i) for i in range(4)], num_unique)


CONV_ATTENTION_CASES = {
    "lightweight": (lambda: transformer_layers.LightweightConv1DLocalAttn(
        -2, 1, D_MODEL, num_unique_depth_filters=2), _lightweight_weights),
    "dynamic": (lambda: transformer_layers.DynamicConv1DLocalAttn(
        -2, 1, D_MODEL, num_unique_depth_filters=2), _dynamic_weights),
}


@pytest.mark.parametrize("name", sorted(CONV_ATTENTION_CASES))
def test_conv_attention_kernels_are_tiled_and_softmax_normalised_over_the_window(name):
  """0.1.21's math: kernel i over d_model / num_unique channels, tiled num_unique times, softmax over i."""
  make_layer, weights_fn = CONV_ATTENTION_CASES[name]

  def reference(x, ids, variables):
    weights = weights_fn(x, variables)  # [(batch, length,) window, d_model], from the unmasked x
    return tf_separable(tf_masked(x, ids), [weights[..., i, :] for i in range(4)], variables)
  check_layer(_build(make_layer()), reference, _x_and_ids(), "batch:2", "batch:batch")


def test_conv_attention_kernel_initializer_variance_is_the_scale_over_the_filter_size():
  layer = transformer_layers.LightweightConv1DLocalAttn(-2, 1, D_MODEL,
                                                        depthwise_filter_initializer_scale=2.0)
  stddevs = _initializer_stddevs(lambda mesh: [_build(layer)(mtf.zeros(mesh, X_SHAPE),
                                                             mtf.ones(mesh, IDS_SHAPE, dtype=tf.int32))])
  assert stddevs[:4] == [pytest.approx((2.0 / 4) ** 0.5)] * 4


@pytest.mark.parametrize("attention_type", ["lightweight_conv", "dynamic_conv"])
def test_local_conv_attn_block_is_glu_then_conv_attention_then_a_projection(attention_type):
  layer = transformer_layers.LocalConvAttnBlock(min_relative_pos=-2, max_relative_pos=1, output_size=D_MODEL,
                                                attention_type=attention_type)

  def reference(x, ids, variables):
    def dense(t, name):
      scope = "layer/%s/" % name
      return tf.einsum("bld,de->ble", t, variables[scope + "kernel"]) + variables[scope + "bias"]
    gated = dense(x, "local_conv_inp_0") * tf.sigmoid(dense(x, "local_conv_inp_1"))
    if attention_type == "dynamic_conv":
      weights = _dynamic_weights(gated, variables, num_unique=1)
    else:
      weights = _lightweight_weights(gated, variables, num_unique=1)
    convolved = tf_separable(tf_masked(gated, ids), [weights[..., i, :] for i in range(4)], variables)
    return dense(convolved, "local_conv_attn_op_projection")
  check_layer(_build(layer), reference, _x_and_ids())


def test_conv_attention_arguments_are_checked():
  with pytest.raises(ValueError, match="unknown attention_type 'gated'"):
    transformer_layers.LocalConvAttnBlock(-2, 0, D_MODEL, attention_type="gated")
  with pytest.raises(ValueError, match="num_unique_depth_filters=3 must divide output_size=4"):
    transformer_layers.LightweightConv1DLocalAttn(-1, 0, D_MODEL, num_unique_depth_filters=3)
  with pytest.raises(NotImplementedError, match="define get_kernel_wt"):
    lower_and_evaluate(lambda mesh: [_build(transformer_layers.Conv1DLocalAttn(-1, 0, D_MODEL))(
        mtf.zeros(mesh, X_SHAPE), mtf.ones(mesh, IDS_SHAPE, dtype=tf.int32))])


def test_record_states_first_part_mode_keeps_the_inputs_before_the_initial_position():
  x = _x()
  initial_position = np.array([1, 5], np.int32)

  def build(mesh):
    xt = mtf.import_tf_tensor(mesh, tf.constant(x), shape=X_SHAPE)
    context = make_context(xt, model_stub(D_MODEL), mode="first_part", initial_position=mtf.import_tf_tensor(
        mesh, tf.constant(initial_position), shape="batch:2"))
    transformer_layers.Conv1D().record_states_first_part_mode(context, xt, filter_size=3)
    state, = context.new_states
    assert state.shape.dimension_names == ["batch", "length_filter_width", "d_model"]
    return [state]
  state, = lower_and_evaluate(build, "batch:2", "batch:batch")
  np.testing.assert_array_equal(state[0], np.stack([np.zeros(D_MODEL), np.zeros(D_MODEL), x[0, 0]]))
  np.testing.assert_array_equal(state[1], x[1, 2:5])


def test_update_state_and_incremental_mode_shift_the_window_and_append_x():
  old_state = RNG.randn(BATCH, 3, D_MODEL).astype(np.float32)
  x = RNG.randn(BATCH, D_MODEL).astype(np.float32)
  expected = np.concatenate([old_state[:, 1:], x[:, None]], axis=1)

  def build(mesh):
    state = mtf.import_tf_tensor(mesh, tf.constant(old_state),
                                 shape="batch:2;length_filter_width:3;d_model:4")
    xt = mtf.import_tf_tensor(mesh, tf.constant(x), shape="batch:2;d_model:4")
    filter_dim = state.shape.dims[1]
    last = mtf.constant(mesh, 2, mtf.Shape(xt.shape.dims[:1]), dtype=tf.int32)
    updated = transformer_layers.Conv1D().update_state(state, xt, last, filter_dim, tf.float32)
    context = make_context(mtf.zeros(mesh, X_SHAPE), model_stub(D_MODEL), mode="incremental", states=[state])
    incremental = transformer_layers.Conv1D().record_states_incremental_mode(context, xt, filter_size=3)
    assert context.new_states == [incremental]
    return [updated, incremental]
  updated, incremental = lower_and_evaluate(build)
  np.testing.assert_allclose(updated, expected)
  np.testing.assert_allclose(incremental, expected)


@pytest.mark.parametrize("make_layer", [
    lambda: transformer_layers.Conv1DLayer(filter_size=2, output_size=D_MODEL),
    lambda: transformer_layers.SeparableConv1DLayer(min_relative_pos=-1, max_relative_pos=0,
                                                    output_size=D_MODEL),
], ids=["conv1d", "separable"])
def test_conv_layers_run_with_a_stand_in_context_in_full_and_incremental_modes(make_layer):
  """A step decodes the window of the last 2 inputs: for the separable filter [-1, 0] that is the full
  pass at t; for Conv1DLayer's centred width-2 filter (t .. t+1 in the full pass) the full pass at t-1."""
  layer, x, t = make_layer(), _x(), 3
  full_position = t - 1 if isinstance(layer, transformer_layers.Conv1DLayer) else t

  def build(mesh):
    xt = mtf.import_tf_tensor(mesh, tf.constant(x), shape=X_SHAPE)
    length_dim = xt.shape.dims[1]
    full_context = mock.MagicMock(mode="train", length_dim=length_dim, activation_dtype=tf.float32,
                                  inputs=mtf.ones(mesh, IDS_SHAPE, dtype=tf.int32))
    with tf.variable_scope("layer"):
      full = layer.call(full_context, xt)
    state = mtf.import_tf_tensor(mesh, tf.constant(x[:, t - 2:t]),
                                 shape="batch:2;length_filter_width:2;d_model:4")
    step_context = mock.MagicMock(mode="incremental", length_dim=length_dim, activation_dtype=tf.float32)
    step_context.get_states.return_value = [state]
    with tf.variable_scope("layer"):
      step = layer.call(step_context, mtf.gather(xt, t, length_dim))
    new_state, = step_context.record_new_states.call_args[0][0]
    return [full, step, new_state]
  full, step, new_state = lower_and_evaluate(build)
  np.testing.assert_allclose(step, full[:, full_position], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new_state, x[:, t - 1:t + 1])


MinimalContext = collections.namedtuple("MinimalContext", ["inputs", "activation_dtype", "mode"])


def _tf_same_conv(x, ids, variables):
  return tf.nn.conv1d(tf_masked(x, ids), variables["layer/conv2d/kernel"][0], 1, "SAME")


def _tf_separable_4(x, ids, variables):
  kernels = [variables[SEPARABLE + "depthwise_conv_hack/depthwise_dense_%d/kernel" % i] for i in range(4)]
  return tf_separable(tf_masked(x, ids), kernels, variables)


@pytest.mark.parametrize("make_layer,conv_fn", [
    (lambda: transformer_layers.Conv1DLayer(filter_size=3, output_size=2), _tf_same_conv),
    (lambda: transformer_layers.SeparableConv1DLayer(min_relative_pos=-2, max_relative_pos=1, output_size=2),
     _tf_separable_4),
], ids=["conv1d", "separable"])
def test_conv_layers_take_the_length_from_x_with_a_context_of_inputs_dtype_and_mode(make_layer, conv_fn):
  """0.1.21's own tests call the layers with only these three context fields."""
  layer = make_layer()

  def build(x, ids):
    return call_layer(layer, MinimalContext(ids, tf.float32, "train"), x)
  result = check_layer(build, conv_fn, _x_and_ids(), "batch:2", "batch:batch")
  assert np.shape(result.y) == (BATCH, LENGTH, 2)


@pytest.mark.parametrize("window_name", ["length", "length_filter_width", "filter"])
def test_incremental_mode_reads_a_state_whatever_its_window_dim_is_named(window_name):
  """A state stored as 0.1.21 stores it ([batch, length=filter_size, d_model]) decodes the same."""
  filter_size, output_size = 3, 2
  state = RNG.randn(BATCH, filter_size, D_MODEL).astype(np.float32)
  x = RNG.randn(BATCH, D_MODEL).astype(np.float32)
  conv_kernel = RNG.randn(1, filter_size, D_MODEL, output_size).astype(np.float32)
  depthwise = [RNG.randn(D_MODEL).astype(np.float32) for _ in range(filter_size)]
  pointwise = RNG.randn(D_MODEL, output_size).astype(np.float32)
  window = np.concatenate([state[:, 1:], x[:, None]], axis=1)

  def build(mesh):
    step_state = mtf.import_tf_tensor(mesh, tf.constant(state),
                                      shape=f"batch:2;{window_name}:{filter_size};d_model:4")
    xt = mtf.import_tf_tensor(mesh, tf.constant(x), shape="batch:2;d_model:4")
    outputs = []
    for name, layer in (("conv", transformer_layers.Conv1DLayer(filter_size, output_size)),
                        ("separable", transformer_layers.SeparableConv1DLayer(-2, 0, output_size))):
      context = make_context(mtf.zeros(mesh, X_SHAPE), model_stub(D_MODEL), mode="incremental",
                             states=[step_state])
      with tf.variable_scope(name):
        if name == "conv":
          outputs.append(layer.call(context, xt))
        else:  # pointwise kernel through mtf.layers.get_dense_kernel_weights, as in 0.1.21's test
          kernels = [mtf.import_tf_tensor(mesh, tf.constant(k), shape="d_model:4") for k in depthwise]
          with mock.patch.object(mtf.layers, "get_dense_kernel_weights") as get_kernel:
            kernel_shape = [mtf.Dimension("d_model", 4), mtf.Dimension("d_model", 2)]
            get_kernel.return_value = mtf.import_tf_tensor(mesh, tf.constant(pointwise), shape=kernel_shape)
            outputs.append(layer.call(context, xt, all_kernel_wts=kernels))
      outputs.append(context.new_states[0])
    return outputs
  with mock.patch.object(tf, "glorot_uniform_initializer",
                         return_value=shape_keyed_initializer({conv_kernel.shape: conv_kernel})):
    conv_y, conv_state, separable_y, separable_state = lower_and_evaluate(build)
  np.testing.assert_allclose(conv_y, np.einsum("bld,hldo->bo", window, conv_kernel), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(separable_y, np.einsum("bld,ld->bd", window, np.array(depthwise)) @ pointwise,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(conv_state, window)
  np.testing.assert_allclose(separable_state, window)


def test_incremental_mode_rejects_a_state_window_of_the_wrong_size():
  layer = transformer_layers.Conv1DLayer(filter_size=3, output_size=D_MODEL)

  def build(mesh):
    state = mtf.zeros(mesh, "batch:2;length:2;d_model:4")
    context = make_context(mtf.zeros(mesh, X_SHAPE), model_stub(D_MODEL), mode="incremental", states=[state])
    return [layer.call(context, mtf.zeros(mesh, "batch:2;d_model:4"))]
  with pytest.raises(ValueError, match="window dim .*length.* of size 2, but the filter needs 3"):
    lower_and_evaluate(build)


def test_filter_size_is_the_width_of_the_filter_as_upstream():
  """0.1.21's read-only filter_size: the width for Conv1DLayer, max - min + 1 for the separable family."""
  assert transformer_layers.Conv1DLayer(filter_size=3, output_size=8).filter_size == 3
  assert transformer_layers.SeparableConv1DLayer(-4, 2, output_size=8).filter_size == 7
  assert transformer_layers.LightweightConv1DLocalAttn(-2, 0, output_size=8).filter_size == 3
  with pytest.raises(AttributeError):
    transformer_layers.Conv1DLayer(filter_size=3, output_size=8).filter_size = 5
