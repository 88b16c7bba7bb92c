"""The training step that step-dependent rates read, and a warning when that step never moves.

Adafactor's default learning rate and decay rate, and the learning-rate schedules, follow
`tf.train.get_or_create_global_step()`. A `MonitoredTrainingSession` loop or the training driver
increments it; a hand-written loop often does not, and then every step silently uses the rates of
step 0. So the global step read here is watched: the second time an update runs with the same
global step value, one warning says so and how to fix it (once per graph, or once per process in
eager mode). An explicit `step` (a Python number or a scalar tf.Tensor) is used as given.
"""

from __future__ import annotations

import weakref

import tensorflow.compat.v1 as tf
from mesh_tensorflow._tf_compat import control_flow_util

__all__ = ["training_step"]

STUCK_STEP_WARNING = (
    "mtf.optimize: the global step is still %d at a second update, so nothing increments it: "
    "step-dependent rates (AdafactorOptimizer's default learning rate and decay rate, learning-rate "
    "schedules) stay at their step-%d values. Increment it with each update, e.g. run "
    "tf.assign_add(tf.train.get_or_create_global_step(), 1) after the update ops, or pass the "
    "step explicitly (AdafactorOptimizer(step=...)).")


class _StepWatch:
  """Remembers the last global-step value seen and warns once when an update sees it again."""

  def __init__(self):
    self._last = None
    self._warned = False

  def __call__(self, value):
    value = int(value)
    if value == self._last and not self._warned:
      self._warned = True
      tf.logging.warning(STUCK_STEP_WARNING, value, value)
    self._last = value
    return value


# Graph mode: one watched read per graph, so several optimizers in one train op see one update.
_watched_reads = weakref.WeakKeyDictionary()
# Eager mode: each update builds its rates anew; one watch per global-step variable.
_eager_watches = {}


def _watched_global_step() -> tf.Tensor:
  """The global step (int64), read through a _StepWatch where it can be (not inside XLA/TPU)."""
  global_step = tf.train.get_or_create_global_step()
  if tf.executing_eagerly():
    _eager_watches.setdefault(global_step.ref(), _StepWatch())(global_step.numpy())
    return tf.convert_to_tensor(global_step)
  graph = tf.get_default_graph()
  if control_flow_util.GraphOrParentsInXlaContext(graph):
    return tf.convert_to_tensor(global_step)  # a Python callback cannot run on a TPU
  if graph not in _watched_reads:
    with tf.control_dependencies(None), tf.device(None), tf.name_scope("mtf_global_step_watch"):
      watched = tf.py_function(_StepWatch(), [global_step], tf.int64)
      watched.set_shape([])
    _watched_reads[graph] = watched
  return _watched_reads[graph]


def training_step(step=None) -> tf.Tensor:
  """The training step as a float32 scalar tensor.

  Args:
    step: None to follow `tf.train.get_or_create_global_step()` (watched: a warning is logged
      once if an update runs twice at the same value), or a Python number or scalar tf.Tensor
      counting training steps, used as given.

  Returns:
    A float32 scalar tf.Tensor.
  """
  if step is None:
    step = _watched_global_step()
  return tf.cast(step, tf.float32)
