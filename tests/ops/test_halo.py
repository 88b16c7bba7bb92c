"""Halo exchange, and spatially partitioned convolutions built from it, against NumPy and plain TF.

A blocked image [b, hb, wb, h, w, c] holds image row hb_i * h + h_i and column wb_i * w + w_i.
Exchanging halos of k = f // 2 along each blocked dim and running a VALID conv must equal the
SAME conv of the unblocked image, forward and backward, whatever splits the blocks dims.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import (
    MAX_EXAMPLES, MODES, assert_allclose, assert_op_matches_tf, lower_and_evaluate, mesh_and_layout)

# ---- halo_exchange itself ----


def _np_halo(x, halo: int, wrap: bool, left_only: bool):
  """Reference on x [b, blocks, block_size, c]: pad the unblocked dim, then cut overlapping windows."""
  b, nb, bs, c = x.shape
  full = x.reshape(b, nb * bs, c)
  if wrap:
    padded = np.concatenate([full] * (2 * (halo // (nb * bs) + 2)), axis=1)
    start = (nb * bs) * (1 + halo // (nb * bs)) - halo
    padded = padded[:, start:]
  else:
    padded = np.pad(full, [(0, 0), (halo, halo), (0, 0)])
  width = bs + (halo if left_only else 2 * halo)
  return np.stack([padded[:, i * bs:i * bs + width] for i in range(nb)], axis=1)


def _tf_halo(halo: int, wrap: bool, left_only: bool):
  def fn(x):
    b, nb, bs, c = x.shape.as_list()
    full = tf.reshape(x, [b, nb * bs, c])
    if wrap:
      reps = 2 * (halo // (nb * bs) + 2)
      start = (nb * bs) * (1 + halo // (nb * bs)) - halo
      padded = tf.concat([full] * reps, axis=1)[:, start:]
    else:
      padded = tf.pad(full, [[0, 0], [halo, halo], [0, 0]])
    width = bs + (halo if left_only else 2 * halo)
    return tf.stack([padded[:, i * bs:i * bs + width] for i in range(nb)], axis=1)
  return fn


def _halo_fn(halo: int, wrap: bool, left_only: bool):
  fn = mtf.left_halo_exchange if left_only else mtf.halo_exchange
  return lambda x: fn(x, x.shape[1], x.shape[2], halo, wrap=wrap)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 3]), halo=st.integers(0, 7), wrap=st.booleans(),
       left_only=st.booleans(), mode=st.sampled_from(MODES))
def test_halo_exchange_and_its_gradient_match_tf_under_any_layout(data, block_size, halo, wrap, left_only,
                                                                   mode):
  sizes = {"b": 2, "blocks": 4, "c": 2}
  mesh_shape, layout = data.draw(mesh_and_layout(sizes))
  x = np.random.RandomState(0).uniform(-1, 1, [2, 4, block_size, 2]).astype(np.float32)
  assert_op_matches_tf(_halo_fn(halo, wrap, left_only), _tf_halo(halo, wrap, left_only),
                       [(x, f"b:2;blocks:4;size:{block_size};c:2")], mesh_shape, layout, mode)


@pytest.mark.parametrize("halo", [1, 2, 5])
@pytest.mark.parametrize("wrap", [False, True])
@pytest.mark.parametrize("left_only", [False, True])
def test_halo_exchange_matches_numpy_with_blocks_split_over_mesh(halo, wrap, left_only):
  x = np.arange(2 * 4 * 2 * 3, dtype=np.float32).reshape([2, 4, 2, 3])
  fn = _halo_fn(halo, wrap, left_only)
  out, = lower_and_evaluate(lambda mesh: [fn(mtf.import_tf_tensor(mesh, x, "b:2;blocks:4;size:2;c:3"))],
                            "rows:4;cols:2", "blocks:rows;b:cols")
  np.testing.assert_array_equal(out, _np_halo(x, halo, wrap, left_only))


def test_halo_exchange_docstring_example():
  x = np.array([[1, 2], [3, 4]], np.float32)

  def build(mesh):
    xm = mtf.import_tf_tensor(mesh, x, "blocks:2;size:2")
    return [mtf.halo_exchange(xm, xm.shape[0], xm.shape[1], 1),
            mtf.left_halo_exchange(xm, xm.shape[0], xm.shape[1], 1)]
  both, left = lower_and_evaluate(build, "all:2", "blocks:all")
  np.testing.assert_array_equal(both, [[0, 1, 2, 3], [2, 3, 4, 0]])
  np.testing.assert_array_equal(left, [[0, 1, 2], [2, 3, 4]])


def test_halo_exchange_with_zero_halo_returns_input():
  mesh = mtf.Mesh(mtf.Graph(), "mesh")
  x = mtf.zeros(mesh, "blocks:2;size:3")
  assert mtf.halo_exchange(x, x.shape[0], x.shape[1], 0) is x
  assert mtf.left_halo_exchange(x, x.shape[0], x.shape[1], 0) is x


@pytest.mark.parametrize("fn", [mtf.halo_exchange, mtf.left_halo_exchange])
def test_halo_exchange_with_bad_arguments_raises(fn):
  mesh = mtf.Mesh(mtf.Graph(), "mesh")
  x = mtf.zeros(mesh, "blocks:2;size:3")
  with pytest.raises(ValueError, match=r"blocks_dim Dimension\(name='rows', size=2\) is not a dimension"):
    fn(x, mtf.Dimension("rows", 2), x.shape[1], 1)
  with pytest.raises(ValueError, match="block_size_dim .* is not a dimension"):
    fn(x, x.shape[0], mtf.Dimension("size", 4), 1)
  with pytest.raises(ValueError, match="must be two different dimensions"):
    fn(x, x.shape[1], x.shape[1], 1)
  with pytest.raises(ValueError, match="halo_size must be a non-negative int"):
    fn(x, x.shape[0], x.shape[1], -1)


# ---- spatially partitioned convolutions ----


def _unblock(x, k: int):
  """TF: [b, blocks_1..k, sizes_1..k, c] -> [b, blocks_1*sizes_1, ..., c]."""
  shape = x.shape.as_list()
  perm = [0] + [a for i in range(k) for a in (1 + i, 1 + k + i)] + [2 * k + 1]
  full = [shape[0]] + [shape[1 + i] * shape[1 + k + i] for i in range(k)] + [shape[-1]]
  return tf.reshape(tf.transpose(x, perm), full)


def _block(y, blocks: list):
  """TF: inverse of _unblock, for the given numbers of blocks."""
  k = len(blocks)
  shape = y.shape.as_list()
  split = [shape[0]] + [a for i in range(k) for a in (blocks[i], shape[1 + i] // blocks[i])] + [shape[-1]]
  perm = [0] + [1 + 2 * i for i in range(k)] + [2 + 2 * i for i in range(k)] + [2 * k + 1]
  return tf.transpose(tf.reshape(y, split), perm)


def _tf_conv_fn(k: int):
  return tf.nn.conv2d if k == 2 else tf.nn.conv3d


def _tf_blocked_conv(k: int, blocks: list, causal: bool):
  """The unpartitioned reference: SAME conv (or left-padded VALID conv if causal) of the whole image."""
  def fn(x, f):
    image = _unblock(x, k)
    if causal:
      fsizes = f.shape.as_list()[:k]
      image = tf.pad(image, [[0, 0]] + [[s - 1, 0] for s in fsizes] + [[0, 0]])
      y = _tf_conv_fn(k)(image, f, [1] * (k + 2), "VALID")
    else:
      y = _tf_conv_fn(k)(image, f, [1] * (k + 2), "SAME")
    return _block(y, blocks)
  return fn


def _mtf_blocked_conv(k: int, causal: bool):
  """Halo exchange along each blocked spatial dim, then a VALID conv."""
  def fn(x, f):
    for i in range(k):
      filter_size = f.shape[i].size
      if causal:
        x = mtf.left_halo_exchange(x, x.shape[1 + i], x.shape[1 + k + i], filter_size - 1)
      else:
        x = mtf.halo_exchange(x, x.shape[1 + i], x.shape[1 + k + i], filter_size // 2)
    op = mtf.Conv2dOperation if k == 2 else mtf.Conv3dOperation
    return op(x, f, None, "VALID").outputs[0]
  return fn


def _blocked_case(k: int, blocks: list, block_sizes: list, filter_sizes: list, seed: int = 0):
  """A blocked image [b, <blocks>, <sizes>, c] and filter [<f>, c, o] with their mtf shapes."""
  rng = np.random.RandomState(seed)
  roles = ["d", "h", "w"][-k:]
  x_dims = ([("b", 2)] + [(r + "b", n) for r, n in zip(roles, blocks)]
            + [(r, s) for r, s in zip(roles, block_sizes)] + [("c", 2)])
  f_dims = [("f" + r, s) for r, s in zip(roles, filter_sizes)] + [("c", 2), ("o", 4)]
  arrays = [rng.uniform(-1, 1, [s for _, s in dims]).astype(np.float32) for dims in (x_dims, f_dims)]
  return [(a, ";".join(f"{n}:{s}" for n, s in dims)) for a, dims in zip(arrays, (x_dims, f_dims))]


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(data=st.data(), fh=st.sampled_from([1, 3, 5]), fw=st.sampled_from([1, 3, 5]),
       mode=st.sampled_from(MODES))
def test_halo_then_valid_conv2d_equals_same_conv2d_of_unsplit_image(data, fh, fw, mode):
  blocks = [2, 4]
  mesh_shape, layout = data.draw(mesh_and_layout({"b": 2, "hb": 2, "wb": 4, "c": 2, "o": 4}))
  assert_op_matches_tf(_mtf_blocked_conv(2, causal=False), _tf_blocked_conv(2, blocks, causal=False),
                       _blocked_case(2, blocks, [3, 2], [fh, fw]), mesh_shape, layout, mode,
                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_shape, layout", [
    ("all:2", "hb:all"),
    ("rows:2;cols:2", "db:rows;wb:cols"),
    ("x:2;y:2;z:2", "db:x;hb:y;wb:z"),
])
def test_halo_then_valid_conv3d_equals_same_conv3d_of_unsplit_volume(mesh_shape, layout, mode):
  blocks = [2, 2, 2]
  assert_op_matches_tf(_mtf_blocked_conv(3, causal=False), _tf_blocked_conv(3, blocks, causal=False),
                       _blocked_case(3, blocks, [2, 2, 2], [3, 3, 5]), mesh_shape, layout, mode,
                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_shape, layout", [
    ("all:4", "wb:all"),
    ("rows:2;cols:4", "hb:rows;wb:cols"),
    ("x:2;y:2;z:2", "hb:x;c:y;o:z"),
])
def test_left_halo_then_valid_conv2d_equals_causal_conv2d_of_unsplit_image(mesh_shape, layout, mode):
  blocks = [2, 4]
  assert_op_matches_tf(_mtf_blocked_conv(2, causal=True), _tf_blocked_conv(2, blocks, causal=True),
                       _blocked_case(2, blocks, [3, 2], [3, 2]), mesh_shape, layout, mode,
                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [2, 3])
def test_blocked_conv_cropped_equals_valid_conv_of_unsplit_input(k):
  """VALID on the whole image = the causal blocked conv without its first f - 1 rows/cols."""
  blocks, block_sizes, filter_sizes = [2] * k, [3] * k, [3, 2, 3][:k]
  (x, x_shape), (f, f_shape) = _blocked_case(k, blocks, block_sizes, filter_sizes)

  def build(mesh):
    return [_mtf_blocked_conv(k, causal=True)(mtf.import_tf_tensor(mesh, x, x_shape),
                                              mtf.import_tf_tensor(mesh, f, f_shape))]
  blocked, = lower_and_evaluate(build, "rows:2;cols:2", "db:rows;hb:cols" if k == 3 else "hb:rows;wb:cols")
  with tf.Graph().as_default(), tf.Session() as sess:
    image_y, valid_y = sess.run([_unblock(tf.constant(blocked), k),
                                 _tf_conv_fn(k)(_unblock(tf.constant(x), k), f, [1] * (k + 2), "VALID")])
  crop = (slice(None),) + tuple(slice(s - 1, None) for s in filter_sizes)
  assert_allclose(image_y[crop], valid_y, rtol=1e-4, atol=1e-4)
