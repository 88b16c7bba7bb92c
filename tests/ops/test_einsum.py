"""einsum / matmul: output-shape rules, results and gradients under any layout, allreduce, errors."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from mesh_tensorflow._ops import einsum as einsum_ops
from tests.harness import (
    MAX_EXAMPLES, MODES, assert_op_matches_tf, lower_and_evaluate, lowering_counters, mesh_and_layout)

DIMS = {"a": 2, "b": 4, "c": 8, "d": 4, "e": 2}  # "e" only ever appears as a broadcast output dim
INPUT_NAMES = ("a", "b", "c", "d")


def _shape(names):
  return mtf.Shape([mtf.Dimension(n, DIMS[n]) for n in names])


def _shape_string(names):
  return ";".join(f"{n}:{DIMS[n]}" for n in names)


def _tf_einsum(input_names, output_names):
  """A TF function computing the same einsum (output dims in no input are broadcast)."""
  in_inputs = [n for n in output_names if any(n in names for names in input_names)]
  equation = "%s->%s" % (",".join("".join(names) for names in input_names), "".join(in_inputs))

  def fn(*xs):
    y = tf.einsum(equation, *xs)
    for i, n in enumerate(output_names):
      if n not in in_inputs:
        y = tf.expand_dims(y, i)
    return tf.broadcast_to(y, [DIMS[n] for n in output_names])
  return fn


def _random_input(names, rng, dtype=np.float32):
  return (rng.uniform(-1, 1, [DIMS[n] for n in names]).astype(dtype), _shape_string(names))


@st.composite
def einsum_cases(draw):
  """(input dim-name lists, how the output is given, mtf kwargs, output dim names)."""
  inputs = draw(st.lists(st.lists(st.sampled_from(INPUT_NAMES), min_size=1, max_size=3, unique=True),
                         min_size=1, max_size=3))
  union = list(dict.fromkeys(n for names in inputs for n in names))
  kind = draw(st.sampled_from(["default", "reduced_dims", "output_shape"]))
  if kind == "default":
    output = [n for n in union if sum(n in names for names in inputs) == 1]
    return inputs, {}, output
  if kind == "reduced_dims":
    reduced = draw(st.lists(st.sampled_from(union), unique=True))
    return inputs, {"reduced_dims": _shape(reduced).dims}, [n for n in union if n not in reduced]
  output = draw(st.lists(st.sampled_from(union + ["e"]), unique=True))
  broadcast = ["e"] if "e" in output else []  # "e" is in no input: the broadcast is asked for
  return inputs, {"output_shape": _shape(output), "broadcast_dims": _shape(broadcast)}, output


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(einsum_cases(), mesh_and_layout(DIMS), st.sampled_from(MODES))
def test_einsum_matches_tf_and_its_gradients_under_any_layout(case, mesh_layout, mode):
  input_names, kwargs, output_names = case
  rng = np.random.RandomState(0)
  assert_op_matches_tf(
      lambda *xs: mtf.einsum(list(xs), **kwargs), _tf_einsum(input_names, output_names),
      [_random_input(names, rng) for names in input_names], *mesh_layout, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_shape,layout", [
    ("all:8", "c:all"), ("rows:2;cols:4", "b:rows;c:cols"), ("x:2;y:2;z:2", "a:x;b:y;d:z")])
def test_matmul_over_split_dims_matches_numpy(mesh_shape, layout, mode):
  rng = np.random.RandomState(1)
  a, b = _random_input("abc", rng), _random_input("cd", rng)
  assert_op_matches_tf(mtf.matmul, _tf_einsum(["abc", "cd"], "abd"), [a, b], mesh_shape, layout, mode)


@pytest.mark.parametrize("mode", MODES)
def test_integer_einsum_uses_multiply_and_reduce(mode):
  rng = np.random.RandomState(2)
  x = rng.randint(-5, 5, [2, 4]).astype(np.int32)
  w = rng.randint(-5, 5, [4, 8]).astype(np.int32)

  def build(mesh):
    xs = mtf.import_tf_tensor(mesh, tf.constant(x), _shape_string("ab"))
    ws = mtf.import_tf_tensor(mesh, tf.constant(w), _shape_string("bc"))
    broadcast = mtf.einsum([xs, ws], output_shape=_shape("cbe"), broadcast_dims=_shape("e"))
    return [mtf.einsum([xs, ws]), broadcast]
  y, z = lower_and_evaluate(build, "rows:2;cols:4", "b:rows;c:cols", mode)
  np.testing.assert_array_equal(y, x @ w)
  np.testing.assert_array_equal(z, np.broadcast_to((x[:, :, None] * w[None]).sum(0).T[..., None],
                                                   (8, 4, 2)))


@pytest.mark.parametrize("mode", MODES)
def test_einsum_of_a_tensor_with_itself_has_both_gradient_contributions(mode):
  x = _random_input("ab", np.random.RandomState(3))
  assert_op_matches_tf(lambda x: mtf.einsum([x, x], output_shape=x.shape), lambda x: x * x, [x],
                       "rows:2;cols:2", "a:rows;b:cols", mode)


def _matmul_graph(x_names, w_names):
  def build(mesh):
    x = mtf.zeros(mesh, _shape(x_names))
    w = mtf.zeros(mesh, _shape(w_names))
    return [mtf.einsum([x, w])]
  return build


def test_contraction_over_a_split_dim_inserts_one_allreduce():
  counters = lowering_counters(_matmul_graph("ab", "bc"), "x:2;y:4", "b:x")
  # Output [a=2, c=8] is replicated: 16 elements on each of 8 processors.
  assert counters["allreduce/[0]/einsum_op"] == 16 * 8
  assert counters["einsum"] == 8 * 2 * 2 * 8  # union [a, b, c] laid out, b split in 2
  assert counters["einsum_unique"] == 2 * 4 * 8


def test_contraction_over_replicated_dims_needs_no_allreduce():
  counters = lowering_counters(_matmul_graph("ab", "bc"), "x:2;y:4", "a:x;c:y")
  assert not [k for k in counters if k.startswith("allreduce")]


def test_default_output_shape_keeps_dims_that_appear_once():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x, w = mtf.zeros(mesh, _shape("ab")), mtf.zeros(mesh, _shape("bc"))
  assert mtf.einsum([x, w]).shape == _shape("ac")
  assert mtf.einsum([x, x]).shape == _shape("")
  assert mtf.einsum([x]).shape == _shape("ab")
  assert mtf.einsum([x, w], reduced_dims=_shape("a").dims).shape == _shape("bc")
  assert mtf.einsum([x, w], output_shape=_shape("ca"), reduced_dims=_shape("b").dims).shape == _shape("ca")


def test_einsum_op_names_and_splittability():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x, w = mtf.zeros(mesh, _shape("ab")), mtf.zeros(mesh, _shape("bc"))
  with pytest.warns(mtf.BroadcastWarning, match=r"einsum 'einsum': output dimension\(s\) \['e'\]"):
    y = mtf.matmul(x, w, output_shape=_shape("ace"))
  op = y.operation
  assert isinstance(op, mtf.EinsumOperation)
  assert (op.name, y.name) == ("einsum", "einsum:0")
  assert op.splittable_dims == frozenset("abce") and op.unsplittable_dims == frozenset()
  assert mtf.einsum([x, w], name="mlp").operation.name == "mlp"


def test_einsum_equation_assigns_letters_in_order_of_first_appearance():
  assert einsum_ops._einsum_equation([_shape("ca"), _shape("ab")], _shape("cb")) == "ab,bc->ac"
  many = mtf.Shape([mtf.Dimension("d%d" % i, 1) for i in range(30)])
  equation = einsum_ops._einsum_equation([many], many)
  assert equation.split("->")[0].endswith("ABCD")


@pytest.fixture
def mesh():
  return mtf.Mesh(mtf.Graph(), "m")


def test_output_dim_with_a_different_size_than_the_input_dim_raises(mesh):
  x = mtf.zeros(mesh, _shape("ab"))
  with pytest.raises(ValueError, match=r"'einsum'.*output dimension 'a' \(size 5\).*use size 2"):
    mtf.einsum([x], output_shape=[mtf.Dimension("a", 5), mtf.Dimension("b", 4)])
  assert len(mesh.graph.operations) == 1  # the failed einsum did not join the graph



def test_same_named_input_dims_of_different_sizes_raise(mesh):
  x = mtf.zeros(mesh, _shape("ab"))
  w = mtf.zeros(mesh, [mtf.Dimension("b", 3), mtf.Dimension("c", 8)])
  with pytest.raises(ValueError, match=r"dimension 'b' has size 4 .* but size 3 .*rename_dimension"):
    mtf.einsum([x, w])


def test_reduced_dims_that_are_not_dimensions_raise(mesh):
  x, w = mtf.zeros(mesh, _shape("ab")), mtf.zeros(mesh, _shape("bc"))
  with pytest.raises(ValueError, match="reduced_dims must be a list of mtf.Dimension"):
    mtf.einsum([x, w], reduced_dims=["b"])


def test_inputs_of_different_dtypes_raise(mesh):
  x = mtf.zeros(mesh, _shape("ab"))
  w = mtf.zeros(mesh, _shape("bc"), dtype=tf.int32)
  with pytest.raises(ValueError, match="same dtype.*mtf.cast"):
    mtf.einsum([x, w])


def test_reduced_dims_contradicting_output_shape_raise(mesh):
  x, w = mtf.zeros(mesh, _shape("ab")), mtf.zeros(mesh, _shape("bc"))
  with pytest.raises(ValueError, match=r"contradicts output_shape.*missing from the output are"):
    mtf.einsum([x, w], output_shape=_shape("ac"), reduced_dims=_shape("a").dims)


def test_einsum_of_no_inputs_raises():
  with pytest.raises(ValueError, match="at least one input"):
    mtf.einsum([])


def test_einsum_of_a_non_tensor_raises_type_error(mesh):
  with pytest.raises(TypeError, match="inputs must be mtf Tensors"):
    mtf.einsum([mtf.zeros(mesh, _shape("ab")), 2.0])
