"""Control ops: stop_gradient, depend, Print, scalar_summary and while_loop, under any mesh/layout."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import (
    MAX_EXAMPLES, MODES, assert_allclose, assert_op_matches_tf, cpu_devices, lower_and_evaluate,
    mesh_and_layout, session_config)

SIZES = {"a": 4, "b": 8}
SHAPE = "a:4;b:8"


def _x(seed=0):
  return np.random.RandomState(seed).uniform(-1, 1, size=(4, 8)).astype(np.float32)


@st.composite
def layout_and_mode(draw, dims=None):
  mesh_shape, layout = draw(mesh_and_layout(dims or SIZES))
  return mesh_shape, layout, draw(st.sampled_from(MODES))


def _lower(build_fn, mesh_shape="all:2", layout="", impl_class=None):
  """Builds and lowers in the current (graph-mode) TF graph; returns (graph, lowering, build outputs)."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  outputs = build_fn(mesh)
  mesh_shape = mtf.convert_to_shape(mesh_shape)
  impl_class = impl_class or mtf.placement_mesh_impl.PlacementMeshImpl
  impl = impl_class(mesh_shape, layout, cpu_devices(mesh_shape.size))
  return graph, mtf.Lowering(graph, {mesh: impl}), outputs


# ---- stop_gradient ----

@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(layout_and_mode())
def test_stop_gradient_is_identity_blocking_gradient_under_any_layout(case):
  mesh_shape, layout, mode = case
  assert_op_matches_tf(lambda x: x * mtf.stop_gradient(x), lambda x: x * tf.stop_gradient(x),
                       [(_x(), SHAPE)], mesh_shape, layout, mode)


def test_stop_gradient_passes_pending_allreduce_through_and_has_no_gradient():
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(_x()), SHAPE)
    s = mtf.reduce_sum(x, reduced_dim=mtf.Dimension("b", 8))
    y = mtf.stop_gradient(s)
    assert y.operation.name == "stop_gradient" and not y.operation.has_gradient
    assert y.operation.splittable_dims == {"a"} and not y.operation.unsplittable_dims
    assert mtf.gradients([y], [x]) == [None]
    return [y]
  with tf.Graph().as_default():
    _, lowering, (y,) = _lower(build, "all:2", "b:all")
    assert isinstance(lowering.tensors[y], mtf.LazyAllreduceSum)
  assert_allclose(lower_and_evaluate(build, "all:2", "b:all")[0], _x().sum(axis=1))


# ---- depend ----

def test_depend_runs_dependencies_before_its_output_in_graph_mode():
  def build(mesh):
    v = mtf.get_variable(mesh, "v", "a:4", initializer=tf.zeros_initializer())
    assign = mtf.assign(v, mtf.constant(mesh, 5.0, "a:4"))
    x = mtf.constant(mesh, 1.0, "a:4")
    return v, mtf.depend(x, [assign]), x
  with tf.Graph().as_default():
    _, lowering, (v, y, x) = _lower(build, "all:2", "a:all")
    tf_v, tf_y, tf_x = (lowering.export_to_tf_tensor(t) for t in (v, y, x))
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      sess.run(tf_x)
      assert_allclose(sess.run(tf_v), np.zeros(4))  # x alone does not assign
      assert_allclose(sess.run(tf_y), np.ones(4))
      assert_allclose(sess.run(tf_v), np.full(4, 5.0))  # computing y ran the assignment


@pytest.mark.parametrize("mode", MODES)
def test_depend_on_tensors_and_ops_is_identity_with_identity_gradient(mode):
  def fn(x):
    sq = x * x
    return mtf.depend(sq, [x, mtf.reduce_sum(x), x.operation])
  assert_op_matches_tf(fn, lambda x: x * x, [(_x(), SHAPE)], "rows:2;cols:2", "a:rows;b:cols", mode)


def test_depend_default_name_and_splittability():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.zeros(mesh, SHAPE)
  op = mtf.Depend(x, [x])
  assert op.name == "depend" and op.dependencies == [x]
  assert op.splittable_dims == {"a", "b"} and not op.unsplittable_dims


