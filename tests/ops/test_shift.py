"""shift, dynamic_shift, pool_tensor_1d and stride_tensor_1d against plain TF, values and gradients.

The shifted dimension may be split over a mesh dimension: then the shift crosses processors, by
whole shards or (offset not a multiple of the shard) in two parts. Both wrap-around and zero fill
are checked with offsets smaller and larger than a shard, and larger than the whole dimension.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, assert_op_matches_tf, lower_and_evaluate, mesh_and_layout

settings_ = settings(max_examples=MAX_EXAMPLES, deadline=None)


def _shape(sizes: dict) -> str:
  return ";".join(f"{n}:{s}" for n, s in sizes.items())


def _array(sizes: dict, seed=0):
  return np.random.RandomState(seed).standard_normal(list(sizes.values())).astype(np.float32)


def _tf_shift(x, offset, axis: int, wrap: bool):
  """y[.., i, ..] = x[.., i - offset, ..] by gather_nd; `offset` is a numpy array broadcastable to x."""
  shape = x.shape.as_list()
  index = list(np.indices(shape))
  source = index[axis] - np.broadcast_to(offset, shape)
  valid = (source >= 0) & (source < shape[axis])
  index[axis] = source % shape[axis]
  y = tf.gather_nd(x, np.stack(index, axis=-1))
  return y if wrap else y * valid.astype(np.float32)


# ---- shift ----

@settings_
@given(st.data(), st.sampled_from(MODES), st.booleans())
def test_shift_matches_tf_under_any_layout(data, mode, wrap):
  sizes = {"a": data.draw(st.sampled_from([2, 4])), "b": data.draw(st.sampled_from([4, 8, 16]))}
  dim = data.draw(st.sampled_from(list(sizes)))
  offset = data.draw(st.integers(-2 * sizes[dim] - 1, 2 * sizes[dim] + 1))
  mesh_layout = data.draw(mesh_and_layout(sizes))
  axis = list(sizes).index(dim)
  assert_op_matches_tf(lambda x: mtf.shift(x, offset, x.shape.get_dim_by_name(dim), wrap),
                       lambda x: _tf_shift(x, offset, axis, wrap),
                       [(_array(sizes), _shape(sizes))], *mesh_layout, mode=mode)


# Shards of l:8 hold 2 entries on the first two meshes and 4 on the third; the offsets fall below,
# on and between multiples of a shard, and beyond the dimension.
@pytest.mark.parametrize("mesh_shape, layout", [
    ("all:4", "l:all"), ("rows:2;cols:4", "l:cols;b:rows"), ("x:2;y:2;z:2", "b:x;l:y"),
])
@pytest.mark.parametrize("offset", [-11, -8, -5, -2, 1, 3, 6, 17])
@pytest.mark.parametrize("wrap", [True, False])
def test_shift_across_split_dim_with_offsets_smaller_and_larger_than_a_shard(
    mesh_shape, layout, offset, wrap):
  sizes = {"b": 2, "l": 8}
  assert_op_matches_tf(lambda x: mtf.shift(x, offset, x.shape.dims[1], wrap),
                       lambda x: _tf_shift(x, offset, 1, wrap),
                       [(_array(sizes), _shape(sizes))], mesh_shape, layout)


@pytest.mark.parametrize("mode", MODES)
def test_shift_of_int_tensor_has_no_gradient_and_correct_values(mode):
  x = np.arange(8, dtype=np.int32)

  def build(mesh):
    t = mtf.import_tf_tensor(mesh, tf.constant(x), "l:8")
    y = mtf.shift(t, 3, t.shape.dims[0], wrap=False)
    assert not y.operation.has_gradient
    return [y]
  got, = lower_and_evaluate(build, "all:4", "l:all", mode)
  np.testing.assert_array_equal(got, [0, 0, 0, 0, 1, 2, 3, 4])


def test_shift_operation_name_and_splittability():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.zeros(mesh, "a:3;b:4")
  op = mtf.ShiftOperation(x, -5, x.shape.dims[1], wrap=True)
  assert op.name == "shift"
  assert op.splittable_dims == frozenset(["a", "b"])
  assert op.unsplittable_dims == frozenset()
  with pytest.raises(ValueError, match="Dimension.name='c'.* is not a dimension of"):
    mtf.shift(x, 1, mtf.Dimension("c", 4), wrap=False)


# ---- dynamic_shift ----

@settings_
@given(st.data(), st.sampled_from(MODES), st.booleans())
def test_dynamic_shift_matches_tf_under_any_layout(data, mode, wrap):
  sizes = {"b": 2, "l": 8, "c": 4}
  offset_dims = [d for d in ("b", "c") if data.draw(st.booleans())]
  offset_sizes = {d: sizes[d] for d in offset_dims}
  offsets = np.random.RandomState(1).randint(-10, 11, size=list(offset_sizes.values())).astype(np.int32)
  broadcast_offsets = offsets.reshape([sizes[d] if d in offset_dims else 1 for d in sizes])
  mesh_layout = data.draw(mesh_and_layout(sizes))
  assert_op_matches_tf(
      lambda x, off: mtf.dynamic_shift(x, off, x.shape.dims[1], wrap),
      lambda x, off: _tf_shift(x, broadcast_offsets, 1, wrap),
      [(_array(sizes), _shape(sizes)), (offsets, _shape(offset_sizes))], *mesh_layout, mode=mode)


def _xy_for_dynamic_shift():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  return mtf.zeros(mesh, "b:2;l:8"), mtf.zeros(mesh, "b:2", dtype=tf.int32)


@pytest.mark.parametrize("build, match", [
    (lambda x, off: mtf.dynamic_shift(x, off, mtf.Dimension("z", 8), True), "is not a dimension of"),
    (lambda x, off: mtf.dynamic_shift(x, mtf.zeros(x.mesh, "l:8", tf.int32), x.shape.dims[1], True),
     "may not be a dimension of offset"),
    (lambda x, off: mtf.dynamic_shift(x, mtf.zeros(x.mesh, "q:3", tf.int32), x.shape.dims[1], True),
     "are not in x's"),
])
def test_dynamic_shift_bad_arguments_raise(build, match):
  with pytest.raises(ValueError, match=match):
    build(*_xy_for_dynamic_shift())


# ---- pool_tensor_1d / stride_tensor_1d ----

_TF_REDUCE = {"mean": tf.reduce_mean, "max": tf.reduce_max, "min": tf.reduce_min}


@settings_
@given(st.data(), st.sampled_from(MODES), st.sampled_from(sorted(_TF_REDUCE)), st.sampled_from([1, 2, 4]))
def test_pool_tensor_1d_matches_tf_under_any_layout(data, mode, reduction, pool_size):
  sizes = {"b": 4, "l": 16}
  mesh_layout = data.draw(mesh_and_layout({"b": 4, "l": 16 // pool_size}))  # l stays divisible
  mtf_reduce = {"mean": mtf.reduce_mean, "max": mtf.reduce_max, "min": mtf.reduce_min}[reduction]
  assert_op_matches_tf(
      lambda x: mtf.pool_tensor_1d(x, x.shape.dims[1], reduce_fn=mtf_reduce, pool_size=pool_size),
      lambda x: _TF_REDUCE[reduction](tf.reshape(x, [4, 16 // pool_size, pool_size]), axis=2),
      [(_array(sizes), _shape(sizes))], *mesh_layout, mode=mode)


@settings_
@given(st.data(), st.sampled_from(MODES), st.sampled_from([1, 2, 4, 8]))
def test_stride_tensor_1d_matches_tf_under_any_layout(data, mode, pool_size):
  sizes = {"l": 16, "c": 2}
  mesh_layout = data.draw(mesh_and_layout({"l": 16 // pool_size, "c": 2}))  # l stays divisible
  assert_op_matches_tf(
      lambda x: mtf.stride_tensor_1d(x, pool_dim=x.shape.dims[0], pool_size=pool_size),
      lambda x: x[::pool_size],
      [(_array(sizes), _shape(sizes))], *mesh_layout, mode=mode)


def test_pool_tensor_1d_defaults_to_mean_of_pairs():
  x = np.arange(8, dtype=np.float32)
  got, = lower_and_evaluate(
      lambda mesh: [mtf.pool_tensor_1d(mtf.import_tf_tensor(mesh, tf.constant(x), "l:8"),
                                       mtf.Dimension("l", 8))], "all:2", "l:all")
  np.testing.assert_allclose(got, [0.5, 2.5, 4.5, 6.5])


@pytest.mark.parametrize("fn", [mtf.pool_tensor_1d, mtf.stride_tensor_1d])
def test_pooling_bad_arguments_raise(fn):
  x = mtf.zeros(mtf.Mesh(mtf.Graph(), "m"), "l:6")
  with pytest.raises(ValueError, match=r"pool_dim .* is not a dimension of"):
    fn(x, mtf.Dimension("z", 6))
  with pytest.raises(ValueError, match="pool_size 4 does not divide"):
    fn(x, x.shape.dims[0], pool_size=4)
