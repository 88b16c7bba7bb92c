"""Python's cyclic garbage collector paused around an eager lowering's bursts of Python objects.

A lowering, and the lowering cache's structure key, allocate a few Python objects per op (laid-out
values, their lists, a key's tuples), nearly all freed by reference counting once the op or the
key is done, and hardly any in reference cycles. With the collector running, its young-generation passes
promote those still alive to the old generation, and once the promoted objects reach a quarter of
the old ones, a full pass traverses every object of the process: 0.3 to 0.4 s with TensorFlow
imported (half a million objects). Paused, they are freed before any pass sees them. GPT-Neo's
test_sampling (benchmarks/bench_gpt_neo_tests.py) promoted 51,004 objects at commit 2eee372,
17,651 with the pauses (and the lowering cache keeping no key of a graph seen once, and eager
random draws uncompiled), 20,274 under the original 0.1.18; its first run of the four tests under
ours had brought on a full pass inside test_sampling.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
  """The collector off for the block, back on after if it was on (a caller's gc.disable() holds)."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()
