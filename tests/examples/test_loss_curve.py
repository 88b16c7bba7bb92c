"""The example's loss-curve picture shows the training loss and the held-out loss of each evaluation."""

from __future__ import annotations

import os

import pytest

from examples.transformer import train
from mesh_tensorflow.transformer._train import progress


def write(log_dir, tag: str, points: dict) -> None:
  writer = progress.summary_writer(str(log_dir))
  for step, value in points.items():
    progress.write_scalars(writer, step, {tag: value})
  writer.close()


def test_the_series_hold_every_training_step_and_each_held_out_evaluation(tmp_path):
  write(tmp_path, "loss", {1: 5.0, 2: 4.0, 3: 3.5, 4: 3.0})
  write(tmp_path / train.HELDOUT_DIR, train.HELDOUT_TAG, {2: 4.5, 4: 3.25})
  assert train.loss_curve_series(str(tmp_path)) == {
      "training": [(1, 5.0), (2, 4.0), (3, 3.5), (4, 3.0)], "held-out": [(2, 4.5), (4, 3.25)]}


def test_the_picture_draws_the_held_out_points_beside_the_training_curve(tmp_path, monkeypatch):
  plt = pytest.importorskip("matplotlib.pyplot", reason="the picture needs matplotlib (the test extra)")
  write(tmp_path, "loss", {1: 5.0, 2: 4.0})
  write(tmp_path / train.HELDOUT_DIR, train.HELDOUT_TAG, {2: 4.5})
  drawn = []
  monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kwargs: drawn.append(fig))
  monkeypatch.setattr(plt, "close", lambda fig: None)
  message = train.draw_loss_curve(str(tmp_path))
  assert message == f"loss curve: {os.path.join(str(tmp_path), 'loss_curve.png')} (1 held-out point)"
  [axes] = drawn[0].axes
  lines = {line.get_label(): list(zip(line.get_xdata(), line.get_ydata())) for line in axes.get_lines()}
  assert lines == {"training (each step)": [(1, 5.0), (2, 4.0)], "held-out (each evaluation)": [(2, 4.5)]}
