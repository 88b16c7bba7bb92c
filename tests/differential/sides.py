"""Runs a script of this folder under the original mesh_tensorflow 0.1.21 or under ours.

Each side runs in a subprocess of its own: the two packages have the same import name, so they
are never imported into one process (nor into the pytest process). The original side's path is
.original/ (written by scripts/setup_original.sh) plus shim/ (its import shim for the TF modules
that TF 2.21 removed); ours is the repository. `-P` and a temporary working directory keep the
script's folder and the repository off the original's path.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ORIGINAL = ROOT / ".original"
SHIM = HERE / "shim"
SIDES = ("original", "ours")
TIMEOUT_S = 600
NOT_INSTALLED = ("the original mesh_tensorflow 0.1.21 is not installed in .original/: run "
                 "`bash scripts/setup_original.sh` (needs pip's access to PyPI, or "
                 "MTF_ORIGINAL_WHEEL=<wheel path>) to run the differential tests")


def original_installed() -> bool:
  return (ORIGINAL / "mesh_tensorflow" / "__init__.py").is_file() and any(
      ORIGINAL.glob("mesh_tensorflow-0.1.21.dist-info"))


def skip_unless_installed():
  """Skips the calling test (or module, at import) when the original is not installed."""
  if not original_installed():
    pytest.skip(NOT_INSTALLED, allow_module_level=True)


def environment(side: str) -> dict:
  """The subprocess environment of `side`: only that side's package importable as mesh_tensorflow."""
  path = [ORIGINAL, SHIM] if side == "original" else [ROOT]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in path), TF_CPP_MIN_LOG_LEVEL="2")
  return env


def start(side: str, script: str, args: list) -> subprocess.Popen:
  """Starts `script` (a file of this folder) under `side` with `args`; see finish()."""
  assert side in SIDES, side
  return subprocess.Popen([sys.executable, "-P", str(HERE / script)] + [str(a) for a in args],
                          cwd=tempfile.gettempdir(), env=environment(side), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, side: str) -> str:
  """Waits for a started script; returns its stdout, raising with its output if it failed."""
  stdout, stderr = process.communicate(timeout=TIMEOUT_S)
  if process.returncode != 0:
    raise RuntimeError(f"{' '.join(process.args[2:])} failed under the {side} package "
                       f"(exit {process.returncode}):\n{stdout[-2000:]}\n{stderr[-6000:]}")
  return stdout


def run(side: str, script: str, args: list) -> str:
  """Runs `script` under `side` to completion; returns its stdout."""
  return finish(start(side, script, args), side)