def test_depend_on_non_mtf_object_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.zeros(mesh, SHAPE)
  with pytest.raises(ValueError, match="depend.*must be mtf Operations or mtf Tensors.*'oops'"):
    mtf.depend(x, ["oops"])


class _NoControlDependenciesImpl(mtf.placement_mesh_impl.PlacementMeshImpl):
  @property
  def supports_control_dependencies(self):
    return False


def test_depend_on_backend_without_control_dependencies_raises_at_lowering():
  def build(mesh):
    x = mtf.zeros(mesh, SHAPE)
    return [mtf.depend(x, [x])]
  with tf.Graph().as_default(), pytest.raises(ValueError, match="depend.*does not support control"):
    _lower(build, impl_class=_NoControlDependenciesImpl)


# ---- Print ----

def test_print_is_identity_and_prints_message_and_data_in_graph_mode(capfd):
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(_x()), SHAPE)
    y = mtf.Print(x, [mtf.reduce_sum(x)], "my_message")
    assert y.operation.name == "Print" and y.operation.splittable_dims == {"a", "b"}
    return [y]
  assert_allclose(lower_and_evaluate(build, "all:4", "b:all")[0], _x())
  assert "my_message [Tensor[reduce" in capfd.readouterr().err


@pytest.mark.parametrize("mode", MODES)
def test_print_gradient_is_identity(mode):
  assert_op_matches_tf(lambda x: mtf.Print(x * x, [x], "msg"), lambda x: x * x, [(_x(), SHAPE)],
                       "x:2;y:2;z:2", "a:x;b:z", mode)


# ---- scalar_summary ----

def _build_summary(mesh):
  x = mtf.import_tf_tensor(mesh, tf.constant(_x()), SHAPE)
  with tf.variable_scope("outer"):
    return [mtf.scalar_summary("my_loss", mtf.reduce_sum(x))]


def test_scalar_summary_records_name_and_value_in_graph_mode():
  with tf.Graph().as_default():
    _, lowering, (op,) = _lower(_build_summary, "rows:2;cols:2", "a:rows;b:cols")
    assert isinstance(op, mtf.ScalarSummaryOperation) and op.name == "outer/my_loss"
    summaries = tf.get_collection(mtf.utils.SCALAR_SUMMARIES_COLLECTION_KEY)
    assert [name for name, _ in summaries] == ["outer/my_loss"]
    with tf.Session(config=session_config()) as sess:
      value, identity = sess.run([summaries[0][1], lowering.export_to_tf_tensor(op.outputs[0])])
  assert_allclose(value, _x().sum())
  assert_allclose(identity, _x().sum())


def test_scalar_summary_records_name_and_value_in_eager_mode():
  mtf.utils.remove_summaries()
  try:
    _lower(_build_summary, "x:2;y:2;z:2", "a:x;b:y")
    summaries = tf.get_collection(mtf.utils.SCALAR_SUMMARIES_COLLECTION_KEY)
    assert [name for name, _ in summaries] == ["outer/my_loss"]
    assert_allclose(summaries[0][1].numpy(), _x().sum())
  finally:
    mtf.utils.remove_summaries()


def test_scalar_summary_of_non_scalar_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  with pytest.raises(ValueError, match="scalar_summary 'bad'.*Shape\\[a=4, b=8\\].*needs a scalar"):
    mtf.scalar_summary("bad", mtf.zeros(mesh, SHAPE))


def test_scalar_summary_gradient_is_identity():
  assert_op_matches_tf(lambda x: x * mtf.scalar_summary("s", mtf.reduce_sum(x * x)).outputs[0],
                       lambda x: x * tf.reduce_sum(x * x), [(_x(), SHAPE)], "all:2", "a:all")


# ---- while_loop ----

def _loop_with_accumulators(x, num_iterations):
  """x doubles each iteration; accumulates sum(x) over b (a pending allreduce if b is split) and x."""
  b = x.shape.get_dim_by_name("b")

  def cond_fn(i, x):
    return mtf.less(i, num_iterations)

  def body_fn(i, x):
    return [i + 1, x * 2.0, mtf.reduce_sum(x, reduced_dim=b), x]
  i = mtf.constant(x.mesh, 0, dtype=tf.int32)
  return mtf.while_loop(cond_fn, body_fn, [i, x], has_accumulators=True)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(layout_and_mode(), st.integers(0, 3))
