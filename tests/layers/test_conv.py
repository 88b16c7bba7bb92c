"""mtf.layers convolutions: conv1d, separable_conv1d, conv2d/3d, transposes, and blocked (halo) variants."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, mesh_and_layout
from tests.layers.layer_check import check_layer, run_layer, shape_keyed_initializer

RNG = np.random.RandomState(0)
OUT = mtf.Dimension("cout", 4)


def _randn(*shape):
  return RNG.randn(*shape).astype(np.float32)


# ---- conv1d ----

@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("mode", MODES)
def test_conv1d_on_length_depth_input_uses_a_1_by_filter_size_kernel(padding, mode):
  x = np.array([[1, 0], [0, 1], [1, 1], [2, 1]], np.float32)  # [length, depth]
  taps = np.array([[1, -2], [2, -4], [3, -6]], np.float32)  # [filter position, depth]
  init = shape_keyed_initializer({(1, 3, 2, 1): taps[None, :, :, None]})
  result = run_layer(lambda x: mtf.layers.conv1d(x, mtf.Dimension("out", 1), filter_size=3,
                                                 filter_initializer=init, padding=padding, name="conv"),
                     [(x, "length:4;depth:2")], mode=mode, grads=False)
  padded = np.pad(x, [[1, 1], [0, 0]]) if padding == "SAME" else x
  expected = [[np.sum(taps * padded[t:t + 3])] for t in range(len(padded) - 2)]
  np.testing.assert_allclose(result.y, expected)
  assert result.shapes == {"conv/kernel": mtf.convert_to_shape("fh:1;fw:3;depth:2;out:1")}


def test_conv1d_default_scope_is_conv2d():
  result = run_layer(lambda x: mtf.layers.conv1d(x, OUT), [(_randn(4, 2), "length:4;depth:2")], grads=False)
  assert list(result.variables) == ["conv2d/kernel"]


@pytest.mark.parametrize("stride,padding", [(1, "SAME"), (2, "SAME"), (1, "VALID")])
@pytest.mark.parametrize("mode", MODES)
def test_conv1d_with_several_batch_dims_matches_tf(stride, padding, mode):
  x = _randn(2, 2, 6, 2)

  def reference(x, variables):
    y = tf.nn.conv2d(tf.reshape(x, [4, 1, 6, 2]), variables["conv/kernel"], [1, 1, stride, 1], padding)
    return tf.reshape(y, [2, 2, -1, 4])

  check_layer(lambda x: mtf.layers.conv1d(x, OUT, filter_size=3, stride=stride, padding=padding,
                                          name="conv"),
              reference, [(x, "b1:2;b2:2;length:6;depth:2")], "rows:2;cols:2", "b1:rows;cout:cols", mode)


# ---- conv2d / conv3d and transposes ----
# Spatial sizes are multiples of the strides: mtf (like upstream) floors out = in // stride there.

SIZES = {"batch": 4, "cin": 2, "cout": 4}


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), strides=st.sampled_from([(1, 1), (2, 1)]), padding=st.sampled_from(["SAME", "VALID"]),
       mode=st.sampled_from(MODES))
def test_conv2d_matches_tf_under_any_layout(data, strides, padding, mode):
  mesh_shape, layout = data.draw(mesh_and_layout(SIZES))
  result = check_layer(
      lambda x: mtf.layers.conv2d(x, OUT, filter_size=(3, 2), strides=strides, padding=padding, name="conv"),
      lambda x, variables: tf.nn.conv2d(x, variables["conv/kernel"], [1, *strides, 1], padding),
      [(_randn(4, 6, 4, 2), "batch:4;h:6;w:4;cin:2")], mesh_shape, layout, mode)
  assert result.shapes == {"conv/kernel": mtf.convert_to_shape("fh:3;fw:2;cin:2;cout:4")}


def _tf_conv_transpose(conv_dimension, name, strides, padding="SAME"):
  fn = tf.nn.conv2d_transpose if conv_dimension == 2 else tf.nn.conv3d_transpose

  def reference(x, variables):
    kernel = variables[name + "/kernel"]
    shape = x.shape.as_list()
    out_spatial = [s * t for s, t in zip(shape[1:-1], strides)]
    return fn(x, kernel, [shape[0], *out_spatial, kernel.shape.as_list()[-2]], [1, *strides, 1], padding)
  return reference


@pytest.mark.parametrize("mode", MODES)
def test_conv2d_transpose_matches_tf(mode):
  result = check_layer(lambda x: mtf.layers.conv2d_transpose(x, OUT, name="up"),
                       _tf_conv_transpose(2, "up", (2, 2)), [(_randn(4, 3, 2, 2), "batch:4;h:3;w:2;cin:2")],
                       "rows:2;cols:2", "batch:rows;cout:cols", mode)
  assert result.y.shape == (4, 6, 4, 4)
  assert result.shapes == {"up/kernel": mtf.convert_to_shape("fh:2;fw:2;cout:4;cin:2")}


@pytest.mark.parametrize("mode", MODES)
def test_conv3d_matches_tf(mode):
  result = check_layer(lambda x: mtf.layers.conv3d(x, OUT, name="conv"),
                       lambda x, variables: tf.nn.conv3d(x, variables["conv/kernel"], [1] * 5, "SAME"),
                       [(_randn(2, 3, 4, 3, 2), "batch:2;d:3;h:4;w:3;cin:2")], "all:2", "cin:all", mode)
  assert result.shapes == {"conv/kernel": mtf.convert_to_shape("fd:3;fh:3;fw:3;cin:2;cout:4")}


@pytest.mark.parametrize("mode", MODES)
def test_conv3d_transpose_matches_tf(mode):
  check_layer(lambda x: mtf.layers.conv3d_transpose(x, OUT, name="up"),
              _tf_conv_transpose(3, "up", (2, 2, 2)), [(_randn(2, 2, 3, 2, 2), "batch:2;d:2;h:3;w:2;cin:2")],
              "all:2", "batch:all", mode)


def test_conv2d_runs_with_bfloat16_activations_and_float32_masters():
  def layer(x):
    return mtf.layers.conv2d(mtf.cast(x, tf.bfloat16), OUT, name="conv")
  result = run_layer(layer, [(_randn(2, 3, 3, 2), "batch:2;h:3;w:3;cin:2")], grads=False)
  assert result.y.dtype == tf.bfloat16.as_numpy_dtype


# ---- blocked (spatially partitioned) convolutions equal the whole-image convolution ----

def _blocks_to_image(x, conv_dimension):
  """[b, blocks (conv_dimension - 1 of them)..., spatial..., c] -> [b, image spatial..., c]."""
  shape = x.shape.as_list()
  nb = conv_dimension if conv_dimension == 2 else 2
  blocks, spatial = shape[1:1 + nb], shape[1 + nb:-1]
  perm = [0]
  for i in range(nb):
    perm += [1 + i, 1 + nb + i]
  perm += list(range(1 + 2 * nb, len(shape)))
  image_spatial = [b * s for b, s in zip(blocks, spatial)] + spatial[nb:]
  return tf.reshape(tf.transpose(x, perm), [shape[0], *image_spatial, shape[-1]])


def _image_to_blocks(y, blocks, conv_dimension):
  shape = y.shape.as_list()
  nb = len(blocks)
  split = []
  for b, s in zip(blocks, shape[1:1 + nb]):
    split += [b, s // b]
  y = tf.reshape(y, [shape[0], *split, *shape[1 + nb:]])
  perm = [0] + [1 + 2 * i for i in range(nb)] + [2 + 2 * i for i in range(nb)]
  perm += list(range(1 + 2 * nb, len(shape) + nb))
  return tf.transpose(y, perm)


def _blocked_reference(conv_dimension, blocks, filter_size, strides, transpose):
  def reference(x, variables):
    image = _blocks_to_image(x, conv_dimension)
    kernel = variables["conv/kernel"]
    if transpose:
      fn = tf.nn.conv2d_transpose if conv_dimension == 2 else tf.nn.conv3d_transpose
      shape = image.shape.as_list()
      out_shape = [shape[0]] + [s * t for s, t in zip(shape[1:-1], strides)] + [kernel.shape.as_list()[-2]]
      y = fn(image, kernel, out_shape, [1, *strides, 1], "SAME")
    else:
      fn = tf.nn.conv2d if conv_dimension == 2 else tf.nn.conv3d
      y = fn(image, kernel, [1, *strides, 1], "SAME")
    return _image_to_blocks(y, blocks, conv_dimension)
  return reference


@pytest.mark.parametrize("filter_size", [(3, 3), (5, 1), (3, 5)])
@pytest.mark.parametrize("mode", MODES)
def test_conv2d_with_blocks_equals_conv2d_of_the_whole_image(filter_size, mode):
  x = _randn(2, 2, 2, 3, 4, 2)
  h_blocks, w_blocks = mtf.Dimension("h_blocks", 2), mtf.Dimension("w_blocks", 2)
  check_layer(lambda x: mtf.layers.conv2d_with_blocks(x, OUT, filter_size, h_blocks_dim=h_blocks,
                                                      w_blocks_dim=w_blocks, name="conv"),
              _blocked_reference(2, [2, 2], filter_size, (1, 1), False),
              [(x, "batch:2;h_blocks:2;w_blocks:2;h:3;w:4;cin:2")], "rows:2;cols:2",
              "h_blocks:rows;w_blocks:cols", mode)


@pytest.mark.parametrize("filter_size,strides", [((2, 2), (2, 2)), ((4, 4), (2, 2)), ((3, 3), (1, 1)),
                                                 ((3, 2), (2, 1))])
@pytest.mark.parametrize("mode", MODES)
def test_conv2d_transpose_with_blocks_equals_conv2d_transpose_of_the_whole_image(filter_size, strides, mode):
  x = _randn(2, 2, 2, 3, 2, 2)
  check_layer(lambda x: mtf.layers.conv2d_transpose_with_blocks(
      x, OUT, filter_size, strides, h_blocks_dim=x.shape.dims[1], w_blocks_dim=x.shape.dims[2], name="conv"),
      _blocked_reference(2, [2, 2], filter_size, strides, True),
      [(x, "batch:2;h_blocks:2;w_blocks:2;h:3;w:2;cin:2")], "rows:2;cols:2", "h_blocks:rows;w_blocks:cols",
      mode)


@pytest.mark.parametrize("mode", MODES)
def test_conv3d_with_blocks_equals_conv3d_of_the_whole_volume(mode):
  x = _randn(2, 2, 2, 2, 3, 3, 2)
  check_layer(lambda x: mtf.layers.conv3d_with_blocks(
      x, OUT, d_blocks_dim=x.shape.dims[1], h_blocks_dim=x.shape.dims[2], name="conv"),
      _blocked_reference(3, [2, 2], (3, 3, 3), (1, 1, 1), False),
      [(x, "batch:2;d_blocks:2;h_blocks:2;d:2;h:3;w:3;cin:2")], "x:2;y:2;z:2",
      "d_blocks:x;h_blocks:y;batch:z", mode)


@pytest.mark.parametrize("mode", MODES)
def test_conv3d_transpose_with_blocks_equals_conv3d_transpose_of_the_whole_volume(mode):
  x = _randn(2, 2, 2, 2, 2, 2, 2)
  check_layer(lambda x: mtf.layers.conv3d_transpose_with_blocks(
      x, OUT, (4, 4, 4), (2, 2, 2), d_blocks_dim=x.shape.dims[1], h_blocks_dim=x.shape.dims[2], name="conv"),
      _blocked_reference(3, [2, 2], (4, 4, 4), (2, 2, 2), True),
      [(x, "batch:2;d_blocks:2;h_blocks:2;d:2;h:2;w:2;cin:2")], "rows:2;cols:2",
      "d_blocks:rows;h_blocks:cols", mode)


def test_conv_with_no_blocks_dims_is_the_plain_convolution():
  x = _randn(2, 3, 4, 2)
  check_layer(lambda x: mtf.layers.conv2d_with_blocks(x, OUT, padding="VALID", name="conv"),
              lambda x, variables: tf.nn.conv2d(x, variables["conv/kernel"], [1] * 4, "VALID"),
              [(x, "batch:2;h:3;w:4;cin:2")])


def test_blocked_conv_with_valid_padding_raises_value_and_not_implemented_error():
  x = _randn(2, 2, 3, 4, 2)
  for error in (ValueError, NotImplementedError):
    with pytest.raises(error, match="padding='VALID' is not supported with blocks dims"):
      run_layer(lambda x: mtf.layers.conv2d_transpose_with_blocks(x, OUT, padding="VALID",
                                                                  h_blocks_dim=x.shape.dims[1]),
                [(x, "batch:2;h_blocks:2;h:3;w:4;cin:2")])


@pytest.mark.parametrize("layer,kwargs,match", [
    (mtf.layers.conv2d_with_blocks, {"padding": "VALID"}, "padding='VALID' is not supported"),
    (mtf.layers.conv2d_with_blocks, {"filter_size": (2, 3)}, "must be odd"),
    (mtf.layers.conv2d_with_blocks, {"strides": (2, 1)}, "must be 1"),
    (mtf.layers.conv2d, {"filter_size": (3,)}, "filter_size=.* must be 2 positive ints"),
])
def test_conv_layers_reject_unsupported_arguments(layer, kwargs, match):
  x = _randn(2, 2, 1, 3, 4, 2)
  kwargs = dict(kwargs)
  if layer is mtf.layers.conv2d_with_blocks:
    kwargs["h_blocks_dim"] = mtf.Dimension("h_blocks", 2)
  with pytest.raises(ValueError, match=match):
    run_layer(lambda x: layer(x, OUT, **kwargs), [(x, "batch:2;h_blocks:2;w_blocks:1;h:3;w:4;cin:2")])


# ---- separable_conv1d ----

SEP_X = np.array([[[1, 2], [3, 4], [5, 6], [7, 8]]], np.float32)  # [batch, length, depth]
SEP_SHAPE = "batch:1;length:4;depth:2"
DEPTH_KERNEL = np.array([1, -1], np.float32)
POINTWISE_KERNEL = np.array([[1, 0, 2], [0, 1, -1]], np.float32)


def _separable_reference(x, depth_kernels, pointwise, depth_bias=0.0, pointwise_bias=0.0):
  """sum_r shift(x, -r) * k_r (zero fill) + bias, then [depth] x [depth, out] + bias."""
  length = x.shape[1]
  total = 0.0
  for r, kernel in zip(range(-1, 2), depth_kernels):
    shifted = np.zeros_like(x)
    src = np.arange(length) + r
    valid = (src >= 0) & (src < length)
    shifted[:, valid] = x[:, src[valid]]
    total = total + shifted * kernel
  return (total + depth_bias) @ pointwise + pointwise_bias


@pytest.mark.parametrize("mode", MODES)
def test_separable_conv1d_kernels_come_from_truncated_normal_and_the_bias_is_added_once(mode):
  init = shape_keyed_initializer({(2,): DEPTH_KERNEL, (2, 3): POINTWISE_KERNEL})
  with mock.patch.object(tf, "truncated_normal_initializer", autospec=True, return_value=init), \
       mock.patch.object(tf, "zeros_initializer", autospec=True, return_value=tf.ones_initializer()):
    result = run_layer(lambda x: mtf.layers.separable_conv1d(x, mtf.Dimension("out", 3), name="sep"),
                       [(SEP_X, SEP_SHAPE)], mode=mode, grads=False)
  expected = _separable_reference(SEP_X, [DEPTH_KERNEL] * 3, POINTWISE_KERNEL, 1.0, 1.0)
  np.testing.assert_allclose(result.y, expected)
  depth = mtf.Shape([mtf.Dimension("depth", 2)])
  assert result.shapes == {
      "sep/depthwise_conv_hack/depthwise_dense_0/kernel": depth,
      "sep/depthwise_conv_hack/depthwise_dense_0/bias": depth,
      "sep/depthwise_conv_hack/depthwise_dense_1/kernel": depth,
      "sep/depthwise_conv_hack/depthwise_dense_2/kernel": depth,
      "sep/pointwise_dense/kernel": mtf.convert_to_shape("depth:2;out:3"),
      "sep/pointwise_dense/bias": mtf.convert_to_shape("out:3")}


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), use_bias=st.booleans(), mode=st.sampled_from(MODES))
def test_separable_conv1d_matches_tf_with_gradients_under_any_layout(data, use_bias, mode):
  mesh_shape, layout = data.draw(mesh_and_layout({"batch": 2, "length": 4, "depth": 2, "cout": 4}))
  x = _randn(2, 4, 2)

  def reference(x, variables):
    scope = "sep/depthwise_conv_hack/depthwise_dense_%d/"
    total = 0.0
    for i, r in enumerate(range(-1, 2)):
      shifted = tf.pad(x, [[0, 0], [max(-r, 0), max(r, 0)], [0, 0]])[:, max(r, 0):max(r, 0) + 4]
      total += shifted * variables[scope % i + "kernel"]
    if use_bias:
      total += variables[scope % 0 + "bias"]
    y = tf.einsum("bld,do->blo", total, variables["sep/pointwise_dense/kernel"])
    return y + variables["sep/pointwise_dense/bias"] if use_bias else y

  check_layer(lambda x: mtf.layers.separable_conv1d(x, OUT, use_bias=use_bias, name="sep"), reference,
              [(x, "batch:2;length:4;depth:2")], mesh_shape, layout, mode)


def test_separable_conv1d_gets_depthwise_and_pointwise_kernels_through_patched_module_attribute():
  kernels = {(): DEPTH_KERNEL, ("out",): POINTWISE_KERNEL}

  def fake_kernel_weights(x, new_dims, reduced_dims, expert_dims, kernel_initializer, name=None,
                          variable_dtype=None, master_dtype=tf.float32, slice_dtype=tf.float32):
    shape = mtf.Shape(expert_dims + reduced_dims + new_dims)
    return mtf.import_tf_tensor(x.mesh, tf.constant(kernels[tuple(d.name for d in new_dims)]), shape)

  with mock.patch.object(mtf.layers, "get_dense_kernel_weights", autospec=True,
                         side_effect=fake_kernel_weights) as patched:
    result = run_layer(lambda x: mtf.layers.separable_conv1d(x, mtf.Dimension("out", 3), use_bias=False),
                       [(SEP_X, SEP_SHAPE)], grads=False)
  assert patched.call_count == 4
  np.testing.assert_allclose(result.y, _separable_reference(SEP_X, [DEPTH_KERNEL] * 3, POINTWISE_KERNEL))


def test_separable_conv1d_uses_given_kernel_depth_weights():
  depth_kernels = [np.array([1, 0], np.float32), np.array([0, 2], np.float32), np.array([3, 3], np.float32)]

  def layer(x):
    depth = mtf.Shape([x.shape.dims[-1]])
    weights = [mtf.import_tf_tensor(x.mesh, tf.constant(k), depth) for k in depth_kernels]
    init = shape_keyed_initializer({(2, 3): POINTWISE_KERNEL})
    with mock.patch.object(tf, "truncated_normal_initializer", autospec=True, return_value=init):
      return mtf.layers.separable_conv1d(x, mtf.Dimension("out", 3), use_bias=False,
                                         kernel_depth_weights=weights, name="sep")

  result = run_layer(layer, [(SEP_X, SEP_SHAPE)], grads=False)
  np.testing.assert_allclose(result.y, _separable_reference(SEP_X, depth_kernels, POINTWISE_KERNEL))
  assert list(result.variables) == ["sep/pointwise_dense/kernel"]


def test_separable_conv1d_rejects_wrong_number_of_kernel_depth_weights():
  with pytest.raises(ValueError, match="got 1 kernel_depth_weights for 3 relative positions"):
    run_layer(lambda x: mtf.layers.separable_conv1d(x, OUT, kernel_depth_weights=[x]), [(SEP_X, SEP_SHAPE)])
