"""custom_gradient, recompute_grad and serialize_training_step: same values and gradients as plain code."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, assert_allclose, lower_and_evaluate, mesh_and_layout

SIZES = {"a": 4, "b": 8, "c": 4}
RNG = np.random.RandomState(0)
X = RNG.uniform(-1, 1, size=(4, 8)).astype(np.float32)  # a, b
BIAS = RNG.uniform(-1, 1, size=(4,)).astype(np.float32)  # c
W = RNG.uniform(-1, 1, size=(8, 4)).astype(np.float32)  # b, c
DY = RNG.uniform(-1, 1, size=(4, 4)).astype(np.float32)  # a, c


def _import(mesh, value, shape):
  return mtf.import_tf_tensor(mesh, tf.constant(value), shape)


def _block(x, bias):
  """A block reading an explicit input, an outside tensor (bias) and a variable it creates."""
  w = mtf.get_variable(x.mesh, "w", "b:8;c:4", initializer=tf.constant_initializer(W))
  h = mtf.tanh(mtf.einsum([x, w], output_shape="a:4;c:4") + bias)
  return h * h + mtf.reduce_sum(x, reduced_dim=mtf.Dimension("b", 8))


def _block_and_gradients(wrap):
  """Builder: the block's output and d(sum(out * DY))/d(x, bias, w), with the block wrapped by `wrap`."""
  def build(mesh):
    x, bias = _import(mesh, X, "a:4;b:8"), _import(mesh, BIAS, "c:4")
    y = wrap(_block, x, bias)
    w = mesh.graph.trainable_variables[0].outputs[0]
    loss = mtf.reduce_sum(y * _import(mesh, DY, "a:4;c:4"))
    return [y] + mtf.gradients([loss], [x, bias, w])
  return build


def _plain(fn, x, bias):
  return fn(x, bias)


@st.composite
def layout_and_mode(draw):
  mesh_shape, layout = draw(mesh_and_layout(SIZES))
  return mesh_shape, layout, draw(st.sampled_from(MODES))


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(layout_and_mode(), st.booleans())
def test_recompute_grad_gives_the_values_and_gradients_of_plain_code(case, control_dependencies):
  mesh_shape, layout, mode = case

  def recomputed(fn, x, bias):
    return mtf.recompute_grad(lambda x: fn(x, bias), [x], control_dependencies=control_dependencies)
  expected = lower_and_evaluate(_block_and_gradients(_plain), mesh_shape, layout, mode)
  actual = lower_and_evaluate(_block_and_gradients(recomputed), mesh_shape, layout, mode)
  for a, e in zip(actual, expected):
    assert_allclose(a, e)


def test_recompute_grad_clones_the_forward_ops_after_the_output_gradients():
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "m")
  with tf.Graph().as_default():
    x, bias = _import(mesh, X, "a:4;b:8"), _import(mesh, BIAS, "c:4")
    y = mtf.recompute_grad(lambda x: _block(x, bias), [x])
    n = len(graph.operations)
    mtf.gradients([mtf.reduce_sum(y)], [x])
  new_ops = graph.operations[n:]
  depends = [op for op in new_ops if isinstance(op, mtf.Depend)]
  # x, bias and w wait for the output gradient before being reused.
  assert len(depends) == 3 and all(len(op.dependencies) == 1 for op in depends)
  assert {op.inputs[0] for op in depends} == {x, bias, graph.trainable_variables[0].outputs[0]}
  assert len([op for op in new_ops if isinstance(op, mtf.EinsumOperation)]) >= 3  # recomputed + grads
  assert len(graph.trainable_variables) == 1  # the variable is shared, not cloned


@pytest.mark.parametrize("mode", MODES)
def test_recompute_grad_reuses_random_values_of_the_forward_pass(mode):
  def build(mesh):
    x = _import(mesh, X, "a:4;b:8")
    y = mtf.recompute_grad(lambda x: mtf.dropout(x * x, rate=0.5), [x])
    return [y, mtf.gradients([mtf.reduce_sum(y)], [x])[0]]
  y, dx = lower_and_evaluate(build, "rows:2;cols:2", "a:rows;b:cols", mode)
  assert 0 < np.count_nonzero(y) < y.size
  assert_allclose(dx, 2.0 * y / X)  # d/dx of x * x * mask / keep_prob, with the forward mask


@pytest.mark.parametrize("mode", MODES)
def test_recompute_grad_with_an_integer_input(mode):
  def build(mesh):
    x = _import(mesh, X, "a:4;b:8")
    ids = mtf.import_tf_tensor(mesh, tf.constant([0, 3, 1, 2], tf.int32), "a:4")
    y = mtf.recompute_grad(lambda x, ids: x * x * mtf.one_hot(ids, mtf.Dimension("b", 8)), [x, ids])
    return [y, mtf.gradients([mtf.reduce_sum(y)], [x])[0]]
  y, dx = lower_and_evaluate(build, "all:2", "b:all", mode)
  mask = np.eye(8, dtype=np.float32)[[0, 3, 1, 2]]
  assert_allclose(y, X * X * mask)
  assert_allclose(dx, 2.0 * X * mask)


