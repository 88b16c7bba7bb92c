"""Binary ops: broadcasting by dimension name, scalar operands, lazy sums, splittability, errors."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, align_to_names, assert_op_matches_tf, mesh_and_layout

SIZES = {"a": 4, "b": 2, "c": 8}
infer_shape = mtf.ops._infer_binary_broadcast_shape


def _shape_string(names):
  return ";".join(f"{n}:{SIZES[n]}" for n in names)


# name -> (mtf fn, tf fn on operands aligned to the output, domain of x2)
BINARY = {
    "add": (mtf.add, tf.add, "signed"),
    "sub": (mtf.sub, tf.subtract, "signed"),
    "multiply": (mtf.multiply, tf.multiply, "signed"),
    "divide": (mtf.divide, tf.divide, "positive"),
    "minimum": (mtf.minimum, tf.minimum, "signed"),
    "maximum": (mtf.maximum, tf.maximum, "signed"),
    "operators": (lambda x, y: (x - y) * x / (y * y + 1.0) + 2.0, lambda x, y: (x - y) * x / (y * y + 1) + 2,
                  "signed"),
}


def _random(rng, names, domain):
  shape = [SIZES[n] for n in names]
  if domain == "positive":
    return rng.uniform(0.5, 2.0, size=shape).astype(np.float32)
  return rng.uniform(-1.0, 1.0, size=shape).astype(np.float32)


def _check_binary(op, names1, names2, mesh_shape, layout, mode, seed):
  mtf_fn, tf_fn, domain = BINARY[op]
  rng = np.random.RandomState(seed)
  x1, x2 = _random(rng, names1, "signed"), _random(rng, names2, domain)
  out = infer_shape(_shape_string(names1), _shape_string(names2)).dimension_names
  assert_op_matches_tf(
      mtf_fn, lambda a, b: tf_fn(align_to_names(a, names1, out), align_to_names(b, names2, out)),
      [(x1, _shape_string(names1)), (x2, _shape_string(names2))], mesh_shape, layout, mode, seed=seed)


@st.composite
def binary_case(draw):
  names = st.lists(st.sampled_from(sorted(SIZES)), unique=True, min_size=0, max_size=3)
  names1, names2 = draw(names.filter(bool)), draw(names)
  mesh_shape, layout = draw(mesh_and_layout({n: SIZES[n] for n in names1 + names2}))
  return (draw(st.sampled_from(sorted(BINARY))), names1, names2, mesh_shape, layout,
          draw(st.sampled_from(MODES)), draw(st.integers(0, 2 ** 16)))


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(binary_case())
def test_binary_op_with_broadcasting_and_gradients_match_tf_under_any_layout(case):
  _check_binary(*case)


@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("names1,names2,mesh_shape,layout,mode", [
    (["a", "c"], ["c"], "rows:2;cols:4", "a:rows;c:cols", "graph"),
    (["a", "b"], ["c", "b"], "x:2;y:2;z:2", "a:x;b:y;c:z", "eager"),
    (["c"], ["a", "c"], "all:8", "c:all", "eager"),
    (["b", "a"], [], "all:4", "a:all", "graph"),
])
def test_each_binary_op_broadcasts_by_name(op, names1, names2, mesh_shape, layout, mode):
  _check_binary(op, names1, names2, mesh_shape, layout, mode, seed=7)


BOOL_VALUED = {
    "less": (mtf.less, tf.less), "greater": (mtf.greater, tf.greater),
    "less_equal": (mtf.less_equal, tf.less_equal), "greater_equal": (mtf.greater_equal, tf.greater_equal),
    "equal": (mtf.equal, tf.equal), "not_equal": (mtf.not_equal, tf.not_equal),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", sorted(BOOL_VALUED))
def test_comparisons_broadcast_and_return_bool(op, mode):
  mtf_fn, tf_fn = BOOL_VALUED[op]
  rng = np.random.RandomState(8)
  x1 = rng.randint(0, 3, size=[4, 8]).astype(np.float32)  # small ints: plenty of ties
  x2 = rng.randint(0, 3, size=[2, 8]).astype(np.float32)

  def mtf_compare(a, b):
    y = mtf_fn(a, b)
    assert y.dtype == tf.bool and y.shape.dimension_names == ["a", "c", "b"]
    return y
  assert_op_matches_tf(mtf_compare, lambda a, b: tf_fn(a[:, :, None], tf.transpose(b)[None]),
                       [(x1, "a:4;c:8"), (x2, "b:2;c:8")], "rows:2;cols:2", "a:rows;b:cols", mode,
                       check_gradients=False)


@pytest.mark.parametrize("mode", MODES)
def test_logical_and_or_floordiv_mod(mode):
  rng = np.random.RandomState(9)
  p, q = rng.rand(4, 2) > 0.5, rng.rand(2) > 0.5
  for mtf_fn, tf_fn in [(mtf.logical_and, tf.logical_and), (mtf.logical_or, tf.logical_or)]:
    assert_op_matches_tf(mtf_fn, tf_fn, [(p, "a:4;b:2"), (q, "b:2")], "all:2", "b:all", mode)
  ints, divisors = rng.randint(-20, 20, size=[4, 8]).astype(np.int32), np.arange(1, 9, dtype=np.int32)
  for mtf_fn, tf_fn in [(mtf.floordiv, tf.math.floordiv), (mtf.mod, tf.math.floormod),
                        (lambda a, b: a // b, tf.math.floordiv), (lambda a, b: a % b, tf.math.floormod)]:
    assert_op_matches_tf(mtf_fn, tf_fn, [(ints, "a:4;c:8"), (divisors, "c:8")], "rows:2;cols:4",
                         "a:rows;c:cols", mode)


SCALAR_CASES = {
    "x+2": (lambda x: x + 2.0, lambda x: x + 2.0),
    "2+x": (lambda x: 2.0 + x, lambda x: 2.0 + x),
    "x-2": (lambda x: x - 2.0, lambda x: x - 2.0),
    "2-x": (lambda x: 2.0 - x, lambda x: 2.0 - x),
    "x*3": (lambda x: x * 3.0, lambda x: x * 3.0),
    "3*x": (lambda x: 3 * x, lambda x: 3.0 * x),
    "x/4": (lambda x: x / 4.0, lambda x: x / 4.0),
    "4/x": (lambda x: 4.0 / x, lambda x: 4.0 / x),
    "divide(2, x)": (lambda x: mtf.divide(2.0, x), lambda x: 2.0 / x),
    "sub(1, x)": (lambda x: mtf.sub(1.0, x), lambda x: 1.0 - x),
    "multiply(np, x)": (lambda x: mtf.multiply(np.float32(0.5), x), lambda x: 0.5 * x),
    "-x": (lambda x: -x, lambda x: -x),
    "add tf scalar": (lambda x: mtf.add(x, tf.constant(1.5)), lambda x: x + 1.5),
    "multiply tf scalar": (lambda x: x * tf.constant(1.5), lambda x: x * 1.5),
    "maximum(x, 1)": (lambda x: mtf.maximum(x, 1.0), lambda x: tf.maximum(x, 1.0)),
    "minimum(1, x)": (lambda x: mtf.minimum(1.0, x), lambda x: tf.minimum(1.0, x)),
    "less(x, 1)": (lambda x: mtf.less(x, 1.0), lambda x: x < 1.0),
    "where scalars": (lambda x: mtf.where(mtf.greater(x, 1.0), 1.0, x),
                      lambda x: tf.where(x > 1.0, tf.ones_like(x), x)),
}


@pytest.mark.parametrize("case,mode", [(c, MODES[i % 2]) for i, c in enumerate(sorted(SCALAR_CASES))])
def test_scalar_operand_on_either_side(case, mode):
  mtf_fn, tf_fn = SCALAR_CASES[case]
  x = np.random.RandomState(10).uniform(0.5, 1.5, size=[4, 8]).astype(np.float32)
  assert_op_matches_tf(mtf_fn, tf_fn, [(x, "a:4;c:8")], "rows:2;cols:2", "a:rows;c:cols", mode,
                       check_gradients=case != "less(x, 1)")


@pytest.mark.parametrize("mode", MODES)
def test_integer_tensor_with_integer_scalars(mode):
  ints = np.arange(32, dtype=np.int32).reshape([4, 8])
  assert_op_matches_tf(lambda x: (x + 3) * 2 - 1, lambda x: (x + 3) * 2 - 1, [(ints, "a:4;c:8")],
                       "all:4", "c:all", mode)
  assert_op_matches_tf(lambda x: (7 - x) // 3 + x % 5, lambda x: (7 - x) // 3 + x % 5,
                       [(ints, "a:4;c:8")], "all:4", "c:all", mode)


@pytest.mark.parametrize("mode", MODES)
def test_where_broadcasts_condition_and_branches(mode):
  rng = np.random.RandomState(11)
  x, y = rng.uniform(-1, 1, size=[4, 8]).astype(np.float32), rng.uniform(-1, 1, size=[8]).astype(np.float32)
  assert_op_matches_tf(lambda a, b: mtf.where(mtf.greater(b, 0.0), a, b),
                       lambda a, b: tf.where(tf.broadcast_to(b > 0, [4, 8]), a, tf.broadcast_to(b, [4, 8])),
                       [(x, "a:4;c:8"), (y, "c:8")], "x:2;y:2;z:2", "a:x;c:z", mode)


@pytest.mark.parametrize("mode", MODES)
def test_explicit_output_shape_reorders_and_adds_dims(mode):
  rng = np.random.RandomState(12)
  x, y = rng.uniform(-1, 1, size=[4, 2]).astype(np.float32), rng.uniform(-1, 1, size=[2]).astype(np.float32)
  assert_op_matches_tf(lambda a, b: mtf.add(a, b, output_shape="b:2;a:4"), lambda a, b: tf.transpose(a + b),
                       [(x, "a:4;b:2"), (y, "b:2")], "rows:2;cols:2", "a:rows;b:cols", mode)
  assert_op_matches_tf(lambda a, b: mtf.add(a, b, output_shape="a:4;b:2;c:8"),
                       lambda a, b: tf.broadcast_to((a + b)[:, :, None], [4, 2, 8]),
                       [(x, "a:4;b:2"), (y, "b:2")], "rows:2;cols:4", "a:rows;c:cols", mode)
  assert_op_matches_tf(lambda a, b: mtf.less(a, b, output_shape="c:8;b:2;a:4"),
                       lambda a, b: tf.broadcast_to(tf.transpose(a < b)[None], [8, 2, 4]),
                       [(x, "a:4;b:2"), (y, "b:2")], "all:8", "c:all", mode, check_gradients=False)


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_and_its_gradient(mode):
  y = np.random.RandomState(13).uniform(-1, 1, size=[2, 8]).astype(np.float32)
  assert_op_matches_tf(lambda t: mtf.broadcast(t, "c:8;a:4;b:2"),
                       lambda t: tf.broadcast_to(tf.transpose(t)[:, None, :], [8, 4, 2]),
                       [(y, "b:2;c:8")], "x:2;y:2;z:2", "c:x;a:y;b:z", mode)


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_of_bools(mode):
  p = np.array([True, False])
  assert_op_matches_tf(lambda t: mtf.broadcast(t, "a:4;b:2"), lambda t: tf.broadcast_to(t, [4, 2]),
                       [(p, "b:2")], "rows:2;cols:2", "a:rows;b:cols", mode)


@pytest.mark.parametrize("mode", MODES)
def test_add_n(mode):
  rng = np.random.RandomState(14)
  xs = [(rng.uniform(-1, 1, size=[4, 8]).astype(np.float32), "a:4;c:8"),
        (rng.uniform(-1, 1, size=[8]).astype(np.float32), "c:8"),
        (rng.uniform(-1, 1, size=[4, 8]).astype(np.float32), "a:4;c:8")]
  assert_op_matches_tf(lambda *ts: mtf.add_n(list(ts)), lambda *ts: ts[0] + ts[1] + ts[2], xs,
                       "rows:2;cols:4", "a:rows;c:cols", mode)
  assert mtf.add_n([]) == 0


def test_add_of_partial_sums_stays_lazy_until_exported():
  rng = np.random.RandomState(15)
  x, y = (rng.uniform(-1, 1, size=[4, 8]).astype(np.float32) for _ in range(2))
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "m")
  c = mtf.Dimension("c", 8)
  sx = mtf.reduce_sum(mtf.import_tf_tensor(mesh, tf.constant(x), "a:4;c:8"), reduced_dim=c)
  sy = mtf.reduce_sum(mtf.import_tf_tensor(mesh, tf.constant(y), "a:4;c:8"), reduced_dim=c)
  total = (sx + sy) * 2.0
  impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", "c:all", ["cpu:%d" % i for i in range(4)])
  lowering = mtf.Lowering(graph, {mesh: impl})
  for t in (sx, sy, total):
    assert isinstance(lowering.tensors[t], mtf.LazyAllreduceSum), t
  np.testing.assert_allclose(lowering.export_to_tf_tensor(total).numpy(),
                             2 * (x.sum(1) + y.sum(1)), rtol=1e-5)


def test_infer_binary_broadcast_shape_rules():
  s = mtf.convert_to_shape
  assert infer_shape("a:4;c:8", "c:8") == s("a:4;c:8")
  assert infer_shape("c:8", "a:4;b:2;c:8") == s("a:4;b:2;c:8")
  assert infer_shape("", "a:4") == s("a:4")
  assert infer_shape("a:4;b:2", "b:2;a:4") == s("a:4;b:2")  # neither a subsequence: union, x1 first
  assert infer_shape("b:2;c:8", "a:4;c:8") == s("b:2;c:8;a:4")
  assert infer_shape("a:4", "b:2", "b:2;a:4;c:8") == s("b:2;a:4;c:8")


def test_every_binary_class_is_all_splittable_with_spec_default_names():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x, y = mtf.zeros(mesh, "a:4;b:2"), mtf.zeros(mesh, "c:8")
  ops = {
      "add": mtf.AddOperation(x, y, None),
      "scalar_mul": mtf.ScalarMultiplyOperation(x, 2.0),
      "scalar_add": mtf.ScalarAddOperation(x, 2.0),
      "binary_op": mtf.BinaryOpWithBroadcasting(tf.less, x, y, None, tf.bool),
      "add_1": mtf.MinMaxOperation(tf.maximum, x, y, None),
      "broadcast": mtf.BroadcastOperation(y, mtf.convert_to_shape("c:8;a:4")),
  }
  for name, op in ops.items():
    assert op.name == name
    dims = {d for t in op.inputs + op.outputs for d in t.shape.dimension_names}
    assert op.splittable_dims == dims and not op.unsplittable_dims, name
  assert ops["add"].outputs[0].shape == mtf.convert_to_shape("a:4;b:2;c:8")
  assert mtf.add(x, y, name="my_add").operation.name == "my_add"
  assert mtf.broadcast(x, x.shape) is x
  assert isinstance(mtf.less(x, y).operation, mtf.BinaryOpWithBroadcasting)
  assert isinstance(mtf.minimum(x, y).operation, mtf.MinMaxOperation)
  assert isinstance(mtf.binary_op_with_broadcasting(tf.pow, x, 2.0).operation, mtf.BinaryOpWithBroadcasting)
  s1, s2 = mtf.binary_arguments_to_tensors(3.0, x)
  assert s1.shape == mtf.Shape([]) and s1.dtype == tf.float32 and s2 is x


def test_binary_op_without_gradient_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.zeros(mesh, "a:4")
  op = mtf.BinaryOpWithBroadcasting(tf.pow, x, x, None, tf.float32, name="pow_op")
  with pytest.raises(ValueError, match="'pow_op'.*has no gradient"):
    op.gradient([x])


@pytest.mark.parametrize("fn", [mtf.add, mtf.sub, mtf.multiply, mtf.divide, mtf.minimum, mtf.less,
                                mtf.floordiv, lambda a, b: a + b])
def test_same_named_dims_of_different_sizes_raise_naming_both_tensors(fn):
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x1 = mtf.import_tf_tensor(mesh, tf.zeros([4, 2]), "a:4;b:2", name="first")
  x2 = mtf.import_tf_tensor(mesh, tf.zeros([6]), "a:6", name="second")
  with pytest.raises(ValueError, match=r"dimension 'a' has size 4 in 'first:0'.*size 6 in '\w*second:0'"):
    fn(x1, x2)


@pytest.mark.parametrize("fn", [mtf.add, mtf.multiply, mtf.maximum, mtf.equal, mtf.logical_and])
def test_dtype_mismatch_raises(fn):
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x1, x2 = mtf.zeros(mesh, "a:4"), mtf.zeros(mesh, "a:4", dtype=tf.int32)
  with pytest.raises(ValueError, match="dtypes differ.*float32.*int32.*cast"):
    fn(x1, x2)


@pytest.mark.parametrize("fn", [mtf.add, mtf.sub, mtf.multiply, mtf.divide, mtf.minimum, mtf.less,
                                mtf.mod, mtf.binary_arguments_to_tensors])
def test_no_tensor_argument_raises(fn):
  with pytest.raises(ValueError, match="at least one of .* must be an mtf Tensor"):
    fn(1.0, 2.0)


def test_bad_scalar_operands_raise():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  ints, floats = mtf.zeros(mesh, "a:4", dtype=tf.int32), mtf.zeros(mesh, "a:4")
  with pytest.raises(ValueError, match="scalar 0.5 .* does not fit tensor .* int32.*floordiv"):
    _ = ints * 0.5
  with pytest.raises(ValueError, match="does not fit tensor .* int32"):
    _ = ints / 2
  with pytest.raises(ValueError, match="does not fit"):
    mtf.less(ints, 1.5)
  with pytest.raises(ValueError, match="must be a scalar.*import_tf_tensor"):
    _ = floats + np.ones(4)
  with pytest.raises(ValueError, match="TF scalar .* int32 but tensor .* float32"):
    _ = floats * tf.constant(2)
  with pytest.raises(ValueError, match="must be a scalar"):
    mtf.add(floats, tf.constant([1.0, 2.0]))


def test_output_shape_missing_input_dims_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x, y = mtf.zeros(mesh, "a:4;b:2"), mtf.zeros(mesh, "b:2")
  with pytest.raises(ValueError, match=r"output shape Shape\[b=2\] lacks \[Dimension\(name='a'.*reduce_sum"):
    mtf.add(x, y, output_shape="b:2")
  with pytest.raises(ValueError, match="lacks"):
    mtf.broadcast(x, "a:4;c:8")
