"""Planning a layout change: the collectives that turn a tensor's old layout into a new one.

Pure Python over names, sizes and layout rules (no TensorFlow, no devices), so the reshape lowering,
a cost model and a layout explainer can all ask which collectives a reshape inserts and how many
bytes they move.

The model. A mesh axis with n processors splitting a tensor dimension whose preceding dims have
product P (its exclusive cumprod, the dimension's "level") keeps, on processor k, the flat
(row-major) indices f with floor(f * P * n / size) % n == k. That depends only on (P, n), not on
the dimension's own size. So a slice of the old shape holds exactly the elements of the new
layout's slice iff every mesh axis splits at the same level in both; the local row-major order
then agrees too, and a per-slice tf.reshape finishes the job.

The plan works on slices of the OLD shape. Several mesh axes may temporarily split the same old
dimension, nested outer to inner: with splits n1 (outer) then n2, the inner one splits at level
P * n1. A step may only add or remove the innermost split of a dimension:

  allsplit(m, i):         m unsplit -> innermost split of old axis i   (no communication)
  alltoall(m, i, j):      m innermost on j -> innermost on i            (moves 1 - 1/n of a slice)
  allconcat(m, j):        m innermost on j -> unsplit                   (gathers n slices)

Example: rules "a:x"; old [a=4, b=6] -> new [c=4, a=6] (the names shift, so x moves from old
axis 0 to old axis 1): alltoall(x, split_axis=1, concat_axis=0), then a local reshape.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional, Sequence

from mesh_tensorflow._core.dims import Shape, convert_to_shape, list_product
from mesh_tensorflow._core.layout import convert_to_layout_rules


ALLREDUCE, ALLCONCAT, ALLTOALL, ALLSPLIT, RECEIVE = (
    "allreduce", "allconcat", "alltoall", "allsplit", "receive")


def bytes_sent(kind: str, group_size: int, num_processors: int, slice_bytes: int,
               source_pcoord: Optional[Sequence] = None) -> int:
  """Bytes one collective sends between processors, all processors together.

  The one byte model of the package (the communication layer's events and the plans' steps both
  use it), backend-independent (n = group size, S = slice bytes, P = processors):

    | kind      | bytes sent by all processors together     |
    | allreduce | 2 (n - 1) S P / n   (ring reduce-scatter + allgather)
    | allconcat | (n - 1) S P         (each processor sends its slice to the n - 1 others)
    | alltoall  | (n - 1) S P / n     (each processor keeps 1/n of its slice)
    | receive   | S per processor whose source is another processor (source_pcoord[k] != k)
    | allsplit  | 0                   (each processor keeps a piece of what it holds)
  """
  n, p = group_size, num_processors
  if kind == ALLREDUCE:
    return 2 * (n - 1) * slice_bytes * (p // n)
  if kind == ALLCONCAT:
    return (n - 1) * slice_bytes * p
  if kind == ALLTOALL:
    return (n - 1) * (slice_bytes // n) * p
  if kind == RECEIVE:
    movers = sum(1 for k, s in enumerate(source_pcoord) if s is not None and s != k)
    return movers * slice_bytes * (p // n)
  if kind == ALLSPLIT:
    return 0
  raise ValueError(f"Unknown collective kind {kind!r}.")


@dataclasses.dataclass(frozen=True)
class LayoutStep:
  """One step applied to every processor's slice; slice shapes are per processor."""

  kind: ClassVar[Optional[str]] = None  # the collective (a `bytes_sent` kind); None: local

  mesh_axis: Optional[int]
  slice_shape_before: tuple
  slice_shape_after: tuple
  num_processors: int

  @property
  def slice_size_before(self) -> int:
    return list_product(self.slice_shape_before)

  def bytes_moved(self, itemsize: int) -> int:
    """Bytes sent between processors by all of them together (`bytes_sent`; 0: purely local)."""
    if self.kind is None:
      return 0
    return bytes_sent(self.kind, self.mesh_axis_size, self.num_processors,
                      self.slice_size_before * itemsize)


@dataclasses.dataclass(frozen=True)
class AllSplit(LayoutStep):
  """Each processor keeps its own 1/n piece of `tensor_axis` (mesh axis becomes a split)."""

  kind: ClassVar[str] = ALLSPLIT
  tensor_axis: int
  mesh_axis_size: int

  def __str__(self):
    return f"allsplit(mesh_axis={self.mesh_axis}, tensor_axis={self.tensor_axis})"


