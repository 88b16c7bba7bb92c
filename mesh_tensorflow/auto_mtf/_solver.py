"""The layout search: exact enumeration under a fast estimate, then exact costing of the best few.

A layout assigns each splittable dimension to at most one mesh dimension that divides it, and no
tensor may use a mesh dimension twice. These spaces are small (a Transformer has about ten
splittable dimensions; a 2-D mesh gives each three choices, minus conflicts), so every valid
assignment is enumerated and scored at once with NumPy by a fast estimate of the cost model:
FLOPs per processor (exact, per `_cost/flops.py`), the allreduces of contracted split dimensions
(einsum, reductions), the layout changes of reshapes (the lowering's own planner), variable
slices and the activation peak under one schedule. The `top_k` best by that estimate are then
costed exactly (`estimate_cost`: a dry run gives the lowering's true communication) and the
best of them is returned. No external solver: OR-tools' CP-SAT crashes in a process that has
loaded TensorFlow 2.21, and a MILP cannot express the max-over-schedule memory peak compactly.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import types
from typing import Optional

import numpy as np

from mesh_tensorflow._core.dims import Shape, names_with_two_sizes
from mesh_tensorflow._core.layout import convert_to_layout_rules
from mesh_tensorflow._cost import flops as flops_lib
from mesh_tensorflow._cost import graph_interface, scheduler
from mesh_tensorflow._cost import model as cost_model
from mesh_tensorflow._lowering import plan as plan_lib

MAX_ENUMERATED = 200_000
_NO_COMM_KINDS = frozenset({"ReshapeOperation", "Variable", "Assign", "Depend"})


@dataclasses.dataclass(frozen=True)
class Solution:
  """An assignment {tensor dim: mesh dim}, its estimated and (if costed) exact cost."""

  assignment: dict
  estimated_s: float
  estimated_memory: float
  report: Optional[cost_model.CostReport] = None

  @property
  def layout_string(self) -> str:
    return ";".join(f"{d}:{m}" for d, m in sorted(self.assignment.items()))

  @property
  def key(self) -> tuple:
    """Order of preference: predicted step time, then memory, then more split dimensions, then
    fewer dimensions on a mesh dimension of another name.

    The third is upstream's tie-break (its objective subtracted the number of assignments): a
    dimension that a size-1 mesh dimension can take is assigned to it. The last makes a tie on a
    mesh named `batch:2;model:2` give batch:batch;d_ff:model, not batch:model;d_ff:batch.
    """
    memory = self.report.memory.total_bytes if self.report else self.estimated_memory
    return (self.step_s, memory, -len(self.assignment), misnamed_splits(self.assignment))

  @property
  def step_s(self) -> float:
    return self.report.step_s if self.report else self.estimated_s


def misnamed_splits(assignment: dict) -> int:
  """How many tensor dims the assignment puts on a mesh dim of another name (a tie-break)."""
  return sum(dim != mesh_dim for dim, mesh_dim in assignment.items())


class Problem:
  """The layouts of one graph on one mesh, scored by the fast estimate (see the module docstring)."""

  def __init__(self, graph, mesh_shape: Shape, validator, outputs=(), time_model=None, schedule=None):
    self.graph, self.mesh_shape, self.outputs = graph, mesh_shape, list(outputs)
    self.time_model = cost_model.time_model_lib.get_time_model(time_model)
    self.mesh_names = [d.name for d in mesh_shape.dims]
    # A name that one tensor holds with two sizes (a kernel [d_model=6, d_model=2]) cannot be
    # split: its rule would put both dims on one mesh dimension.
    held_twice = {n for op in graph.operations for t in (*op.inputs, *op.outputs)
                  for n in names_with_two_sizes(t.shape)}
    self.dims = sorted(
      d
      for d in validator.splittable_mtf_dimension_names
      if d not in held_twice and any(validator.is_valid_assignment(d, m) for m in self.mesh_names)
    )
    self.domains = {
      d: [None] + [k for k, m in enumerate(self.mesh_names) if validator.is_valid_assignment(d, m)]
      for d in self.dims
    }
    self._index = {d: i for i, d in enumerate(self.dims)}
    self.conflicts = set()
    for op in graph.operations:
      for t in (*op.inputs, *op.outputs):
        names = [n for n in t.shape.dimension_names if n in self._index]
        self.conflicts.update(itertools.combinations(sorted(names), 2))
    self.schedule = schedule
    self._memory_steps = None
    self._reshape_memo = {}
    self._ceil_table = self._ceil_correction_table(graph)

  def Proto(self) -> types.SimpleNamespace:  # noqa: N802  (OR-tools' CpModel.Proto name)
    """The decision variables, one per (splittable dimension, mesh dimension it may take), in the
    form 0.1.21's tests read from its CP-SAT model (`optimizer._model.Proto().variables`). They
    are per dimension name, so repeating an op adds none."""
    return types.SimpleNamespace(
      variables=[(d, self.mesh_names[k]) for d in self.dims for k in self.domains[d] if k is not None]
    )

  # --- enumeration -----------------------------------------------------------------------------
  def count_upper_bound(self) -> int:
    return math.prod(len(v) for v in self.domains.values())

  def assignments(self) -> np.ndarray:
    """Every valid assignment as rows of mesh axis indices (-1: not split), one column per dim."""
    rows, current = [], []
    partners = {d: [e for e in self.dims if (min(d, e), max(d, e)) in self.conflicts] for d in self.dims}

    def extend(i):
      if i == len(self.dims):
        rows.append(list(current))
        return
      d = self.dims[i]
      taken = {current[self._index[e]] for e in partners[d] if self._index[e] < i}
      for axis in self.domains[d]:
        if axis is None or axis not in taken:
          current.append(-1 if axis is None else axis)
          extend(i + 1)
          current.pop()

    extend(0)
    return np.array(rows, dtype=np.int64).reshape(len(rows), len(self.dims))

  def to_row(self, assignment: dict) -> np.ndarray:
    """The row of an assignment {dim: mesh dim name} (the inverse of to_assignment)."""
    row = np.full(len(self.dims), -1)
    for d, m in assignment.items():
      row[self._index[d]] = self.mesh_names.index(m)
    return row

  def to_assignment(self, row) -> dict:
    return {d: self.mesh_names[a] for d, a in zip(self.dims, row) if a >= 0}

  # --- the fast estimate -------------------------------------------------------------------------
  def _indicator(self, names) -> np.ndarray:
    v = np.zeros(len(self.dims))
    for n in names:
      if n in self._index:
        v[self._index[n]] = 1
    return v

  def _axis_use(self, rows: np.ndarray, groups: np.ndarray) -> list:
    """Per mesh axis k: (candidates x groups) bool, True where a dim of the group is on axis k."""
    return [((rows == k).astype(float) @ groups) > 0 for k in range(len(self.mesh_names))]

  def _log_factor(self, uses: list) -> np.ndarray:
    sizes = [math.log(d.size) for d in self.mesh_shape.dims]
    return sum(u * s for u, s in zip(uses, sizes)) if uses else 0.0

  def _ceil_correction_table(self, graph) -> np.ndarray:
    """[dims, mesh axes + 1]: log(n / ceil(n / m)) - log(m) for a dim of size n on an axis of size m.

    Zero where m divides n (every assignment the search enumerates); otherwise it makes a
    processor's share ceil(n / m) of n, as upstream's evaluate_layout counted it. The last column
    (index -1: not split) is zero.
    """
    sizes = {d.name: d.size for op in graph.operations for t in (*op.inputs, *op.outputs)
             for d in t.shape.dims}
    table = np.zeros((len(self.dims), len(self.mesh_names) + 1))
    for i, name in enumerate(self.dims):
      for k, m in enumerate(d.size for d in self.mesh_shape.dims):
        n = sizes[name]
        if n % m:
          table[i, k] = math.log(n / -(-n // m)) - math.log(m)
    return table

  def _log_shrink(self, rows: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """(candidates x groups): log of how many times smaller one processor's share of each group is."""
    correction = self._ceil_table[np.arange(len(self.dims)), rows]  # rows' -1 picks the zero column
    return self._log_factor(self._axis_use(rows, groups)) + correction @ groups

  def estimate(self, rows: np.ndarray) -> tuple:
    """(estimated step seconds, estimated bytes of memory) per row; inf seconds for unplannable rows."""
    tm = self.time_model
    groups, full = [], []
    for op in self.graph.operations:
      f = flops_lib.op_flops(op, Shape([]), convert_to_layout_rules([]))
      if f:
        groups.append(self._indicator({d.name for t in (*op.inputs, *op.outputs) for d in t.shape.dims}))
        full.append(f)
    seconds = np.zeros(len(rows))
    if groups:
      log_factor = self._log_shrink(rows, np.array(groups).T)
      seconds += (np.exp(-log_factor) @ np.array(full)) / tm.flops_per_s
    seconds += self._allreduce_seconds(rows) + self._reshape_seconds(rows)
    return seconds, self._memory(rows)

  def _allreduce_seconds(self, rows: np.ndarray) -> np.ndarray:
    tm = self.time_model
    contracted, outs, out_bytes = [], [], []
    for op in self.graph.operations:
      if type(op).__name__ in _NO_COMM_KINDS or not op.outputs:
        continue
      out_names = {n for t in op.outputs for n in t.shape.dimension_names}
      gone = {n for t in op.inputs for n in t.shape.dimension_names} - out_names
      if gone & set(self.dims):
        contracted.append(self._indicator(gone))
        outs.append(self._indicator(op.outputs[0].shape.dimension_names))
        out_bytes.append(op.outputs[0].size * op.outputs[0].dtype.size)
    if not contracted:
      return np.zeros(len(rows))
    uses = self._axis_use(rows, np.array(contracted).T)
    n = np.exp(self._log_factor(uses))
    slice_bytes = np.array(out_bytes) * np.exp(-self._log_shrink(rows, np.array(outs).T))
    bandwidth = np.full(n.shape, np.inf)
    latency = np.zeros(n.shape)
    for k, name in enumerate(self.mesh_names):
      bandwidth = np.where(uses[k], np.minimum(bandwidth, tm.bandwidth([name])), bandwidth)
      latency = np.where(uses[k], np.maximum(latency, tm.latency([name])), latency)
    seconds = np.where(n > 1, latency + 2 * (1 - 1 / n) * slice_bytes / bandwidth, 0.0)
    return seconds.sum(axis=1)

  def _reshape_seconds(self, rows: np.ndarray) -> np.ndarray:
    reshapes = [op for op in self.graph.operations if type(op).__name__ == "ReshapeOperation"]
    out = np.zeros(len(rows))
    for op in reshapes:
      x, y = op.inputs[0], op.outputs[0]
      cols = sorted(
        {self._index[n] for n in (*x.shape.dimension_names, *y.shape.dimension_names) if n in self._index}
      )
      for i, row in enumerate(rows):
        key = (x.shape, y.shape, tuple(row[cols]), tuple(cols))
        if key not in self._reshape_memo:
          self._reshape_memo[key] = self._plan_seconds(x, y, row)
        out[i] += self._reshape_memo[key]
    return out

  def _plan_seconds(self, x, y, row) -> float:
    rules = convert_to_layout_rules(list(self.to_assignment(row).items()))
    try:
      steps = plan_lib.plan_reshape(x.shape, y.shape, self.mesh_shape, rules)
    except (ValueError, NotImplementedError):
      return math.inf
    p = self.mesh_shape.size
    return sum(
      self.time_model.collective_s(s.bytes_moved(x.dtype.size) / p, [self.mesh_names[s.mesh_axis]])
      for s in steps[:-1]
      if s.bytes_moved(x.dtype.size)
    )

  def _signature(self, tensor) -> tuple:
    return tuple(sorted(set(tensor.shape.dimension_names) & set(self.dims)))

  def memory_steps(self) -> tuple:
    """(steps x signatures bytes of activations live at each scheduled op, signatures' variable bytes).

    A signature is the set of splittable dimension names of a tensor: every tensor of one
    signature shrinks by the same factor under a layout. Tensors are allocated when their op runs
    and freed after their last consumer, as the cost model's memory estimate counts them
    (`_cost.memory._memory_contents`, tensors told apart by identity); the live bytes are kept as
    one running vector, so this is linear in the number of ops. Dominated steps (no more bytes of
    any signature than another step) cannot be a peak and are dropped.
    """
    if self._memory_steps is None:
      self._memory_steps = self._compute_memory_steps()
    return self._memory_steps

  def _compute_memory_steps(self) -> tuple:
    operations = self.graph.operations
    if self.schedule is None:
      self.schedule = memory_schedule(self.graph, self.outputs)
    variables = {v.outputs[0] for v in self.graph.all_variables}
    signatures = {}
    tensor_sig, tensor_bytes = {}, {}
    for op in operations:
      for t in op.outputs:
        tensor_sig[t] = signatures.setdefault(self._signature(t), len(signatures))
        tensor_bytes[t] = t.size * t.dtype.size
    var_vec = np.zeros(len(signatures))
    for t in variables:
      var_vec[tensor_sig[t]] += tensor_bytes[t]
    uses = collections.Counter(t for op in operations for t in op.inputs)
    uses.update(self.outputs)
    live, current, steps = set(), np.zeros(len(signatures)), []

    def free(t):
      if t in live:
        live.discard(t)
        current[tensor_sig[t]] -= tensor_bytes[t]

    for index in self.schedule:
      op = operations[index]
      for t in op.outputs:
        if t not in variables and t not in live:
          live.add(t)
          current[tensor_sig[t]] += tensor_bytes[t]
      steps.append(current.copy())
      for t in op.outputs:
        if uses[t] == 0:
          free(t)
      for t in op.inputs:
        uses[t] -= 1
        if uses[t] == 0:
          free(t)
    steps = _undominated(np.unique(np.array(steps), axis=0)) if steps else np.zeros((1, len(signatures)))
    groups = np.array([self._indicator(sig) for sig in signatures]).reshape(len(signatures), len(self.dims))
    return steps, var_vec, groups.T

  def _memory(self, rows: np.ndarray) -> np.ndarray:
    steps, var_vec, groups = self.memory_steps()
    inverse = np.exp(-self._log_shrink(rows, groups))  # candidates x signatures
    peak = np.zeros(len(rows))
    for start in range(0, len(rows), 4096):
      chunk = inverse[start : start + 4096]
      peak[start : start + 4096] = (chunk @ steps.T).max(axis=1) + chunk @ var_vec
    return peak

  # --- exact costs -------------------------------------------------------------------------------
  def cost_report(self, assignment: dict) -> cost_model.CostReport:
    """The cost model's report of `assignment` (a dry run); ValueError if the lowering rejects it."""
    self.memory_steps()  # fixes the schedule
    return cost_model.estimate_cost(
      self.graph, self.mesh_shape, list(assignment.items()), self.outputs, self.time_model,
      schedule=self.schedule,
    )

  def memory_report(self, assignment: dict):
    """The cost model's memory report of `assignment` (no dry run)."""
    self.memory_steps()
    return cost_model.memory_lib.estimate_memory(
      self.graph, self.mesh_shape, list(assignment.items()), self.outputs, schedule=self.schedule
    )

  def dimension_sizes(self) -> dict:
    return {d.name: d.size for op in self.graph.operations for t in op.outputs for d in t.shape.dims}