def test_while_loop_with_accumulators_matches_numpy_under_any_layout(case, num_iterations):
  mesh_shape, layout, mode = case

  def build(mesh):
    return _loop_with_accumulators(mtf.import_tf_tensor(mesh, tf.constant(_x()), SHAPE), num_iterations)
  i, x, row_sums, x_sum = lower_and_evaluate(build, mesh_shape, layout, mode)
  factors = 2.0 ** np.arange(num_iterations)
  assert i == num_iterations
  assert_allclose(x, _x() * 2.0 ** num_iterations)
  assert_allclose(row_sums, _x().sum(axis=1) * factors.sum())
  assert_allclose(x_sum, _x() * factors.sum())


def test_while_loop_defers_accumulator_allreduce_until_after_the_loop():
  def build(mesh):
    return _loop_with_accumulators(mtf.import_tf_tensor(mesh, tf.constant(_x()), SHAPE), 3)
  with tf.Graph().as_default():
    _, lowering, outputs = _lower(build, "all:4", "b:all")
    assert isinstance(lowering.tensors[outputs[2]], mtf.LazyAllreduceSum)
    assert not isinstance(lowering.tensors[outputs[3]], mtf.LazyAllreduceSum)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nested", [False, True])
def test_while_loop_reads_outer_pending_allreduce_also_used_after_the_loop(mode, nested):
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(_x()), SHAPE)
    s = mtf.reduce_sum(x, reduced_dim=mtf.Dimension("b", 8))  # lazy: b is split

    def body_fn(y):
      if nested:  # s is read only by the inner loop, which runs once
        j = mtf.constant(mesh, 0, dtype=tf.int32)
        return mtf.while_loop(lambda j, z: mtf.less(j, 1), lambda j, z: [j + 1, z + s + 1.0], [j, y])[1:]
      return [y + s + 1.0]
    (y,) = mtf.while_loop(lambda y: mtf.less(mtf.reduce_sum(y), 100.0), body_fn, [mtf.zeros(mesh, "a:4")])
    return [y, s + 1.0]
  y, after = lower_and_evaluate(build, "rows:2;cols:4", "a:rows;b:cols", mode)
  s = _x().sum(axis=1)
  expected = np.zeros(4)
  while expected.sum() < 100.0:
    expected = expected + s + 1.0
  assert_allclose(y, expected)
  assert_allclose(after, s + 1.0)


@pytest.mark.parametrize("mode", MODES)
def test_while_loop_with_num_loop_vars_matches_plain_loop(mode):
  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(_x()), SHAPE)
    z = mtf.zeros(mesh, SHAPE)
    i = mtf.constant(mesh, 0, dtype=tf.int32)

    def body_fn(i, x, z):
      return [i + 1, x * 2.0, z + x, mtf.reduce_sum(x)]
    return mtf.while_loop(lambda i, x, z: mtf.less(i, 3), body_fn, [i, x, z], num_loop_vars=2,
                          has_accumulators=True)
  i, x, total = lower_and_evaluate(build, "all:2", "a:all", mode)
  assert i == 3
  assert_allclose(x, _x() * 8.0)
  assert_allclose(total, _x().sum() * 7.0)


@pytest.mark.parametrize("mode", MODES)
def test_nested_while_loops(mode):
  def build(mesh):
    def inner(x):
      j = mtf.constant(mesh, 0, dtype=tf.int32)
      return mtf.while_loop(lambda j, y: mtf.less(j, 2), lambda j, y: [j + 1, y + 1.0], [j, x])[1]
    i = mtf.constant(mesh, 0, dtype=tf.int32)
    return mtf.while_loop(lambda i, x: mtf.less(i, 3), lambda i, x: [i + 1, inner(x)],
                          [i, mtf.zeros(mesh, SHAPE)])
  i, x = lower_and_evaluate(build, "x:2;y:2;z:2", "a:x;b:y", mode)
  assert i == 3
  assert_allclose(x, np.full((4, 8), 6.0))


