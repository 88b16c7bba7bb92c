"""reshape (incl. layout changes via allsplit/alltoall/allconcat), transpose, renames and anonymize."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from mesh_tensorflow._lowering import plan
from mesh_tensorflow._lowering.lazy import LazyAllreduceSum
from tests.harness import (
    MAX_EXAMPLES, MODES, assert_op_matches_tf, cpu_devices, lower_and_evaluate, lowering_counters,
    mesh_and_layout)
from tests.lowering.test_plan import reshape_cases


def _input(shape_string, seed=0):
  shape = mtf.convert_to_shape(shape_string)
  return np.random.RandomState(seed).uniform(-1, 1, shape.to_integer_list).astype(np.float32), shape_string


def _supported(old, new, mesh, rules):
  try:
    plan.plan_reshape(old, new, mesh, rules)
    plan.plan_reshape(new, old, mesh, rules)  # the gradient reshapes back
    return True
  except NotImplementedError:
    return False


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(reshape_cases(), st.sampled_from(MODES))
def test_reshape_matches_tf_and_its_gradient_under_any_layout(case, mode):
  old, new, mesh, rules = case
  assume(_supported(*case))
  assert_op_matches_tf(lambda x: mtf.reshape(x, new), lambda x: tf.reshape(x, new.to_integer_list),
                       [_input(old)], mesh, rules, mode)


# (old shape, new shape, layout, the collective the layout change needs) on mesh x:2;y:4.
LAYOUT_CHANGES = [
    ("a:4;b:8", "a2:4;b:8", "a:x", "allconcat/0"),        # split -> replicated
    ("a2:4;b:8", "a:4;b:8", "a:x", "allsplit/0"),         # replicated -> split
    ("a:4;b:8", "c:4;a:8", "a:x", "alltoall/0"),          # split moves to another dim
    ("a:4;b:8", "b:4;a:8", "a:x;b:y", "alltoall/1"),      # two mesh axes swap dims
    ("a:4;b:8", "c:32", "a:x;c:y", "allconcat/0"),        # flatten and move to the other mesh axis
    ("c:32", "a:2;d:16", "c:x;a:x;d:y", "allsplit/1"),    # split a flat dim, add a nested split
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("old,new,layout,collective", LAYOUT_CHANGES)
def test_layout_changing_reshape_uses_the_planned_collective(old, new, layout, collective, mode):
  assert_op_matches_tf(lambda x: mtf.reshape(x, new),
                       lambda x: tf.reshape(x, mtf.convert_to_shape(new).to_integer_list),
                       [_input(old)], "x:2;y:4", layout, mode)
  counters = lowering_counters(
      lambda mesh: [mtf.reshape(mtf.ones(mesh, mtf.convert_to_shape(old)), new)], "x:2;y:4", layout)
  assert collective + "/reshape_op" in counters, counters


@pytest.mark.parametrize("mode", MODES)
def test_rename_dimension_moves_a_dim_between_split_and_replicated(mode):
  x, _ = _input("a:4;b:8")

  def build(mesh):
    t = mtf.import_tf_tensor(mesh, tf.constant(x), "a:4;b:8")
    replicated = mtf.rename_dimension(t, "a", "r")
    return [replicated, mtf.rename_dimension(replicated, "r", "a")]
  (replicated, split) = lower_and_evaluate(build, "x:4", "a:x", mode, per_processor=True)
  for r in replicated:
    np.testing.assert_array_equal(r, x)
  for k, s in enumerate(split):
    np.testing.assert_array_equal(s, x[k:k + 1])


def test_reshape_of_a_pending_allreduce_stays_lazy():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    total = mtf.reduce_sum(mtf.ones(mesh, "a:4;b:8"), output_shape="a:4")
    flat = mtf.reshape(total, "c:2;d:2")
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("x:2", "b:x", cpu_devices(2))
    lowering = mtf.Lowering(graph, {mesh: impl})
    assert isinstance(lowering.tensors[flat], LazyAllreduceSum)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(st.permutations("abc"), mesh_and_layout({"a": 2, "b": 4, "c": 8}), st.sampled_from(MODES))
def test_transpose_matches_tf_under_any_layout(order, mesh_layout, mode):
  sizes = {"a": 2, "b": 4, "c": 8}
  new = ";".join(f"{n}:{sizes[n]}" for n in order)
  perm = ["abc".index(n) for n in order]
  assert_op_matches_tf(lambda x: mtf.transpose(x, new), lambda x: tf.transpose(x, perm),
                       [_input("a:2;b:4;c:8")], *mesh_layout, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_replace_dimensions_on_a_tensor_reshapes_it(mode):
  x, _ = _input("a:2;b:4;c:8")

  def build(mesh):
    t = mtf.import_tf_tensor(mesh, tf.constant(x), "a:2;b:4;c:8")
    return [mtf.replace_dimensions(t, t.shape.dims[1:], mtf.Dimension("bc", 32))]
  np.testing.assert_array_equal(lower_and_evaluate(build, "x:2;y:4", "a:x;bc:y", mode)[0], x.reshape(2, 32))


@pytest.mark.parametrize("mode", MODES)
def test_anonymize_replicates_the_tensor(mode):
  x, _ = _input("a:4;b:8")

  def build(mesh):
    t = mtf.import_tf_tensor(mesh, tf.constant(x), "a:4;b:8")
    anon = mtf.anonymize(t)
    assert anon.shape == mtf.Shape([mtf.Dimension("_anonymous_0", 4), mtf.Dimension("_anonymous_1", 8)])
    return [anon]
  for s in lower_and_evaluate(build, "x:2;y:4", "a:x;b:y", mode, per_processor=True)[0]:
    np.testing.assert_array_equal(s, x)


@pytest.fixture
def x():
  return mtf.zeros(mtf.Mesh(mtf.Graph(), "m"), "a:2;b:4;c:8")


def test_reshape_and_transpose_op_names_and_splittability(x):
  y = mtf.reshape(x, "d:8;c:8")
  assert isinstance(y.operation, mtf.ReshapeOperation)
  assert (y.operation.name, y.name) == ("reshape", "reshape:0")
  assert y.operation.splittable_dims == frozenset("abcd") and y.operation.unsplittable_dims == frozenset()
  t = mtf.transpose(x, "c:8;a:2;b:4")
  assert isinstance(t.operation, mtf.EinsumOperation) and t.operation.name == "transpose"


def test_replace_dimensions_on_a_shape():
  shape = mtf.convert_to_shape("a:2;b:4;c:8")
  b, c = shape.dims[1:]
  assert mtf.replace_dimensions(shape, [b, c], mtf.Dimension("bc", 32)) == mtf.convert_to_shape("a:2;bc:32")
  assert mtf.replace_dimensions(shape, b, [mtf.Dimension("b1", 2), mtf.Dimension("b2", 2)]) == (
      mtf.convert_to_shape("a:2;b1:2;b2:2;c:8"))


def test_reshape_to_a_different_size_raises(x):
  with pytest.raises(ValueError, match=r"reshape 'reshape'.*\(size 64\) to .*\(size 63\)"):
    mtf.reshape(x, "d:63")
  assert len(x.graph.operations) == 1  # the failed reshape did not join the graph


def test_unsupported_layout_change_raises_not_implemented_at_lowering():
  def build(mesh):
    return [mtf.reshape(mtf.ones(mesh, "a:4;b:6"), "a:4;b1:2;b2:3")]
  with pytest.raises(NotImplementedError, match="Reshape in two steps"):
    lowering_counters(build, "x:3", "b2:x")


def test_transpose_to_different_dims_raises(x):
  with pytest.raises(ValueError, match="must have the same dimensions"):
    mtf.transpose(x, "a:2;b:4;d:8")


def test_rename_of_a_missing_dimension_raises(x):
  with pytest.raises(ValueError, match="No dimension named 'z'"):
    mtf.rename_dimension(x, "z", "y")


@pytest.mark.parametrize("tensor_or_shape,old,new,match", [
    ("a:2;b:4", mtf.Dimension("a", 2), mtf.Dimension("z", 2), "must be an mtf.Tensor or mtf.Shape"),
    (mtf.convert_to_shape("a:2;b:4"), [], mtf.Dimension("z", 2), "old_dim_or_dims must be a Dimension"),
    (mtf.convert_to_shape("a:2;b:4"), mtf.Dimension("a", 2), [], "new_dim_or_dims must be a Dimension"),
    (mtf.convert_to_shape("a:2;b:4"), "a", mtf.Dimension("z", 2), "old_dim_or_dims must be a Dimension"),
    (mtf.convert_to_shape("a:2;b:4;c:8"), [mtf.Dimension("a", 2), mtf.Dimension("c", 8)],
     mtf.Dimension("z", 16), "consecutively and in order"),
    (mtf.convert_to_shape("a:2;b:4"), [mtf.Dimension("b", 4), mtf.Dimension("a", 2)],
     mtf.Dimension("z", 8), "consecutively and in order"),
    (mtf.convert_to_shape("a:2;b:4"), mtf.Dimension("q", 2), mtf.Dimension("z", 2), "consecutively"),
])
def test_replace_dimensions_bad_arguments_raise(tensor_or_shape, old, new, match):
  with pytest.raises(ValueError, match=match):
    mtf.replace_dimensions(tensor_or_shape, old, new)
