"""Checkpoints: atomic saves, keep_checkpoint_max, crash during a save, checked and cross-layout restores."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer._train import checkpoints
from tests.harness import cpu_devices, session_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_model(mesh_shape: str, layout: str, hidden: int = 8, masters: str = "whole"):
  """A two-layer mtf regression with an SGD step; returns (lowering, loss, train_op)."""
  tf.set_random_seed(1)
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  batch, d_in, d_hidden = mtf.Dimension("batch", 8), mtf.Dimension("d_in", 4), mtf.Dimension("hidden", hidden)
  x = mtf.import_tf_tensor(mesh, tf.reshape(tf.range(32, dtype=tf.float32) / 32.0, [8, 4]), [batch, d_in])
  h = mtf.relu(mtf.layers.dense(x, d_hidden, reduced_dims=[d_in], name="layer_1"))
  y = mtf.layers.dense(h, mtf.Dimension("out", 1), reduced_dims=[d_hidden], name="layer_2")
  loss = mtf.reduce_mean(mtf.square(y - 1.0))
  variables = graph.trainable_variables
  grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
  updates = mtf.optimize.SgdOptimizer(0.1).apply_grads(grads, variables)
  shape = mtf.convert_to_shape(mesh_shape)
  impl = mtf.placement_mesh_impl.PlacementMeshImpl(shape, layout, cpu_devices(shape.size), masters=masters)
  lowering = mtf.Lowering(graph, {mesh: impl})
  global_step = tf.train.get_or_create_global_step()
  with tf.control_dependencies([lowering.lowered_operation(u) for u in updates]):
    train_op = tf.assign_add(global_step, 1)
  return lowering, lowering.export_to_tf_tensor(loss), train_op


def train_and_save(model_dir: str, steps, mesh_shape="batch:8", layout="batch:batch", keep=None):
  """Trains, saving after each step listed in `steps`; returns {step: {var name: value}} saved."""
  saved = {}
  with tf.Graph().as_default():
    lowering, _, train_op = build_model(mesh_shape, layout)
    manager = checkpoints.CheckpointManager(model_dir, tf.global_variables(), keep,
                                            before_save=lowering.copy_slices_to_masters())
    copy_in = lowering.copy_masters_to_slices()
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(copy_in)
      for step in range(1, max(steps) + 1):
        sess.run(train_op)
        if step in steps:
          manager.save(sess, step)
          saved[step] = {v.op.name: sess.run(v) for v in tf.global_variables()}
  return saved


def restored_values(model_dir: str, mesh_shape: str, layout: str, train_steps: int = 0):
  """Restores the latest checkpoint under another layout; returns (values read back through the
  slices, loss after `train_steps` more steps)."""
  with tf.Graph().as_default():
    lowering, loss, train_op = build_model(mesh_shape, layout)
    manager = checkpoints.CheckpointManager(model_dir, tf.global_variables())
    copy_in, copy_out = lowering.copy_masters_to_slices(), lowering.copy_slices_to_masters()
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      manager.restore(sess, checkpoints.latest_checkpoint(model_dir))
      sess.run(copy_in)
      for v in tf.global_variables():  # scribble on the masters: the values must come from the slices
        sess.run(v.assign(tf.zeros_like(v)))
      sess.run(copy_out)
      values = {v.op.name: sess.run(v) for v in tf.global_variables() if v.op.name != "global_step"}
      losses = [sess.run([loss, train_op])[0] for _ in range(train_steps)]
  return values, losses


def test_saves_are_loadable_by_plain_tf_and_only_the_newest_are_kept(tmp_path):
  saved = train_and_save(str(tmp_path), steps=[1, 2, 3], keep=2)
  steps = [checkpoints.get_step_from_checkpoint_path(p) for p in checkpoints.list_checkpoints(str(tmp_path))]
  assert steps == [2, 3]
  assert checkpoints.latest_checkpoint(str(tmp_path)) == str(tmp_path / "model.ckpt-3")
  state = tf.train.get_checkpoint_state(str(tmp_path))
  assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == ["model.ckpt-2", "model.ckpt-3"]
  reader = tf.train.load_checkpoint(str(tmp_path / "model.ckpt-3"))
  assert reader.get_tensor("global_step") == 3
  np.testing.assert_array_equal(reader.get_tensor("layer_1/kernel"), saved[3]["layer_1/kernel"])
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_a_checkpoint_written_under_batch_8_restores_bit_identically_under_other_meshes(tmp_path):
  saved = train_and_save(str(tmp_path), steps=[2])[2]
  _, reference_losses = restored_values(str(tmp_path), "batch:8", "batch:batch", train_steps=3)
  for mesh_shape, layout in [("batch:2;model:4", "batch:batch;hidden:model"), ("all:1", "")]:
    values, losses = restored_values(str(tmp_path), mesh_shape, layout, train_steps=3)
    for name, value in values.items():
      np.testing.assert_array_equal(value, saved[name], err_msg=f"{name} under {mesh_shape}")
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)  # and training continues alike
    assert losses[-1] < losses[0]


def test_a_checkpoint_of_another_model_is_refused_naming_the_variable_and_both_shapes(tmp_path):
  train_and_save(str(tmp_path), steps=[1])
  with tf.Graph().as_default():
    build_model("all:1", "", hidden=6)
    with pytest.raises(checkpoints.CheckpointMismatchError,
                       match=r"'layer_1/kernel' with shape \[4, 8\].*"
                             r"model's 'layer_1/kernel' has shape \[4, 6\]"):
      checkpoints.check_checkpoint_matches(str(tmp_path / "model.ckpt-1"), tf.global_variables())


def test_missing_variables_are_an_error_except_when_warm_starting(tmp_path):
  train_and_save(str(tmp_path), steps=[1])
  path = str(tmp_path / "model.ckpt-1")
  with tf.Graph().as_default():
    build_model("all:1", "")
    extra = tf.get_variable("new_head", [3], initializer=tf.ones_initializer())
    with pytest.raises(checkpoints.CheckpointMismatchError,
                       match=r"lacks 1 of the model's variables.*new_head"):
      checkpoints.check_checkpoint_matches(path, tf.global_variables())
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      found = checkpoints.restore_available(sess, path, tf.global_variables())
      assert extra not in found and len(found) == len(tf.global_variables()) - 1
      np.testing.assert_array_equal(sess.run(extra), np.ones(3))
      kernel = [v for v in tf.global_variables() if v.op.name == "layer_2/kernel"][0]
      np.testing.assert_array_equal(sess.run(kernel),
                                    tf.train.load_checkpoint(path).get_tensor("layer_2/kernel"))


def test_warm_starting_maps_names_and_skips_filtered_variables(tmp_path):
  train_and_save(str(tmp_path), steps=[1])
  path = str(tmp_path / "model.ckpt-1")
  reader = tf.train.load_checkpoint(path)
  with tf.Graph().as_default():
    renamed = tf.get_variable("student/layer_1/kernel", [4, 8], initializer=tf.zeros_initializer())
    skipped = tf.get_variable("student/layer_2/kernel", [8, 1], initializer=tf.zeros_initializer())
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      found = checkpoints.restore_available(sess, path, [renamed, skipped],
                                            checkpoint_name=lambda n: n.replace("student/", ""),
                                            should_load=lambda n: "layer_2" not in n)
      assert found == [renamed]
      np.testing.assert_array_equal(sess.run(renamed), reader.get_tensor("layer_1/kernel"))
      np.testing.assert_array_equal(sess.run(skipped), np.zeros([8, 1]))


def test_warm_starting_restores_every_part_of_a_variable_split_over_processors(tmp_path):
  """With sliced masters (the driver's CPU default) a variable split 4 ways has 4 parts saved
  under one name; init_checkpoint's restore must fill all of them, not only the last."""
  train_and_save(str(tmp_path), steps=[1])
  path = str(tmp_path / "model.ckpt-1")
  reader = tf.train.load_checkpoint(path)
  with tf.Graph().as_default():
    lowering, _, _ = build_model("batch:2;model:4", "batch:batch;hidden:model", masters="sliced")
    kernels = {v.name: v.get_master() for v in lowering.graph.trainable_variables}
    copy_in = lowering.copy_masters_to_slices()
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      model_variables = [v for v in tf.global_variables() if v.op.name != "global_step"]
      checkpoints.restore_available(sess, path, model_variables)
      sess.run(copy_in)
      for name, value in sess.run(kernels).items():
        np.testing.assert_array_equal(value, reader.get_tensor(name), err_msg=name)


@pytest.mark.slow
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_latest_and_intact(tmp_path):
  # The fault is injected here: Saver.save of step 2 kills its process once the data is written,
  # before the checkpoint is complete, as a crash during the save would.
  script = textwrap.dedent(f"""
      import os, signal
      import tensorflow.compat.v1 as tf
      save = tf.train.Saver.save
      def save_then_die(self, sess, save_path, *args, **kwargs):
        result = save(self, sess, save_path, *args, **kwargs)
        if save_path.endswith("model.ckpt-2"):
          os.kill(os.getpid(), signal.SIGKILL)
        return result
      tf.train.Saver.save = save_then_die
      from tests.harness import configure_virtual_cpus
      configure_virtual_cpus()
      from tests.transformer.test_checkpoints import train_and_save
      train_and_save({str(tmp_path)!r}, steps=[1, 2])
      """)
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
  assert result.returncode == -9, result.stderr[-2000:]
  assert any(re.match(r"\.tmp-\d+-model\.ckpt-2\.", f) for f in os.listdir(tmp_path))  # the save had begun
  latest = checkpoints.latest_checkpoint(str(tmp_path))
  assert latest == str(tmp_path / "model.ckpt-1")
  assert tf.train.load_checkpoint(latest).get_tensor("global_step") == 1
  assert checkpoints.remove_partial_saves(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ["checkpoint", "model.ckpt-1.data-00000-of-00001",
                                          "model.ckpt-1.index"]


def test_latest_checkpoint_skips_a_state_file_entry_whose_index_is_missing(tmp_path):
  train_and_save(str(tmp_path), steps=[1, 2])
  os.remove(tmp_path / "model.ckpt-2.index")
  assert checkpoints.latest_checkpoint(str(tmp_path)) == str(tmp_path / "model.ckpt-1")
  assert checkpoints.latest_checkpoint(str(tmp_path / "nowhere")) is None


def test_checkpoint_paths_must_name_a_step():
  assert checkpoints.get_step_from_checkpoint_path("/a/model.ckpt-120") == 120
  # as 0.1.21: the step of the last model.ckpt-<step> in the path, whatever follows it
  assert checkpoints.get_step_from_checkpoint_path(checkpoint_path="/a/model.ckpt-120.index") == 120
  assert checkpoints.get_step_from_checkpoint_path("/model.ckpt-5/model.ckpt-7.data-00000-of-00001") == 7
  with pytest.raises(ValueError, match="not a checkpoint path"):
    checkpoints.get_step_from_checkpoint_path("/a/model.ckpt")
