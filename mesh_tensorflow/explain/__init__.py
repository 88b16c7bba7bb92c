"""Explains a layout: every collective, per-processor memory, and the communication a rule change would avoid.

    mtf.explain(graph, "batch:2;model:4", "batch:batch;heads:model", outputs=[loss], plot_dir="/tmp/x")

or, for a gin-configured Transformer (package gin files + bindings):

    python -m mesh_tensorflow.explain --gin_file models/lm_base.gin --gin_param "num_layers = 2" \\
        --mesh_shape "batch:2;model:4" --layout "batch:batch;length:model" [--plot_dir DIR]

Both print, after the table, `fits: yes|no (<used> of <limit> per processor)` against the
accelerator's memory and `predicted: <N> tokens/s, <U>% of peak FLOP/s`. `--accelerator tpu_v3`
(or a100, h100, tpu_v4, tpu_v5e) picks the accelerator; `--search` replaces --layout by the
layout auto_mtf finds within the accelerator's memory; `--remat` rematerialises every layer.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

from mesh_tensorflow._cost import model as cost_model
from mesh_tensorflow._explain import report as report_lib


@dataclasses.dataclass(frozen=True)
class Explanation:
  """The cost report, the avoidable-communication warnings, the printed text and any picture paths."""

  report: cost_model.CostReport
  warnings: tuple
  text: str
  pictures: tuple = ()
  tokens_per_step: Optional[int] = None

  @property
  def fits(self) -> Optional[bool]:
    """Whether the layout fits the accelerator's memory per processor (None: no memory size known)."""
    limit = self.report.time_model.memory_bytes
    return None if limit is None else self.report.memory.fits(limit)

  @property
  def tokens_per_s(self) -> Optional[float]:
    return self.tokens_per_step / self.report.step_s if self.tokens_per_step else None

  @property
  def utilization(self) -> float:
    """The share of peak FLOP/s the predicted step uses."""
    return report_lib.utilization(self.report)


def explain(
  graph,
  mesh_shape,
  layout_rules,
  outputs=(),
  time_model=None,
  file=None,
  plot_dir: Optional[str] = None,
  plot_format: str = "png",
  plot_tensors=None,
  tokens_per_step: Optional[int] = None,
) -> Explanation:
  """Prints (to `file`, default stdout) and returns the explanation of a layout of `graph`.

  Args:
    graph: an mtf Graph on one mesh.
    mesh_shape, layout_rules: as for mtf.dry_run.
    outputs: tensors kept to the end of the step (for memory).
    time_model: a TimeModel or a preset name: "cpu", "gpu", "tpu", or an accelerator with its memory
      size ("tpu_v3", "tpu_v4", "tpu_v5e", "a100", "h100"; see mtf.cost_model).
    plot_dir: if given, writes tiling.<fmt> and comm_per_layer.<fmt> there (needs matplotlib).
    plot_format: "png" or "svg".
    plot_tensors: mtf Tensors whose tiling to draw (default: the three largest variables).
    tokens_per_step: tokens one step trains on (batch x length), for the predicted tokens/s.
  """
  report = cost_model.estimate_cost(graph, mesh_shape, layout_rules, outputs, time_model)
  warnings = tuple(report_lib.avoidable_communication(graph, report, outputs))
  text = report_lib.format_report(graph, report, warnings, tokens_per_step)
  print(text, file=file or sys.stdout)
  pictures = ()
  if plot_dir is not None:
    from mesh_tensorflow._explain import plots

    if plot_tensors is None:
      variables = sorted(graph.trainable_variables, key=lambda v: -v.outputs[0].size)
      plot_tensors = [v.outputs[0] for v in variables[:3]]
    pictures = tuple(plots.draw(report, list(plot_tensors), plot_dir, plot_format))
  return Explanation(report, warnings, text, pictures, tokens_per_step)


def main(argv=None) -> int:
  """The command line: explains a layout of a gin-configured Transformer's training step."""
  import argparse

  parser = argparse.ArgumentParser(
    prog="python -m mesh_tensorflow.explain",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--gin_file", action="append", default=[], help="gin file (package-relative or a path)")
  parser.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. 'd_model = 64'")
  parser.add_argument("--mesh_shape", required=True)
  parser.add_argument("--layout", help="layout rules (required unless --search)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=32)
  parser.add_argument("--vocab_size", type=int, default=256)
  presets = sorted(cost_model.time_model_lib.PRESETS)
  parser.add_argument("--time_model", "--accelerator", dest="time_model", default="cpu", choices=presets)
  parser.add_argument("--search", action="store_true", help="search the layout within the memory limit")
  parser.add_argument("--remat", action="store_true", help="rematerialise every layer on the backward pass")
  parser.add_argument("--plot_dir", default=None)
  parser.add_argument("--plot_format", default="png", choices=["png", "svg"])
  args = parser.parse_args(argv)
  if not args.search and not args.layout:
    parser.error("give --layout, or --search to find one")
  from mesh_tensorflow._explain.transformer_graph import build_transformer_graph

  bindings = args.gin_param + (["LayerStack.recompute_grads = True"] if args.remat else [])
  graph, loss = build_transformer_graph(args.gin_file, bindings, args.batch, args.length, args.vocab_size)
  layout = args.layout
  if args.search:
    from mesh_tensorflow.auto_mtf import api as auto_mtf_api

    time_model = cost_model.time_model_lib.get_time_model(args.time_model)
    rules = auto_mtf_api.layout(
      graph, args.mesh_shape, [loss], memory_limit_bytes=time_model.memory_bytes, time_model=time_model
    )
    layout = ";".join(f"{d}:{m}" for d, m in rules)
    print(f"searched layout: {layout or '(replicated)'}")
  try:
    explanation = explain(
      graph,
      args.mesh_shape,
      layout,
      [loss],
      args.time_model,
      plot_dir=args.plot_dir,
      plot_format=args.plot_format,
      tokens_per_step=args.batch * args.length,
    )
  except ImportError as e:
    print(e, file=sys.stderr)
    return 1
  for path in explanation.pictures:
    print(f"wrote {path}")
  return 0
