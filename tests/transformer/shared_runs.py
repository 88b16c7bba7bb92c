"""Training runs that several test modules read, each done once per test process.

Training costs a graph construction and lowering; tests that only need some trained checkpoint of
the tiny model share one. The shared model_dir is never written to: a test that runs any mode on
it (modes write summaries, checkpoints, locks) works on its own copy (`copy_model_dir`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import shutil

import gin
import pytest

from mesh_tensorflow.transformer import utils
from tests.transformer import tiny_run

_RUNS: dict = {}


@dataclasses.dataclass(frozen=True)
class TrainedRun:
  """A finished training run: its model_dir (read only), corpus glob, result and printed output."""
  model_dir: pathlib.Path
  corpus: str
  result: dict
  out: str


def tiny_lm(tmp_path_factory) -> TrainedRun:
  """tiny_run's language model on two devices, trained 6 steps (checkpoints at steps 3 and 6)."""
  if "tiny_lm" not in _RUNS:
    directory = tmp_path_factory.mktemp("shared_tiny_lm")
    corpus = tiny_run.write_corpus(str(directory))
    out = io.StringIO()
    try:
      tiny_run.configure_gin(corpus, tiny_run.TWO_DEVICES)
      with contextlib.redirect_stdout(out):
        result = tiny_run.run(directory / "model", "train")
    finally:
      gin.clear_config()
      utils.FLAGS.unparse_flags()
    _RUNS["tiny_lm"] = TrainedRun(directory / "model", corpus, result, out.getvalue())
  return _RUNS["tiny_lm"]


@pytest.fixture
def trained(tmp_path_factory) -> TrainedRun:
  """The fixture of `tiny_lm` (copy its model_dir before running any mode on it)."""
  return tiny_lm(tmp_path_factory)


def copy_model_dir(trained: TrainedRun, destination: pathlib.Path) -> pathlib.Path:
  """A copy of the run's model_dir at `destination` (checkpoint state files name files relatively)."""
  shutil.copytree(trained.model_dir, destination)
  return destination
