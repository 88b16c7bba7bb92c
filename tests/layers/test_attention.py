"""mtf.layers attention: dot-product, multi-head, incremental, local 1-D/2-D, memory-compressed, masks."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, assert_op_matches_tf, lower_and_evaluate, mesh_and_layout
from tests.layers.layer_check import check_layer, import_inputs, run_layer

RNG = np.random.RandomState(0)
HEADS = mtf.Dimension("heads", 2)
KV = mtf.Dimension("kv", 4)
NEG = -1e9


def _randn(*shape):
  return RNG.randn(*shape).astype(np.float32)


def _tf_attention(q, k, v, bias=None, extra_logit=False):
  """softmax(q.k + bias).v over the second-to-last axis of k; q/k/v are [..., len, depth]."""
  logits = tf.einsum("...qd,...md->...qm", q, k)
  if bias is not None:
    logits += bias
  if extra_logit:
    logits = tf.concat([logits, tf.zeros_like(logits[..., :1])], axis=-1)
    weights = tf.nn.softmax(logits)[..., :-1]
  else:
    weights = tf.nn.softmax(logits)
  return tf.einsum("...qm,...md->...qd", weights, v)


def _project(x, w, spec="blc"):
  """[..., c] x [heads, c, kv] -> [..., heads at front of the per-position dims, kv]."""
  out = spec[0] + "h" + spec[1:-1] + "k"
  return tf.einsum(f"{spec},hck->{out}", x, w)


# ---- dot_product_attention ----

DPA_SIZES = {"batch": 2, "heads": 2, "length": 4, "memory": 8, "kv": 4}


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), with_mask=st.booleans(), mode=st.sampled_from(MODES))
def test_dot_product_attention_matches_tf_under_any_layout(data, with_mask, mode):
  mesh_shape, layout = data.draw(mesh_and_layout(DPA_SIZES))
  q, k, v = _randn(2, 2, 4, 4), _randn(2, 2, 8, 4), _randn(2, 2, 8, 4)
  mask = np.where(RNG.uniform(size=(4, 8)) < 0.3, NEG, 0).astype(np.float32)
  inputs = [(q, "batch:2;heads:2;length:4;kv:4"), (k, "batch:2;heads:2;memory:8;kv:4"),
            (v, "batch:2;heads:2;memory:8;kv:4"), (mask, "length:4;memory:8")]
  assert_op_matches_tf(
      lambda q, k, v, m: mtf.layers.dot_product_attention(q, k, v, m if with_mask else None, False),
      lambda q, k, v, m: _tf_attention(q, k, v, m if with_mask else None), inputs, mesh_shape, layout,
      mode, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_dot_product_attention_extra_logit_and_no_dropout_when_not_training(mode):
  q, k, v = _randn(2, 4, 4), _randn(2, 8, 4), _randn(2, 8, 4)
  inputs = [(q, "batch:2;length:4;kv:4"), (k, "batch:2;memory:8;kv:4"), (v, "batch:2;memory:8;kv:4")]
  assert_op_matches_tf(
      lambda q, k, v: mtf.layers.dot_product_attention(q, k, v, None, False, dropout=0.5, extra_logit=0.0),
      lambda q, k, v: _tf_attention(q, k, v, extra_logit=True), inputs, "all:2", "memory:all", mode,
      rtol=1e-4, atol=1e-4)


# ---- multihead attention and its variables ----

MHA_SIZES = {"batch": 2, "length": 4, "io": 4, "heads": 2, "kv": 4}
X = _randn(2, 4, 4)
X_SHAPE = "batch:2;length:4;io:4"
IO = mtf.Dimension("io", 4)


def _mha_reference(scope):
  def reference(x, variables, memory=None, bias=None):
    wq, wk, wv, wo = tf.unstack(variables[scope + "/qkvo"])
    memory = x if memory is None else memory
    o = _tf_attention(_project(x, wq), _project(memory, wk), _project(memory, wv), bias)
    return tf.einsum("bhlk,hck->blc", o, wo)
  return reference


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), mode=st.sampled_from(MODES))
def test_multihead_self_attention_matches_tf_under_any_layout(data, mode):
  mesh_shape, layout = data.draw(mesh_and_layout(MHA_SIZES))
  result = check_layer(
      lambda x: mtf.layers.multihead_attention(x, None, None, KV, HEADS, is_training=False, name="mha"),
      _mha_reference("mha"), [(X, X_SHAPE)], mesh_shape, layout, mode)
  assert result.shapes == {"mha/qkvo": mtf.Shape([mtf.Dimension("qkvo", 4), HEADS, IO, KV])}


@pytest.mark.parametrize("mode", MODES)
def test_multihead_attention_over_memory_with_autoregressive_mask_matches_tf(mode):
  memory = _randn(2, 6, 4)
  bias = np.where(np.arange(4)[:, None] < np.arange(6)[None, :], NEG, 0).astype(np.float32)

  def layer(x, m, mask):
    return mtf.layers.multihead_attention(x, mtf.rename_dimension(m, "length", "memory_length"), mask, KV,
                                          HEADS, is_training=False, name="mha")

  reference = _mha_reference("mha")
  check_layer(layer, lambda x, m, bias, variables: reference(x, variables, memory=m, bias=bias),
              [(X, X_SHAPE), (memory, "batch:2;length:6;io:4"), (bias, "length:4;memory_length:6")],
              "rows:2;cols:2", "batch:rows;heads:cols", mode)


@pytest.mark.parametrize("memory_shape,match", [("other:2;memory_length:4;io:4", "memory batch dims"),
                                                ("batch:2;memory_length:4;d:3", "memory channels")])
def test_multihead_attention_rejects_mismatched_memory(memory_shape, match):
  memory = np.zeros(mtf.convert_to_shape(memory_shape).to_integer_list, np.float32)
  with pytest.raises(ValueError, match=match):
    run_layer(lambda x, m: mtf.layers.multihead_attention(x, m, None, KV, HEADS, False),
              [(X, X_SHAPE), (memory, memory_shape)])


def test_multihead_attention_params_make_q_k_v_o_with_scaled_random_normal_initializers():
  with mock.patch.object(tf, "random_normal_initializer", autospec=True,
                         return_value=tf.zeros_initializer()) as patched:
    result = run_layer(lambda x: mtf.add_n(mtf.layers.multihead_attention_params(
        x.mesh, HEADS, IO, KV, mtf.VariableDType())), [(X, X_SHAPE)], grads=False)
  assert result.shapes == {name: mtf.Shape([HEADS, IO, KV]) for name in "qkvo"}
  qk, v, o = 4 ** -0.5 * 4 ** -0.25, 4 ** -0.5, (4 * 2) ** -0.5
  assert [c.kwargs["stddev"] for c in patched.call_args_list] == pytest.approx([qk, qk, v, o])


def test_multihead_attention_vars_scale_each_slice_of_qkvo():
  heads, io, kv = mtf.Dimension("heads", 16), mtf.Dimension("io", 64), mtf.Dimension("kv", 16)
  result = run_layer(lambda x: mtf.layers.multihead_attention_vars(
      x.mesh, heads, io, kv, tf.float32, tf.float32, tf.float32)[0], [(X, X_SHAPE)], grads=False)
  stds = result.variables["qkvo"].reshape(4, -1).std(axis=1)
  expected = [64 ** -0.5 * 16 ** -0.25] * 2 + [64 ** -0.5, (64 * 16) ** -0.5]
  np.testing.assert_allclose(stds, expected, rtol=0.1)


# ---- incremental decoding equals the full computation ----

@pytest.mark.parametrize("mode", MODES)
def test_multihead_self_attention_incremental_matches_causal_attention(mode):
  length = mtf.Dimension("length", 4)
  memory_length = mtf.Dimension("memory_length", 4)

  def build(mesh):
    (x,) = import_inputs(mesh, [(X, X_SHAPE)])
    mask = mtf.layers.attention_mask_autoregressive(mtf.range(mesh, length, tf.int32))
    full = mtf.layers.multihead_attention(x, None, mask, KV, HEADS, False, name="mha")
    cache_shape = mtf.Shape([mtf.Dimension("batch", 2), HEADS, memory_length, KV])
    k = v = mtf.zeros(mesh, cache_shape)
    steps = []
    for t in range(4):
      (x_t,) = import_inputs(mesh, [(X[:, t], "batch:2;io:4")])
      y_t, k, v = mtf.layers.multihead_self_attention_incremental(
          x_t, k, v, mtf.constant(mesh, t, dtype=tf.int32), tf.float32, tf.float32, name="mha")
      steps.append(y_t)
    return [full, mtf.stack(steps, "length", axis=1)]

  full, steps = lower_and_evaluate(build, "all:2", "heads:all", mode)
  np.testing.assert_allclose(steps, full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_multihead_encdec_attention_incremental_matches_full_attention_at_each_step(mode):
  memory = _randn(2, 6, 4)

  def build(mesh):
    x, m = import_inputs(mesh, [(X, X_SHAPE), (memory, "batch:2;memory_length:6;io:4")])
    full = mtf.layers.multihead_attention(x, m, None, KV, HEADS, False, name="mha")
    with tf.variable_scope("mha"):
      wq, wk, wv, wo = mtf.layers.multihead_attention_vars(mesh, HEADS, IO, KV, tf.float32, tf.float32,
                                                           tf.float32)
    kv_shape = mtf.Shape([mtf.Dimension("batch", 2), HEADS, m.shape.dims[1], KV])
    k, v = mtf.einsum([m, wk], kv_shape), mtf.einsum([m, wv], kv_shape)
    (x_2,) = import_inputs(mesh, [(X[:, 2], "batch:2;io:4")])
    return [full, mtf.layers.multihead_encdec_attention_incremental(x_2, wq, wo, k, v, None)]

  full, step = lower_and_evaluate(build, "all:2", "batch:all", mode)
  np.testing.assert_allclose(step, full[:, 2], rtol=1e-4, atol=1e-5)


# ---- masked local attention 1-D ----

def _local_1d_reference(window, scope="local"):
  def reference(x, variables):
    wq, wk, wv, wo = tf.unstack(variables[scope + "/qkvo"])
    length = x.shape.as_list()[1]
    pad = [[0, 0], [0, 0], [window, 0], [0, 0]]
    k, v = tf.pad(_project(x, wk), pad), tf.pad(_project(x, wv), pad)
    p, j = np.arange(length)[:, None], np.arange(length + window)[None, :]
    bias = np.where((j > p) & (j <= p + window), 0, NEG).astype(np.float32)
    return tf.einsum("bhlk,hck->blc", _tf_attention(_project(x, wq), k, v, bias), wo)
  return reference


@pytest.mark.parametrize("length,window", [(16, 2), (16, 4), (8, 2), (8, 4)])
@pytest.mark.parametrize("mode", MODES)
def test_masked_local_attention_1d_matches_windowed_causal_attention(length, window, mode):
  x = _randn(2, length, 4)
  check_layer(lambda x: mtf.layers.masked_local_attention_1d(x, KV, HEADS, False, window_size=window,
                                                             name="local"),
              _local_1d_reference(window), [(x, f"batch:2;length:{length};io:4")], "all:2", "heads:all", mode)


@pytest.mark.parametrize("window", [2, 8])
@pytest.mark.parametrize("mode", MODES)
def test_masked_local_attention_1d_with_split_length_exchanges_halos_between_blocks(window, mode):
  x = _randn(2, 16, 4)
  check_layer(lambda x: mtf.layers.masked_local_attention_1d(x, KV, HEADS, False, window_size=window,
                                                             length_per_split=4, name="local"),
              _local_1d_reference(window), [(x, "batch:2;length:16;io:4")], "rows:4;cols:2",
              "length:rows;batch:cols", mode)


@pytest.mark.parametrize("mode", MODES)
def test_masked_local_attention_1d_returns_kv_and_accepts_params(mode):
  x = _randn(2, 8, 4)
  holder = {}

  def layer(x):
    with tf.variable_scope("local"):
      params = mtf.layers.multihead_attention_vars(x.mesh, HEADS, IO, KV, tf.float32, tf.float32, x.dtype)
    return_kv = []
    y = mtf.layers.masked_local_attention_1d(x, KV, HEADS, False, window_size=2, return_kv=return_kv,
                                             params=params)
    holder["kv_shapes"] = [t.shape for t in return_kv]
    return y

  check_layer(layer, _local_1d_reference(2), [(x, "batch:2;length:8;io:4")], mode=mode)
  kv_shape = mtf.convert_to_shape("batch:2;heads:2;length:8;kv:4")
  assert holder["kv_shapes"] == [kv_shape, kv_shape]


@pytest.mark.parametrize("mode", MODES)
def test_masked_local_attention_1d_incremental_matches_the_full_layer(mode):
  window = 3
  x_np = _randn(2, 8, 4)

  def build(mesh):
    (x,) = import_inputs(mesh, [(x_np, "batch:2;length:8;io:4")])
    full = mtf.layers.masked_local_attention_1d(x, KV, HEADS, False, window_size=window, name="local")
    cache_shape = mtf.Shape([mtf.Dimension("batch", 2), HEADS, mtf.Dimension("window", window), KV])
    k = v = mtf.zeros(mesh, cache_shape)
    steps = []
    for t in range(8):
      (x_t,) = import_inputs(mesh, [(x_np[:, t], "batch:2;io:4")])
      y_t, k, v = mtf.layers.masked_local_attention_1d_incremental(
          x_t, k, v, mtf.constant(mesh, t, dtype=tf.int32), tf.float32, tf.float32, name="local")
      steps.append(y_t)
    return [full, mtf.stack(steps, "length", axis=1)]

  full, steps = lower_and_evaluate(build, "all:2", "batch:all", mode)
  np.testing.assert_allclose(steps, full, rtol=1e-4, atol=1e-5)


# ---- local attention over spatial blocks ----

def _blocks_1d_reference(mask_right):
  def reference(x, variables):
    wq, wk, wv, wo = tf.unstack(variables["blocks/qkvo"])
    q, k, v = (_project(x, w, "bnwc") for w in (wq, wk, wv))  # [b, h, n, w, kv]
    w = x.shape.as_list()[2]

    def neighbours(t):
      prev = tf.pad(t, [[0, 0], [0, 0], [1, 0], [0, 0], [0, 0]])[:, :, :-1]
      nxt = tf.pad(t, [[0, 0], [0, 0], [0, 1], [0, 0], [0, 0]])[:, :, 1:]
      return tf.concat([prev, t] if mask_right else [prev, t, nxt], axis=3)
    bias = None
    if mask_right:
      bias = np.where(np.arange(2 * w)[None, :] - w > np.arange(w)[:, None], NEG, 0).astype(np.float32)
    o = _tf_attention(q, neighbours(k), neighbours(v), bias)
    return tf.einsum("bhnwk,hck->bnwc", o, wo)
  return reference


@pytest.mark.parametrize("mask_right", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_local_self_attention_spatial_blocks_attends_to_neighbour_blocks(mask_right, mode):
  x = _randn(2, 4, 3, 4)
  check_layer(lambda x: mtf.layers.local_self_attention_spatial_blocks(x, KV, HEADS, False,
                                                                       mask_right=mask_right, name="blocks"),
              _blocks_1d_reference(mask_right), [(x, "batch:2;num_w:4;w:3;io:4")], "rows:2;cols:2",
              "num_w:rows;heads:cols", mode)


def _blocks_2d_reference(mask_right, h, w):
  def reference(x, variables):
    wq, wk, wv, wo = tf.unstack(variables["blocks/qkvo"])
    q, k, v = (_project(x, wt, "bijyxc") for wt in (wq, wk, wv))  # [b, heads, nh, nw, h, w, kv]
    nh, nw = x.shape.as_list()[1:3]

    def memories(t):
      image = tf.reshape(tf.transpose(t, [0, 1, 2, 4, 3, 5, 6]), [2, 2, nh * h, nw * w, 4])
      after = 0 if mask_right else 1
      image = tf.pad(image, [[0, 0], [0, 0], [h, after * h], [w, after * w], [0, 0]])
      mh, mw = (2 if mask_right else 3) * h, (2 if mask_right else 3) * w
      rows = [tf.stack([image[:, :, i * h:i * h + mh, j * w:j * w + mw] for j in range(nw)], axis=2)
              for i in range(nh)]
      return tf.reshape(tf.stack(rows, axis=2), [2, 2, nh, nw, mh * mw, 4])
    bias = None
    if mask_right:
      qh, qw = np.divmod(np.arange(h * w), w)
      mh, mw = np.divmod(np.arange(4 * h * w), 2 * w)
      mh, mw = mh - h, mw - w
      hidden = (mh[None] > qh[:, None]) | ((mh[None] == qh[:, None]) & (mw[None] > qw[:, None]))
      bias = np.where(hidden, NEG, 0).astype(np.float32)
    o = _tf_attention(tf.reshape(q, [2, 2, nh, nw, h * w, 4]), memories(k), memories(v), bias)
    return tf.einsum("bhijyxk,hck->bijyxc", tf.reshape(o, [2, 2, nh, nw, h, w, 4]), wo)
  return reference


@pytest.mark.parametrize("mask_right", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_local_2d_self_attention_spatial_blocks_attends_to_neighbour_blocks(mask_right, mode):
  x = _randn(2, 2, 2, 2, 3, 4)
  check_layer(lambda x: mtf.layers.local_2d_self_attention_spatial_blocks(
      x, KV, HEADS, False, mask_right=mask_right, name="blocks"),
      _blocks_2d_reference(mask_right, 2, 3), [(x, "batch:2;num_h:2;num_w:2;h:2;w:3;io:4")],
      "x:2;y:2;z:2", "num_h:x;num_w:y;batch:z", mode)


def test_local_halo_exchange_without_blocks_dims_pads_with_zeros():
  k = _randn(2, 3, 4)

  def build(mesh):
    (t,) = import_inputs(mesh, [(k, "a:2;w:3;d:4")])
    w = t.shape.dims[1]
    return [*mtf.layers.local_1d_halo_exchange(t, t, None, w, mask_right=False),
            mtf.layers.local_1d_halo_exchange(t, t, None, w, mask_right=True)[0]]
  both, both_v, left = lower_and_evaluate(build)
  np.testing.assert_array_equal(both, np.pad(k, [[0, 0], [3, 3], [0, 0]]))
  np.testing.assert_array_equal(both_v, both)
  np.testing.assert_array_equal(left, np.pad(k, [[0, 0], [3, 0], [0, 0]]))


# ---- memory-compressed attention ----

@pytest.mark.parametrize("mask_right", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_memory_compressed_attention_attends_to_group_means(mask_right, mode):
  x = _randn(2, 8, 4)

  def reference(x, variables):
    wq, wk, wv, wo = tf.unstack(variables["compressed/qkvo"])
    memory = tf.reduce_mean(tf.reshape(x, [2, 4, 2, 4]), axis=2)
    bias = None
    if mask_right:
      bias = np.where(np.arange(4)[None, :] * 2 + 1 > np.arange(8)[:, None], NEG, 0).astype(np.float32)
    o = _tf_attention(_project(x, wq), _project(memory, wk), _project(memory, wv), bias, extra_logit=True)
    return tf.einsum("bhlk,hck->blc", o, wo)

  check_layer(lambda x: mtf.layers.multihead_self_attention_memory_compressed(
      x, mask_right, 2, KV, HEADS, False, name="compressed"), reference,
      [(x, "batch:2;length:8;io:4")], "all:2", "batch:all", mode)


def test_compress_mean_averages_consecutive_groups_and_keeps_the_dim_name():
  x = _randn(2, 6, 3)

  def build(mesh):
    (t,) = import_inputs(mesh, [(x, "a:2;length:6;d:3")])
    y = mtf.layers.compress_mean(t, t.shape.dims[1], 3)
    assert y.shape == mtf.convert_to_shape("a:2;length:2;d:3")
    return [y]
  (y,) = lower_and_evaluate(build)
  np.testing.assert_allclose(y, x.reshape(2, 2, 3, 3).mean(axis=2), rtol=1e-6)


def test_compress_mean_rejects_indivisible_dim():
  with pytest.raises(ValueError, match="divisible by compression_factor=4"):
    run_layer(lambda t: mtf.layers.compress_mean(t, t.shape.dims[1], 4),
              [(X[:, :3], "batch:2;length:3;io:4")])


# ---- masks ----

@pytest.mark.parametrize("mode", MODES)
def test_attention_masks_match_numpy(mode):
  ids = np.array([[5, 3, 0, 0], [1, 0, 2, 0]], np.int32)
  segments = np.array([[1, 1, 2, 2], [1, 2, 2, 3]], np.int32)

  def build(mesh):
    t, s = import_inputs(mesh, [(ids, "batch:2;length:4"), (segments, "batch:2;length:4")])
    position = mtf.range(mesh, t.shape.dims[1], tf.int32)
    masks = [mtf.layers.attention_mask_ignore_padding(t), mtf.layers.attention_mask_autoregressive(position),
             mtf.layers.attention_mask_same_segment(s),
             mtf.layers.attention_mask_same_segment(s, s * 0 + 2)]
    assert [m.shape.dimension_names for m in masks] == [
        ["batch", "memory_length"], ["length", "memory_length"], ["batch", "length", "memory_length"],
        ["batch", "length", "memory_length"]]
    return masks
  padding, causal, same, same_as_two = lower_and_evaluate(build, "all:2", "batch:all", mode)
  np.testing.assert_array_equal(padding, np.where(ids == 0, NEG, 0))
  np.testing.assert_array_equal(causal, np.where(np.arange(4)[:, None] < np.arange(4), NEG, 0))
  np.testing.assert_array_equal(same, np.where(segments[:, :, None] != segments[:, None, :], NEG, 0))
  np.testing.assert_array_equal(same_as_two, np.where(segments[:, :, None] != 2, NEG, 0) + 0 * same)


def test_attention_bias_local_blocks_hide_the_future_of_the_own_block():
  def build(mesh):
    block, memory = mtf.Dimension("w", 3), mtf.Dimension("memory_w", 3)
    return [mtf.layers.attention_bias_local_block(mesh, block, memory),
            mtf.layers.attention_bias_local_2d_block(mesh, mtf.Dimension("h", 2), block,
                                                     mtf.Dimension("memory_h", 2), memory)]
  local_1d, local_2d = lower_and_evaluate(build)
  q, m = np.arange(3)[:, None], np.arange(6)[None, :] - 3
  np.testing.assert_array_equal(local_1d, np.where(m > q, NEG, 0))
  qh, qw = np.arange(2)[:, None, None, None], np.arange(3)[None, :, None, None]
  mh, mw = np.arange(4)[None, None, :, None] - 2, np.arange(6)[None, None, None, :] - 3
  np.testing.assert_array_equal(local_2d, np.where((mh > qh) | ((mh == qh) & (mw > qw)), NEG, 0))


_CAUSAL_BIAS = np.where(np.arange(4)[:, None] < np.arange(4), NEG, 0).astype(np.float32)
_BF16_CASES = {
    "multihead": (lambda x: mtf.layers.multihead_attention(
        x, None, mtf.layers.attention_mask_autoregressive(mtf.range(x.mesh, x.shape.dims[1], tf.int32)), KV,
        HEADS, False, master_dtype=tf.float32, slice_dtype=tf.bfloat16, name="att"),
                  lambda x, variables: _mha_reference("att")(x, variables, bias=_CAUSAL_BIAS)),
    "local_1d": (lambda x: mtf.layers.masked_local_attention_1d(x, KV, HEADS, False, window_size=2,
                                                                slice_dtype=tf.bfloat16, name="att"),
                 _local_1d_reference(2, "att")),
}


@pytest.mark.parametrize("case", sorted(_BF16_CASES))
@pytest.mark.parametrize("mode", MODES)
def test_attention_layers_run_in_bfloat16_with_float32_masters(case, mode):
  layer, reference = _BF16_CASES[case]
  result = run_layer(lambda x: mtf.cast(layer(mtf.cast(x, tf.bfloat16)), tf.float32), [(X, X_SHAPE)], "all:2",
                     "heads:all", mode)
  qkvo = result.variables["att/qkvo"]
  assert qkvo.dtype == tf.bfloat16.as_numpy_dtype
  assert np.all(np.isfinite(result.input_grads[0])) and np.all(np.isfinite(result.variable_grads["att/qkvo"]))
  with tf.Graph().as_default(), tf.Session() as sess:
    expected = sess.run(reference(tf.constant(X), {"att/qkvo": tf.constant(qkvo.astype(np.float32))}))
  np.testing.assert_allclose(result.y, expected, rtol=0.05, atol=0.05)
