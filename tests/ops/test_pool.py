"""Max/average pooling and its gradient against plain TensorFlow and NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from mesh_tensorflow._ops.pool import PoolArgumentError
from tests.harness import MAX_EXAMPLES, MODES, assert_op_matches_tf, lower_and_evaluate, mesh_and_layout

TF_POOLS = {"AVG_2D": tf.nn.avg_pool2d, "MAX_2D": tf.nn.max_pool2d,
            "AVG_3D": tf.nn.avg_pool3d, "MAX_3D": tf.nn.max_pool3d}
SIZES = {"b": 4, "a": 2, "c": 4}


def _input(rank: int, spatial: int, seed: int = 0):
  """x [b, a, (d,) h, w, c] with distinct values (so max-pool windows have no ties)."""
  shape = [SIZES["b"], SIZES["a"]] + [spatial] * rank + [SIZES["c"]]
  x = np.random.RandomState(seed).permutation(np.prod(shape)).reshape(shape).astype(np.float32) / 100
  names = ["b", "a"] + ["d", "h", "w"][-rank:] + ["c"]
  return x, ";".join(f"{n}:{s}" for n, s in zip(names, shape))


def _tf_pool(fn_string: str, ksize: list):
  def fn(x):
    shape = x.shape.as_list()
    y = TF_POOLS[fn_string](tf.reshape(x, [-1] + shape[2:]), ksize, ksize, "VALID")
    return tf.reshape(y, shape[:2] + y.shape.as_list()[1:])
  return fn


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), fn_string=st.sampled_from(sorted(TF_POOLS)), spatial=st.sampled_from([4, 5]),
       window=st.sampled_from([1, 2]), mode=st.sampled_from(MODES))
def test_pool_and_its_gradient_match_tf_under_any_layout(data, fn_string, spatial, window, mode):
  rank = int(fn_string[-2])
  ksize = [2] + [window] * (rank - 1)
  mesh_shape, layout = data.draw(mesh_and_layout(SIZES))
  assert_op_matches_tf(lambda x: mtf.PoolOperation(x, ksize, ksize, fn_string).outputs[0],
                       _tf_pool(fn_string, ksize), [_input(rank, spatial)], mesh_shape, layout, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn_string", sorted(TF_POOLS))
def test_pool_with_batch_and_channels_split_on_3d_mesh_matches_tf(fn_string, mode):
  ksize = [2] * int(fn_string[-2])
  assert_op_matches_tf(lambda x: mtf.PoolOperation(x, ksize, ksize, fn_string).outputs[0],
                       _tf_pool(fn_string, ksize), [_input(len(ksize), 4)], "x:2;y:2;z:2", "b:x;a:y;c:z",
                       mode)


@pytest.mark.parametrize("mode", MODES)
def test_max_pool_gradient_goes_to_every_tied_maximum(mode):
  # Windows of 2x2 hold (1, 1, 0, 1): the three tied maxima each get the window's dy.
  x = np.tile(np.array([[1, 1], [0, 1]], np.float32), (2, 2))[None, :, :, None]  # [1, 4, 4, 1]
  dy = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)[None, :, :, None]

  def build(mesh):
    xm = mtf.import_tf_tensor(mesh, x, "b:1;h:4;w:4;c:1")
    y = mtf.PoolOperation(xm, [2, 2], [2, 2], "MAX_2D").outputs[0]
    return [y, mtf.pool_backprop(xm, y, mtf.import_tf_tensor(mesh, dy, y.shape), [2, 2], [2, 2], "MAX_2D")]
  y, dx = lower_and_evaluate(build, mode=mode)
  np.testing.assert_array_equal(y, np.ones([1, 2, 2, 1]))
  expected = np.repeat(np.repeat(dy, 2, axis=1), 2, axis=2) * x
  np.testing.assert_array_equal(dx, expected)


def test_avg_pool_gradient_is_dy_over_window_size_and_zero_where_cropped():
  x = np.arange(5 * 5, dtype=np.float32).reshape([1, 5, 5, 1])
  dy = np.full([1, 2, 2, 1], 8.0, np.float32)

  def build(mesh):
    xm = mtf.import_tf_tensor(mesh, x, "b:1;h:5;w:5;c:1")
    y = mtf.PoolOperation(xm, [2, 2], [2, 2], "AVG_2D").outputs[0]
    return [mtf.pool_backprop(xm, y, mtf.import_tf_tensor(mesh, dy, y.shape), [2, 2], [2, 2], "AVG_2D")]
  dx, = lower_and_evaluate(build)
  expected = np.zeros([5, 5], np.float32)
  expected[:4, :4] = 2.0
  np.testing.assert_array_equal(dx[0, :, :, 0], expected)


def test_pool_shapes_names_and_splittability():
  mesh = mtf.Mesh(mtf.Graph(), "mesh")
  x = mtf.zeros(mesh, "b:2;d:4;h:6;w:5;c:3")
  op2 = mtf.PoolOperation(x, [2, 2], [2, 2], "AVG_2D")
  assert op2.name == "pool"
  assert op2.outputs[0].shape == mtf.convert_to_shape("b:2;d:4;h:3;w:2;c:3")
  assert op2.unsplittable_dims == {"h", "w"} and op2.splittable_dims == {"b", "d", "c"}
  op3 = mtf.PoolOperation(x, [2, 3, 2], [2, 3, 2], "MAX_3D")
  assert op3.outputs[0].shape == mtf.convert_to_shape("b:2;d:2;h:2;w:2;c:3")
  assert op3.unsplittable_dims == {"d", "h", "w"}
  dx = op3.gradient([mtf.ones(mesh, op3.outputs[0].shape)])[0]
  assert dx.shape == x.shape
  assert dx.operation.name == "pool_backprop"
  assert isinstance(dx.operation, mtf.PoolBackPropOperation)


@pytest.mark.parametrize("args, message", [
    (([2, 2], [1, 1], "MAX_2D"), "ksize must equal strides"),
    (([2, 2], [2, 2], "MIN_2D"), "pool_fn_string must be one of"),
    (([2, 2], [2, 2], "AVG_3D"), "needs ksize of 3 positive ints"),
])
def test_pool_with_bad_arguments_raises(args, message):
  mesh = mtf.Mesh(mtf.Graph(), "mesh")
  x = mtf.zeros(mesh, "b:2;h:4;w:4;c:3")
  with pytest.raises(ValueError, match=message):
    mtf.PoolOperation(x, *args)
  with pytest.raises(AssertionError):  # upstream asserted these
    mtf.PoolOperation(x, *args)
  assert issubclass(PoolArgumentError, ValueError)


def test_pool_of_integer_tensor_raises():
  mesh = mtf.Mesh(mtf.Graph(), "mesh")
  with pytest.raises(ValueError, match="floating-point input.*int32"):
    mtf.PoolOperation(mtf.zeros(mesh, "b:2;h:4;w:4;c:3", dtype=tf.int32), [2, 2], [2, 2], "MAX_2D")


def test_pool_along_split_spatial_dim_raises():
  def build(mesh):
    return [mtf.PoolOperation(mtf.zeros(mesh, "b:2;h:4;w:4;c:3"), [2, 2], [2, 2], "MAX_2D").outputs[0]]
  with pytest.raises(ValueError, match=r"PoolOperation 'pool' can't split dimension 'w'.*mesh dimension 'all'"
                                       r".*pooling needs.*Remove the layout rule w:all"):
    lower_and_evaluate(build, "all:2", "w:all")
