"""The pipeline's schedule as pure Python: which layer each stage holds, and what it runs each tick.

No graph, no devices: `mtf.pipeline` builds its ticks from it, and a cost model or a picture of
the schedule can read it without building anything.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["PipelineSchedule", "pipeline_schedule"]

SCHEDULES = ("fill_drain", "circular")


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
  """S stages, M microbatches, R rounds of K layers per stage; L = S * R * K layers in all.

  Layer l = (r * S + s) * K + k lives on stage s, in slot j = r * K + k of that stage's weights:
  fill-drain (R = 1) gives stage s the K = L / S consecutive layers s*K .. s*K + K - 1; circular
  gives it K consecutive layers of each round r, (r*S + s)*K .. (r*S + s)*K + K - 1, and a
  microbatch goes round the stages R times. With L = 8, S = 4:

      | schedule            | stage 0 | stage 1 | stage 2 | stage 3 |
      | fill_drain (K = 2)  | 0, 1    | 2, 3    | 4, 5    | 6, 7    |
      | circular (K=1, R=2) | 0, 4    | 1, 5    | 2, 6    | 3, 7    |

  A tick runs K layers on every stage. Microbatch m starts round r on stage 0 at tick r * P + m,
  P = max(M, S) (a microbatch back from the last stage waits until stage 0 is free), and is on
  stage s at tick r * P + m + s. So

      num_ticks = (R - 1) * P + M + S - 1       (fill-drain: M + S - 1)
      bubble    = 1 - R * M / num_ticks         (fill-drain: (S - 1) / (M + S - 1); circular
                                                 with M >= S: (S - 1) / (R * M + S - 1))

  the share of stage-ticks that compute nothing a microbatch needs.
  """

  num_stages: int
  num_microbatches: int
  num_rounds: int
  layers_per_tick: int

  @property
  def num_layers(self) -> int:
    """L, the layers in the stack."""
    return self.num_stages * self.num_rounds * self.layers_per_tick

  @property
  def slots_per_stage(self) -> int:
    """The layers one stage holds (the size of its weights' layer dimension)."""
    return self.num_rounds * self.layers_per_tick

  @property
  def period(self) -> int:
    """Ticks between a microbatch's starts of two rounds on stage 0."""
    return max(self.num_microbatches, self.num_stages)

  @property
  def num_ticks(self) -> int:
    """The ticks the schedule runs (see the class docstring)."""
    return (self.num_rounds - 1) * self.period + self.num_microbatches + self.num_stages - 1

  @property
  def bubble_fraction(self) -> float:
    """The share of stage-ticks that idle (see the class docstring)."""
    return 1.0 - self.num_rounds * self.num_microbatches / self.num_ticks

  def layer_position(self, layer: int) -> tuple:
    """(stage, slot) holding `layer`."""
    block, k = divmod(layer, self.layers_per_tick)
    r, s = divmod(block, self.num_stages)
    return s, r * self.layers_per_tick + k

  def layer_at(self, stage: int, slot: int) -> int:
    """The layer in `slot` of `stage` (the inverse of layer_position)."""
    r, k = divmod(slot, self.layers_per_tick)
    return (r * self.num_stages + stage) * self.layers_per_tick + k

  def work(self, tick: int, stage: int) -> Optional[tuple]:
    """(round, microbatch) that `stage` runs at `tick`, or None when it idles (the bubble)."""
    r, m = divmod(tick - stage, self.period)
    if tick < stage or m >= self.num_microbatches or r >= self.num_rounds:
      return None
    return r, m

  def start_tick(self, round_: int, microbatch: int) -> int:
    """The tick at which `microbatch` starts `round_` on stage 0."""
    return round_ * self.period + microbatch

  def picture(self, max_ticks: Optional[int] = None) -> str:
    """The schedule as text, a row per stage and a column per tick: the microbatch (round letter
    after it when R > 1) or '.' for a bubble. With more than max_ticks ticks, only the first and
    the last max_ticks / 2 are drawn, with '~' for the ticks between."""
    width = len(str(self.num_microbatches - 1)) + (self.num_rounds > 1)
    ticks = list(range(self.num_ticks))
    if max_ticks is not None and self.num_ticks > max_ticks:
      half = max_ticks // 2
      ticks = ticks[:half] + [None] + ticks[-half:]
    rows = []
    for s in range(self.num_stages):
      cells = []
      for t in ticks:
        w = None if t is None else self.work(t, s)
        if t is None:
          cell = "~"
        elif w is None:
          cell = "."
        else:
          cell = str(w[1]) + ("abcdefghijklmnopqrstuvwxyz"[w[0] % 26] if self.num_rounds > 1 else "")
        cells.append(cell.rjust(width))
      rows.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(rows)


def pipeline_schedule(num_layers: int, num_stages: int, num_microbatches: int,
                      schedule: str = "fill_drain", layers_per_round: int = 1) -> PipelineSchedule:
  """The schedule `mtf.pipeline` runs for these counts (see PipelineSchedule).

  Args:
    num_layers: L, the layers in the stack.
    num_stages: S, the pipeline stages (the stage dimension's size).
    num_microbatches: M, the pieces the batch is cut into.
    schedule: "fill_drain" (GPipe: each stage holds L / S consecutive layers, one pass) or
      "circular" (each stage holds `layers_per_round` layers of each of L / (S * layers_per_round)
      rounds; the bubble shrinks by about that many rounds).
    layers_per_round: K for "circular"; must be 1 for "fill_drain".

  Raises:
    ValueError: a count below 1, an unknown schedule, or stages (times layers_per_round) that do
      not divide the layers.

  Example:
    pipeline_schedule(8, 4, 4).num_ticks == 7; pipeline_schedule(8, 4, 4, "circular").num_ticks == 11
  """
  _check_positive(num_layers=num_layers, num_stages=num_stages, num_microbatches=num_microbatches,
                  layers_per_round=layers_per_round)
  _check_schedule(schedule, layers_per_round)
  per_pass = num_stages * layers_per_round
  _check_stages_divide_layers(num_layers, num_stages, per_pass, schedule)
  if schedule == "fill_drain":
    return PipelineSchedule(num_stages, num_microbatches, 1, num_layers // num_stages)
  return PipelineSchedule(num_stages, num_microbatches, num_layers // per_pass, layers_per_round)


def _check_positive(**counts) -> None:
  for what, n in counts.items():
    if not isinstance(n, int) or n < 1:
      raise ValueError(f"pipeline: {what}={n!r} must be a positive int.")


def _check_schedule(schedule: str, layers_per_round: int) -> None:
  if schedule not in SCHEDULES:
    raise ValueError(f"pipeline: unknown schedule={schedule!r}; use one of {SCHEDULES}.")
  if schedule == "fill_drain" and layers_per_round != 1:
    raise ValueError(f"pipeline: layers_per_round={layers_per_round} applies to the circular "
                     f"schedule; fill_drain gives each stage num_layers / num_stages layers. Pass "
                     f"schedule='circular' or drop layers_per_round.")


def _check_stages_divide_layers(num_layers: int, num_stages: int, per_pass: int, schedule: str) -> None:
  if num_layers % per_pass == 0:
    return
  divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
  what = (f"{num_stages} stages" if per_pass == num_stages else
          f"{num_stages} stages x {per_pass // num_stages} layers_per_round = {per_pass}")
  raise ValueError(
      f"pipeline ({schedule}): {what} do not divide the {num_layers} layers, so the stages would "
      f"hold different numbers of layers. Use a stage dimension (times layers_per_round) that "
      f"divides {num_layers}: one of {divisors}, or change the number of layers.")
