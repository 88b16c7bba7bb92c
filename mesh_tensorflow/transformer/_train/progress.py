"""Training progress: one line per `iterations_per_loop` steps, the same scalars in TensorBoard.

The line reads `step 200/1000  loss 2.3451  lr 1.00e-02  3.21 steps/s  6,573 tokens/s  ETA 4m09s`.
Scalars go to event files in model_dir (tags `loss`, `learning_rate`, `steps_per_sec`,
`tokens_per_sec`), written with a summary FileWriter, and can be read back with `read_scalars`.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Callable, Optional

import tensorflow.compat.v1 as tf


def format_duration(seconds: float) -> str:
  seconds = max(0, int(round(seconds)))
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  if hours:
    return "%dh%02dm" % (hours, minutes)
  return "%dm%02ds" % (minutes, seconds) if minutes else "%ds" % seconds


def summary_writer(log_dir: str):
  """A tf.summary FileWriter for event files in log_dir (it may be created in eager mode too).

  TF names an event file by the second it was opened in and the host, and truncates a file of
  that name: a run resumed within the same second overwrote the previous run's scalars. The
  suffix (nanoseconds, fixed width) keeps every run's file, sorted in the order they were opened.
  """
  with tf.Graph().as_default():
    return tf.summary.FileWriter(log_dir, filename_suffix=f".{time.time_ns():020d}")


def write_scalars(writer, step: int, scalars: dict) -> None:
  """Writes {tag: float} at `step` to a tf.summary FileWriter."""
  summary = tf.Summary(value=[tf.Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()])
  writer.add_summary(summary, step)
  writer.flush()


def read_scalars(log_dir: str, tag: str) -> list:
  """[(step, value)] of `tag` in the event files of log_dir, sorted by step (last write wins)."""
  values = {}
  for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
    for event in tf.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == tag:
          values[event.step] = value.simple_value
  return sorted(values.items())


class ProgressReporter:
  """Prints progress lines and writes the same scalars to TensorBoard.

  Args:
    writer: a tf.summary.FileWriter (or None for no event files).
    start_step: the global step training starts (or resumes) from.
    total_steps: the step training stops at.
    tokens_per_step: tokens (non-padding targets) in one training batch, for tokens/s.
    print_fn: where lines go (print by default).
  """

  def __init__(self, writer, start_step: int, total_steps: int, print_fn: Optional[Callable] = None,
               clock: Callable[[], float] = time.time):
    self._writer = writer
    self._total = total_steps
    self._print = print_fn or (lambda line: print(line, flush=True))
    self._clock = clock
    self._last_step = start_step
    self._last_time = clock()
    self._tokens = 0

  def add_tokens(self, tokens: int) -> None:
    self._tokens += int(tokens)

  def report(self, step: int, loss: float, learning_rate: float) -> dict:
    """Prints the line for `step` (rates since the previous report) and writes its scalars."""
    now = self._clock()
    elapsed = max(now - self._last_time, 1e-9)
    steps_per_sec = (step - self._last_step) / elapsed
    tokens_per_sec = self._tokens / elapsed
    eta = (self._total - step) / steps_per_sec if steps_per_sec > 0 else float("inf")
    scalars = {"loss": loss, "learning_rate": learning_rate, "steps_per_sec": steps_per_sec,
               "tokens_per_sec": tokens_per_sec}
    width = len(str(self._total))
    self._print(f"step {step:{width}d}/{self._total}  loss {loss:.4f}  lr {learning_rate:.2e}  "
                f"{steps_per_sec:.2f} steps/s  {tokens_per_sec:,.0f} tokens/s  "
                f"ETA {format_duration(eta) if eta != float('inf') else '?'}")
    if self._writer is not None:
      write_scalars(self._writer, step, scalars)
    self._last_step, self._last_time, self._tokens = step, now, 0
    return scalars
