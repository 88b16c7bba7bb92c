"""Elementwise ops: values and gradients equal plain TF under any mesh/layout, splittability, errors."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import (
    MAX_EXAMPLES, MODES, assert_allclose, assert_op_matches_tf, lower_and_evaluate, mesh_and_layout)

SIZES = {"a": 4, "b": 2, "c": 8}


def _tf_gelu(x):
  return 0.5 * x * (1.0 + tf.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x * x * x)))


# name -> (mtf fn, tf fn, input domain). "signed" keeps |x| >= 0.1 so kinks (relu, abs) are not hit.
# Integer-valued outputs (to_int32) have no gradient to check.
UNARY = {
    "identity": (mtf.identity, tf.identity, "signed"),
    "sin": (mtf.sin, tf.sin, "signed"),
    "cos": (mtf.cos, tf.cos, "signed"),
    "square": (mtf.square, tf.square, "signed"),
    "sqrt": (mtf.sqrt, tf.sqrt, "positive"),
    "rsqrt": (mtf.rsqrt, tf.math.rsqrt, "positive"),
    "log": (mtf.log, tf.math.log, "positive"),
    "exp": (mtf.exp, tf.exp, "signed"),
    "sigmoid": (mtf.sigmoid, tf.sigmoid, "signed"),
    "tanh": (mtf.tanh, tf.tanh, "signed"),
    "negative": (mtf.negative, tf.negative, "signed"),
    "reciprocal": (mtf.reciprocal, tf.math.reciprocal, "positive"),
    "relu": (mtf.relu, tf.nn.relu, "signed"),
    "squared_relu": (mtf.squared_relu, lambda x: tf.square(tf.nn.relu(x)), "signed"),
    "leaky_relu": (mtf.leaky_relu, lambda x: tf.nn.leaky_relu(x, 0.2), "signed"),
    "leaky_relu_alpha": (lambda x: mtf.leaky_relu(x, alpha=0.5), lambda x: tf.nn.leaky_relu(x, 0.5),
                         "signed"),
    "sign": (mtf.sign, tf.sign, "signed"),
    "elu": (mtf.elu, tf.nn.elu, "signed"),
    "selu": (mtf.selu, tf.nn.selu, "signed"),
    "softplus": (mtf.softplus, tf.nn.softplus, "signed"),
    "swish": (mtf.swish, lambda x: x * tf.sigmoid(x), "signed"),
    "gelu": (mtf.gelu, _tf_gelu, "signed"),
    "abs": (mtf.abs, tf.abs, "signed"),
    "pow_scalar": (lambda x: mtf.pow(x, 2.5), lambda x: tf.pow(x, 2.5), "positive"),
    "cast_float64": (lambda x: mtf.cast(x, tf.float64), lambda x: tf.cast(x, tf.float64), "signed"),
    "to_int32": (mtf.to_int32, lambda x: tf.cast(x, tf.int32), "signed"),
}


def _random_input(rng, shape, domain):
  if domain == "positive":
    return rng.uniform(0.5, 2.0, size=shape).astype(np.float32)
  magnitude = rng.uniform(0.1, 1.0, size=shape)
  return (magnitude * rng.choice([-1.0, 1.0], size=shape)).astype(np.float32)


def _shape_string(names):
  return ";".join(f"{n}:{SIZES[n]}" for n in names)


@st.composite
def unary_case(draw):
  op = draw(st.sampled_from(sorted(UNARY)))
  names = draw(st.lists(st.sampled_from(sorted(SIZES)), unique=True, min_size=1, max_size=3))
  mesh_shape, layout = draw(mesh_and_layout({n: SIZES[n] for n in names}))
  return op, names, mesh_shape, layout, draw(st.sampled_from(MODES)), draw(st.integers(0, 2 ** 16))


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(unary_case())
def test_unary_op_and_gradient_match_tf_under_any_layout(case):
  op, names, mesh_shape, layout, mode, seed = case
  mtf_fn, tf_fn, domain = UNARY[op]
  x = _random_input(np.random.RandomState(seed), [SIZES[n] for n in names], domain)
  assert_op_matches_tf(mtf_fn, tf_fn, [(x, _shape_string(names))], mesh_shape, layout, mode, seed=seed,
                       check_gradients=op != "to_int32")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", sorted(UNARY))
def test_each_unary_op_matches_tf_on_a_3d_mesh(op, mode):
  mtf_fn, tf_fn, domain = UNARY[op]
  x = _random_input(np.random.RandomState(1), [4, 2, 8], domain)
  assert_op_matches_tf(mtf_fn, tf_fn, [(x, "a:4;b:2;c:8")], "x:2;y:2;z:2", "a:x;b:y;c:z", mode,
                       check_gradients=op != "to_int32")


@pytest.mark.parametrize("mode", MODES)
def test_pow_with_tensor_exponent_broadcasts_and_differentiates_both(mode):
  rng = np.random.RandomState(2)
  x = rng.uniform(0.5, 2.0, size=[4, 8]).astype(np.float32)
  y = rng.uniform(-1.0, 1.0, size=[8]).astype(np.float32)
  assert_op_matches_tf(mtf.pow, tf.pow, [(x, "a:4;c:8"), (y, "c:8")], "rows:2;cols:4", "a:rows;c:cols",
                       mode)


@pytest.mark.parametrize("mode", MODES)
def test_casts_from_integers_and_to_bfloat16(mode):
  ints = np.arange(-8, 8, dtype=np.int32).reshape([4, 4])
  assert_op_matches_tf(mtf.to_float, lambda t: tf.cast(t, tf.float32), [(ints, "a:4;d:4")],
                       "all:4", "a:all", mode)
  floats = np.linspace(-2, 2, 32, dtype=np.float32).reshape([4, 8])
  assert_op_matches_tf(mtf.to_bfloat16, lambda t: tf.cast(t, tf.bfloat16), [(floats, "a:4;c:8")],
                       "rows:2;cols:2", "a:rows;c:cols", mode, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode", MODES)
def test_logical_not(mode):
  bools = np.array([[True, False], [False, False], [True, True], [False, True]])
  assert_op_matches_tf(mtf.logical_not, tf.logical_not, [(bools, "a:4;b:2")], "all:2", "b:all", mode)


def test_cast_to_same_dtype_returns_the_tensor():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.zeros(mesh, "a:4")
  assert mtf.cast(x, tf.float32) is x
  assert mtf.to_int32(x).dtype == tf.int32 and mtf.to_bfloat16(x).dtype == tf.bfloat16


def test_builtin_shadowing_aliases():
  assert mtf.abs is mtf.mtf_abs and mtf.pow is mtf.mtf_pow


# ---- slicewise / cwise ----

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_shape,layout", [("all:4", "a:all"), ("rows:2;cols:2", "a:cols"),
                                               ("all:1", "")])
def test_slicewise_reducing_an_unsplit_dim_with_generic_gradient(mesh_shape, layout, mode):
  x = np.random.RandomState(3).uniform(-1, 1, size=[4, 8]).astype(np.float32)

  def mtf_fn(t):
    a = t.shape.get_dim_by_name("a")
    return mtf.slicewise(lambda s: tf.reduce_sum(tf.sin(s), axis=1), [t], output_shape=[a],
                         splittable_dims=[a])
  assert_op_matches_tf(mtf_fn, lambda t: tf.reduce_sum(tf.sin(t), axis=1), [(x, "a:4;c:8")],
                       mesh_shape, layout, mode)


@pytest.mark.parametrize("mode", MODES)
def test_slicewise_multiple_outputs_gradient_with_one_output_unused(mode):
  x = np.random.RandomState(4).uniform(-1, 1, size=[4, 8]).astype(np.float32)
  dy = np.random.RandomState(5).uniform(-1, 1, size=[4, 8]).astype(np.float32)

  def build(mesh):
    t = mtf.import_tf_tensor(mesh, tf.constant(x), "a:4;c:8")
    y1, y2 = mtf.slicewise(lambda s: (tf.sin(s), tf.cast(s > 0, tf.int32)), [t],
                           output_shape=[None, None], output_dtype=[tf.float32, tf.int32],
                           splittable_dims=t.shape.dims)
    assert y2.dtype == tf.int32 and y1.name != y2.name
    dx = mtf.gradients([y1], [t], [mtf.import_tf_tensor(mesh, tf.constant(dy), "a:4;c:8")])[0]
    return [y1, y2, dx]
  y1, y2, dx = lower_and_evaluate(build, "rows:2;cols:4", "a:rows;c:cols", mode)
  np.testing.assert_allclose(y1, np.sin(x), rtol=1e-6)
  np.testing.assert_array_equal(y2, (x > 0).astype(np.int32))
  np.testing.assert_allclose(dx, np.cos(x) * dy, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_explicit_grad_function_is_used_and_zero_means_no_gradient(mode):
  def build(mesh):
    x = mtf.constant(mesh, 1.5, "a:4")
    doubled = mtf.cwise(tf.identity, [x], grad_function=lambda op, dy: [dy * 2.0])
    blocked = mtf.cwise(tf.identity, [x], grad_function=0)
    assert not blocked.operation.has_gradient
    assert mtf.gradients([blocked], [x]) == [None]
    return [mtf.gradients([doubled], [x])[0]]
  np.testing.assert_allclose(lower_and_evaluate(build, "all:2", "a:all", mode)[0], [2.0] * 4)


def test_slicewise_splittability_sets():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.zeros(mesh, "a:4;b:2")
  a, b = x.shape.dims
  y = mtf.slicewise(lambda s: tf.reduce_sum(s, 1, keepdims=True), [x],
                    output_shape=[a, mtf.Dimension("one", 1)], splittable_dims=[a], name="sw")
  op = y.operation
  assert isinstance(op, mtf.SlicewiseOperation) and op.name == "sw"
  assert op.splittable_dims == {"a"} and op.unsplittable_dims == {"b", "one"}
  by_name = mtf.slicewise(tf.identity, [x], splittable_dims=["b"]).operation
  assert by_name.name == "slicewise" and by_name.splittable_dims == {"b"}
  assert mtf.slicewise(tf.identity, [x]).operation.unsplittable_dims == {"a", "b"}
  c = mtf.exp(x).operation
  assert c.name == "exp" and c.splittable_dims == {"a", "b"} and not c.unsplittable_dims
  assert mtf.cwise(tf.identity, [x]).operation.name == "cwise"


def test_generic_grad_operation_is_declared_all_splittable_keeps_what_its_forward_op_cannot_split():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.zeros(mesh, "a:4")
  y = mtf.slicewise(lambda s: tf.reduce_sum(s), [x], output_shape=[], splittable_dims=[])
  (dx,) = mtf.gradients([y], [x])
  op = dx.operation
  assert isinstance(op, mtf.GenericGradOperation) and op.name.endswith("generic_grad")
  assert op.splittable_dims == {"a"} and not op.unsplittable_dims  # declared as upstream did
  assert op.layout_unsplittable_dims == {"a"}
  assert dx.shape == x.shape and dx.dtype == x.dtype


@pytest.mark.parametrize("mode", MODES)
def test_splitting_an_unsplittable_dim_raises_naming_op_dim_and_mesh_dim(mode):
  def build(mesh):
    x = mtf.zeros(mesh, "a:4;b:2")
    return [mtf.slicewise(tf.identity, [x], splittable_dims=x.shape.dims[:1], name="my_sw")]
  with pytest.raises(ValueError, match="'my_sw' can't split dimension 'b'.*'cols'.*'b' is not declared as "
                                       "splittable"):
    lower_and_evaluate(build, "rows:2;cols:2", "a:rows;b:cols", mode)


FLOAT_ONLY = {
    "sin": mtf.sin, "cos": mtf.cos, "sqrt": mtf.sqrt, "rsqrt": mtf.rsqrt, "log": mtf.log,
    "exp": mtf.exp, "sigmoid": mtf.sigmoid, "tanh": mtf.tanh, "reciprocal": mtf.reciprocal,
    "leaky_relu": mtf.leaky_relu, "elu": mtf.elu, "selu": mtf.selu, "softplus": mtf.softplus,
    "swish": mtf.swish, "gelu": mtf.gelu, "log_of_pow": lambda x: mtf.pow(x, 2.0),
}


@pytest.mark.parametrize("op", sorted(FLOAT_ONLY))
def test_integer_input_to_float_op_raises_naming_op_and_tensor(op):
  mesh = mtf.Mesh(mtf.Graph(), "m")
  ints = mtf.import_tf_tensor(mesh, tf.constant([1, 2]), "a:2", name="ints")
  with pytest.raises(ValueError, match=r"\w+: tensor 'ints:0' has dtype int32.*floating.*to_float"):
    FLOAT_ONLY[op](ints)


def test_integer_friendly_ops_accept_integers():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  ints = mtf.import_tf_tensor(mesh, tf.constant([1, 2]), "a:2")
  for fn in (mtf.identity, mtf.square, mtf.negative, mtf.relu, mtf.sign, mtf.abs):
    assert fn(ints).dtype == tf.int32


def test_logical_not_of_non_bool_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  with pytest.raises(ValueError, match="logical_not.*float32, expected bool"):
    mtf.logical_not(mtf.zeros(mesh, "a:2"))


def test_slicewise_bad_arguments_raise():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.zeros(mesh, "a:2")
  with pytest.raises(ValueError, match="needs at least one input"):
    mtf.slicewise(tf.identity, [])
  with pytest.raises(ValueError, match="inputs must be mtf Tensors"):
    mtf.cwise(tf.add, [x, 1.0])
  with pytest.raises(ValueError, match="output_shape must be a list"):
    mtf.slicewise(lambda s: (s, s), [x], output_shape=[x.shape], output_dtype=[tf.float32, tf.float32])
  two = mtf.slicewise(lambda s: (s, s), [x], output_dtype=[tf.float32, tf.int32])
  assert [t.shape for t in two] == [x.shape, x.shape] and two[1].dtype == tf.int32


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("alpha", [None, 0.3])
def test_relu_gradient_is_linear_in_dy_and_so_is_its_own_gradient(mode, alpha):
  """relu's gradient (one ReluGrad kernel per slice) differentiated again, with respect to dy."""
  x_np = np.array([[-2.0, 0.5], [3.0, -0.1]], np.float32)
  v_np = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
  fn = mtf.relu if alpha is None else (lambda t: mtf.leaky_relu(t, alpha))

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(x_np), "a:2;b:2")
    u = mtf.zeros(mesh, "a:2;b:2")
    dx, = mtf.gradients([mtf.reduce_sum(fn(x) * u)], [x])
    du, = mtf.gradients([mtf.reduce_sum(dx * mtf.import_tf_tensor(mesh, tf.constant(v_np), "a:2;b:2"))],
                        [u])
    return [du]
  du, = lower_and_evaluate(build, "rows:2;cols:2", "a:rows;b:cols", mode)
  assert_allclose(du, np.where(x_np > 0, v_np, (alpha or 0.0) * v_np))


def test_leaky_relu_name_names_its_operation():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  y = mtf.leaky_relu(mtf.ones(mesh, "a:2"), 0.1, name="my_leaky")
  assert y.operation.name.startswith("my_leaky")
