"""mtf.gradients: compositions match TF autodiff of the unsharded computation under any layout."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import (
    MAX_EXAMPLES, MODES, assert_allclose, assert_op_matches_tf, lower_and_evaluate, mesh_and_layout)

SIZES = {"a": 4, "b": 8, "c": 2}
RNG = np.random.RandomState(0)
X = RNG.uniform(0.5, 1.5, size=(4, 8)).astype(np.float32)  # a, b
W = RNG.uniform(-1, 1, size=(8, 2)).astype(np.float32)  # b, c
G = RNG.uniform(-1, 1, size=(4, 2)).astype(np.float32)  # a, c


@st.composite
def layout_and_mode(draw):
  mesh_shape, layout = draw(mesh_and_layout(SIZES))
  return mesh_shape, layout, draw(st.sampled_from(MODES))


def _chain_mtf(x, w):
  h = mtf.einsum([mtf.exp(x * 0.5), w], output_shape="a:4;c:2")
  return mtf.tanh(h) * mtf.reduce_sum(mtf.sigmoid(x), reduced_dim=mtf.Dimension("b", 8))


def _chain_tf(x, w):
  h = tf.einsum("ab,bc->ac", tf.exp(x * 0.5), w)
  return tf.tanh(h) * tf.reduce_sum(tf.sigmoid(x), axis=1, keepdims=True)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(layout_and_mode())
def test_gradient_of_a_chain_matches_tf_under_any_layout(case):
  mesh_shape, layout, mode = case
  assert_op_matches_tf(_chain_mtf, _chain_tf, [(X, "a:4;b:8"), (W, "b:8;c:2")], mesh_shape, layout, mode,
                       rtol=1e-4, atol=1e-5)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(layout_and_mode())
def test_gradients_from_fan_out_are_summed(case):
  mesh_shape, layout, mode = case

  def mtf_fn(x):
    y = x * x
    return y * mtf.sin(x) + y + x * 3.0 + mtf.log(y)

  def tf_fn(x):
    y = x * x
    return y * tf.sin(x) + y + x * 3.0 + tf.math.log(y)
  assert_op_matches_tf(mtf_fn, tf_fn, [(X, "a:4;b:8")], mesh_shape, layout, mode, rtol=1e-4)


def _tf_gradients(ys_fn, xs_values, grad_ys_values=None):
  with tf.Graph().as_default():
    xs = [tf.constant(v) for v in xs_values]
    ys = ys_fn(*xs)
    grad_ys = [tf.constant(g) for g in grad_ys_values] if grad_ys_values else None
    with tf.Session() as sess:
      return sess.run(tf.gradients(ys, xs, grad_ys=grad_ys))


@pytest.mark.parametrize("mode", MODES)
def test_explicit_grad_ys_and_several_ys(mode):
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), "a:4;b:8")
    w = mtf.import_tf_tensor(mesh, tf.constant(W), "b:8;c:2")
    y1 = _chain_mtf(x, w)
    y2 = mtf.reduce_sum(x * x)
    g1 = mtf.import_tf_tensor(mesh, tf.constant(G), "a:4;c:2")
    g2 = mtf.constant(mesh, 2.0)
    return mtf.gradients([y1, y2], [x, w], grad_ys=[g1, g2])
  dx, dw = lower_and_evaluate(build, "rows:2;cols:4", "a:rows;b:cols", mode)
  expected = _tf_gradients(lambda x, w: [_chain_tf(x, w), tf.reduce_sum(x * x)], [X, W],
                           [G, np.float32(2.0)])
  assert_allclose(dx, expected[0], rtol=1e-4)
  assert_allclose(dw, expected[1], rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_default_grad_ys_are_ones_and_a_y_in_xs_gets_them(mode):
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), "a:4;b:8")
    y = x * 2.0
    return mtf.gradients([y], [x, y])
  dx, dy = lower_and_evaluate(build, "x:2;y:2;z:2", "a:x;b:y", mode)
  assert_allclose(dx, np.full((4, 8), 2.0))
  assert_allclose(dy, np.ones((4, 8)))


def test_unreachable_xs_get_none():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.import_tf_tensor(mesh, tf.constant(X), "a:4;b:8")
  unrelated = mtf.import_tf_tensor(mesh, tf.constant(W), "b:8;c:2")
  through_ints = mtf.import_tf_tensor(mesh, tf.constant(X), "a:4;b:8")
  downstream_only = x * 3.0  # computed from x but not used by y
  y = mtf.reduce_sum(x * x + mtf.cast(mtf.cast(through_ints, tf.int32), tf.float32))
  dx, d_unrelated, d_ints, d_downstream = mtf.gradients(
      [y], [x, unrelated, through_ints, downstream_only])
  assert dx is not None and dx.shape == x.shape
  assert d_unrelated is None and d_ints is None and d_downstream is None
  assert mtf.gradients([mtf.stop_gradient(y)], [x]) == [None]
  ints = mtf.cast(x, tf.int32)
  assert mtf.gradients([mtf.reduce_sum(ints)], [x, ints]) == [None, None]  # integers carry no gradient


def test_gradients_nobody_asked_for_are_not_left_in_the_graph():
  """An einsum's gradient builds one for each input; the one for an imported input is dropped,
  since every op of the graph is lowered and would run (a whole matmul per step)."""
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.import_tf_tensor(mesh, tf.constant(X), "a:4;b:8")
  w = mtf.import_tf_tensor(mesh, tf.constant(W), "b:8;c:2")
  y = mtf.reduce_sum(mtf.einsum([x, w], output_shape="a:4;c:2"))
  (dw,) = mtf.gradients([y], [w])
  einsums = [op for op in mesh.graph.operations if isinstance(op, mtf.EinsumOperation)]
  assert len(einsums) == 2 and einsums[-1].outputs[0] is dw  # the forward one and dw's
  assert all(t.operation in mesh.graph.operations for op in mesh.graph.operations for t in op.inputs)


def test_dropping_unneeded_gradients_keeps_the_values_of_the_needed_ones():
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), "a:4;b:8")
    w = mtf.import_tf_tensor(mesh, tf.constant(W), "b:8;c:2")
    return mtf.gradients([mtf.reduce_sum(mtf.square(mtf.einsum([x, w], output_shape="a:4;c:2")))], [w])
  (dw,) = lower_and_evaluate(build, "rows:2;cols:4", "a:rows;b:cols")
  assert_allclose(dw, X.T @ (2 * (X @ W)), rtol=1e-5)


def test_graph_drop_unneeded_keeps_stateful_ops_and_what_they_read():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.import_tf_tensor(mesh, tf.constant(X), "a:4;b:8")
  def build():
    kept = x * 4.0
    mtf.assign(mtf.get_variable(mesh, "v", x.shape), kept)
    return x * 2.0, x * 3.0, mtf.random_uniform(mesh, x.shape) * 5.0, kept
  (needed, unneeded, noise, kept), added = mesh.graph.capture_operations(build)
  mesh.graph.drop_unneeded(added, [needed])
  operations = mesh.graph.operations
  assert needed.operation in operations and kept.operation in operations
  assert unneeded.operation not in operations and noise.operation not in operations
  assert noise.operation.inputs[0].operation in operations  # the random draw itself stays


def test_operations_argument_limits_the_ops_differentiated():
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), "a:4;b:8")
    h = x * 2.0
    y, ops = mesh.graph.capture_operations(lambda: mtf.reduce_sum(h * h))
    # Only the ops from h on: the gradient reaches h but not x.
    assert mtf.gradients([y], [x], operations=ops) == [None]
    return mtf.gradients([y], [h], operations=ops)
  (dh,) = lower_and_evaluate(build, "rows:2;cols:4", "a:rows;b:cols")
  assert_allclose(dh, 2 * (2.0 * X))  # d/dh sum(h^2) = 2h


def test_gradient_ops_are_named_under_the_forward_op_nested_in_the_graphs_scope():
  with tf.Graph().as_default():
    with tf.variable_scope("model"):
      graph = mtf.Graph()
      mesh = mtf.Mesh(graph, "m")
      x = mtf.import_tf_tensor(mesh, tf.constant(X), "a:4;b:8")
      y = mtf.reduce_sum(mtf.exp(x))
    n = len(graph.operations)
    mtf.gradients([y], [x])
  names = [op.name for op in graph.operations[n:]]
  exp_name = y.operation.inputs[0].operation.name
  assert exp_name == "model/exp"
  # tf.variable_scope(op.name + "/gradients") inside graph.captured_variable_scope, as upstream.
  assert any(name.startswith("model/model/exp/gradients/") for name in names), names


def _second_order_through(kind):
  """d/dx of sum(first-order gradient), where that gradient is computed by a `kind` op."""
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.zeros(mesh, "b:2;h:4;w:4;c:3")
  if kind == "conv":
    f = mtf.zeros(mesh, "fh:2;fw:2;c:3;o:5")
    y = mtf.Conv2dOperation(x, f, None, "SAME").outputs[0]
    (grad,) = mtf.gradients([mtf.reduce_sum(y * y)], [f])
  elif kind == "pool":
    y = mtf.PoolOperation(x, [2, 2], [2, 2], "MAX_2D").outputs[0]
    (grad,) = mtf.gradients([mtf.reduce_sum(y * y)], [x])
  else:
    y = mtf.slicewise(tf.exp, [x], splittable_dims=x.shape.dims)
    (grad,) = mtf.gradients([mtf.reduce_sum(y)], [x])
  return grad.operation, lambda: mtf.gradients([mtf.reduce_sum(grad)], [x])


@pytest.mark.parametrize("kind, op_class", [
    ("conv", "Conv2or3dBackpropFilterOperation"), ("pool", "PoolBackPropOperation"),
    ("generic", "GenericGradOperation")])
def test_second_order_gradient_through_a_gradient_op_raises_naming_it(kind, op_class):
  grad_op, second_order = _second_order_through(kind)
  assert type(grad_op).__name__ == op_class
  with pytest.raises(mtf.GradientNotImplementedError,
                     match=f"{op_class} '{grad_op.name}' has no gradient.*second-order.*stop_gradient"):
    second_order()