@dataclasses.dataclass(frozen=True)
class AllToAll(LayoutStep):
  """Moves the mesh axis's split from `concat_axis` to `split_axis` (each processor trades n-1 pieces)."""

  kind: ClassVar[str] = ALLTOALL
  split_axis: int
  concat_axis: int
  mesh_axis_size: int

  def __str__(self):
    return (f"alltoall(mesh_axis={self.mesh_axis}, split_axis={self.split_axis}, "
            f"concat_axis={self.concat_axis})")


@dataclasses.dataclass(frozen=True)
class AllConcat(LayoutStep):
  """Gathers the n pieces of `tensor_axis` along the mesh axis (it becomes replicated)."""

  kind: ClassVar[str] = ALLCONCAT
  tensor_axis: int
  mesh_axis_size: int

  def __str__(self):
    return f"allconcat(mesh_axis={self.mesh_axis}, tensor_axis={self.tensor_axis})"


@dataclasses.dataclass(frozen=True)
class LocalReshape(LayoutStep):
  """Per-slice tf.reshape to the new slice shape (always the last step)."""

  def __str__(self):
    return f"local_reshape({list(self.slice_shape_before)} -> {list(self.slice_shape_after)})"


def total_bytes_moved(steps: Sequence[LayoutStep], itemsize: int) -> int:
  return sum(step.bytes_moved(itemsize) for step in steps)


def plan_reshape(old_shape, new_shape, mesh_shape, layout_rules) -> list:
  """Steps turning slices of `old_shape` into slices of `new_shape`, both laid out by `layout_rules`.

  Args:
    old_shape, new_shape: tensor shapes (Shape or "name:size;..."), equal total size.
    mesh_shape: the mesh (Shape or string); layout_rules: LayoutRules, string or pairs.

  Returns:
    A list of AllSplit / AllToAll / AllConcat steps (in execution order) ending with a LocalReshape.

  Raises:
    ValueError: sizes differ, or a split does not divide a dimension.
    NotImplementedError: a new split does not fall on a whole old dimension (or a nest of splits of
      one); reshape in two steps instead: first insert the dimension, then change the layout.
  """
  old_shape, new_shape = convert_to_shape(old_shape), convert_to_shape(new_shape)
  mesh_shape = convert_to_shape(mesh_shape)
  layout_rules = convert_to_layout_rules(layout_rules)
  _check_same_size(old_shape, new_shape)
  mesh_sizes = mesh_shape.to_integer_list
  old_layout = layout_rules.tensor_layout(old_shape, mesh_shape)
  new_layout = layout_rules.tensor_layout(new_shape, mesh_shape)
  new_slice_shape = tuple(_slice_shape(new_shape, new_layout, mesh_shape))
  state = _SliceState(old_shape, mesh_sizes)
  for tensor_axis, mesh_axis in enumerate(old_layout):
    if mesh_axis is not None and mesh_sizes[mesh_axis] > 1:
      state.chains[tensor_axis].append(mesh_axis)
  state.check_divisible(mesh_shape)
  final = _final_chains(old_shape, new_shape, new_layout, mesh_shape)
  steps = []
  while state.chains != final:
    steps.append(_next_step(state, final))
  steps.append(LocalReshape(None, state.slice_shape(), new_slice_shape, list_product(mesh_sizes)))
  return steps


class _SliceState:
  """Which mesh axes split each old tensor axis (outer to inner), and the resulting slice shape."""

  def __init__(self, old_shape: Shape, mesh_sizes: list):
    self.old_shape = old_shape
    self.mesh_sizes = mesh_sizes
    self.chains = [[] for _ in old_shape]

  def slice_shape(self) -> tuple:
    return tuple(d.size // list_product(self.mesh_sizes[m] for m in chain)
                 for d, chain in zip(self.old_shape, self.chains))

  def location(self, mesh_axis: int) -> Optional[int]:
    return next((i for i, chain in enumerate(self.chains) if mesh_axis in chain), None)

  def check_divisible(self, mesh_shape: Shape) -> None:
    for d, chain in zip(self.old_shape, self.chains):
      for m in chain:
        _check_divides(d, mesh_shape[m].size, mesh_shape[m].name, self.old_shape)

  def apply(self, step_type, mesh_axis: int, remove_from=None, add_to=None, **fields) -> LayoutStep:
    """Moves `mesh_axis` off the innermost split of `remove_from` and/or onto that of `add_to`."""
    before = self.slice_shape()
    if remove_from is not None:
      self.chains[remove_from].pop()
    if add_to is not None:
      self.chains[add_to].append(mesh_axis)
    return step_type(mesh_axis, before, self.slice_shape(), list_product(self.mesh_sizes),
                     mesh_axis_size=self.mesh_sizes[mesh_axis], **fields)


