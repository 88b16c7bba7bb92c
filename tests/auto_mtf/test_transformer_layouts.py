"""On the bundled Transformer, the searched layout is at least as good as every hand-written one."""

from __future__ import annotations

import glob
import os
import re

import gin
import pytest

import mesh_tensorflow as mtf
from mesh_tensorflow import auto_mtf, cost_model
from mesh_tensorflow._explain.transformer_graph import build_transformer_graph
from mesh_tensorflow.transformer._utils.gin_config import packaged_gin_dir

# Small but realistic: every dimension a layout file splits divides 8.
BINDINGS = ["num_layers = 2", "d_model = 64", "d_ff = 256", "d_kv = 8", "num_heads = 8"]
# Hand layouts in the docs (docs/transformer.md, docs/layouts.md), besides the gin layouts/ files.
DOC_LAYOUTS = {
  "batch:2;model:4": ["batch:batch;d_ff:model;heads:model;vocab:model", "batch:batch;d_ff:model;heads:model"],
  "model:8": ["d_ff:model;heads:model;vocab:model"],
}


def _gin_layouts(mesh_shape: str) -> list:
  """layout_rules of the shipped layouts/*.gin files whose mesh shape is `mesh_shape`."""
  out = []
  for path in sorted(glob.glob(os.path.join(packaged_gin_dir(), "layouts", "*.gin"))):
    text = open(path).read()
    mesh = re.search(r'utils.run.mesh_shape = "([^"]*)"', text).group(1)
    if mtf.convert_to_shape(mesh) == mtf.convert_to_shape(mesh_shape):
      out.append(re.search(r'utils.run.layout_rules = "([^"]*)"', text).group(1))
  return out


@pytest.fixture(scope="module")
def transformer():
  gin.clear_config()
  try:
    yield build_transformer_graph(["models/lm_base.gin"], BINDINGS, batch=8, length=32, vocab_size=256)
  finally:
    gin.clear_config()


@pytest.mark.parametrize("mesh_shape", ["batch:2;model:4", "model:8"])
def test_searched_layout_is_at_least_as_good_as_every_hand_layout(transformer, mesh_shape):
  graph, loss = transformer
  hand = _gin_layouts(mesh_shape) + DOC_LAYOUTS[mesh_shape]
  assert len(_gin_layouts(mesh_shape)) >= 1
  searched = auto_mtf.layout(graph, mesh_shape, [loss], num_devices=8)
  best = cost_model.estimate_cost(graph, mesh_shape, searched, [loss]).step_s
  for rules in hand:
    assert best <= cost_model.estimate_cost(graph, mesh_shape, rules, [loss]).step_s, rules
