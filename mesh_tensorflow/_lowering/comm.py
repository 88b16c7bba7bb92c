"""The communication layer: every data movement between processors goes through here.

Op families never call a backend's collectives themselves. They ask the lowering for a
`Communicator` bound to their op (`lowering.comm(op)`), which records one `CommEvent` per
collective -- kind, mesh axes, group size, slice shape, dtype, bytes sent, the mtf op and the
reason -- and then runs the backend primitive. A reduction the backend cannot run as one
collective (SIMD's MAX/MIN) is composed here of recorded allconcats (`allreduce_by_allconcat`),
and the collectives a backend runs on its own -- gathering a whole tensor across processes for an
export or a master copy -- go through `for_backend(mesh_impl)`, which the lowering binds to the op
they serve with `charged_to`. `Lowering.counters` and
`Lowering.communication_events` are both derived from these events, and a shape-only lowering
(`mtf.dry_run`) records the same events without building any TF op.

Bytes follow one backend-independent model, `plan.bytes_sent` (the layout plans' steps use the
same function), e.g. an allreduce sends 2 (n - 1) S P / n bytes (n = group size, S = slice bytes,
P = processors).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional, Sequence

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import list_product
from mesh_tensorflow._lowering import plan as plan_lib
from mesh_tensorflow._lowering.plan import (
    ALLCONCAT, ALLREDUCE, ALLSPLIT, ALLTOALL, RECEIVE, bytes_sent)
from mesh_tensorflow._lowering.tf_helpers import reduction_fn


@dataclasses.dataclass(frozen=True)
class CommEvent:
  """One collective: what moved, over which mesh axes, for which mtf op and why."""

  kind: str
  mesh_axes: tuple
  group_size: int
  num_processors: int
  slice_shape: tuple
  dtype: str
  itemsize: int
  bytes_sent: int
  op_name: str
  reason: str
  in_loop: Optional[str] = None  # name of the enclosing while_loop (the event repeats per iteration)

  @property
  def bytes_per_processor(self) -> float:
    """Average bytes each processor sends."""
    return self.bytes_sent / self.num_processors

  @property
  def counter_key(self) -> str:
    """The `Lowering.counters` key: "allreduce/[0, 1]/reduce_op", "alltoall/0/reshape_op", ..."""
    axes = list(self.mesh_axes) if self.kind == ALLREDUCE else self.mesh_axes[0]
    return f"{self.kind}/{axes}/{self.reason}"

  @property
  def elements_sent(self) -> int:
    return self.bytes_sent // self.itemsize

  def __str__(self):
    return (f"{self.kind}(mesh_axes={list(self.mesh_axes)}, group={self.group_size}, "
            f"slice={list(self.slice_shape)} {self.dtype}, {self.bytes_sent} bytes) "
            f"for {self.op_name!r} ({self.reason})")


class Communicator:
  """The collectives of one mesh impl, recorded as events of one mtf op.

  Args:
    mesh_impl: the backend that runs the collectives.
    record: called with each CommEvent (the lowering appends it to its event list).
    op_name: the mtf op the events are charged to.
    in_loop: the enclosing while_loop's name, if any.
  """

  def __init__(self, mesh_impl, record: Callable[[CommEvent], None], op_name: str,
               in_loop: Optional[str] = None):
    self.mesh_impl = mesh_impl
    self._record = record
    self.op_name = op_name
    self.in_loop = in_loop

  def _event(self, kind: str, x, mesh_axes: Sequence[int], reason: str, source_pcoord=None) -> None:
    mesh_impl = self.mesh_impl
    slice_shape = tuple(x.slice_shape)
    dtype = tf.as_dtype(x.dtype)
    group_size = list_product(mesh_impl.shape[a].size for a in mesh_axes)
    slice_bytes = list_product(slice_shape) * dtype.size
    self._record(CommEvent(
        kind=kind, mesh_axes=tuple(mesh_axes), group_size=group_size,
        num_processors=mesh_impl.size, slice_shape=slice_shape, dtype=dtype.name,
        itemsize=dtype.size,
        bytes_sent=bytes_sent(kind, group_size, mesh_impl.size, slice_bytes, source_pcoord),
        op_name=self.op_name, reason=reason, in_loop=self.in_loop))

  def allreduce(self, x, mesh_axes: Sequence[int], reduction_fn_string: str, reason: str):
    """Reduces x over the processors that differ only along mesh_axes.

    A reduction the backend does not run as one collective (not in its allreduce_reductions)
    is recorded as what runs: an allconcat per mesh axis (see `allreduce_by_allconcat`).
    """
    if not mesh_axes:
      return x
    if reduction_fn_string not in self.mesh_impl.allreduce_reductions:
      return allreduce_by_allconcat(
          self.mesh_impl, x, mesh_axes, reduction_fn_string,
          lambda y, mesh_axis, concat_axis: self.allconcat(y, mesh_axis, concat_axis, reason))
    x = x.to_laid_out_tensor()
    self._event(ALLREDUCE, x, mesh_axes, reason)
    return self.mesh_impl.allreduce(x, list(mesh_axes), reduction_fn_string)

  def allconcat(self, x, mesh_axis: int, concat_axis: int, reason: str):
    """Every processor gets the slices of its group along mesh_axis, concatenated on concat_axis."""
    x = x.to_laid_out_tensor()
    self._event(ALLCONCAT, x, [mesh_axis], reason)
    return self.mesh_impl.allconcat(x, mesh_axis, concat_axis)

  def alltoall(self, x, mesh_axis: int, split_axis: int, concat_axis: int, reason: str):
    """Moves the split along mesh_axis from concat_axis to split_axis."""
    x = x.to_laid_out_tensor()
    self._event(ALLTOALL, x, [mesh_axis], reason)
    return self.mesh_impl.alltoall(x, mesh_axis, split_axis, concat_axis)

  def allsplit(self, x, mesh_axis: int, split_axis: int, reason: str):
    """Each processor keeps its own 1/n piece of split_axis (no data moves)."""
    x = x.to_laid_out_tensor()
    self._event(ALLSPLIT, x, [mesh_axis], reason)
    return self.mesh_impl.allsplit(x, mesh_axis, split_axis)

  def receive(self, x, mesh_axis: int, source_pcoord: Sequence, reason: str):
    """Processor k along mesh_axis gets the slice of processor source_pcoord[k] (zeros for None)."""
    x = x.to_laid_out_tensor()
    self._event(RECEIVE, x, [mesh_axis], reason, source_pcoord=source_pcoord)
    return self.mesh_impl.receive(x, mesh_axis, source_pcoord)

  def shift_by_n_processors(self, x, mesh_axis: int, offset: int, wrap: bool, reason: str):
    """Processor i along mesh_axis receives the slice of processor i - offset (zeros past the ends)."""
    source_pcoord = shift_sources(self.mesh_impl.shape[mesh_axis].size, offset, wrap)
    return self.receive(x, mesh_axis, source_pcoord, reason)

  def run_layout_step(self, x, step: plan_lib.LayoutStep, reason: str):
    """Runs one collective step of a plan from `_lowering/plan.py`."""
    if isinstance(step, plan_lib.AllSplit):
      return self.allsplit(x, step.mesh_axis, step.tensor_axis, reason)
    if isinstance(step, plan_lib.AllToAll):
      return self.alltoall(x, step.mesh_axis, step.split_axis, step.concat_axis, reason)
    if isinstance(step, plan_lib.AllConcat):
      return self.allconcat(x, step.mesh_axis, step.tensor_axis, reason)
    raise ValueError(f"{step} is not a collective step.")

  def lazy_allreduce_sum(self, x, mesh_axes: Sequence[int], reason: str):
    """Partial sums over mesh_axes, allreduced (and recorded) only when first used."""
    from mesh_tensorflow._lowering.lazy import LazyAllreduceSum
    return LazyAllreduceSum(self.mesh_impl, x, list(mesh_axes), comm=self, reason=reason)


def allreduce_by_allconcat(mesh_impl, x, mesh_axes: Sequence[int], reduction_fn_string: str,
                           allconcat: Callable):
  """A reduction over mesh_axes built from allconcats: for a backend whose allreduce only sums.

  Per mesh axis, every processor stacks its group's slices on a new leading axis
  (allconcat(x, mesh_axis, concat_axis) of the slices with that axis added) and reduces over it.
  `allconcat` is the backend's (its own primitive) or a Communicator's (recorded).
  """
  reduce_fn = reduction_fn(reduction_fn_string)
  for mesh_axis in mesh_axes:
    stacked = allconcat(mesh_impl.slicewise(lambda t: tf.expand_dims(t, 0), x), mesh_axis, 0)
    x = mesh_impl.slicewise(lambda t: reduce_fn(t, 0), stacked)
  return x


_charged = []  # Communicators that a backend's own collectives are charged to, innermost last


@contextlib.contextmanager
def charged_to(communicator: Communicator):
  """Within it, collectives its mesh impl runs on its own are recorded by `communicator`.

  The lowering wraps what makes a backend gather slices by itself (exporting a tensor, copying
  slices to a master) so those collectives are events of the op they serve.
  """
  _charged.append(communicator)
  try:
    yield communicator
  finally:
    _charged.pop()


def for_backend(mesh_impl) -> Communicator:
  """The Communicator for collectives `mesh_impl` runs on its own (see `charged_to`).

  Outside any `charged_to` for this mesh impl (no Lowering asked), one that records nothing.
  """
  for communicator in reversed(_charged):
    if communicator.mesh_impl is mesh_impl:
      return communicator
  return Communicator(mesh_impl, lambda event: None, op_name="")


def shift_sources(n: int, offset: int, wrap: bool) -> list:
  """Per coordinate i of n: the coordinate i - offset it receives from (None past the ends)."""
  ret = []
  for i in range(n):
    c = i - offset
    if c != c % n:
      c = c % n if wrap else None
    ret.append(c)
  return ret
