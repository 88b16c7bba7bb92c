"""Non-finite training steps: the run stops before saving them, or skips them (no update) and counts."""

from __future__ import annotations

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer._train import checkpoints, nonfinite, progress
from tests.transformer import tiny_run


@gin.configurable("poisoned_learning_rate")
def poisoned_learning_rate(step, total_train_steps, from_step=gin.REQUIRED, until_step=10 ** 9, value=1e30):
  """0.01, except `value` for global steps in [from_step, until_step) (the step from_step + 1 on)."""
  del total_train_steps
  step = tf.cast(step, tf.float32)
  return tf.where(tf.logical_and(step >= from_step, step < until_step), value, 0.01)


def poisoned(from_step: int, *extra) -> list:
  return tiny_run.TWO_DEVICES + ["utils.run.learning_rate_schedule = @poisoned_learning_rate",
                                 f"poisoned_learning_rate.from_step = {from_step}",
                                 "utils.run.train_steps = 9", *extra]


def float_weights(path: str) -> dict:
  reader = tf.train.load_checkpoint(path)
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
          if name not in ("global_step",) and reader.get_tensor(name).dtype.kind == "f"}


def test_a_learning_rate_that_blows_up_stops_the_run_at_the_first_non_finite_step_with_nothing_bad_saved(
    tmp_path, corpus):
  # 1e30 from global step 3: step 4's update explodes the weights; step 6's loss is NaN.
  tiny_run.configure_gin(corpus, poisoned(3))
  with pytest.raises(nonfinite.NonFiniteStepError) as raised:
    tiny_run.run(tmp_path, "train")
  message = str(raised.value).splitlines()[0]
  assert message.startswith("Step 6 is not finite (loss nan, learning rate 1e+30): stopped before saving")
  assert f"the last good checkpoint is {tmp_path}/model.ckpt-3" in message
  assert "non_finite_steps.skip = True" in message
  left = checkpoints.list_checkpoints(str(tmp_path))
  assert [checkpoints.get_step_from_checkpoint_path(p) for p in left] == [3]
  for path in left:
    assert all(np.isfinite(value).all() for value in float_weights(path).values())


def test_skipped_non_finite_steps_change_no_variable_and_are_counted_in_tensorboard(tmp_path, corpus):
  # An infinite learning rate at global steps 4 and 5: steps 5 and 6 are skipped, the rest train.
  tiny_run.configure_gin(corpus, poisoned(4, "poisoned_learning_rate.until_step = 6",
                                          "poisoned_learning_rate.value = 1e400",
                                          "non_finite_steps.skip = True",
                                          "utils.run.save_checkpoints_steps = 1"))
  result = tiny_run.run(tmp_path, "train")
  assert result["step"] == 9 and result["skipped_steps"] == 2
  before, after, trained = (float_weights(checkpoints.checkpoint_path(str(tmp_path), s)) for s in (4, 6, 7))
  assert before.keys() == after.keys() and len(before) > 4
  for name, value in before.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)  # weights and optimizer slots
  assert any(not np.array_equal(trained[name], value) for name, value in before.items())
  assert progress.read_scalars(str(tmp_path), nonfinite.SKIPPED_TAG) == [(5, 1.0), (6, 2.0)]


def test_with_skipping_on_the_run_stops_after_max_skipped_in_a_row(tmp_path, corpus):
  tiny_run.configure_gin(corpus, poisoned(4, "poisoned_learning_rate.value = 1e400",
                                          "non_finite_steps.skip = True",
                                          "non_finite_steps.max_skipped_in_a_row = 3"))
  with pytest.raises(nonfinite.NonFiniteStepError, match=r"Steps 5 to 7 were all not finite \(3 in a row"):
    tiny_run.run(tmp_path, "train")
  assert checkpoints.latest_checkpoint(str(tmp_path)) == checkpoints.checkpoint_path(str(tmp_path), 6)


def test_a_save_after_an_exploding_update_is_refused_naming_the_variables(tmp_path, corpus):
  # 1e30 from global step 4: step 5's update explodes the weights, step 6's makes them NaN, and
  # step 6 is a save step: the save is refused, the checkpoint of step 3 stays the latest.
  tiny_run.configure_gin(corpus, poisoned(4))
  with pytest.raises(checkpoints.NonFiniteCheckpointError,
                     match=r"Not saving .*model.ckpt-6: \d+ variables hold NaN or infinite values, e.g. "
                           r"\['transformer/"):
    tiny_run.run(tmp_path, "train")
  assert checkpoints.list_checkpoints(str(tmp_path)) == [checkpoints.checkpoint_path(str(tmp_path), 3)]


def test_a_checkpoint_holding_a_nan_is_not_written(tmp_path):
  with tf.Graph().as_default():
    weight = tf.Variable([1.0, float("nan")], name="weight")
    manager = checkpoints.CheckpointManager(str(tmp_path), [weight])
    with tf.Session() as session:
      session.run(tf.global_variables_initializer())
      with pytest.raises(checkpoints.NonFiniteCheckpointError,
                         match=r"Not saving .*model.ckpt-1: 1 variables hold NaN .*\['weight'\]"):
        manager.save(session, 1)
  assert checkpoints.list_checkpoints(str(tmp_path)) == []


def test_max_skipped_in_a_row_must_be_positive():
  with pytest.raises(ValueError, match="non_finite_steps.max_skipped_in_a_row = 0: expected a positive int"):
    nonfinite.non_finite_policy(skip=True, max_skipped_in_a_row=0)
