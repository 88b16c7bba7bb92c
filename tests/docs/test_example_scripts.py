"""The example and benchmark scripts: honest verdicts and timings at short settings, clear errors."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
import tensorflow as tf2
import tensorflow.compat.v1 as tf

from examples import classifier

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def keep_tf_log_verbosity():
  """The scripts' main() sets TF's log verbosity for the whole process; later tests need it back."""
  verbosity = tf.logging.get_verbosity()
  yield
  tf.logging.set_verbosity(verbosity)


def load_benchmark():
  path = ROOT / "benchmarks" / "bench_classifier.py"
  spec = importlib.util.spec_from_file_location("bench_classifier", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_classifier_with_ten_steps_passes_when_the_layouts_agree(capsys):
  assert classifier.main(["--steps", "10"]) == 0
  out = capsys.readouterr().out
  assert re.search(r"layouts agree: .* OK", out)
  assert re.search(r"model learns: +OK: loss fell from [\d.]+ to [\d.]+ \(expected at most [\d.]+ after 10",
                   out)


def test_classifier_fails_naming_the_learning_check_when_the_loss_does_not_fall(capsys):
  assert classifier.main(["--steps", "5", "--learning_rate", "0"]) == 1
  out = capsys.readouterr().out
  assert re.search(r"layouts agree: .* OK", out)
  assert "FAILED: the loss did not fall as expected" in out


def test_learning_check_scales_with_the_number_of_steps():
  assert classifier.check_learning([2.0] * 4).startswith("not checked")
  assert classifier.check_learning([2.0, 2.0, 2.0, 2.0, 1.9]).startswith("OK")      # 5% after 5 steps
  assert classifier.check_learning([2.0, 2.0, 2.0, 2.0, 1.95]).startswith("FAILED")
  assert classifier.check_learning([2.0] * 59 + [1.0]).startswith("OK")             # a half after 60
  assert classifier.check_learning([2.0] * 59 + [1.1]).startswith("FAILED")


def test_benchmark_reports_each_layouts_step_time_as_a_ratio_to_plain_tf(capsys):
  load_benchmark().main(["--steps", "3", "--batch_size", "32", "--hidden", "32", "--lowering_devices", "1"])
  rows = re.findall(r"^(plain TF, 1 device|mtf [\w-]+, 8 devices) +([\d.]+) ms/step +ratio ([\d.]+)$",
                    capsys.readouterr().out, re.M)
  assert [name for name, _, _ in rows] == ["plain TF, 1 device", "mtf data-parallel, 8 devices",
                                           "mtf model-parallel, 8 devices", "mtf 2-D, 8 devices"]
  plain_ms = float(rows[0][1])
  for _, ms, ratio in rows:  # printed to 0.001 ms and 0.01: the ratio of the printed times, rounded
    low = (float(ms) - 0.0005) / (plain_ms + 0.0005) - 0.005
    high = (float(ms) + 0.0005) / (plain_ms - 0.0005) + 0.005
    assert low <= float(ratio) <= high, rows


def test_benchmark_on_gpu_without_gpus_says_so(capsys, monkeypatch):
  bench = load_benchmark()
  real = tf2.config.list_physical_devices
  monkeypatch.setattr(tf2.config, "list_physical_devices",
                      lambda kind=None: [] if kind == "GPU" else real(kind))
  with pytest.raises(SystemExit):
    bench.main(["--device", "gpu", "--steps", "1"])
  assert "--device gpu: TensorFlow sees no GPU here" in capsys.readouterr().err
