"""What the driver does with a bad unit of work (a non-finite step, a batch of bad ids): stop or skip.

Both choices share one shape: skip (default off, so nothing is silently thrown away) and how many
skips in a row end the run anyway.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SkipPolicy:
  skip: bool = False
  max_skipped_in_a_row: int = 10


def skip_policy(option: str, what: str, skip: bool, max_skipped_in_a_row: int) -> SkipPolicy:
  """The checked policy of gin configurable `option`; `what` names the skipped things in the error."""
  if not isinstance(max_skipped_in_a_row, int) or max_skipped_in_a_row < 1:
    raise ValueError(f"{option}.max_skipped_in_a_row = {max_skipped_in_a_row!r}: expected a positive int "
                     f"(how many {what} in a row end the run).")
  return SkipPolicy(bool(skip), max_skipped_in_a_row)
