"""The explanation of a layout: the collectives table, per-processor memory and avoidable communication."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from mesh_tensorflow._core.layout import convert_to_layout_rules
from mesh_tensorflow._cost import model as cost_model
from mesh_tensorflow.auto_mtf import _solver, valid_layouts


@dataclasses.dataclass(frozen=True)
class LayoutWarning:
  """Communication a different layout rule would avoid."""

  rule: str
  bytes_per_processor: float
  ops: tuple
  kinds: tuple
  fix: str
  predicted_s: float
  fixed_s: float

  def __str__(self):
    what = "a sequence-split attention layout: " if self.rule.split(":")[0] in _SEQUENCE else ""
    return (
      f"WARNING: {what}the rule {self.rule} makes {self.bytes_per_processor:,.0f} bytes per processor of "
      f"{'/'.join(self.kinds)} in {len(self.ops)} op(s) ({', '.join(self.ops[:3])}"
      f"{', ...' if len(self.ops) > 3 else ''}). Fix: {self.fix} (the search's estimate of "
      f"compute + communication: {self.predicted_s * 1e3:.3f} ms -> {self.fixed_s * 1e3:.3f} ms)."
    )


_SEQUENCE = frozenset({"length", "memory_length", "memory", "sequence"})


def _rules_of(layout_rules) -> list:
  return sorted(convert_to_layout_rules(layout_rules)._pairs)


def event_rules(graph, report) -> dict:
  """{"dim:mesh_dim": [events]}: each event goes to the rules on its mesh axes that split its op's dims."""
  ops = {op.name: op for op in graph.operations}
  for op in graph.operations:
    for nested in op.nested_operations():
      ops.setdefault(nested.name, nested)
  mesh_names = [d.name for d in report.mesh_shape.dims]
  out = collections.defaultdict(list)
  for e in report.events:
    op = ops.get(e.op_name)
    dims = {n for t in (*op.inputs, *op.outputs) for n in t.shape.dimension_names} if op else set()
    for d, m in _rules_of(report.layout_rules):
      if d in dims and m in mesh_names and mesh_names.index(m) in e.mesh_axes:
        out[f"{d}:{m}"].append(e)
  return out


def avoidable_communication(graph, report, outputs=(), threshold: float = 0.01) -> list:
  """Warnings for rules whose communication another rule would avoid, each with the best such rule.

  A rule is flagged when it makes a reshape or rename move data (the dimension and its renamed
  copy are laid out differently, as when attention renames a split sequence), or when removing it
  or moving its mesh dimension to another dimension makes the step more than `threshold`
  (relative) faster. Alternatives are scored by the layout search's fast estimate. Plain data
  parallelism is not flagged (see `is_data_parallel`).
  """
  validator = valid_layouts.LayoutValidator(graph, report.mesh_shape)
  problem = _solver.Problem(graph, report.mesh_shape, validator, outputs, report.time_model)
  # Rules for mesh dimensions this mesh lacks do not apply (the dry run warned about likely typos).
  current = {d: m for d, m in _rules_of(report.layout_rules) if d in problem.dims and m in problem.mesh_names}
  warnings = []
  ops = {op.name: op for op in graph.operations}
  for rule, events in sorted(event_rules(graph, report).items()):
    dim, mesh_dim = rule.split(":")
    if dim not in current or is_data_parallel(graph, dim, events, ops):
      continue
    alternatives = [({d: m for d, m in current.items() if d != dim}, f"drop the rule {rule}")]
    for other in problem.dims:
      if other not in current and validator.is_valid_assignment(other, mesh_dim):
        alt = {d: m for d, m in current.items() if d != dim}
        alt[other] = mesh_dim
        alternatives.append((alt, f"replace {rule} with {other}:{mesh_dim}"))
    rows = [_row(problem, a) for a in [current] + [a for a, _ in alternatives]]
    valid = [i for i, r in enumerate(rows) if r is not None]
    seconds, _ = problem.estimate(np.array([rows[i] for i in valid]))
    scores = dict(zip(valid, seconds))
    best = min((i for i in valid if i > 0), key=lambda i: scores[i], default=None)
    # Layout changes in a reshape or rename are avoidable by construction: a dimension and its
    # renamed copy are laid out differently (a split sequence is all-gathered for attention).
    relayout = any(e.reason == "reshape_op" and e.bytes_sent for e in events)
    if 0 in scores and best is not None and (relayout or scores[best] < scores[0] * (1 - threshold)):
      warnings.append(
        LayoutWarning(
          rule=rule,
          bytes_per_processor=sum(e.bytes_per_processor for e in events),
          ops=tuple(dict.fromkeys(e.op_name for e in events)),
          kinds=tuple(sorted({e.kind for e in events})),
          fix=alternatives[best - 1][1],
          predicted_s=float(scores[0]),
          fixed_s=float(scores[best]),
        )
      )
  return sorted(warnings, key=lambda w: -w.bytes_per_processor)


def is_data_parallel(graph, dim: str, events, ops: dict) -> bool:
  """Whether a rule is plain data parallelism: `dim` is in no variable and its only communication
  sums gradients over `dim` (a gradient op whose output lacks `dim`).

  That sum is the price of sharing the step among processors; the only rule change that removes
  it replicates the work on every processor (on a small model it is predicted faster, which says
  to use fewer processors, not to change the layout).
  """
  if any(dim in v.outputs[0].shape.dimension_names for v in graph.trainable_variables):
    return False
  for e in events:
    op = ops.get(e.op_name)
    if e.reason == "reshape_op" or op is None or not op.outputs or "/gradients/" not in f"/{op.name}/":
      return False
    if dim in op.outputs[0].shape.dimension_names:
      return False
  return True