def memory_schedule(graph, outputs=()) -> list:
  """The op order the memory estimate uses: the LIST schedule, or graph order for recomputed layers.

  A graph built with mtf.recompute_grad repeats op names (recomputed ops keep their originals'
  names), which a name-keyed schedule would mix up; graph order recomputes each layer when its
  gradient arrives, as `_cost.memory.estimate_memory` does for such graphs.
  """
  if len({op.name for op in graph.operations}) < len(graph.operations):
    return list(range(len(graph.operations)))
  interface = graph_interface.GraphInterface(graph)
  for t in outputs:
    interface.set_tensor_final(t.name)
  return scheduler.minimize_peak_memory(interface, "LIST")


def _undominated(steps: np.ndarray) -> np.ndarray:
  """The rows of `steps` that no other row bounds from above in every column (the possible peaks).

  For any non-negative weights, max over rows of weights . row is attained on these rows.
  """
  order = np.argsort(-steps.sum(axis=1), kind="stable")
  kept = np.zeros((0, steps.shape[1]))
  for row in steps[order]:
    if not (kept >= row).all(axis=1).any():
      kept = np.vstack([kept, row])
  return kept


class AnyAssignment:
  """A LayoutValidator view under which every splittable dimension may go on every mesh dimension.

  A Problem built with it scores assignments the search never enumerates (see estimated_step_s).
  """

  def __init__(self, validator):
    self.splittable_mtf_dimension_names = validator.splittable_mtf_dimension_names

  def is_valid_assignment(self, mtf_dimension_name: str, mesh_dimension_name: str) -> bool:
    del mesh_dimension_name
    return mtf_dimension_name in self.splittable_mtf_dimension_names


