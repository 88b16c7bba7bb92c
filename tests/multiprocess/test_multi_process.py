"""Meshes spanning processes: 2 x 4 and 4 x 2 train exactly as 1 x 8; a lost task stops the run loudly.

Tasks are started by the launcher on loopback ports and always stopped (the launcher kills its
tasks' process groups when one fails; a time limit bounds every launch). The training runs are
the launches of conftest.py's cluster_checks, which also run the collectives' checks.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from tests.multiprocess import train_script
from tests.multiprocess.launching import LAYOUTS, SHAPES, STEPS, kill_a_peer_without_launcher

pytestmark = pytest.mark.slow  # launched clusters of TensorFlow processes

KILLED_SHAPE = (2, 4)


def _assert_same_records(got, expected, what):
  assert [r["step"] for r in got] == [r["step"] for r in expected], what
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g["loss"], e["loss"], rtol=1e-5, err_msg=f"{what}, step {e['step']}")
    for g_grad, e_grad in zip(g["grads"], e["grads"]):
      np.testing.assert_allclose(g_grad, e_grad, rtol=1e-5, atol=1e-6, err_msg=f"{what}, step {e['step']}")


@pytest.mark.parametrize("num_processes,devices_per_process", sorted(SHAPES))
def test_processes_train_like_one_process_for_data_model_and_2d_layouts(
    cluster_checks, training_reference, num_processes, devices_per_process):
  run = cluster_checks(num_processes, devices_per_process)
  die_at_step = SHAPES[num_processes, devices_per_process]
  if die_at_step is None:
    assert run["status"] == 0, run["stdout"][-4000:]
  else:  # the only failure is the planned one (see the killed-task test)
    assert "[launch] task 1 was killed by signal 9" in run["stdout"], run["stdout"][-4000:]
  for rank in range(num_processes):
    assert f"[{rank}] step 1 loss" in run["stdout"]
  for rank in range(num_processes):
    with open(os.path.join(run["folder"], f"rank{rank}.json")) as f:
      got = json.load(f)
    assert sorted(got) == sorted(LAYOUTS)
    for name in LAYOUTS:
      steps = die_at_step if die_at_step is not None and name == LAYOUTS[-1] else STEPS
      _assert_same_records(got[name], training_reference[name][:steps], f"rank {rank}, layout {name}")


def test_killed_task_stops_the_run_naming_it_and_the_last_checkpoint_resumes(
    cluster_checks, training_reference, tmp_path):
  run = cluster_checks(*KILLED_SHAPE)
  die_at_step = SHAPES[KILLED_SHAPE]
  assert run["status"] != 0
  assert "[launch] task 1 was killed by signal 9" in run["stdout"], run["stdout"][-4000:]
  assert run["seconds"] < 120
  # The chief saved after every step before the kill; the checkpoint of that step is whole and
  # restorable (copied: resuming saves more checkpoints).
  ckpt_dir = shutil.copytree(os.path.join(run["folder"], "ckpt"), tmp_path / "ckpt")
  assert tf.train.latest_checkpoint(str(ckpt_dir)).endswith(f"model-{die_at_step}")
  name = LAYOUTS[-1]
  with tf.Graph().as_default():
    resumed = train_script.train(*train_script.LAYOUTS[name], STEPS - die_at_step, ckpt_dir=str(ckpt_dir),
                                 restore=True)
  _assert_same_records(resumed, training_reference[name][die_at_step:], f"resumed layout {name}")


def test_survivor_without_launcher_fails_within_the_timeout_naming_the_lost_task(tmp_path):
  survivor_output, survivor_status, killed_status = kill_a_peer_without_launcher(str(tmp_path))
  assert killed_status == -9
  assert survivor_status != 0
  assert "LostPeerError: Lost task 1 (127.0.0.1:" in survivor_output
