"""mtf.utils: balanced variable placement, host-call summaries, topology rank, rewrites helper."""

from __future__ import annotations

import glob

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from tensorflow.python.tpu import topology as tpu_topology

import mesh_tensorflow as mtf
from mesh_tensorflow import utils as mtf_utils

SUMMARIES = mtf_utils.SCALAR_SUMMARIES_COLLECTION_KEY


# ---- BalancedVariablePlacer ----

@pytest.mark.parametrize("use_resource", [False, True])
def test_balanced_placer_puts_each_variable_on_the_least_used_device(use_resource):
  device_list = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
  with tf.Graph().as_default() as g, tf.variable_scope(tf.get_variable_scope(),
                                                        use_resource=use_resource):
    placer = mtf_utils.BalancedVariablePlacer(device_list, [100, 0, 0, 0])
    mesh = mtf.Mesh(mtf.Graph(), "my_mesh", placer)
    shape = [mtf.Dimension("hidden", 10), mtf.Dimension("output_feature", 10)]
    for i in range(5):  # 400 bytes each: cpu:1, cpu:2, cpu:3, cpu:0 (100 < 400), cpu:1 (tie -> name)
      mtf.get_variable(mesh, "w%d" % i, shape, initializer=tf.zeros_initializer())
    for i in range(5):
      assert g.get_tensor_by_name("w%d:0" % i).device == "cpu:%d" % ((i + 1) % 4)


def test_balanced_placer_weighs_variables_by_bytes():
  with tf.Graph().as_default() as g:
    placer = mtf_utils.BalancedVariablePlacer(["cpu:0", "cpu:1"])
    mesh = mtf.Mesh(mtf.Graph(), "mesh", placer)
    big = mtf.get_variable(mesh, "big", "x:100", initializer=tf.zeros_initializer())
    small = [mtf.get_variable(mesh, "small%d" % i, "x:10", dtype=tf.bfloat16,
                              initializer=tf.zeros_initializer()) for i in range(3)]
    del big, small
    devices = [g.get_tensor_by_name(name + ":0").device
               for name in ["big", "small0", "small1", "small2"]]
  assert devices == ["cpu:0", "cpu:1", "cpu:1", "cpu:1"]  # 400 bytes vs 3 x 20


def test_balanced_placer_sends_non_variable_ops_to_the_last_chosen_device():
  with tf.Graph().as_default():
    placer = mtf_utils.BalancedVariablePlacer(["cpu:0", "cpu:1"], [8, 0])
    assert placer.device_function(var=tf.constant(1.0).op) == "cpu:0"  # before any variable: first
    with tf.device(placer.device_function):
      v = tf.get_variable("v", [2], use_resource=False)
      after = tf.constant(2.0)
    assert v.device == after.device == "cpu:1"


def test_balanced_placer_needs_one_usage_per_device():
  with pytest.raises(ValueError, match="one initial usage per device"):
    mtf_utils.BalancedVariablePlacer(["cpu:0", "cpu:1"], [1, 2, 3])


# ---- outside_all_rewrites ----

def test_outside_all_rewrites_clears_control_dependencies():
  with tf.Graph().as_default():
    a = tf.constant(1.0)
    with tf.control_dependencies([a]):
      inside = tf.constant(2.0)
      with mtf_utils.outside_all_rewrites():
        outside = tf.constant(3.0)
  assert inside.op.control_inputs == [a.op]
  assert outside.op.control_inputs == []


# ---- create_host_call / remove_summaries ----

def _read_scalars(model_dir) -> dict:
  ret = {}
  for path in glob.glob(model_dir + "/events.out.tfevents.*"):
    for event in tf.train.summary_iterator(path):
      for value in event.summary.value:
        assert value.metadata.plugin_data.plugin_name == "scalars"
        ret[(event.step, value.tag)] = float(tf.make_ndarray(value.tensor))
  return ret


