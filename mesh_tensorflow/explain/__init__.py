"""Explains a layout: every collective, per-processor memory, and the communication a rule change would avoid.

    mtf.explain(graph, "batch:2;model:4", "batch:batch;heads:model", outputs=[loss], plot_dir="/tmp/x")

or, for a gin-configured Transformer (package gin files + bindings):

    python -m mesh_tensorflow.explain --gin_file models/lm_base.gin --gin_param "num_layers = 2" \\
        --mesh_shape "batch:2;model:4" --layout "batch:batch;length:model" [--plot_dir DIR]

Both print, after the table, `fits: yes|no (<used> of <limit> per processor)` against the
accelerator's memory and `predicted: <N> tokens/s, <U>% of peak FLOP/s`. `--accelerator tpu_v3`
(or a100, h100, tpu_v4, tpu_v5e) picks the accelerator; `--search` replaces --layout by the
layout auto_mtf finds within the accelerator's memory; `--remat` rematerialises every layer.
On a model deeper than 3 layers `--search` then also prices pipelined layouts (mesh
`stage:S;b:x;m:y` for the same number of processors, microbatches, recompute; docs/pipeline.md)
and prints the fastest that fits with its schedule; `--no_pipeline_search` leaves them out.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

from mesh_tensorflow._cost import model as cost_model
from mesh_tensorflow._explain import plots
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
    if plot_tensors is None:
      variables = sorted(graph.trainable_variables, key=lambda v: -v.outputs[0].size)
      plot_tensors = [v.outputs[0] for v in variables[:3]]
    pictures = tuple(plots.draw(report, list(plot_tensors), plot_dir, plot_format))
  return Explanation(report, warnings, text, pictures, tokens_per_step)
