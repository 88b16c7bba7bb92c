"""The garbage collector paused while an eager Lowering lowers its ops (_lowering/collector.py)."""

import gc

import numpy as np
import tensorflow as tf2
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._lowering import collector


def _lower_recording_the_collector(monkeypatch) -> tuple:
  """Lowers relu(x) * 2 with the cache off; returns (collector on in each op's lowering, value)."""
  seen = []
  lower_operation = mtf.Lowering.lower_operation

  def recording(self, op):
    seen.append(gc.isenabled())
    return lower_operation(self, op)
  monkeypatch.setattr(mtf.Lowering, "lower_operation", recording)
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  x = mtf.import_tf_tensor(mesh, tf.constant([[-1.0, 2.0], [3.0, -4.0]]), "a:2;b:2")
  y = mtf.relu(x) * 2.0
  impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "a:all", ["cpu:0", "cpu:0"])
  with mtf.lowering_cache(enabled=False):
    value = mtf.Lowering(graph, {mesh: impl}).export_to_tf_tensor(y)
  return seen, value


def test_an_eager_lowering_runs_its_ops_with_the_collector_paused_and_turns_it_back_on(monkeypatch):
  assert tf.executing_eagerly()
  seen, value = _lower_recording_the_collector(monkeypatch)
  assert seen and not any(seen)
  assert gc.isenabled()
  np.testing.assert_array_equal(value.numpy(), [[0.0, 4.0], [6.0, 0.0]])


def test_a_graph_mode_lowering_leaves_the_collector_running(monkeypatch):
  with tf2.Graph().as_default():
    seen, value = _lower_recording_the_collector(monkeypatch)
    with tf.Session() as session:
      np.testing.assert_array_equal(session.run(value), [[0.0, 4.0], [6.0, 0.0]])
  assert seen and all(seen)


def test_paused_keeps_a_collector_the_caller_switched_off():
  gc.disable()
  try:
    with collector.paused():
      assert not gc.isenabled()
    assert not gc.isenabled()
  finally:
    gc.enable()
  with collector.paused():
    assert not gc.isenabled()
  assert gc.isenabled()