@pytest.mark.parametrize("mode", MODES)
def test_recompute_grad_through_a_gather_whose_indices_are_computed_inside(mode):
  """The gather's gradient reads the (recomputed) indices of its own inputs, not the forward op's."""
  def build(mesh):
    x = _import(mesh, X, "a:4;b:8")
    w = _import(mesh, W, "b:8;c:4")

    def fn(x, w):
      ids = mtf.argmax(x, mtf.Dimension("b", 8))  # [a], computed inside the recomputed block
      return mtf.gather(w, ids, mtf.Dimension("b", 8)) * mtf.reduce_sum(x, reduced_dim=mtf.Dimension("b", 8))

    y = mtf.recompute_grad(fn, [x, w])
    return [y, mtf.gradients([mtf.reduce_sum(y)], [w])[0]]
  y, dw = lower_and_evaluate(build, "all:2", "a:all", mode)
  ids, sums = X.argmax(axis=1), X.sum(axis=1)
  assert_allclose(y, W[ids] * sums[:, None])
  want = np.zeros_like(W)
  np.add.at(want, ids, np.repeat(sums[:, None], 4, axis=1))
  assert_allclose(dw, want)


def test_recompute_grad_with_unused_float_input_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x, unused = _import(mesh, X, "a:4;b:8"), _import(mesh, BIAS, "c:4")
  y = mtf.recompute_grad(lambda x, unused: x * 2.0, [x, unused])
  with pytest.raises(ValueError, match="recompute_grad: the gradient for input 'import_1:0' is None"):
    mtf.gradients([mtf.reduce_sum(y)], [x, unused])


# ---- custom_gradient ----

@pytest.mark.parametrize("mode", MODES)
def test_custom_gradient_uses_grad_fn_and_passes_its_context(mode):
  seen = {}

  def grad_fn(explicit_inputs, all_inputs, forward_operations, outputs, output_grads):
    seen.update(explicit_inputs=explicit_inputs, all_inputs=all_inputs,
                forward_operations=forward_operations, outputs=outputs, output_grads=output_grads)
    dy, = output_grads
    return [dy * 3.0, mtf.reduce_sum(dy, reduced_dim=mtf.Dimension("b", 8)) * 0.0 + 7.0]

  def build(mesh):
    x, s = _import(mesh, X, "a:4;b:8"), _import(mesh, BIAS, "a:4")
    captured = {}

    def fn(x):
      captured["ops"], y = mesh.graph.operations[:], x * x + s
      return y
    y = mtf.custom_gradient(fn, grad_fn, [x])
    assert isinstance(y.operation, mtf.CustomGradientOperation) and y.operation.name == "custom_gradient"
    assert y.operation.splittable_dims == {"a", "b"} and not y.operation.unsplittable_dims
    dx, ds = mtf.gradients([mtf.reduce_sum(y)], [x, s])
    assert seen["explicit_inputs"] == [x] and seen["all_inputs"] == [x, s]
    assert seen["forward_operations"] == mesh.graph.operations[len(captured["ops"]):][:2]
    assert seen["outputs"] == [y.operation.inputs[-1]] and len(seen["output_grads"]) == 1
    return [y, dx, ds]
  y, dx, ds = lower_and_evaluate(build, "x:2;y:2;z:2", "a:x;b:z", mode)
  assert_allclose(y, X * X + BIAS[:, None])
  assert_allclose(dx, np.full((4, 8), 3.0))
  assert_allclose(ds, np.full((4,), 7.0))


@pytest.mark.parametrize("mode", MODES)
def test_custom_gradient_with_tuple_outputs_and_partial_output_gradients(mode):
  def grad_fn(explicit_inputs, all_inputs, forward_operations, outputs, output_grads):
    d_double, d_triple = output_grads
    assert d_triple is None  # only the first output reaches the loss
    return [d_double * 10.0]

  def build(mesh):
    x = _import(mesh, X, "a:4;b:8")
    double, triple = mtf.custom_gradient(lambda x: (x * 2.0, x * 3.0), grad_fn, [x])
    return [double, triple, mtf.gradients([mtf.reduce_sum(double)], [x])[0]]
  double, triple, dx = lower_and_evaluate(build, "all:4", "b:all", mode)
  assert_allclose(double, 2.0 * X)
  assert_allclose(triple, 3.0 * X)
  assert_allclose(dx, np.full((4, 8), 10.0))


def test_custom_gradient_marks_internal_tensors_unusable_but_not_random_draws():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = _import(mesh, X, "a:4;b:8")
  internal = {}

  def fn(x):
    internal["h"] = x * 2.0
    internal["noise"] = mtf.random_uniform(mesh, "a:4;b:8")
    return internal["h"] + internal["noise"]
  y = mtf.custom_gradient(fn, lambda **kwargs: [None], [x])
  assert y.usable and y.operation.inputs[-1].usable and internal["noise"].usable
  assert not internal["h"].usable
  with pytest.raises(ValueError, match="reads tensor 'scalar_mul:0'.*internal to a custom_gradient"):
    mtf.negative(internal["h"])


