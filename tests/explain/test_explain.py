"""mtf.explain and `python -m mesh_tensorflow.explain`: the collectives table, memory, warnings, pictures."""

from __future__ import annotations

import io
import re

import matplotlib

import mesh_tensorflow as mtf
from mesh_tensorflow._explain.cli import main as explain_main
from tests.lowering.test_communication import FAMILIES, _build

TINY_LM = [
  "--gin_file",
  "models/lm_base.gin",
  "--gin_param",
  "num_layers = 1",
  "--gin_param",
  "d_model = 32",
  "--gin_param",
  "d_ff = 64",
  "--gin_param",
  "d_kv = 4",
  "--gin_param",
  "num_heads = 4",
  "--batch",
  "4",
  "--length",
  "8",
  "--vocab_size",
  "32",
]


def test_explain_lists_every_collective_with_op_kind_bytes_mesh_dims_and_reason():
  build_fn, mesh_shape, layout = FAMILIES["einsum"]
  graph, _, _ = _build(build_fn)
  out = io.StringIO()
  explanation = mtf.explain(graph, mesh_shape, layout, file=out)
  text = out.getvalue()
  assert explanation.text in text and explanation.report.events
  for e in explanation.report.events:
    assert f"{e.kind:10} {e.bytes_per_processor:12,.0f}" in text
    assert e.reason in text
  assert "Memory per processor" in text and "Predicted step" in text


def test_a_sequence_split_attention_layout_is_flagged_with_its_fix(capsys, tmp_path):
  with matplotlib.rc_context({"svg.fonttype": "none"}):  # the SVGs keep their text as text
    assert (
      explain_main(
        TINY_LM
        + [
          "--mesh_shape",
          "batch:2;model:4",
          "--layout",
          "batch:batch;length:model",
          "--plot_dir",
          str(tmp_path),
          "--plot_format",
          "svg",
        ]
      )
      == 0
    )
  text = capsys.readouterr().out
  warning = next(line for line in text.splitlines() if line.startswith("WARNING"))
  assert "sequence-split attention layout" in warning and "length:model" in warning
  assert "Fix: " in warning and (
    "drop the rule length:model" in warning or "replace length:model with" in warning
  )
  labels = {name: re.findall(r"<text[^>]*>([^<]*)</text>", (tmp_path / name).read_text())
            for name in ("tiling.svg", "comm_per_layer.svg")}
  # Each tiled tensor is titled with its name and shape, its axes with its first two dims.
  assert {"transformer/embedding:0", "Shape[vocab=128, d_model=32]", "vocab", "d_model"} <= set(
    labels["tiling.svg"])
  # These variables are split nowhere: each panel says so instead of drawing one block labelled 0.
  assert labels["tiling.svg"].count("nothing split") == 3 and "all 8 processors" in labels["tiling.svg"]
  assert not [label for label in labels["tiling.svg"] if re.fullmatch(r"[−\d.]+", label)]
  # One bar per layer that communicates: the attention block's sequence-split relayouts among them.
  assert {"transformer/block_000", "bytes sent per processor"} <= set(labels["comm_per_layer.svg"])


def test_the_usual_model_parallel_layout_gets_no_relayout_warning(capsys):
  assert (
    explain_main(
      TINY_LM
      + ["--mesh_shape", "batch:2;model:4", "--layout", "batch:batch;d_ff:model;heads:model;vocab:model"]
    )
    == 0
  )
  assert "sequence-split" not in capsys.readouterr().out


