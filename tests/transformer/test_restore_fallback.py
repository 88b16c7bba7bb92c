"""A latest checkpoint with flipped bytes: a one-line error, or (--restore_fallback) the one before."""

from __future__ import annotations

import glob
import subprocess

import pytest

from mesh_tensorflow.transformer._train import checkpoints
from tests.transformer import tiny_run

pytestmark = pytest.mark.slow  # runs the command line twice

STEPS = tiny_run.TWO_DEVICES + ["utils.run.train_steps = 9"]


def flip_bytes(path: str) -> None:
  """Inverts 16 bytes in the middle of the checkpoint's data file (a disk or copy error)."""
  [data] = glob.glob(path + ".data-*")
  with open(data, "r+b") as f:
    middle = len(f.read()) // 2
    f.seek(middle)
    chunk = f.read(16)
    f.seek(middle)
    f.write(bytes(b ^ 0xFF for b in chunk))


def main(model_dir, corpus, *flags) -> subprocess.CompletedProcess:
  command = tiny_run.main_command(str(model_dir), corpus, STEPS) + list(flags)
  return subprocess.run(command, cwd=tiny_run.ROOT, capture_output=True, text=True, timeout=300)


def test_a_corrupt_latest_checkpoint_is_one_line_without_the_option_and_skipped_with_it(tmp_path, corpus):
  tiny_run.configure_gin(corpus, STEPS + ["utils.run.train_steps = 6"])
  tiny_run.run(tmp_path, "train")  # checkpoints at steps 3 and 6
  latest = checkpoints.checkpoint_path(str(tmp_path), 6)
  flip_bytes(latest)

  refused = main(tmp_path, corpus)
  assert refused.returncode == 1
  [line] = refused.stderr.strip().splitlines()
  assert line.startswith(f"Error (CheckpointCorruptError): Checkpoint {latest} cannot be read: ")
  assert "Checksum does not match" in line and "--restore_fallback" in line
  assert "Traceback" not in refused.stderr and "Traceback" not in refused.stdout

  resumed = main(tmp_path, corpus, "--restore_fallback")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"Skipping {latest} (restore_fallback): it cannot be read: " in resumed.stdout
  assert f"Resuming from {checkpoints.checkpoint_path(str(tmp_path), 3)} at step 3." in resumed.stdout
  assert checkpoints.latest_checkpoint(str(tmp_path)) == checkpoints.checkpoint_path(str(tmp_path), 9)
  assert checkpoints.unreadable_reason(latest) is None  # step 6 saved again, whole


def test_traceback_flag_shows_the_traceback(tmp_path, corpus):
  tiny_run.configure_gin(corpus, STEPS + ["utils.run.train_steps = 3"])
  tiny_run.run(tmp_path, "train")
  flip_bytes(checkpoints.checkpoint_path(str(tmp_path), 3))
  shown = main(tmp_path, corpus, "--traceback")
  assert shown.returncode == 1
  assert "Traceback (most recent call last)" in shown.stderr
  assert "CheckpointCorruptError: Checkpoint" in shown.stderr
