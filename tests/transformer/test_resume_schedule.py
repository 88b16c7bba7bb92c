"""A resumed run whose learning-rate schedule horizon changed says so, naming the binding that keeps it."""

from __future__ import annotations

import math

from mesh_tensorflow.transformer import learning_rate_schedules
from mesh_tensorflow.transformer._train import schedule_horizon
from tests.transformer import tiny_run

# lm_pydoc.gin's noam schedule (warmup 1000 steps, linear decay over the last tenth of training).
PEAK = 1 / math.sqrt(1000)
TWO_STEPS = tiny_run.TWO_DEVICES + ["utils.run.train_steps = 2", "utils.run.save_checkpoints_steps = 2"]


def train(model_dir, corpus, train_steps: int, capsys) -> str:
  tiny_run.configure_gin(corpus, TWO_STEPS + [f"utils.run.train_steps = {train_steps}"])
  tiny_run.run(model_dir, "train")
  return capsys.readouterr().out


def test_resuming_with_a_larger_train_steps_prints_the_horizon_change_and_the_binding_that_keeps_it(
    tmp_path, corpus, capsys):
  model_dir = tmp_path / "run"
  assert "horizon" not in train(model_dir, corpus, 2, capsys)
  # At step 2 the 2-step schedule has decayed to 0; over 4 steps the decay starts at step 3.6.
  out = train(model_dir, corpus, 4, capsys)
  assert (f"Learning-rate schedule: its horizon changed from 2 to 4 steps (utils.run.total_run_steps, "
          f"else train_steps), so the rate at step 2 jumps from 0.00e+00 to {PEAK:.2e}. To keep the "
          f"previous schedule, bind utils.run.total_run_steps = 2 "
          f"(--gin_param='utils.run.total_run_steps = 2').") in out
  assert "It falls below 0 after step 2" in out  # keeping a finished decay would train with negative rates
  assert "step 4/4" in out


def test_resuming_with_the_same_horizon_prints_nothing_about_the_schedule(tmp_path, corpus, capsys):
  model_dir = tmp_path / "run"
  train(model_dir, corpus, 2, capsys)
  tiny_run.configure_gin(corpus, TWO_STEPS + ["utils.run.train_steps = 4", "utils.run.total_run_steps = 2"])
  tiny_run.run(model_dir, "train")  # a larger train_steps, the horizon kept by total_run_steps
  out = capsys.readouterr().out
  assert "Resuming from" in out and "step 4/4" in out
  assert "horizon" not in out


def test_a_schedule_that_ignores_the_horizon_gives_no_message():
  def rsqrt(step, total_train_steps):
    return learning_rate_schedules.truncated_rsqrt(step, total_train_steps, warmup_steps=10)

  assert schedule_horizon.horizon_change_message(rsqrt, 500, 500, 560) is None
  message = schedule_horizon.horizon_change_message(
      learning_rate_schedules.learning_rate_schedule_noam, 500, 500, 560)
  assert "rate at step 500 jumps from 0.00e+00 to 1.00e-02" in message  # the case, warmup 10000
