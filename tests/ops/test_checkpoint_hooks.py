"""Checkpoint hooks: slices trained on 4 devices reach the checkpoint, and restore onto any layout."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import cpu_devices, session_config

VALUE = np.arange(32, dtype=np.float32).reshape(8, 4) - 10.0
SHAPE = "rows:8;cols:4"


def _build(mesh_shape: str, layout: str):
  """w (zeros) += VALUE on each train step, lowered on len(mesh) CPU devices."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  w = mtf.get_variable(mesh, "w", SHAPE, initializer=tf.zeros_initializer())
  update = mtf.assign_add(w, mtf.constant(mesh, VALUE, shape=mtf.convert_to_shape(SHAPE)))
  impl = mtf.placement_mesh_impl.PlacementMeshImpl(
      mesh_shape, layout, cpu_devices(mtf.convert_to_shape(mesh_shape).size))
  lowering = mtf.Lowering(graph, {mesh: impl})
  global_step = tf.train.get_or_create_global_step()
  train_op = tf.group(lowering.operations[update], tf.assign_add(global_step, 1))
  return lowering, w, train_op


def _monitored_session(hooks, checkpoint_dir=None):
  return tf.train.MonitoredTrainingSession(
      checkpoint_dir=checkpoint_dir, hooks=hooks, config=session_config(),
      save_checkpoint_secs=None, save_checkpoint_steps=None, save_summaries_steps=None,
      save_summaries_secs=None, log_step_count_steps=None)


def _train(checkpoint_dir: str, steps: int, mesh_shape="all:4", layout="rows:all") -> None:
  with tf.Graph().as_default():
    lowering, _, train_op = _build(mesh_shape, layout)
    saver_hook = tf.train.CheckpointSaverHook(
        checkpoint_dir, save_steps=1000, saver=tf.train.Saver(),
        listeners=[mtf.MtfCheckpointSaverListener(lowering)])
    with _monitored_session([mtf.MtfRestoreHook(lowering), saver_hook], checkpoint_dir) as sess:
      for _ in range(steps):
        sess.run(train_op)


def _restore_and_read(checkpoint_dir: str, mesh_shape: str, layout: str) -> np.ndarray:
  with tf.Graph().as_default():
    lowering, w, _ = _build(mesh_shape, layout)
    w_tf = lowering.export_to_tf_tensor(w)
    with _monitored_session([mtf.MtfRestoreHook(lowering)], checkpoint_dir) as sess:
      return sess.run(w_tf)


def test_values_trained_in_slices_reach_the_checkpoint(tmp_path):
  _train(str(tmp_path), steps=3)
  checkpoint = tf.train.latest_checkpoint(str(tmp_path))
  assert checkpoint.endswith("-3")
  np.testing.assert_allclose(tf.train.load_variable(checkpoint, "w"), 3 * VALUE)
  # Only masters are checkpointed: slice variables stay out of it.
  assert {name for name, _ in tf.train.list_variables(checkpoint)} == {"w", "global_step"}


@pytest.mark.parametrize("mesh_shape, layout", [
    ("all:4", "rows:all"), ("rows:2;cols:2", "rows:rows;cols:cols"), ("a:2;b:2", "cols:a"),
    ("all:1", ""),
])
def test_restore_into_another_mesh_and_layout_gets_the_same_values(tmp_path, mesh_shape, layout):
  _train(str(tmp_path), steps=2)
  np.testing.assert_allclose(_restore_and_read(str(tmp_path), mesh_shape, layout), 2 * VALUE)


def test_training_resumes_from_the_restored_slices(tmp_path):
  _train(str(tmp_path), steps=2, mesh_shape="rows:2;cols:2", layout="rows:cols;cols:rows")
  _train(str(tmp_path), steps=1)  # restores 2 * VALUE into 4 row-slices, then adds VALUE
  np.testing.assert_allclose(_restore_and_read(str(tmp_path), "all:2", "cols:all"), 3 * VALUE)


def test_restore_hook_copies_masters_to_slices_before_a_saver_reads_them(tmp_path):
  # Step-0 checkpoint of a fresh run: the restore hook runs first, so the saved master is the
  # initial value, not garbage from uninitialised slices.
  with tf.Graph().as_default():
    lowering, _, _ = _build("all:4", "rows:all")
    saver_hook = tf.train.CheckpointSaverHook(
        str(tmp_path), save_steps=1000, saver=tf.train.Saver(),
        listeners=[mtf.MtfCheckpointSaverListener(lowering)])
    with _monitored_session([mtf.MtfRestoreHook(lowering), saver_hook]):
      pass
  checkpoint = tf.train.latest_checkpoint(str(tmp_path))
  assert checkpoint.endswith("-0")
  np.testing.assert_allclose(tf.train.load_variable(checkpoint, "w"), np.zeros([8, 4]))
