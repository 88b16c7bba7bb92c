"""explain --search on a deep Transformer also searches pipelined layouts (stage counts, a stage's
mesh, microbatches, recompute): the ≈100B decoder on 512 TPU v3 chips, where no 2-D layout fits."""

from __future__ import annotations

import re

from mesh_tensorflow._explain import cli

MODEL_100B = ["--gin_file=models/lm_base.gin", "--gin_param=num_layers = 64", "--gin_param=d_model = 12288",
              "--gin_param=d_ff = 49152", "--gin_param=num_heads = 96", "--gin_param=d_kv = 128",
              "--gin_param=Unitransformer.max_length = 2048", "--length=2048", "--vocab_size=32768",
              "--accelerator=tpu_v3", "--mesh_shape=b:16;m:32"]


def test_a_pipelined_layout_fits_the_100b_model_at_1024_x_2048_tokens_where_no_2d_layout_does(capsys):
  """The issue's batch: only a pipeline whose microbatches are the outer batch, split over the
  stages with the embedding and the loss, fits (the fixed part on every stage in full does not)."""
  assert cli.main([*MODEL_100B, "--batch=1024", "--search"]) == 0
  out = capsys.readouterr().out
  two_d, pipelined = out.split("pipelined layouts (")
  assert "no layout fits" in two_d and re.search(r"^fits: no ", two_d, re.M)
  found = re.search(r"^searched pipelined layout: (\S+) on mesh (\S+)$", pipelined, re.M)
  assert found and found.group(1).startswith("outer_batch:stage;stages:stage;")
  assert found.group(2).startswith("stage:")
  assert re.search(r"^fits: yes \(([\d.]+) GB of 34.36 GB per processor\)$", pipelined, re.M)
  assert re.search(r"^predicted: [\d,]+ tokens/s, [\d.]+% of peak FLOP/s$", pipelined, re.M)
  stages, micro, ticks = map(int, re.search(r"^pipeline: (\d+) stages, (\d+) microbatches, (\d+) ticks",
                                            pipelined, re.M).groups())
  assert ticks == stages + micro - 1
  assert f"tpu_estimator_model_fn.outer_batch_size = {micro}" in pipelined
  assert len(re.findall(r"^stage \d+:.* ~ ", pipelined, re.M)) == stages  # the picture, middle left out
  fitting = [line for line in pipelined.splitlines()[2:] if re.match(r"  stage:.* yes +[\d,]+$", line)]
  assert fitting, pipelined


def test_at_256_x_2048_tokens_the_schedule_is_drawn_whole(capsys):
  assert cli.main([*MODEL_100B, "--batch=256", "--search"]) == 0
  pipelined = capsys.readouterr().out.split("pipelined layouts (")[1]
  stages, ticks = map(int, re.search(r"^pipeline: (\d+) stages, \d+ microbatches, (\d+) ticks",
                                     pipelined, re.M).groups())
  rows = re.findall(r"^stage \d+:(.*)$", pipelined, re.M)
  assert len(rows) == stages and all(len(row.split()) == ticks for row in rows)
  assert re.search(r"^fits: yes ", pipelined, re.M)


def test_no_pipeline_search_leaves_the_pipelines_out(capsys):
  assert cli.main([*MODEL_100B, "--batch=256", "--search", "--no_pipeline_search"]) == 0
  assert "pipelined" not in capsys.readouterr().out


def test_explaining_a_pipelined_layout_prints_its_bubble_and_schedule(capsys):
  argv = ["--gin_file=models/lm_base.gin", "--gin_param=num_layers = 4", "--gin_param=d_model = 32",
          "--gin_param=d_ff = 64", "--gin_param=d_kv = 4",
          "--gin_param=transformer.LayerStack.pipeline_stages = 2",
          "--gin_param=transformer.LayerStack.num_microbatches = 4", "--batch=8", "--length=8",
          "--vocab_size=32", "--mesh_shape=stage:2;batch:2;model:2",
          "--layout=stages:stage;batch:batch;d_ff:model;heads:model;vocab:model"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert ("pipeline: 2 stages, 4 microbatches, 5 ticks of 2 layer(s), bubble 20.0% of every stage's "
          "ticks") in out
  assert "stage 0: 0 1 2 3 .\nstage 1: . 0 1 2 3" in out