def test_custom_gradient_grad_fn_creating_variables_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = _import(mesh, X, "a:4;b:8")

  def grad_fn(explicit_inputs, all_inputs, forward_operations, outputs, output_grads):
    v = mtf.get_variable(mesh, "sneaky", "a:4;b:8", initializer=tf.zeros_initializer())
    return [output_grads[0] + v]
  with tf.Graph().as_default():
    y = mtf.custom_gradient(lambda x: x * 2.0, grad_fn, [x])
    with pytest.raises(ValueError, match="grad_fn created variables .'custom_gradient/gradients/sneaky'."):
      mtf.gradients([mtf.reduce_sum(y)], [x])


def test_custom_gradient_bad_grad_count_and_no_inputs_raise():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = _import(mesh, X, "a:4;b:8")
  y = mtf.custom_gradient(lambda x: x * 2.0, lambda **kwargs: [None, None], [x])
  with pytest.raises(ValueError, match="grad_fn returned 2 gradients for 1 inputs \\['import:0'\\]"):
    mtf.gradients([mtf.reduce_sum(y)], [x])
  with pytest.raises(ValueError, match="custom_gradient needs at least one explicit input"):
    mtf.custom_gradient(lambda: x, lambda **kwargs: [], [])


# ---- serialize_training_step ----

BATCH = mtf.Dimension("batch", 16)
FEATURES = RNG.uniform(-1, 1, size=(16, 4)).astype(np.float32)  # batch, d
IDS = RNG.randint(0, 2, size=(16,)).astype(np.int32)  # batch
WD = RNG.uniform(-1, 1, size=(4, 2)).astype(np.float32)  # d, e


def _model_fn(features):
  x, ids = features["x"], features["ids"]
  w = mtf.get_variable(x.mesh, "w", "d:4;e:2", initializer=tf.constant_initializer(WD))
  v = mtf.get_variable(x.mesh, "v", "e:2", initializer=tf.ones_initializer())
  logits = mtf.einsum([x, w], output_shape=mtf.Shape([ids.shape.dims[0], mtf.Dimension("e", 2)])) + v
  chosen = mtf.reduce_sum(logits * mtf.one_hot(ids, mtf.Dimension("e", 2)), reduced_dim=mtf.Dimension("e", 2))
  return {"loss": mtf.reduce_sum(mtf.square(chosen)), "logits": logits}


def _training_step(num_splits):
  def build(mesh):
    features = {"x": _import(mesh, FEATURES, "batch:16;d:4"), "ids": _import(mesh, IDS, "batch:16")}
    if num_splits:
      grads, outputs = mtf.serialize_training_step(features, _model_fn, BATCH, num_splits)
    else:
      outputs = _model_fn(features)
      grads = mtf.gradients([outputs["loss"]], [v.outputs[0] for v in mesh.graph.trainable_variables])
    assert sorted(outputs) == ["logits", "loss"]
    assert [v.name for v in mesh.graph.trainable_variables] == ["w", "v"]
    return grads + [outputs["loss"], outputs["logits"]]
  return build


@settings(max_examples=max(1, MAX_EXAMPLES // 2), deadline=None)
@given(st.builds(lambda ml, mode: ml + (mode,), mesh_and_layout({"batch": 4, "d": 4, "e": 2}),
                 st.sampled_from(MODES)),
       st.sampled_from([2, 4]))
def test_serialize_training_step_matches_one_big_step(case, num_splits):
  mesh_shape, layout, mode = case
  expected = lower_and_evaluate(_training_step(None), mesh_shape, layout, mode)
  actual = lower_and_evaluate(_training_step(num_splits), mesh_shape, layout, mode)
  for a, e in zip(actual, expected):
    assert_allclose(a, e, rtol=1e-4)


def test_serialize_training_step_bad_inputs_raise():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  features = {"x": _import(mesh, FEATURES, "batch:16;d:4")}
  with pytest.raises(ValueError, match="num_splits=3 does not divide Dimension\\(name='batch', size=16\\)"):
    mtf.serialize_training_step(features, _model_fn, BATCH, 3)
  with pytest.raises(ValueError, match="feature 'bias'.*lacks the batch dimension"):
    mtf.serialize_training_step({"bias": _import(mesh, BIAS, "c:4")}, _model_fn, BATCH, 2)
  with pytest.raises(ValueError, match="model_fn must return a dict with a 'loss'.*\\['out'\\]"):
    mtf.serialize_training_step(features, lambda f: {"out": f["x"]}, BATCH, 2)


def test_serialize_training_step_with_disconnected_variable_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  features = {"x": _import(mesh, FEATURES, "batch:16;d:4")}
  with tf.Graph().as_default():
    mtf.get_variable(mesh, "unused", "d:4", initializer=tf.zeros_initializer())
    with pytest.raises(ValueError, match="trainable variables \\['unused'\\] get no gradient"):
      mtf.serialize_training_step(features, lambda f: {"loss": mtf.reduce_sum(f["x"])}, BATCH, 2)
