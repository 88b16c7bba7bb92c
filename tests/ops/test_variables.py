"""Variables: creation and reuse, masters vs per-processor slices, assignment and re-reading."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import MODES, cpu_devices, lower_and_evaluate, session_config

INIT = np.arange(32, dtype=np.float32).reshape(4, 8)
LAYOUTS = [("all:1", ""), ("all:8", "c:all"), ("rows:2;cols:4", "r:rows;c:cols"), ("x:2;y:2;z:2", "r:x;c:z")]


def _var(mesh, name="w", dtype=tf.float32):
  return mtf.get_variable(mesh, name, "r:4;c:8", dtype=dtype, initializer=tf.constant_initializer(INIT))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_variable_value_equals_initializer_under_any_layout(mode, mesh_shape, layout):
  got, = lower_and_evaluate(lambda mesh: [_var(mesh)], mesh_shape, layout, mode)
  np.testing.assert_array_equal(got, INIT)


def test_get_variable_reuses_by_scoped_name_and_builds_dtypes():
  with tf.Graph().as_default():
    mesh = mtf.Mesh(mtf.Graph(), "m")
    with tf.variable_scope("block"):
      a = _var(mesh)
      b = _var(mesh)
    assert a is b and a.operation.name == "block/w"
    mixed = mtf.get_variable(mesh, "mixed", "r:4", dtype=tf.float32, slice_dtype=tf.bfloat16,
                             activation_dtype=tf.bfloat16)
    var = mixed.operation
    assert (var.master_dtype, var.slice_dtype, var.activation_dtype) == (
        tf.float32, tf.bfloat16, tf.bfloat16)
    assert mixed.dtype == tf.bfloat16
    explicit = mtf.get_variable(mesh, "explicit", "r:4", dtype=mtf.VariableDType(tf.float32))
    assert explicit.operation.dtype.slice_dtype == tf.float32
    with pytest.raises(ValueError, match="dtype"):
      mtf.get_variable(mesh, "bad", "r:4", dtype="float32")
    with pytest.raises(ValueError, match="VariableDType"):
      mtf.Variable(mesh, "raw", mtf.convert_to_shape("r:4"), tf.float32, None, True)


def test_masters_carry_scoped_names_and_slices_are_not_checkpointed():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    with tf.variable_scope("encoder"):
      _var(mesh)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", "c:all", cpu_devices(4))
    mtf.Lowering(graph, {mesh: impl})
    assert [v.op.name for v in tf.global_variables()] == ["encoder/w"]


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_assignment_is_visible_to_read_variable_and_reaches_the_master_eager(mesh_shape, layout):
  holder = {}

  def build(mesh):
    w = _var(mesh)
    mtf.assign_add(w, mtf.ones(mesh, w.shape))
    mtf.assign_sub(w, mtf.ones(mesh, w.shape) * 3.0)
    holder["var"] = w.operation
    return [w, mtf.read_variable(w.operation)]

  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "m")
  outputs = build(mesh)
  impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout,
                                                   cpu_devices(mtf.convert_to_shape(mesh_shape).size))
  lowering = mtf.Lowering(graph, {mesh: impl}, autostack=False)
  before, after = [lowering.export_to_tf_tensor(x).numpy() for x in outputs]
  np.testing.assert_array_equal(before, INIT)
  np.testing.assert_array_equal(after, INIT - 2)
  lowering.copy_slices_to_masters()
  np.testing.assert_array_equal(holder["var"].get_master().numpy(), INIT - 2)


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS)
def test_a_step_that_reads_and_updates_sees_the_old_value_graph(mesh_shape, layout):
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    w = _var(mesh)
    total = mtf.reduce_sum(w * 2.0)
    update = mtf.assign(w, w + 1.0)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(
        mesh_shape, layout, cpu_devices(mtf.convert_to_shape(mesh_shape).size))
    lowering = mtf.Lowering(graph, {mesh: impl})
    tf_total = lowering.export_to_tf_tensor(total)
    tf_update = lowering.lowered_operation(update)
    copy_back = lowering.copy_slices_to_masters()
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      for step in range(3):
        got, _ = sess.run([tf_total, tf_update])
        assert got == pytest.approx(2 * (INIT + step).sum())
      sess.run(copy_back)
      np.testing.assert_array_equal(sess.run(w.operation.get_master()), INIT + 3)


@pytest.mark.parametrize("mesh_shape,layout", LAYOUTS[1:])
def test_the_copy_to_masters_is_built_at_its_first_request_in_the_lowerings_graph(mesh_shape, layout):
  """Only saving needs it, so lowering leaves it out. Asked for from another default graph, it is
  built in the lowering's graph; asked again under control dependencies, it is the same op."""
  with tf.Graph().as_default() as tf_graph:
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    w = _var(mesh)
    update = mtf.assign(w, w + 1.0)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(
        mesh_shape, layout, cpu_devices(mtf.convert_to_shape(mesh_shape).size))
    lowering = mtf.Lowering(graph, {mesh: impl})
    tf_update = lowering.lowered_operation(update)
    lowered_ops = set(tf_graph.get_operations())
    barrier = tf.no_op(name="barrier")
  with tf.Graph().as_default():
    copy_back = lowering.copy_slices_to_masters()
  assert copy_back.graph is tf_graph
  copy_ops = set(tf_graph.get_operations()) - lowered_ops - {barrier}
  assert copy_back in copy_ops and not any(barrier in op.control_inputs for op in copy_ops)
  with tf_graph.as_default(), tf.control_dependencies([barrier]):
    assert lowering.copy_slices_to_masters() is copy_back
  with tf.Session(graph=tf_graph, config=session_config()) as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(lowering.copy_masters_to_slices())
    sess.run(tf_update)
    sess.run(copy_back)
    np.testing.assert_array_equal(sess.run(w.operation.get_master()), INIT + 1)


def test_assign_validates_target_and_shape():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  w = _var(mesh)
  with pytest.raises(ValueError, match="shapes must be equal"):
    mtf.assign(w, mtf.ones(mesh, "r:4"))
  with pytest.raises(ValueError, match="not an mtf Variable"):
    mtf.assign(mtf.ones(mesh, "r:4;c:8") + mtf.ones(mesh, "r:4;c:8"), mtf.ones(mesh, "r:4;c:8"))
  cast = mtf.cast(w, tf.bfloat16)
  assert mtf.assign(cast, mtf.cast(mtf.ones(mesh, w.shape), tf.bfloat16)).variables == [w.operation]
