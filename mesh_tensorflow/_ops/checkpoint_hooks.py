"""Session hooks that keep checkpointed master variables and per-device slices in sync.

Checkpoints hold only the master variables, while training updates the slices. So slices are
copied to the masters before each save, and masters to the slices once the session (and any
restore) is ready.
"""

from __future__ import annotations

import tensorflow.compat.v1 as tf

__all__ = ["MtfCheckpointSaverListener", "MtfRestoreHook"]


class MtfCheckpointSaverListener(tf.train.CheckpointSaverListener):
  """Copies slices to masters before each checkpoint (pass in CheckpointSaverHook's listeners).

  Build it while the lowered graph is the default graph: the copy op is created here.

  Args:
    lowering: the mtf.Lowering whose variables are saved.

  Example:
    tf.train.CheckpointSaverHook(checkpoint_dir, save_steps=100,
                                 listeners=[mtf.MtfCheckpointSaverListener(lowering)])
  """

  def __init__(self, lowering):
    self._op = lowering.copy_slices_to_masters()

  def before_save(self, session, global_step_value):
    tf.logging.info("Copying slices to masters before saving step %s.", global_step_value)
    session.run(self._op)


class MtfRestoreHook(tf.train.SessionRunHook):
  """Copies masters (initialised or restored) to the slices when the session is created.

  List it before any hook that reads slices in after_create_session (e.g. a CheckpointSaverHook
  with an MtfCheckpointSaverListener, which saves at step 0).

  Args:
    lowering: the mtf.Lowering whose variables are restored.

  Example:
    tf.train.MonitoredTrainingSession(checkpoint_dir=..., hooks=[mtf.MtfRestoreHook(lowering), ...])
  """

  def __init__(self, lowering):
    self._lowering = lowering
    self._op = None

  def begin(self):
    # A named scope makes the op easy to find when an exported graph is loaded elsewhere.
    with tf.name_scope("mtf_restore_hook"):
      self._op = self._lowering.copy_masters_to_slices()

  def after_create_session(self, session, coord):
    tf.logging.info("Copying masters to slices.")
    session.run(self._op)
