"""tf.train.Checkpoint of a MeshModule: whole values by name, restored under any layout."""

import numpy as np
import pytest
import tensorflow as tf2

import mesh_tensorflow as mtf
from tests.tf2 import mlp


def _train(step, data) -> list:
  return [float(step(x, y)) for x, y in data]


@pytest.mark.parametrize("written_under, restored_under", [("data_parallel_8", "mesh_2x4"),
                                                           ("mesh_2x4", "one_device")])
def test_a_checkpoint_written_under_one_layout_restores_under_another(tmp_path, written_under,
                                                                      restored_under):
  data = mlp.batches(8)
  writer = mtf.tf2.MeshModule(mlp.mesh_impl(written_under))
  writer_step = mlp.train_step(writer)
  _train(writer_step, data[:4])
  path = tf2.train.Checkpoint(model=writer).save(str(tmp_path / "ckpt"))
  uninterrupted = _train(writer_step, data[4:])

  # Restored before the step's first call (the variables come into being at that call) ...
  reader = mtf.tf2.MeshModule(mlp.mesh_impl(restored_under))
  reader_step = mlp.train_step(reader)
  tf2.train.Checkpoint(model=reader).restore(path).assert_existing_objects_matched()
  assert int(reader.step) == 4
  np.testing.assert_allclose(_train(reader_step, data[4:]), uninterrupted, rtol=1e-5)

  # ... and after it, over weights that have been trained since.
  tf2.train.Checkpoint(model=reader).restore(path).assert_consumed()
  assert int(reader.step) == 4
  np.testing.assert_allclose(_train(reader_step, data[4:]), uninterrupted, rtol=1e-5)


def test_the_checkpoint_holds_each_variable_whole_under_its_name(tmp_path):
  module = mtf.tf2.MeshModule(mlp.mesh_impl("mesh_2x4"))
  step = mlp.train_step(module)
  _train(step, mlp.batches(3))
  path = tf2.train.Checkpoint(model=module).save(str(tmp_path / "ckpt"))
  saved = {name: shape for name, shape in tf2.train.list_variables(path)}
  assert saved["model/mtf_variables/w1/.ATTRIBUTES/VARIABLE_VALUE"] == [mlp.INPUT, mlp.HIDDEN]
  assert saved["model/mtf_variables/w2/.ATTRIBUTES/VARIABLE_VALUE"] == [mlp.HIDDEN, mlp.OUTPUT]
  assert saved["model/step/.ATTRIBUTES/VARIABLE_VALUE"] == []
  # the saved w1 is the trained one: a one-device module given it computes 2x4's loss
  reader = tf2.train.load_checkpoint(path)
  w1 = reader.get_tensor("model/mtf_variables/w1/.ATTRIBUTES/VARIABLE_VALUE")
  assert not np.allclose(w1, mlp.W1)
  evaluate_on = {}
  for name in ("one_device", "mesh_2x4"):
    other = mtf.tf2.MeshModule(mlp.mesh_impl(name))
    evaluate = other.function(lambda mesh, x, y: (mlp.loss_fn(mesh, x, y), []), mlp.INPUT_SIGNATURE)
    tf2.train.Checkpoint(model=other).restore(path)
    evaluate_on[name] = float(evaluate(*mlp.batches(1, seed=9)[0]))
  assert evaluate_on["one_device"] == pytest.approx(float(evaluate(*mlp.batches(1, seed=9)[0])), rel=1e-6)
  assert evaluate_on["one_device"] == pytest.approx(evaluate_on["mesh_2x4"], rel=1e-6)


def test_a_run_resumed_by_checkpoint_manager_draws_the_uninterrupted_dropout_masks(tmp_path):
  data = mlp.batches(6)
  tf2.random.set_seed(3)
  uninterrupted = _train(mlp.train_step(mtf.tf2.MeshModule(mlp.mesh_impl("mesh_2x4")), 0.5), data)

  tf2.random.set_seed(3)
  first = mtf.tf2.MeshModule(mlp.mesh_impl("mesh_2x4"))
  manager = tf2.train.CheckpointManager(tf2.train.Checkpoint(model=first), str(tmp_path), max_to_keep=2)
  first_losses = _train(mlp.train_step(first, 0.5), data[:3])
  manager.save(checkpoint_number=int(first.step))

  tf2.random.set_seed(3)
  resumed = mtf.tf2.MeshModule(mlp.mesh_impl("data_parallel_8"))
  resumed_manager = tf2.train.CheckpointManager(tf2.train.Checkpoint(model=resumed), str(tmp_path),
                                                max_to_keep=2)
  assert resumed_manager.latest_checkpoint.endswith("ckpt-3")
  resumed_manager.restore_or_initialize()
  resumed_losses = _train(mlp.train_step(resumed, 0.5), data[3:])
  np.testing.assert_allclose(first_losses + resumed_losses, uninterrupted, rtol=1e-5)