def test_while_loop_keeps_body_ops_and_hoists_variables_into_the_graph():
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "m")
  with tf.Graph().as_default():
    x = mtf.zeros(mesh, SHAPE)

    def body_fn(x):
      w = mtf.get_variable(mesh, "w", SHAPE, initializer=tf.ones_initializer())
      return [x + w]
    (y,) = mtf.while_loop(lambda x: mtf.less(mtf.reduce_sum(x), 10.0), body_fn, [x])
  loop = y.operation
  assert isinstance(loop, mtf.WhileLoopOperation) and loop.name == "while_loop"
  assert [type(op).__name__ for op in graph.operations] == ["Constant", "Variable", "WhileLoopOperation"]
  assert graph.trainable_variables[0].name == "w"
  assert loop.splittable_dims == {"a", "b"} and not loop.unsplittable_dims
  assert loop.outputs[0].name == "while_loop:0"


@pytest.mark.parametrize("mode", MODES)
def test_while_loop_with_variable_created_in_body(mode):
  def build(mesh):
    def body_fn(i, x):
      w = mtf.get_variable(mesh, "w", SHAPE, initializer=tf.ones_initializer())
      return [i + 1, x + w]
    i = mtf.constant(mesh, 0, dtype=tf.int32)
    return mtf.while_loop(lambda i, x: mtf.less(i, 4), body_fn, [i, mtf.zeros(mesh, SHAPE)])
  _, x = lower_and_evaluate(build, "rows:2;cols:2", "b:cols", mode)
  assert_allclose(x, np.full((4, 8), 4.0))


def _loop_error(body_fn, cond_fn=None, has_accumulators=False, **kwargs):
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.zeros(mesh, SHAPE)
  return mtf.while_loop(cond_fn or (lambda x: mtf.less(mtf.reduce_sum(x), 1.0)), body_fn, [x],
                        has_accumulators=has_accumulators, **kwargs)


def test_while_loop_shape_change_raises_naming_the_loop_variable():
  with pytest.raises(ValueError, match="loop variable 0 \\('constant:0'\\) enters as Shape\\[a=4, b=8\\].*"
                                       "loop-invariant"):
    _loop_error(lambda x: [mtf.reduce_sum(x, reduced_dim=mtf.Dimension("b", 8))])


def test_while_loop_dtype_change_raises():
  with pytest.raises(ValueError, match="loop variable 0.*float32.*loop-invariant"):
    _loop_error(lambda x: [mtf.cast(x, tf.int32)])


def test_while_loop_body_output_count_mismatch_raises():
  with pytest.raises(ValueError, match="returned 2 tensors for 1 loop variables"):
    _loop_error(lambda x: [x, x])
  with pytest.raises(ValueError, match="returned 0 tensors for 1 loop variables"):
    _loop_error(lambda x: [], has_accumulators=True)


def test_while_loop_cond_must_be_scalar_bool():
  with pytest.raises(ValueError, match="cond_fn must return a scalar bool"):
    _loop_error(lambda x: [x], cond_fn=lambda x: mtf.less(x, 1.0))
  with pytest.raises(ValueError, match="cond_fn must return a scalar bool"):
    _loop_error(lambda x: [x], cond_fn=lambda x: mtf.reduce_sum(x))


def test_while_loop_back_prop_and_bad_num_loop_vars_raise():
  with pytest.raises(ValueError, match="back_prop"):
    _loop_error(lambda x: [x], back_prop=True)
  with pytest.raises(ValueError, match="num_loop_vars=2 must be in \\[1, 1\\]"):
    _loop_error(lambda x: [x], num_loop_vars=2)


def test_while_loop_has_no_gradient():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.zeros(mesh, SHAPE)
  (y,) = mtf.while_loop(lambda x: mtf.less(mtf.reduce_sum(x), 1.0), lambda x: [x + 1.0], [x])
  with pytest.raises(NotImplementedError, match="while_loop.*has no gradient"):
    mtf.gradients([mtf.reduce_sum(y)], [x])