def _row(problem, assignment: dict):
  """The assignment as a solver row, or None if it breaks a per-tensor constraint."""
  row = [problem.mesh_names.index(assignment[d]) if d in assignment else -1 for d in problem.dims]
  for a, b in problem.conflicts:
    ra, rb = row[problem.dims.index(a)], row[problem.dims.index(b)]
    if ra >= 0 and ra == rb:
      return None
  return row


def fits_line(report: cost_model.CostReport) -> str:
  """`fits: yes|no (<used> of <limit> per processor)` against the time model's memory size."""
  limit, used = report.time_model.memory_bytes, report.memory.total_bytes
  if limit is None:
    return (
      f"fits: unknown ({_gb(used)} per processor; the {report.time_model.name} time model has no "
      f"memory size: pass an accelerator such as tpu_v3 or h100)"
    )
  return f"fits: {'yes' if report.memory.fits(limit) else 'no'} ({_gb(used)} of {_gb(limit)} per processor)"


def predicted_line(report: cost_model.CostReport, tokens_per_step=None) -> str:
  """`predicted: <N> tokens/s, <U>% of peak FLOP/s` (steps/s when the tokens per step are unknown)."""
  rate = (
    f"{tokens_per_step / report.step_s:,.0f} tokens/s"
    if tokens_per_step
    else f"{1 / report.step_s:,.3g} steps/s"
  )
  return f"predicted: {rate}, {100 * utilization(report):.1f}% of peak FLOP/s"


def utilization(report: cost_model.CostReport) -> float:
  """The share of the processor's peak FLOP/s the predicted step uses."""
  return report.flops / (report.step_s * report.time_model.flops_per_s)


def _gb(num_bytes: float) -> str:
  return f"{num_bytes / 1e9:,.2f} GB"


def memory_sum(m) -> str:
  """`Memory per processor: variables ... = <total> bytes`: the memory report's terms and their sum."""
  return (
    f"Memory per processor: variables {m.variable_bytes:,} + optimizer state {m.slot_bytes:,} + activation "
    f"peak {m.activation_peak_bytes:,} + communication buffer {m.comm_buffer_bytes:,} = {m.total_bytes:,} "
    f"bytes"
  )


def step_line(report) -> str:
  """`Predicted step (<time model>): <ms> = compute + communication + overhead (ops and step)`."""
  return (
    f"Predicted step ({report.time_model.name} time model): {report.step_s * 1e3:.3f} ms = compute "
    f"{report.compute_s * 1e3:.3f} + communication {report.comm_s * 1e3:.3f} + overhead (ops and step) "
    f"{report.overhead_s * 1e3:.3f}."
  )


def collective_rows(graph, report) -> list:
  """The collectives table: one row per collective that moves bytes, then one line for any that move none.

  Names are printed whole (the widest sets the column), so rows of different ops never read the
  same; the tensor column gives the op's output shape, which tells apart the collectives of one op.
  """
  ops = {op.name: op for op in graph.operations}
  moving = [e for e in report.events if e.bytes_per_processor > 0]
  cells = []
  for e in moving:
    op = ops.get(e.op_name)
    tensor = _shape_text(op.outputs[0].shape) if op is not None and op.outputs else ""
    mesh_dims = ",".join(cost_model.mesh_dim_names(report.mesh_shape, e.mesh_axes))
    loop = f" (per iteration of {e.in_loop})" if e.in_loop else ""
    cells.append((e.op_name, tensor, e.kind, f"{e.bytes_per_processor:,.0f}", mesh_dims, e.reason + loop))
  header = ("op", "output shape", "kind", "bytes/proc", "mesh dims", "why")
  widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header) - 1)]
  widths[2], widths[3] = max(widths[2], 10), max(widths[3], 12)  # `kind bytes` as tests and docs read them

  def row(c):
    op, tensor, kind, sent, mesh_dims, why = c
    w = widths
    return f"{op:{w[0]}} {tensor:{w[1]}} {kind:{w[2]}} {sent:>{w[3]}} {mesh_dims:{w[4]}} {why}"

  lines = [row(header)] + [row(c) for c in cells]
  idle = len(report.events) - len(moving)
  if idle:
    kinds = ", ".join(sorted({e.kind for e in report.events if e.bytes_per_processor == 0}))
    lines.append(f"({idle} more collective(s) move 0 bytes: {kinds})")
  if not report.events:
    lines.append("(no communication)")
  return lines


def _shape_text(shape) -> str:
  return "[" + ", ".join(f"{d.name}:{d.size}" for d in shape.dims) + "]"


def format_report(graph, report: cost_model.CostReport, warnings, tokens_per_step=None) -> str:
  """The text explanation: collectives table, memory, time, the fits/predicted lines and warnings."""
  lines = [
    f"Layout {';'.join(f'{d}:{m}' for d, m in _rules_of(report.layout_rules)) or '(replicated)'} "
    f"on mesh {report.mesh_shape} ({report.mesh_shape.size} processors)",
    "",
    *collective_rows(graph, report),
  ]
  m = report.memory
  lines += [
    "",
    f"Collectives: {len(report.events)}, {report.comm_bytes_per_processor:,.0f} bytes sent per processor.",
    f"{memory_sum(m)} (the peak holds the gradients alive then, {m.gradient_bytes:,} bytes for all "
    f"variables; {'layers rematerialised' if m.remat else 'no rematerialisation'}).",
    f"Compute per processor: {report.flops:,} FLOPs.",
    step_line(report),
    fits_line(report),
    predicted_line(report, tokens_per_step),
  ]
  lines += [""] + [str(w) for w in warnings] if warnings else ["", "No avoidable communication found."]
  return "\n".join(lines)
