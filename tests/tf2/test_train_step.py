"""mtf.tf2.TrainStep: a training step lowered once into a TF function, with session mode's values."""

import numpy as np
import pytest
import tensorflow as tf2

import mesh_tensorflow as mtf
from tests.tf2 import mlp


@pytest.mark.parametrize("mesh_name", sorted(mlp.MESHES))
def test_twenty_steps_give_the_session_mode_losses(mesh_name):
  data = mlp.batches(20)
  module = mtf.tf2.MeshModule(mlp.mesh_impl(mesh_name))
  step = mlp.train_step(module)
  losses = [float(step(x, y)) for x, y in data]
  np.testing.assert_allclose(losses, mlp.session_mode_losses(mesh_name, data), rtol=1e-6, atol=1e-7)
  assert losses[-1] < losses[0] / 2  # it learns
  assert int(module.step) == 20


def test_adafactor_follows_the_step_counter_as_in_session_mode():
  """Its default rates depend on the global step: the module's step, built inside the step."""
  data = mlp.batches(6)
  module = mtf.tf2.MeshModule(mlp.mesh_impl("mesh_2x4"))
  step = mtf.tf2.TrainStep(module, mlp.loss_fn, mtf.optimize.AdafactorOptimizer, mlp.INPUT_SIGNATURE)
  np.testing.assert_allclose([float(step(x, y)) for x, y in data],
                             mlp.session_mode_losses("mesh_2x4", data, mtf.optimize.AdafactorOptimizer),
                             rtol=1e-5)


def test_calls_after_the_first_build_and_lower_nothing(monkeypatch):
  counts = {"lowerings": 0, "graphs": 0}
  lowering_init, graph_init = mtf.Lowering.__init__, mtf.Graph.__init__

  def counting_lowering(self, *args, **kwargs):
    counts["lowerings"] += 1
    lowering_init(self, *args, **kwargs)

  def counting_graph(self, *args, **kwargs):
    counts["graphs"] += 1
    graph_init(self, *args, **kwargs)

  monkeypatch.setattr(mtf.Lowering, "__init__", counting_lowering)
  monkeypatch.setattr(mtf.Graph, "__init__", counting_graph)
  step = mlp.train_step(mtf.tf2.MeshModule(mlp.mesh_impl("mesh_2x4")))
  data = mlp.batches(5)
  step(*data[0])
  assert counts == {"lowerings": 1, "graphs": 1}
  for x, y in data[1:]:
    step(x, y)
  assert counts == {"lowerings": 1, "graphs": 1}


def test_an_evaluation_function_shares_the_trained_variables():
  module = mtf.tf2.MeshModule(mlp.mesh_impl("mesh_2x4"))
  step = mlp.train_step(module)
  evaluate = module.function(lambda mesh, x, y: (mlp.loss_fn(mesh, x, y), []), mlp.INPUT_SIGNATURE)
  data = mlp.batches(4)
  before = float(evaluate(*data[0]))
  first_loss = float(step(*data[0]))
  for x, y in data[1:]:
    step(x, y)
  after = float(evaluate(*data[0]))
  assert before == pytest.approx(first_loss, rel=1e-6)
  assert after < before
  assert int(module.step) == 4  # evaluating does not count as a step
  # a function first built after training starts from the trained weights too
  late = module.function(lambda mesh, x, y: (mlp.loss_fn(mesh, x, y), []), mlp.INPUT_SIGNATURE)
  assert float(late(*data[0])) == pytest.approx(after, rel=1e-6)
  assert float(evaluate(*data[0])) == pytest.approx(after, rel=1e-6)
  # the module's variables: the masters and 2x4's slice variables, found by name
  assert sorted(module.mtf_variables) == ["w1", "w2"]


def test_random_ops_draw_fresh_values_at_every_call():
  module = mtf.tf2.MeshModule(mlp.mesh_impl("data_parallel_8"))
  batch, units = mtf.Dimension("batch", mlp.BATCH), mtf.Dimension("units", 5)
  draw = module.function(lambda mesh: (mtf.random_uniform(mesh, [batch, units]), []), [])
  first, second = draw().numpy(), draw().numpy()
  assert first.shape == (mlp.BATCH, 5)
  assert not np.array_equal(first, second)
  assert 0.0 <= first.min() and first.max() < 1.0


def test_dropout_masks_follow_the_step_counter():
  """With random_position="step" (and a seed), a step's masks depend only on the step number."""
  data = mlp.batches(3)
  runs = []
  for _ in range(2):
    tf2.random.set_seed(7)
    module = mtf.tf2.MeshModule(mlp.mesh_impl("data_parallel_8"))
    step = mlp.train_step(module, dropout_rate=0.5)
    runs.append([float(step(x, y)) for x, y in data])
  assert runs[0] == runs[1]
  no_dropout = [float(mlp.train_step(mtf.tf2.MeshModule(mlp.mesh_impl("data_parallel_8")))(x, y))
                for x, y in data]
  assert runs[0] != no_dropout


def test_bad_arguments_are_named():
  module = mtf.tf2.MeshModule(mlp.mesh_impl("one_device"))
  with pytest.raises(ValueError, match="random_position='global'"):
    module.function(lambda mesh: ([], []), [], random_position="global")
  step = mlp.train_step(module)
  with pytest.raises(ValueError, match="got 1 inputs for an input signature of 2"):
    step(np.zeros([mlp.BATCH, mlp.INPUT], np.float32))
  sliced = mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "", ["cpu:0", "cpu:1"], masters="sliced")
  with pytest.raises(ValueError, match="masters='whole'"):
    mtf.tf2.MeshModule(sliced)
  with pytest.raises(ValueError, match="optimizer_fn must be a function"):
    mtf.tf2.TrainStep(module, mlp.loss_fn, mtf.optimize.SgdOptimizer(0.1), mlp.INPUT_SIGNATURE)
  batch = mtf.Dimension("batch", mlp.BATCH)
  not_scalar = mtf.tf2.TrainStep(
      module, lambda mesh, x, y: mtf.reduce_sum(mtf.import_tf_tensor(
          mesh, x, [batch, mtf.Dimension("inp", mlp.INPUT)]), output_shape=[batch]),
      lambda: mtf.optimize.SgdOptimizer(0.1), mlp.INPUT_SIGNATURE)
  with pytest.raises(ValueError, match="return a scalar loss"):
    not_scalar(*mlp.batches(1)[0])