def _next_step(state: _SliceState, final: list) -> LayoutStep:
  """Greedy: place the next split of a final chain if possible (allsplit / alltoall), else undo one.

  Placing never has to be undone (it extends a chain that is a prefix of its final chain), and
  undoing only touches chains that are not such a prefix, so the loop terminates.
  """
  def is_prefix(i):
    return state.chains[i] == final[i][:len(state.chains[i])]

  for i, chain in enumerate(state.chains):
    if not is_prefix(i) or len(chain) == len(final[i]):
      continue
    mesh_axis = final[i][len(chain)]
    source = state.location(mesh_axis)
    if source is None:
      return state.apply(AllSplit, mesh_axis, add_to=i, tensor_axis=i)
    if state.chains[source][-1] == mesh_axis:
      return state.apply(AllToAll, mesh_axis, remove_from=source, add_to=i, split_axis=i,
                         concat_axis=source)
  for j, chain in enumerate(state.chains):
    if not is_prefix(j):
      return state.apply(AllConcat, chain[-1], remove_from=j, tensor_axis=j)
  raise AssertionError("unreachable: a chain is incomplete yet nothing can be placed")


def _final_chains(old_shape: Shape, new_shape: Shape, new_layout, mesh_shape: Shape) -> list:
  """Per old tensor axis, the mesh axes that must split it (outer to inner) to match the new layout."""
  old_cumprod, new_cumprod = old_shape.cumprod, new_shape.cumprod
  placed = [[] for _ in old_shape]  # (level, mesh_axis, new_axis) per old axis
  for new_axis, mesh_axis in enumerate(new_layout):
    if mesh_axis is None or mesh_shape[mesh_axis].size == 1:
      continue
    level = new_cumprod[new_axis]
    old_axis = next((i for i, d in enumerate(old_shape)
                     if old_cumprod[i] <= level < old_cumprod[i] * d.size), None)
    if old_axis is None:
      _raise_unsupported(old_shape, new_shape, mesh_shape, mesh_axis, new_shape[new_axis])
    placed[old_axis].append((level, mesh_axis, new_axis))
  final = []
  for old_axis, entries in enumerate(placed):
    entries.sort()
    level = old_cumprod[old_axis]
    for entry_level, mesh_axis, new_axis in entries:
      if entry_level != level:
        _raise_unsupported(old_shape, new_shape, mesh_shape, mesh_axis, new_shape[new_axis])
      level *= mesh_shape[mesh_axis].size
    if old_shape[old_axis].size * old_cumprod[old_axis] % level:
      _, mesh_axis, new_axis = entries[-1]
      _raise_unsupported(old_shape, new_shape, mesh_shape, mesh_axis, new_shape[new_axis])
    final.append([mesh_axis for _, mesh_axis, _ in entries])
  return final


def _slice_shape(shape: Shape, layout, mesh_shape: Shape) -> list:
  ret = []
  for d, mesh_axis in zip(shape, layout):
    n = 1 if mesh_axis is None else mesh_shape[mesh_axis].size
    if n > 1:
      _check_divides(d, n, mesh_shape[mesh_axis].name, shape)
    ret.append(d.size // n)
  return ret


# ---- checks (one rule each) ----

def _check_same_size(old_shape: Shape, new_shape: Shape) -> None:
  if old_shape.size != new_shape.size:
    raise ValueError(
        f"Cannot reshape {old_shape} (size {old_shape.size}) to {new_shape} (size {new_shape.size}): "
        f"the total sizes differ.")


def _check_divides(dim, n: int, mesh_dim_name: str, shape: Shape) -> None:
  if dim.size % n:
    raise ValueError(
        f"Tensor dimension {dim.name!r} (size {dim.size}) of {shape} is split over mesh dimension "
        f"{mesh_dim_name!r} (size {n}), which does not divide it; change the layout rule or the size.")


def _raise_unsupported(old_shape: Shape, new_shape: Shape, mesh_shape: Shape, mesh_axis: int,
                       dim) -> None:
  mesh_dim = mesh_shape[mesh_axis]
  raise NotImplementedError(
      f"Reshape {old_shape} -> {new_shape}: splitting over mesh dimension {mesh_dim.name!r} "
      f"(size {mesh_dim.size}) at dimension {dim.name!r} does not fall on a whole dimension of "
      f"the old shape, so it cannot be laid out by allsplit/alltoall/allconcat. Reshape in two "
      f"steps: first a reshape that keeps the layout and creates a dimension where the split "
      f"goes, then a rename/reshape that changes the layout.")
