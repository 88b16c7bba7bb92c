"""The launches and one-process references shared by the tests of this folder.

One launch per cluster shape runs the checks of both test_collectives_between_processes.py and
test_multi_process.py (cluster_checks_script.py): every task start imports TensorFlow (~5 s of
CPU), so each shape is launched once per test session, even across pytest-xdist workers.
"""

from __future__ import annotations

import os

import pytest
import tensorflow.compat.v1 as tf

from tests.multiprocess import collectives_script, train_script
from tests.multiprocess.launching import LAYOUTS, ROOT, SHAPES, STEPS, launch_script, shared_launch

CHECKS_SCRIPT = os.path.join(ROOT, "tests", "multiprocess", "cluster_checks_script.py")


@pytest.fixture(scope="session")
def cluster_checks(tmp_path_factory):
  """(processes, devices per process) -> {"status", "stdout", "seconds", "folder"} of that launch.

  The folder holds rank<R>.npz (the collectives), rank<R>.json (the training records) and, for a
  shape with a killed task, ckpt/ (the chief's checkpoints).
  """
  def launched(num_processes: int, devices_per_process: int) -> dict:
    die_at_step = SHAPES[num_processes, devices_per_process]

    def launch(folder):
      flags = ["--out", str(folder), "--layouts", ",".join(LAYOUTS), "--steps", str(STEPS)]
      if die_at_step is not None:
        flags += ["--die_at_step", str(die_at_step), "--ckpt_dir", str(folder / "ckpt")]
      result, seconds = launch_script(CHECKS_SCRIPT, num_processes, devices_per_process, *flags)
      return {"status": result.returncode, "stdout": result.stdout, "seconds": seconds}

    return shared_launch(tmp_path_factory, f"cluster-checks-{num_processes}x{devices_per_process}", launch)

  return launched


@pytest.fixture(scope="session")
def training_reference():
  """Layout name -> the records of STEPS steps on one process holding all 8 processors."""
  references = {}
  for name in LAYOUTS:
    with tf.Graph().as_default():
      references[name] = train_script.train(*train_script.LAYOUTS[name], STEPS)
  return references


@pytest.fixture(scope="session")
def collectives_reference():
  """Every case of collectives_script.py on one process holding all 8 processors."""
  with tf.Graph().as_default():
    return collectives_script.run_cases()
