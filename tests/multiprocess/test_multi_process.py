"""Meshes spanning processes: 2 x 4 and 4 x 2 train exactly as 1 x 8; a lost task stops the run loudly.

Tasks are started by the launcher on loopback ports and always stopped (the launcher kills its
tasks' process groups when one fails; subprocess timeouts bound every test).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from tests.multiprocess import train_script
from tests.multiprocess.launching import ROOT, kill_a_peer_without_launcher, launch_script

SCRIPT = os.path.join(ROOT, "tests", "multiprocess", "train_script.py")


def _launch(num_processes, devices_per_process, *script_args):
  return launch_script(SCRIPT, num_processes, devices_per_process, *script_args)


def _reference(name, steps):
  """The same run on one process holding all 8 processors."""
  return train_script.train(*train_script.LAYOUTS[name], steps)


def _assert_same_records(got, expected):
  assert [r["step"] for r in got] == [r["step"] for r in expected]
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g["loss"], e["loss"], rtol=1e-5)
    for g_grad, e_grad in zip(g["grads"], e["grads"]):
      np.testing.assert_allclose(g_grad, e_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_processes,devices_per_process", [(2, 4), (4, 2)])
def test_processes_train_like_one_process_for_data_model_and_2d_layouts(
    tmp_path, num_processes, devices_per_process):
  names = sorted(train_script.LAYOUTS)
  result, _ = _launch(num_processes, devices_per_process, "--layouts", ",".join(names),
                      "--steps", "2", "--out", str(tmp_path))
  assert result.returncode == 0, result.stdout[-4000:]
  for rank in range(num_processes):
    assert f"[{rank}] step 1 loss" in result.stdout
  with tf.Graph().as_default():
    expected = {name: _reference(name, 2) for name in names}
  for rank in range(num_processes):
    with open(tmp_path / f"rank{rank}.json") as f:
      got = json.load(f)
    for name in names:
      _assert_same_records(got[name], expected[name])


def test_killed_task_stops_the_run_naming_it_and_the_last_checkpoint_resumes(tmp_path):
  ckpt_dir = tmp_path / "ckpt"
  result, seconds = _launch(2, 4, "--steps", "4", "--die_at_step", "2", "--ckpt_dir", str(ckpt_dir),
                            "--out", str(tmp_path / "out"))
  assert result.returncode != 0
  assert "[launch] task 1 was killed by signal 9" in result.stdout
  assert seconds < 120
  # The chief saved after steps 0 and 1; the checkpoint of step 2 is whole and restorable.
  assert tf.train.latest_checkpoint(str(ckpt_dir)).endswith("model-2")
  with tf.Graph().as_default():
    resumed = train_script.train(*train_script.LAYOUTS["2d"], 2, ckpt_dir=str(ckpt_dir), restore=True)
  with tf.Graph().as_default():
    expected = _reference("2d", 4)
  _assert_same_records(resumed, expected[2:])


def test_survivor_without_launcher_fails_within_the_timeout_naming_the_lost_task(tmp_path):
  survivor_output, survivor_status, killed_status = kill_a_peer_without_launcher(str(tmp_path))
  assert killed_status == -9
  assert survivor_status != 0
  assert "LostPeerError: Lost task 1 (127.0.0.1:" in survivor_output