def estimated_step_s(problem: Problem, assignment: dict) -> float:
  """The fast estimate's step time of one assignment, plus the cost model's per-op and step overheads.

  Works for any assignment of `problem.dims` (a mesh dimension need not divide the dimension: a
  processor's share is then ceil(n / m)); inf where a reshape's layout change cannot be planned.
  """
  seconds, _ = problem.estimate(problem.to_row(assignment)[None])
  tm = problem.time_model
  return float(seconds[0]) + len(problem.graph.operations) * tm.op_overhead_s + tm.step_overhead_s


def search(problem, memory_limit_bytes: Optional[float] = None, top_k: int = 4) -> Solution:
  """The best layout of `problem`: estimate every assignment, cost the top_k exactly, keep the best.

  `problem` is a Problem, or anything with its enumeration, `estimate` and `cost_report` (such as
  `depth.DepthProblem`, which extrapolates a layer stack's costs to its full depth).

  Raises:
    NoLayoutFits: no layout keeps a processor within memory_limit_bytes.
    SearchSpaceTooLarge: more than MAX_ENUMERATED candidate layouts.
  """
  if problem.count_upper_bound() > MAX_ENUMERATED:
    raise SearchSpaceTooLarge(
      f"{problem.count_upper_bound()} candidate layouts of dimensions {problem.dims} on mesh "
      f"{problem.mesh_shape} are too many to enumerate; use a mesh with fewer dimensions."
    )
  rows = problem.assignments()
  seconds, memory = problem.estimate(rows)
  fits = np.isfinite(seconds)
  if memory_limit_bytes is not None:
    fits &= memory <= memory_limit_bytes * 1.25  # the estimate is rough; the exact check follows
  num_split = (rows >= 0).sum(axis=1)
  misnamed = _misnamed_counts(problem, rows)
  order = [i for i in np.lexsort((misnamed, -num_split, memory, seconds)) if fits[i]]
  best, attempts, fitting = None, 0, 0
  for i in order:
    if fitting == top_k or attempts == 4 * top_k:
      break
    attempts += 1
    candidate = _costed(problem, rows[i], seconds[i], memory[i])
    if candidate is None or (
      memory_limit_bytes is not None and candidate.report.memory.total_bytes > memory_limit_bytes
    ):
      continue
    fitting += 1
    if best is None or candidate.key < best.key:
      best = candidate
  if best is None and memory_limit_bytes is not None:  # the fastest all exceed it: the leanest next
    tried = set(order[:attempts])
    for i in [i for i in np.argsort(memory, kind="stable") if fits[i] and i not in tried][:top_k]:
      candidate = _costed(problem, rows[i], seconds[i], memory[i])
      if candidate is not None and candidate.report.memory.total_bytes <= memory_limit_bytes:
        if best is None or candidate.key < best.key:
          best = candidate
  if best is None and memory_limit_bytes is None:  # replicating everything always lowers
    replicated = np.full(len(problem.dims), -1)
    best = _costed(problem, replicated, *[v[0] for v in problem.estimate(replicated[None])])
  if best is None:
    raise NoLayoutFits(problem, memory_limit_bytes, rows[int(np.argmin(memory))])
  return best


