"""explain --search on a model deeper than the search depths: full-depth fits and predicted lines."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._explain import search as search_lib
from mesh_tensorflow._explain.cli import main as explain_main
from tests.auto_mtf.test_depth import mlp

FITS = re.compile(r"^fits: (yes|no) \(([\d,.]+) GB of ([\d,.]+) GB per processor\)$", re.M)
PREDICTED = re.compile(r"^predicted: ([\d,]+) tokens/s, ([\d.]+)% of peak FLOP/s$", re.M)


def _number(text: str) -> float:
  return float(text.replace(",", ""))


def test_the_printed_lines_are_the_full_depth_models_cost_of_the_searched_layout():
  out = io.StringIO()
  cpu_with_memory = dataclasses.replace(mtf.cost_model.get_time_model("cpu"), memory_bytes=1e9)
  with tf.Graph().as_default():
    assignment, cost = search_lib.search_deep_model(mlp, 8, "b:2;m:4", cpu_with_memory, 64, file=out)
    graph, outputs = mlp(8)
    rules = list(assignment.items())
    report = mtf.cost_model.estimate_cost(graph, "b:2;m:4", rules, outputs, cpu_with_memory)
  assert assignment  # a split layout
  text = out.getvalue()
  layout = ";".join(f"{d}:{m}" for d, m in sorted(assignment.items()))
  assert f"searched layout: {layout} (searched at 2 and 3 layers, costs extrapolated to 8)" in text
  assert f"Layout {layout} on mesh Shape[b=2, m=4] (8 processors), 8 layers" in text
  fits, predicted = FITS.search(text), PREDICTED.search(text)
  assert fits.group(1) == "yes" and _number(fits.group(2)) == round(report.memory.total_bytes / 1e9, 2)
  assert _number(predicted.group(1)) == round(64 / report.step_s)
  assert cost.step_s == pytest.approx(report.step_s, rel=1e-9)


def test_without_a_fitting_layout_it_shows_the_least_memory_one_and_says_no():
  out = io.StringIO()
  tiny = dataclasses.replace(mtf.cost_model.get_time_model("h100"), memory_bytes=1000.0)
  with tf.Graph().as_default():
    search_lib.search_deep_model(mlp, 8, "b:2;m:4", tiny, tokens_per_step=64, file=out)
  text = out.getvalue()
  assert text.startswith("No layout fits the memory limit of 1,000 bytes per processor")
  assert "no layout fits; the one with the least memory: " in text
  assert FITS.search(text).group(1) == "no" and PREDICTED.search(text)


def test_the_command_line_plans_a_four_layer_transformer_from_two_and_three_layers(capsys):
  bindings = ["num_layers = 4", "d_model = 16", "d_ff = 32", "d_kv = 4", "num_heads = 4"]
  flags = [f"--gin_param={b}" for b in bindings]
  code = explain_main(
    ["--gin_file=models/lm_base.gin", *flags, "--batch=8", "--length=16", "--vocab_size=32",
     "--mesh_shape=b:2;m:4", "--accelerator=h100", "--search"]
  )
  out = capsys.readouterr().out
  assert code == 0
  heading = r"^searched layout: .* \(searched at 2 and 3 layers, costs extrapolated to 4\)$"
  assert re.search(heading, out, re.M)
  assert FITS.search(out).group(1) == "yes" and PREDICTED.search(out)
