"""Convolutions, transposed convolutions and their backprop ops against plain TensorFlow."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, assert_op_matches_tf, lower_and_evaluate, mesh_and_layout

# (conv dimension, is_transpose) -> op class.
CONV_CLASSES = {
    (2, False): mtf.Conv2dOperation, (3, False): mtf.Conv3dOperation,
    (2, True): mtf.Conv2dTransposeOperation, (3, True): mtf.Conv3dTransposeOperation,
}
ROLES = {2: ("h", "w"), 3: ("d", "h", "w")}
SIZES = {"b": 4, "a": 2, "c": 4, "o": 4}  # batch, extra batch, in channels, out channels


def _case(cd: int, transpose: bool, spatial: int, filter_size: int, seed: int = 0):
  """(x, filter) arrays and their mtf shape strings: x [b, a, (d,) h, w, c]."""
  rng = np.random.RandomState(seed)
  roles = ROLES[cd]
  x_shape = "b:%d;a:%d;" % (SIZES["b"], SIZES["a"]) + "".join(f"{r}:{spatial};" for r in roles) + "c:4"
  channels = ("o", "c") if transpose else ("c", "o")
  f_shape = "".join(f"f{r}:{filter_size};" for r in roles) + ";".join(f"{c}:4" for c in channels)
  x = rng.uniform(-1, 1, [SIZES["b"], SIZES["a"]] + [spatial] * cd + [4]).astype(np.float32)
  f = rng.uniform(-1, 1, [filter_size] * cd + [4, 4]).astype(np.float32)
  return (x, x_shape), (f, f_shape)


def _tf_conv(cd: int, transpose: bool, strides: list, padding: str):
  """The same convolution in plain TF, with the two leading batch dims flattened.

  mtf rounds strided output sizes down (upstream's rule), so TF's partial last window is cropped.
  """
  def fn(x, f):
    shape = x.shape.as_list()
    flat = tf.reshape(x, [-1] + shape[2:])
    if transpose:
      out_spatial = [n * s + (max(k - s, 0) if padding == "VALID" else 0)
                     for n, s, k in zip(shape[2:-1], strides[1:-1], f.shape.as_list())]
      conv_t = tf.nn.conv2d_transpose if cd == 2 else tf.nn.conv3d_transpose
      y = conv_t(flat, f, [flat.shape[0]] + out_spatial + [4], strides, padding)
    else:
      y = (tf.nn.conv2d if cd == 2 else tf.nn.conv3d)(flat, f, strides, padding)
      out_spatial = [(n - (k - 1 if padding == "VALID" else 0)) // s
                     for n, s, k in zip(shape[2:-1], strides[1:-1], f.shape.as_list())]
      y = y[(slice(None),) + tuple(slice(0, n) for n in out_spatial)]
    return tf.reshape(y, shape[:2] + y.shape.as_list()[1:])
  return fn


def _mtf_conv(cd: int, transpose: bool, strides: list, padding: str):
  return lambda x, f: CONV_CLASSES[cd, transpose](x, f, strides, padding).outputs[0]


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), kind=st.sampled_from(sorted(CONV_CLASSES)), padding=st.sampled_from(["SAME", "VALID"]),
       stride=st.sampled_from([1, 2]), mode=st.sampled_from(MODES))
def test_conv_matches_tf_under_any_layout(data, kind, padding, stride, mode):
  cd, transpose = kind
  mesh_shape, layout = data.draw(mesh_and_layout(SIZES))
  strides = [1] + [stride] * cd + [1]
  spatial = 5 if cd == 2 else 4
  assert_op_matches_tf(_mtf_conv(cd, transpose, strides, padding), _tf_conv(cd, transpose, strides, padding),
                       _case(cd, transpose, spatial, 3), mesh_shape, layout, mode, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(CONV_CLASSES))
def test_conv_with_batch_and_both_channel_dims_split_matches_tf(kind, mode):
  cd, transpose = kind
  strides = [1] * (cd + 2)
  assert_op_matches_tf(_mtf_conv(cd, transpose, strides, "SAME"), _tf_conv(cd, transpose, strides, "SAME"),
                       _case(cd, transpose, 3, 2), "x:2;y:2;z:2", "b:x;c:y;o:z", mode, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cd, padding", [(2, "SAME"), (2, "VALID"), (3, "SAME")])
def test_strided_conv_drops_partial_last_window_and_its_gradient(cd, padding, mode):
  strides = [1] + [2] * cd + [1]  # 5 // 2: TF's third (partial) window is dropped, as upstream did
  assert_op_matches_tf(_mtf_conv(cd, False, strides, padding), _tf_conv(cd, False, strides, padding),
                       _case(cd, False, 5, 3 if padding == "VALID" else 2), "rows:2;cols:2", "b:rows;o:cols",
                       mode, rtol=1e-4, atol=1e-4)


BACKPROP_FNS = {
    (2, False): (mtf.conv2d_backprop_input, mtf.conv2d_backprop_filter),
    (3, False): (mtf.conv3d_backprop_input, mtf.conv3d_backprop_filter),
    (2, True): (mtf.conv2d_transpose_backprop_input, mtf.conv2d_transpose_backprop_filter),
    (3, True): (mtf.conv3d_transpose_backprop_input, mtf.conv3d_transpose_backprop_filter),
}


@pytest.mark.parametrize("kind", sorted(BACKPROP_FNS))
def test_backprop_functions_equal_tf_gradients_with_channels_split(kind):
  cd, transpose = kind
  strides, padding = [1] + [2] * cd + [1], "VALID"
  (x, x_shape), (f, f_shape) = _case(cd, transpose, 4, 3)
  backprop_input, backprop_filter = BACKPROP_FNS[kind]
  with tf.Graph().as_default(), tf.Session() as sess:
    tx, tfl = tf.constant(x), tf.constant(f)
    y = _tf_conv(cd, transpose, strides, padding)(tx, tfl)
    dy = np.random.RandomState(1).uniform(-1, 1, y.shape.as_list()).astype(np.float32)
    expected = sess.run(tf.gradients(y, [tx, tfl], grad_ys=dy))

  def build(mesh):
    xm = mtf.import_tf_tensor(mesh, x, x_shape)
    fm = mtf.import_tf_tensor(mesh, f, f_shape)
    dym = mtf.import_tf_tensor(mesh, dy, CONV_CLASSES[kind](xm, fm, strides, padding).outputs[0].shape)
    return [backprop_input(xm.shape, fm, dym, strides, padding),
            backprop_filter(xm, fm.shape, dym, strides, padding)]
  actual = lower_and_evaluate(build, "x:2;y:2;z:2", "a:x;c:y;o:z")
  for a, e in zip(actual, expected):
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4)


def _graph_tensors(x_shape: str, f_shape: str, dtype=tf.float32):
  mesh = mtf.Mesh(mtf.Graph(), "mesh")
  return (mtf.zeros(mesh, x_shape, dtype=dtype), mtf.zeros(mesh, f_shape, dtype=dtype))


@pytest.mark.parametrize("kind", sorted(CONV_CLASSES))
def test_conv_output_shape_names_and_splittability(kind):
  cd, transpose = kind
  roles = ROLES[cd]
  x, f = _graph_tensors("b:2;" + "".join(f"{r}:5;" for r in roles) + "c:3",
                        "".join(f"f{r}:3;" for r in roles) + ("o:4;c:3" if transpose else "c:3;o:4"))
  op = CONV_CLASSES[kind](x, f, [1] + [2] * cd + [1], "SAME")
  out = op.outputs[0].shape
  assert out.dimension_names == ["b", *roles, "o"]
  # SAME: 5 // 2 (upstream's rule; TF would give 3); transposed SAME: 5 * 2.
  assert out.to_integer_list == [2] + [10 if transpose else 2] * cd + [4]
  spatial = set(roles) | {"f" + r for r in roles}
  assert op.unsplittable_dims == spatial
  assert op.splittable_dims == {"b", "c", "o"}
  assert op.name == ("conv%dd%s" % (cd, "_transpose" if transpose else ""))
  grad_ops = [g.operation for g in op.gradient([mtf.ones(x.mesh, out)])]
  suffix = "_transpose" if transpose else ""
  assert [g.name for g in grad_ops] == ["conv%dd%s_backprop" % (cd, suffix),
                                        "conv%dd%s_backprop_filter" % (cd, suffix)]
  for g in grad_ops:  # declared as upstream did; the layout check still keeps spatial dims whole
    assert g.unsplittable_dims == frozenset()
    assert g.splittable_dims == spatial | {"b", "c", "o"}
    assert g.layout_unsplittable_dims == spatial
  assert [t.shape for t in op.gradient([mtf.ones(x.mesh, out)])] == [x.shape, f.shape]


def test_conv_backprop_ops_declare_all_dims_splittable_but_the_layout_check_keeps_spatial_dims_whole():
  x, f = _graph_tensors("b:2;h:4;w:4;c:3", "fh:3;fw:3;c:3;o:5")
  dy = mtf.zeros(x.mesh, "b:2;h:4;w:4;o:5")
  strides = [1, 1, 1, 1]
  op = mtf.Conv2or3dBackpropInputOperation(2, False, x.shape, f, dy, strides, "SAME")
  assert op.outputs[0].shape == x.shape and not op.unsplittable_dims
  assert op.layout_unsplittable_dims == {"h", "w", "fh", "fw"}
  op = mtf.Conv2or3dBackpropFilterOperation(2, False, x, f.shape, dy, strides, "SAME")
  assert op.outputs[0].shape == f.shape and not op.unsplittable_dims
  assert op.layout_unsplittable_dims == {"h", "w", "fh", "fw"}
  assert op.to_string.startswith("Conv2or3dBackpropFilterOperation[Inputs=(")


def test_conv_with_mismatched_in_channel_dims_raises():
  x, f = _graph_tensors("b:2;h:4;w:4;c:3", "fh:3;fw:3;k:3;o:5")
  with pytest.raises(ValueError, match=r"Dimensions do not match.*'k'.*'c'"):
    mtf.Conv2dOperation(x, f, [1, 1, 1, 1], "SAME")
  x, f = _graph_tensors("b:2;h:4;w:4;c:3", "fh:3;fw:3;c:3;o:5")
  with pytest.raises(ValueError, match="Dimensions do not match"):
    mtf.Conv2dTransposeOperation(x, f, [1, 1, 1, 1], "SAME")  # transposed filters are [fh, fw, out, in]


def test_conv_of_integer_or_mixed_dtype_tensors_raises():
  x, f = _graph_tensors("b:2;h:4;w:4;c:3", "fh:3;fw:3;c:3;o:5", dtype=tf.int32)
  with pytest.raises(ValueError, match="floating-point.*int32"):
    mtf.Conv2dOperation(x, f, [1, 1, 1, 1], "SAME")
  x, f = _graph_tensors("b:2;h:4;w:4;c:3", "fh:3;fw:3;c:3;o:5")
  with pytest.raises(ValueError, match="has dtype float16 but .* has float32; cast"):
    mtf.Conv2dOperation(x, mtf.cast(f, tf.float16), [1, 1, 1, 1], "SAME")


@pytest.mark.parametrize("kwargs, message", [
    ({"strides": [1, 1, 1]}, "strides must be a list of 4"),
    ({"strides": [2, 1, 1, 1]}, "1 for the batch and channel dims"),
    ({"padding": "FULL"}, "padding must be one of"),
])
def test_conv_with_bad_strides_or_padding_raises(kwargs, message):
  x, f = _graph_tensors("b:2;h:4;w:4;c:3", "fh:3;fw:3;c:3;o:5")
  args = {"strides": [1, 1, 1, 1], "padding": "SAME", **kwargs}
  with pytest.raises(ValueError, match=message):
    mtf.Conv2dOperation(x, f, args["strides"], args["padding"])


def test_conv_with_wrong_ranks_or_oversized_valid_filter_raises():
  x, f = _graph_tensors("h:4;w:4", "fh:3;fw:3;c:3;o:5")
  with pytest.raises(ValueError, match="at least 4 dims"):
    mtf.Conv3dOperation(x, f, None, "SAME")
  x, f = _graph_tensors("b:2;h:2;w:4;c:3", "fh:3;fw:3;c:3;o:5")
  with pytest.raises(ValueError, match="output dim h would be empty"):
    mtf.Conv2dOperation(x, f, None, "VALID")


@pytest.mark.parametrize("layout, role", [("h:all", "h"), ("w:all", "w"), ("fh:all", "fh"), ("fw:all", "fw")])
def test_conv_along_split_spatial_dim_raises_and_suggests_halo_exchange(layout, role):
  def build(mesh):
    x = mtf.zeros(mesh, "b:2;h:4;w:4;c:3")
    f = mtf.zeros(mesh, "fh:2;fw:2;c:3;o:5")
    return [mtf.Conv2dOperation(x, f, [1, 1, 1, 1], "SAME").outputs[0]]
  with pytest.raises(ValueError, match=f"Conv2dOperation 'conv2d' can't split dimension '{role}'.*"
                                       f"'all'.*halo_exchange.*Remove the layout rule {layout}"):
    lower_and_evaluate(build, "all:2", layout)


def test_conv3d_backprop_along_split_depth_raises():
  def build(mesh):
    x = mtf.zeros(mesh, "b:2;d:4;h:4;w:4;c:3")
    f = mtf.zeros(mesh, "fd:3;fh:3;fw:3;c:3;o:5")
    dy = mtf.zeros(mesh, "b:2;d:4;h:4;w:4;o:5")
    return [mtf.conv3d_backprop_input(x.shape, f, dy, None, "SAME")]
  with pytest.raises(ValueError,
                     match="Conv2or3dBackpropInputOperation 'conv3d_backprop' can't split dimension 'd'"):
    lower_and_evaluate(build, "all:2", "d:all")


# ---- conv3d_backprop_filter_v2 / conv3d_backprop_input_v2 (upstream's mtf names for TF's ops) ----

V2_X_SHAPE = "b:4;d_blocks:2;d:4;h:4;w:4;c:4"  # d_blocks: a blocks dim, as spatial partitioning lays out


def _v2_case(padding: str, stride: int):
  """x [b, d_blocks, d, h, w, c], filter [3, 3, 3, c, o], dy [b, d_blocks, d', h', w', o].

  d' is a size TF and mtf agree on (no partial last window).
  """
  rng = np.random.RandomState(3)
  out = (4 if padding == "SAME" else 2) // stride
  x = rng.uniform(-1, 1, [4, 2, 4, 4, 4, 4]).astype(np.float32)
  f = rng.uniform(-1, 1, [3, 3, 3, 4, 4]).astype(np.float32)
  dy = rng.uniform(-1, 1, [4, 2, out, out, out, 4]).astype(np.float32)
  return x, f, dy, "b:4;d_blocks:2;" + "".join(f"{r}:{out};" for r in "dhw") + "o:4"


def _tf_v2_backprops(x, f, dy, strides, padding):
  """TensorFlow's own two ops on the same data, the batch and blocks dims flattened into one."""
  with tf.Graph().as_default(), tf.Session() as sess:
    flat_x, flat_dy = x.reshape((8,) + x.shape[2:]), dy.reshape((8,) + dy.shape[2:])
    dw = tf.nn.conv3d_backprop_filter_v2(flat_x, f.shape, flat_dy, strides, padding)
    dx = tf.raw_ops.Conv3DBackpropInputV2(input_sizes=flat_x.shape, filter=f, out_backprop=flat_dy,
                                          strides=strides, padding=padding)
    dx_value, dw_value = sess.run([dx, dw])
  return dx_value.reshape(x.shape), dw_value


@pytest.mark.parametrize("mesh_shape, layout", [
    ("all:8", ""),
    ("x:2;y:2;z:2", "b:x;d_blocks:y;o:z"),  # dw: allreduce over x and y; dx: over z
    ("x:2;y:4", "d_blocks:x;c:y"),          # both outputs sliced along c
])
@pytest.mark.parametrize("padding, stride", [("SAME", 1), ("SAME", 2), ("VALID", 1)])
def test_conv3d_backprop_v2_on_mtf_tensors_equals_tf_ops_under_layouts(mesh_shape, layout, padding, stride):
  strides = [1, stride, stride, stride, 1]
  x, f, dy, dy_shape = _v2_case(padding, stride)
  expected = _tf_v2_backprops(x, f, dy, strides, padding)

  def build(mesh):
    xm = mtf.import_tf_tensor(mesh, x, V2_X_SHAPE)
    fm = mtf.import_tf_tensor(mesh, f, "fd:3;fh:3;fw:3;c:4;o:4")
    dym = mtf.import_tf_tensor(mesh, dy, dy_shape)
    return [mtf.conv3d_backprop_input_v2(xm.shape, fm, dym, strides, padding),
            mtf.conv3d_backprop_filter_v2(xm, fm.shape, dym, strides, padding)]
  for actual, want in zip(lower_and_evaluate(build, mesh_shape, layout), expected):
    np.testing.assert_allclose(actual, want, rtol=1e-4, atol=1e-4)


def test_conv3d_backprop_v2_on_mtf_tensors_in_eager_mode_and_without_gradient():
  strides, padding = [1, 1, 1, 1, 1], "SAME"
  x, f, dy, dy_shape = _v2_case(padding, 1)
  expected = _tf_v2_backprops(x, f, dy, strides, padding)

  def build(mesh):
    xm = mtf.import_tf_tensor(mesh, x, V2_X_SHAPE)
    fm = mtf.import_tf_tensor(mesh, f, "fd:3;fh:3;fw:3;c:4;o:4")
    dym = mtf.import_tf_tensor(mesh, dy, dy_shape)
    dx = mtf.conv3d_backprop_input_v2(xm.shape, fm, dym, strides, padding, name="dx")
    dw = mtf.conv3d_backprop_filter_v2(xm, fm.shape, dym, strides, padding, name="dw")
    assert (dx.operation.name, dw.operation.name) == ("dx", "dw")
    with pytest.raises(mtf.GradientNotImplementedError, match="has no gradient"):
      mtf.gradients([mtf.reduce_sum(dw)], [dym])  # as upstream's mtf backprop ops: none
    return [dx, dw]
  for actual, want in zip(lower_and_evaluate(build, "x:2;y:4", "b:x;o:y", mode="eager"), expected):
    np.testing.assert_allclose(actual, want, rtol=1e-4, atol=1e-4)


def test_conv3d_backprop_v2_on_tf_tensors_are_tfs_ops_with_tfs_gradients():
  # 0.1.21's mtf.conv3d_backprop_*_v2 were TensorFlow's functions: TF tensors in, TF's op out.
  strides, padding = [1, 2, 2, 2, 1], "SAME"
  x, f, dy, _ = _v2_case(padding, 2)
  flat_x, flat_dy = x.reshape((8,) + x.shape[2:]), dy.reshape((8,) + dy.shape[2:])
  expected = _tf_v2_backprops(x, f, dy, strides, padding)
  w = np.random.RandomState(4).uniform(-1, 1, f.shape).astype(np.float32)
  with tf.Graph().as_default(), tf.Session() as sess:
    tx, tdy = tf.constant(flat_x), tf.constant(flat_dy)
    dw = mtf.conv3d_backprop_filter_v2(tx, f.shape, tdy, strides, padding, name="dw")
    dx = mtf.conv3d_backprop_input_v2(flat_x.shape, tf.constant(f), tdy, strides, padding, name="dx")
    assert (dw.op.type, dx.op.type) == ("Conv3DBackpropFilterV2", "Conv3DBackpropInputV2")
    # dw is linear in dy: d(sum(dw * w))/d(dy) is the convolution of x with w.
    (grad_dy,) = tf.gradients(tf.reduce_sum(dw * w), [tdy])
    values = sess.run([dx, dw, grad_dy, tf.nn.conv3d(tx, w, strides, padding)])
  np.testing.assert_allclose(values[0].reshape(x.shape), expected[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(values[1], expected[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(values[2], values[3], rtol=1e-4, atol=1e-4)


def test_conv3d_backprop_v2_rejects_mixed_tensors_and_tf_only_options_on_mtf_tensors():
  mesh = mtf.Mesh(mtf.Graph(), "mesh")
  x = mtf.zeros(mesh, "b:2;d:4;h:4;w:4;c:3")
  f = mtf.zeros(mesh, "fd:3;fh:3;fw:3;c:3;o:5")
  dy = mtf.zeros(mesh, "b:2;d:4;h:4;w:4;o:5")
  strides = [1, 1, 1, 1, 1]
  with pytest.raises(ValueError, match="out_backprop are mtf Tensors but input are not"):
    mtf.conv3d_backprop_filter_v2(np.zeros([2, 4, 4, 4, 3], np.float32), f.shape, dy, strides, "SAME")
  with pytest.raises(ValueError, match="only data_format='NDHWC'"):
    mtf.conv3d_backprop_input_v2(x.shape, f, dy, strides, "SAME", data_format="NCDHW")
  with pytest.raises(ValueError, match=r"dilations must be \[1, 1, 1, 1, 1\]"):
    mtf.conv3d_backprop_filter_v2(x, f.shape, dy, strides, "SAME", dilations=[1, 2, 2, 2, 1])
