"""Progress lines and TensorBoard scalars of the training loop."""

from __future__ import annotations

import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer._train import progress


def test_progress_line_has_step_loss_lr_rates_and_eta_and_the_same_scalars_reach_tensorboard(tmp_path):
  lines, now = [], [100.0]
  with tf.Graph().as_default():
    writer = tf.summary.FileWriter(str(tmp_path))
    reporter = progress.ProgressReporter(writer, start_step=10, total_steps=1010, print_fn=lines.append,
                                         clock=lambda: now[0])
    reporter.add_tokens(4096)
    now[0] = 102.0  # 100 steps and 4096 tokens in 2 s
    scalars = reporter.report(110, loss=2.5, learning_rate=0.01)
    writer.close()
  assert lines == ["step  110/1010  loss 2.5000  lr 1.00e-02  50.00 steps/s  2,048 tokens/s  ETA 18s"]
  assert scalars == {"loss": 2.5, "learning_rate": 0.01, "steps_per_sec": 50.0, "tokens_per_sec": 2048.0}
  for tag, value in scalars.items():
    [(step, logged)] = progress.read_scalars(str(tmp_path), tag)
    assert step == 110 and abs(logged - value) < 1e-6 * max(1.0, value)


def test_durations_are_short_and_readable():
  assert progress.format_duration(42) == "42s"
  assert progress.format_duration(125) == "2m05s"
  assert progress.format_duration(3 * 3600 + 61) == "3h01m"


def test_runs_writing_scalars_within_one_second_keep_every_runs_scalars(tmp_path):
  for step in (1, 2, 3):  # a run per step, as a resumed job writes; all within a second or so
    writer = progress.summary_writer(str(tmp_path))
    progress.write_scalars(writer, step, {"loss": float(step)})
    writer.close()
  assert progress.read_scalars(str(tmp_path), "loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]