def _misnamed_counts(problem, rows: np.ndarray) -> np.ndarray:
  """misnamed_splits of each row (a row holds each dim's mesh axis, or -1)."""
  names = list(problem.mesh_names)
  same_name = np.array([names.index(d) if d in names else -2 for d in problem.dims])
  return ((rows >= 0) & (rows != same_name)).sum(axis=1)


def _costed(problem, row, estimated_s, estimated_memory) -> Optional[Solution]:
  """The Solution of `row` with its exact cost report, or None if an op's lowering rejects it."""
  assignment = problem.to_assignment(row)
  try:
    report = problem.cost_report(assignment)
  except (ValueError, NotImplementedError):  # the estimate can't foresee every op's layout limits
    return None
  return Solution(assignment, float(estimated_s), float(estimated_memory), report)


class SearchSpaceTooLarge(ValueError):
  """More candidate layouts than MAX_ENUMERATED (a mesh with many dimensions)."""


class SolverError(ValueError):
  """The layout search found no acceptable layout (0.1.21's `layout_optimizer.SolverError`)."""


class NoLayoutFits(SolverError):
  """No layout keeps one processor's memory under the limit."""

  def __init__(self, problem, limit: float, smallest_row):
    assignment = problem.to_assignment(smallest_row)
    report = problem.memory_report(assignment)
    largest = ", ".join(f"{n} ({b:,} bytes)" for n, b in report.largest[:3])
    sizes = problem.dimension_sizes()
    mesh = {d.name: d.size for d in problem.mesh_shape.dims}
    stuck = sorted(n for n in sizes if not n.startswith("_anonymous_") and n not in problem.dims)
    super().__init__(
      f"No layout fits the memory limit of {limit:,.0f} bytes per processor on mesh {problem.mesh_shape}: "
      f"the smallest, {';'.join(f'{d}:{m}' for d, m in sorted(assignment.items())) or '(replicated)'}, "
      f"needs {report.total_bytes:,} bytes ({report.total_bytes - limit:,.0f} over): variables "
      f"{report.variable_bytes:,}, optimizer state {report.slot_bytes:,}, activation peak "
      f"{report.activation_peak_bytes:,}, dominated by {largest or 'variables'}. Dimensions no mesh "
      f"dimension ({mesh}) can split: {', '.join(f'{n}:{sizes[n]}' for n in stuck) or 'none'}. Use more "
      f"processors, smaller batch or sizes divisible by the mesh dimensions, or fewer outputs kept."
    )
    self.assignment = assignment  # the layout with the least memory
    self.excess_bytes = report.total_bytes - limit
    self.report = report
