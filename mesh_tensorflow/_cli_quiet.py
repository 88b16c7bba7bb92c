"""Quiet start-up for command-line entry points: runs before TensorFlow is first imported.

`python -m mesh_tensorflow.transformer.main ...` (and scripts that set MTF_QUIET=1 before importing
mesh_tensorflow) would otherwise print TensorFlow's C++ start-up lines (oneDNN, CPU features,
absl) on every run. Here, for those entry points only, TF_CPP_MIN_LOG_LEVEL defaults to 3 and
stderr is muted while TensorFlow loads. `--verbose` on the command line, or MTF_QUIET=0, keeps
everything. This module must not import TensorFlow at module level before muting.
"""

from __future__ import annotations

import contextlib
import os
import sys


def _wanted() -> bool:
  if "--verbose" in sys.argv or os.environ.get("MTF_QUIET") == "0":
    return False
  return os.environ.get("MTF_QUIET") == "1" or sys.argv[:1] == ["-m"]


@contextlib.contextmanager
def _muted_stderr():
  sys.stderr.flush()
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  try:
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)


if _wanted() and "tensorflow" not in sys.modules:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  with _muted_stderr():
    import tensorflow  # noqa: F401  (loaded here so its start-up lines go nowhere)
