"""mtf.layers pooling: max/avg pool 2-D and 3-D on [batch, depth, height, width, channels], with gradients."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import MODES, assert_op_matches_tf, lower_and_evaluate
from tests.layers.layer_check import import_inputs

X_SHAPE = "batch:2;d:4;h:4;w:6;c:2"
# Distinct values, so every max-pool window has one maximum.
X = np.random.RandomState(0).permutation(2 * 4 * 4 * 6 * 2).reshape(2, 4, 4, 6, 2).astype(np.float32) / 10
# Pooled dims must stay whole; for 2-D pooling, d is one more batch dim and may be split.
LAYOUTS = {2: [("all:1", ""), ("rows:2;cols:2", "batch:rows;c:cols"), ("x:2;y:2;z:2", "d:x;c:y;batch:z")],
           3: [("all:1", ""), ("rows:2;cols:2", "batch:rows;c:cols"), ("x:2;y:2;z:2", "c:x;batch:y")]}
POOLS = {"max_pool2d": tf.nn.max_pool2d, "avg_pool2d": tf.nn.avg_pool2d,
         "max_pool3d": tf.nn.max_pool3d, "avg_pool3d": tf.nn.avg_pool3d}
KSIZES = {2: [(2, 2), (4, 3)], 3: [(2, 2, 2), (1, 4, 3)]}


def _tf_pool(name, ksize):
  def fn(x):
    if name.endswith("2d"):  # [b, d, h, w, c]: pool h, w with b*d as batch
      y = POOLS[name](tf.reshape(x, [8, 4, 6, 2]), ksize, ksize, "VALID")
      return tf.reshape(y, [2, 4] + y.shape.as_list()[1:])
    return POOLS[name](x, ksize, ksize, "VALID")
  return fn


@pytest.mark.parametrize("name,ksize,mesh_shape,layout", [
    (n, k, m, lay) for n in POOLS for k in KSIZES[int(n[-2])] for m, lay in LAYOUTS[int(n[-2])]])
@pytest.mark.parametrize("mode", MODES)
def test_pool_layers_and_their_gradients_match_tf(name, ksize, mesh_shape, layout, mode):
  assert_op_matches_tf(lambda x: getattr(mtf.layers, name)(x, ksize=ksize), _tf_pool(name, ksize),
                       [(X, X_SHAPE)], mesh_shape, layout, mode)


@pytest.mark.parametrize("name,ksize", [("avg_pool2d", (2, 3)), ("avg_pool3d", (2, 2, 3)),
                                        ("max_pool2d", (2, 3)), ("max_pool3d", (2, 2, 3))])
@pytest.mark.parametrize("mode", MODES)
def test_pool_gradient_is_uniform_for_avg_and_one_per_window_for_max(name, ksize, mode):
  window = int(np.prod(ksize))

  def build(mesh):
    (x,) = import_inputs(mesh, [(X, X_SHAPE)])
    y = getattr(mtf.layers, name)(x, ksize=ksize)
    assert y.operation.name == name
    return mtf.gradients([mtf.reduce_sum(y)], [x])
  (dx,) = lower_and_evaluate(build, "all:2", "batch:all", mode)
  if name.startswith("avg"):
    np.testing.assert_allclose(dx, np.full(X.shape, 1.0 / window), rtol=1e-6)
  else:
    assert set(np.unique(dx)) == {0.0, 1.0}
    assert np.count_nonzero(dx) == X.size // window


@pytest.mark.parametrize("name,ksize", [("max_pool2d", (1, 1)), ("avg_pool3d", [1, 1, 1])])
def test_pool_with_unit_window_returns_its_input(name, ksize):
  def build(mesh):
    (x,) = import_inputs(mesh, [(X, X_SHAPE)])
    assert getattr(mtf.layers, name)(x, ksize=ksize) is x
    return [x]
  lower_and_evaluate(build)
