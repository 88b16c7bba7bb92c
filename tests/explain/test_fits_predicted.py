"""The explainer's `fits` and `predicted` lines: present, computed as documented, and right at pod scale."""

from __future__ import annotations

import io
import re

import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._explain.transformer_graph import build_transformer_graph
from mesh_tensorflow._explain.cli import main as explain_main

TINY = ["num_layers = 1", "d_model = 16", "d_ff = 32", "d_kv = 4", "num_heads = 4"]
FITS = re.compile(r"^fits: (yes|no) \(([\d,.]+) GB of ([\d,.]+) GB per processor\)$", re.M)
PREDICTED = re.compile(r"^predicted: ([\d,]+) tokens/s, ([\d.]+)% of peak FLOP/s$", re.M)


def _number(text: str) -> float:
  return float(text.replace(",", ""))


def test_explain_prints_fits_and_predicted_lines_computed_from_the_report():
  with tf.Graph().as_default():
    graph, loss = build_transformer_graph(["models/lm_base.gin"], TINY, batch=8, length=16, vocab_size=32)
  out = io.StringIO()
  explanation = mtf.explain(
    graph, "b:2;m:4", "batch:b;d_ff:m", [loss], "tpu_v3", file=out, tokens_per_step=128
  )
  report = explanation.report
  fits, predicted = FITS.search(out.getvalue()), PREDICTED.search(out.getvalue())
  assert fits.group(1) == "yes" and explanation.fits is True
  assert _number(fits.group(2)) == round(report.memory.total_bytes / 1e9, 2)
  assert _number(fits.group(3)) == round(32 * 2**30 / 1e9, 2)
  assert _number(predicted.group(1)) == round(128 / report.step_s)
  utilization = report.flops / (report.step_s * 123e12)
  assert _number(predicted.group(2)) == round(100 * utilization, 1) and 0 < utilization < 1
  assert explanation.tokens_per_s == 128 / report.step_s


def test_a_data_parallel_100b_parameter_model_does_not_fit_512_tpu_v3_chips_and_a_split_one_does():
  """Transformer-sized weights of 56 layers (d_model 12288, d_ff 49152, 96 heads of 128), stacked."""
  with tf.Graph().as_default():  # graph mode: eager would initialise 200 GB of weights
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    layers, batch = mtf.Dimension("layers", 56), mtf.Dimension("batch", 512)
    d_model, d_ff, heads = (
      mtf.Dimension("d_model", 12288),
      mtf.Dimension("d_ff", 49152),
      mtf.Dimension("heads", 96),
    )
    qkvo, d_kv = mtf.Dimension("qkvo", 4), mtf.Dimension("d_kv", 128)
    x = mtf.random_uniform(mesh, [batch, d_model], dtype=tf.bfloat16)
    wi = mtf.get_variable(mesh, "wi", [layers, d_model, d_ff], dtype=tf.bfloat16)
    wo = mtf.get_variable(mesh, "wo", [layers, d_ff, d_model], dtype=tf.bfloat16)
    attention = mtf.get_variable(mesh, "attention", [layers, qkvo, d_model, heads, d_kv], dtype=tf.bfloat16)
    h = mtf.relu(mtf.einsum([x, wi], [batch, layers, d_ff]))
    y = mtf.einsum([h, wo], [batch, d_model]) + mtf.reduce_sum(attention, output_shape=[d_model])
    loss = mtf.reduce_mean(mtf.square(y))
  parameters = sum(v.outputs[0].size for v in graph.trainable_variables)
  assert 100e9 < parameters < 102e9
  out = io.StringIO()
  data_parallel = mtf.explain(graph, "all:512", "batch:all", [loss], "tpu_v3", file=out)
  assert data_parallel.fits is False
  assert FITS.search(out.getvalue()).group(1) == "no"
  assert data_parallel.report.memory.variable_bytes == 2 * parameters  # every chip holds all of it
  split = mtf.explain(graph, "b:16;m:32", "d_model:b;d_ff:m;heads:m", [loss], "tpu_v3", file=out)
  assert split.fits is True and split.report.memory.variable_bytes < 2 * parameters / 256


def test_the_command_line_searches_within_the_accelerators_memory_and_prints_both_lines(capsys):
  flags = [f"--gin_param={b}" for b in TINY] + ["--batch=8", "--length=16", "--vocab_size=32"]
  code = explain_main(
    ["--gin_file=models/lm_base.gin", *flags, "--mesh_shape=b:2;m:4", "--accelerator=h100", "--search"]
  )
  out = capsys.readouterr().out
  assert code == 0
  searched = re.search(r"^searched layout: (.*)$", out, re.M).group(1)
  assert re.search(rf"^Layout {re.escape(searched)} on mesh", out, re.M)
  assert FITS.search(out).group(1) == "yes" and PREDICTED.search(out)
  assert "(h100 time model)" in out