def test_create_host_call_without_summaries_returns_none():
  with tf.Graph().as_default():
    assert mtf_utils.create_host_call("/nonexistent") is None


def test_create_host_call_writes_mean_scalars_at_the_global_step_in_graph_mode(tmp_path):
  model_dir = str(tmp_path)
  with tf.Graph().as_default():
    tf.add_to_collection(SUMMARIES, ("loss", tf.constant(2.5)))
    tf.add_to_collection(SUMMARIES, ("tokens", tf.constant(7, tf.int64)))
    tf.add_to_collection(SUMMARIES, ("lr", tf.constant(0.5, tf.bfloat16)))
    host_call_fn, args = mtf_utils.create_host_call(model_dir)
    assert [a.shape.as_list() for a in args] == [[1]] * 4
    assert [a.dtype for a in args] == [tf.int32, tf.float32, tf.int32, tf.float32]
    # The host receives the per-core [1] tensors concatenated; it writes their mean.
    per_core = [tf.concat([a, a + 1], 0) for a in args[1:]]
    summary_ops = host_call_fn(args[0], *per_core)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.assign(tf.train.get_global_step(), 5))
      sess.run(summary_ops)
  assert _read_scalars(model_dir) == {(5, "loss"): 3.0, (5, "tokens"): 7.5, (5, "lr"): 1.0}


def test_create_host_call_writes_scalars_in_eager_mode(tmp_path):
  model_dir = str(tmp_path)
  tf.get_default_graph().get_collection_ref(SUMMARIES)[:] = [("acc", tf.constant(0.25))]
  # Eager mode has one global step per process; earlier tests in this process may have moved it.
  tf.train.get_or_create_global_step().assign(3)
  try:
    host_call_fn, args = mtf_utils.create_host_call(model_dir)
    host_call_fn(*args)
  finally:
    mtf_utils.remove_summaries()
  assert _read_scalars(model_dir) == {(3, "acc"): 0.25}


def test_create_host_call_rejects_non_scalar_summaries():
  with tf.Graph().as_default():
    tf.add_to_collection(SUMMARIES, ("loss", tf.constant([1.0, 2.0])))
    with pytest.raises(ValueError, match="'loss' .* summaries must be scalars"):
      mtf_utils.create_host_call("/nonexistent")


def test_create_host_call_collects_lowered_mtf_scalar_summaries(tmp_path):
  model_dir = str(tmp_path)
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    x = mtf.import_tf_tensor(mesh, tf.constant([1.0, 2.0, 3.0, 6.0]), "b:4")
    mtf.scalar_summary("total", mtf.reduce_sum(x))
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "b:all", ["", ""])
    mtf.Lowering(graph, {mesh: impl})
    host_call_fn, args = mtf_utils.create_host_call(model_dir)
    summary_ops = host_call_fn(*args)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(summary_ops)
  assert _read_scalars(model_dir) == {(0, "total"): 12.0}


def test_remove_summaries_empties_the_collection():
  with tf.Graph().as_default():
    tf.add_to_collection(SUMMARIES, ("loss", tf.constant(1.0)))
    mtf_utils.remove_summaries()
    assert tf.get_collection(SUMMARIES) == []
    assert mtf_utils.create_host_call("/nonexistent") is None


# ---- topology_rank ----

def _topology():
  return tpu_topology.Topology(mesh_shape=[2, 2, 1, 2],
                               device_coordinates=np.array([[[0, 0, 0, 0], [0, 0, 0, 1]]]))


def test_topology_rank_of_a_topology_and_of_its_serialized_bytes():
  topology = _topology()
  assert mtf_utils.topology_rank(topology) == 4
  assert mtf_utils.topology_rank(topology.serialized()) == 4


def test_topology_rank_rejects_other_types():
  with pytest.raises(ValueError, match="got list"):
    mtf_utils.topology_rank([2, 2, 1, 2])
