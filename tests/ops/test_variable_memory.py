"""Variable memory: with master_as_slice, no device holds a second copy of an unsplit variable;
with share_replicas, replicas in one process hold one copy in all."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import cpu_devices, session_config

INIT = np.arange(32, dtype=np.float32).reshape(4, 8)


def _lowered(mesh_shape, layout, master_as_slice=True, share_replicas=False, **var_kwargs):
  """(lowering, variable, update, total, tf graph): w = INIT, total = sum(2 w), update w += 1."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "m")
  w = mtf.get_variable(mesh, "w", "r:4;c:8", initializer=tf.constant_initializer(INIT), **var_kwargs)
  total = mtf.reduce_sum(w * 2.0)
  update = mtf.assign(w, w + 1.0)
  impl = mtf.placement_mesh_impl.PlacementMeshImpl(
      mesh_shape, layout, cpu_devices(mtf.convert_to_shape(mesh_shape).size), master_as_slice,
      share_replicas=share_replicas)
  lowering = mtf.Lowering(graph, {mesh: impl})
  return lowering, w.operation, lowering.lowered_operation(update), lowering.export_to_tf_tensor(total)


def _variables_by_device(graph) -> dict:
  ret = {}
  for op in graph.get_operations():
    if op.type == "VarHandleOp":
      ret.setdefault(tf.DeviceSpec.from_string(op.device).to_string(), []).append(op.name)
  return ret


def test_data_parallel_master_is_the_first_processors_slice():
  with tf.Graph().as_default() as g:
    lowering, var, _, _ = _lowered("all:4", "")
    by_device = _variables_by_device(g)
    assert by_device["/device:CPU:0"] == ["w"]  # the master, and no "w_slice_0" beside it
    for k in range(1, 4):
      assert by_device[f"/device:CPU:{k}"] == [f"w_slice_{k}"]
    assert not lowering.variables[var].slice_is_master  # several processors still have slices


def test_shared_replicas_of_an_unsplit_variable_are_the_master_itself():
  with tf.Graph().as_default() as g:
    _lowered("all:4", "", share_replicas=True)
    assert _variables_by_device(g) == {"/device:CPU:0": ["w"]}
  with tf.Graph().as_default() as g:  # without master_as_slice: one slice beside the master
    _lowered("all:4", "", master_as_slice=False, share_replicas=True)
    assert _variables_by_device(g) == {"/device:CPU:0": ["w", "w_slice_0"]}


@pytest.mark.parametrize("share_replicas", [False, True])
@pytest.mark.parametrize("mesh_shape,layout", [("all:4", ""), ("a:2;b:2", "c:b")])
def test_a_step_reads_old_values_and_masters_receive_updates(mesh_shape, layout, share_replicas):
  with tf.Graph().as_default():
    lowering, var, update, total = _lowered(mesh_shape, layout, share_replicas=share_replicas)
    copy_back = lowering.copy_slices_to_masters()
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      for step in range(3):
        got, _ = sess.run([total, update])
        assert got == pytest.approx(2 * (INIT + step).sum())
      sess.run(copy_back)
      np.testing.assert_array_equal(sess.run(var.get_master()), INIT + 3)


@pytest.mark.parametrize("layout,master_as_slice", [("c:all", True), ("", False)])
def test_split_variable_or_default_keeps_a_master_and_a_slice_per_processor(layout, master_as_slice):
  with tf.Graph().as_default() as g:
    _lowered("all:4", layout, master_as_slice)
    assert _variables_by_device(g)["/device:CPU:0"] == ["w", "w_slice_0"]


@pytest.mark.parametrize("var_kwargs", [{"use_resource": False}, {"slice_dtype": tf.bfloat16}])
def test_master_is_not_a_slice_when_ref_variable_or_other_slice_dtype(var_kwargs):
  with tf.Graph().as_default() as g:
    _lowered("all:2", "", **var_kwargs)
    names = [op.name for op in g.get_operations() if op.type in ("VarHandleOp", "VariableV2")]
    assert sorted(names) == ["w", "w_slice_0", "w_slice_1"]


def test_masters_are_resource_variables_even_without_v2_behaviour():
  with tf.Graph().as_default():
    mesh = mtf.Mesh(mtf.Graph(), "m")
    w = mtf.get_variable(mesh, "w", "r:4", initializer=tf.zeros_initializer())
    assert w.operation.get_master().op.type == "VarHandleOp"


def test_eager_updates_reach_every_processor_and_the_master_when_it_is_a_slice():
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "m")
  w = mtf.get_variable(mesh, "w", "r:4;c:8", initializer=tf.constant_initializer(INIT))
  mtf.assign_add(w, mtf.ones(mesh, w.shape))
  after = mtf.read_variable(w.operation)
  impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", "", cpu_devices(4), master_as_slice=True)
  lowering = mtf.Lowering(graph, {mesh: impl})
  for value in lowering.tensors[after].to_laid_out_tensor().tensor_list:
    np.testing.assert_array_equal(value.numpy(), INIT + 1)
  lowering.copy_slices_to_masters()
  np.testing.assert_array_equal(w.operation.get_master().numpy(), INIT + 1)