def test_pictures_without_matplotlib_say_how_to_install_it(monkeypatch, tmp_path):
  import builtins

  real_import = builtins.__import__

  def no_matplotlib(name, *args, **kwargs):
    if name.startswith("matplotlib"):
      raise ImportError("No module named 'matplotlib'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_matplotlib)
  build_fn, mesh_shape, layout = FAMILIES["einsum"]
  graph, _, _ = _build(build_fn)
  try:
    mtf.explain(graph, mesh_shape, layout, file=io.StringIO(), plot_dir=str(tmp_path))
  except ImportError as e:
    assert "pip install 'mesh-tensorflow[plot]'" in str(e)
  else:
    raise AssertionError("expected an ImportError")


def test_tiling_grid_shows_which_processor_holds_each_block():
  from mesh_tensorflow._explain.plots import comm_bytes_per_layer, owner_grid
  mesh_shape = mtf.convert_to_shape("x:2;y:4")
  grid = owner_grid(mtf.convert_to_shape("a:4;b:8;c:3"), mesh_shape, mtf.convert_to_layout_rules("a:x;b:y"))
  assert grid.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
  grid = owner_grid(mtf.convert_to_shape("b:8"), mesh_shape, mtf.convert_to_layout_rules("b:x"))
  assert grid.tolist() == [[0], [4]]  # one tensor dimension, split over x; replicated over y
  build_fn, mesh_shape, layout = FAMILIES["einsum"]
  graph, _, _ = _build(build_fn)
  events = mtf.cost_model.estimate_cost(graph, mesh_shape, layout).events
  per_layer = comm_bytes_per_layer(events)
  assert sum(per_layer.values()) == sum(e.bytes_per_processor for e in events)


def test_tiling_titles_name_each_split_and_ticks_count_the_blocks(tmp_path):
  from mesh_tensorflow._explain.plots import split_summary
  mesh_shape = mtf.convert_to_shape("batch:2;model:4")
  rules = mtf.convert_to_layout_rules("batch:batch;d_ff:model")
  assert split_summary(mtf.convert_to_shape("d_model:8;d_ff:16"), mesh_shape, rules) == "d_ff→model"
  assert split_summary(mtf.convert_to_shape("d_model:8"), mesh_shape, rules) == "nothing split"
  with matplotlib.rc_context({"svg.fonttype": "none"}):
    explain_main(TINY_LM + ["--mesh_shape", "batch:2;model:4", "--layout", "batch:batch;d_ff:model",
                            "--plot_dir", str(tmp_path), "--plot_format", "svg"])
  labels = re.findall(r"<text[^>]*>([^<]*)</text>", (tmp_path / "tiling.svg").read_text())
  assert "d_ff→model" in labels  # the two feed-forward kernels, split over model's 4 processors
  assert {"0", "1", "2", "3"} <= set(labels)


def _explained(capsys, mesh_shape: str, layout: str, *extra: str) -> str:
  assert explain_main(
    TINY_LM + ["--batch", "8", "--mesh_shape", mesh_shape, "--layout", layout, *extra]
  ) == 0
  return capsys.readouterr().out


def _table(text: str) -> list:
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("op "))
  return lines[start + 1 : lines.index("", start)]


def test_table_rows_name_each_collective_whole_so_no_two_rows_read_the_same(capsys):
  rows = _table(_explained(capsys, "batch:8", "batch:batch"))
  assert len(rows) == 11 and len(set(rows)) == len(rows)
  # The four attention projections' weight gradients, cut at 40 characters before, now differ.
  for name in ("einsum", "einsum_1", "einsum_2", "einsum_5"):
    assert any(r.startswith(f"transformer/block_000/layer_000/SelfAttention/{name}/gradients/einsum_1 ")
               for r in rows)


def test_collectives_that_move_no_bytes_are_folded_into_one_line(capsys):
  rows = _table(_explained(capsys, "batch:2;model:4", "batch:batch;length:model"))
  folded = [r for r in rows if r.startswith("(")]
  assert folded == ["(4 more collective(s) move 0 bytes: allsplit, receive)"]
  assert all(not re.search(r"\s0\s+\S+\s+\S+$", r) for r in rows if not r.startswith("("))


def test_plain_data_parallelism_gets_no_warning(capsys):
  text = _explained(capsys, "batch:8", "batch:batch")
  assert "WARNING" not in text and "No avoidable communication found." in text


def test_a_tiny_model_on_a_tpu_is_predicted_far_below_peak(capsys):
  text = _explained(capsys, "batch:2;model:4", "batch:batch", "--accelerator", "tpu_v3")
  step = re.search(r"overhead \(ops and step\) ([\d.]+)\.$", text, re.M)
  utilization = float(re.search(r"^predicted: [\d,]+ tokens/s, ([\d.]+)% of peak", text, re.M).group(1))
  assert float(step.group(1)) >= 0.03 and utilization < 1.0
