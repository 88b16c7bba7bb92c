"""What names a random op's stream (with the graph seed, the name is the op's key).

An op made inside `scope(name)` is `<name>/<j>`, the j-th random op of that scope, so the same
layer code draws the same values however much else the graph holds (the Transformer's LayerStack
opens one scope per layer, named after the layer). Any other op is `<n>`, the n-th such random
op of its mtf Graph: a program built again (eagerly, or in another process) numbers its random
ops alike, whatever name scopes TF made unique.

In a pipeline, one op serves every stage at once, each stage running another layer on another
microbatch: `stagewise` gives it, per stage, the name that layer's op has unpipelined and the
microbatch, so each stage draws the unpipelined values of its rows (random_bits.StagewiseGeometry).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref
from typing import Optional, Sequence


_counts = weakref.WeakKeyDictionary()  # mtf Graph -> count of its random ops made in no scope
_frames = []  # the open scopes (_Scope) and pipeline layers (Stagewise), innermost last


@dataclasses.dataclass
class _Scope:
  name: str
  count: int = 0


@dataclasses.dataclass
class Stagewise:
  """A pipeline tick's layer: per stage, the scope its layer has unpipelined and its microbatch.

  Attributes:
    stage_dim_name: the pipeline's stage dimension.
    batch_dim_name: the batch dimension cut into num_microbatches microbatches (a microbatch's row
      r is row r * M + m of the whole batch), or None when the microbatches were given as a
      dimension of their own, the unpipelined op's leading one (microbatch m's elements follow
      the m earlier microbatches').
    num_microbatches: M.
    stage_scopes: per stage, its layer's unpipelined scope name, or None where the stage idles.
    microbatches: per stage, the microbatch it runs (0 where it idles).
  """

  stage_dim_name: str
  batch_dim_name: Optional[str]
  num_microbatches: int
  stage_scopes: Sequence[Optional[str]]
  microbatches: Sequence[int]
  counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass(frozen=True)
class StagewiseKeys:
  """A pipelined random op's per-stage key names and the layout of its rows."""

  stage_axis: int
  batch_axis: Optional[int]
  num_microbatches: int
  names: tuple  # per stage: the unpipelined op's key name, or None (idle)
  microbatches: tuple
  microbatch_major: bool = False  # the microbatches are the unpipelined op's leading dimension


@contextlib.contextmanager
def _opened(frame):
  _frames.append(frame)
  try:
    yield
  finally:
    _frames.pop()


def scope(name: str):
  """Random ops made within are named `<name>/<j>` (j counts them), inside a pipeline too."""
  return _opened(_Scope(name))


def stagewise(context: Stagewise):
  """Random ops made within (with the stage dimension) draw per stage as their layer unpipelined."""
  return _opened(context)


def key_name(graph, shape) -> tuple:
  """(the key name of a new random op of `shape` in `graph`, its StagewiseKeys or None)."""
  scopes = []
  for frame in reversed(_frames):
    if isinstance(frame, Stagewise):
      return _in_pipeline(frame, [s.name for s in reversed(scopes)], shape)
    scopes.append(frame)
  if scopes:
    innermost = scopes[0]
    innermost.count += 1
    return f"{innermost.name}/{innermost.count - 1}", None
  counts = _counts.setdefault(graph, collections.Counter())
  counts["unscoped"] += 1
  return str(counts["unscoped"] - 1), None


def _in_pipeline(context: Stagewise, scopes: list, shape) -> tuple:
  """A random op made in a pipeline layer, within `scopes` (outermost first) inside it."""
  within = "/".join(scopes)
  index = context.counts[within]
  context.counts[within] += 1
  names = shape.dimension_names
  own = f"pipeline/{within}/{index}"
  if context.stage_dim_name not in names:
    return own, None  # the same on every stage: no unpipelined twin to follow
  prefix = f"/{within}" if within else ""
  per_stage = tuple(None if s is None else f"{s}{prefix}/{index}" for s in context.stage_scopes)
  batch_axis = names.index(context.batch_dim_name) if context.batch_dim_name in names else None
  return own, StagewiseKeys(names.index(context.stage_dim_name), batch_axis, context.num_microbatches,
                            per_stage, tuple(context.microbatches), context.batch_dim_name is None)
