"""A resumed run whose learning-rate schedule's horizon changed says so.

The schedules decay over `total_train_steps` (utils.run.total_run_steps, else train_steps), so
resuming with a larger train_steps silently moves the decay and the rate jumps. Each training run
records its horizon in model_dir; a resumed run with another horizon prints what changed and the
binding that keeps the previous schedule.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Optional

import numpy as np
import tensorflow.compat.v1 as tf
from absl import logging

from mesh_tensorflow.transformer._train import checkpoints, loop

RECORD = "learning_rate_horizon.json"
_SAMPLES = 64  # steps from the resume step to the later horizon at which the two schedules are compared


def _recorded_horizon(model_dir: str) -> Optional[int]:
  """The previous run's horizon: its record, else its operative_config.gin's bindings (older runs)."""
  record = os.path.join(model_dir, RECORD)
  if tf.io.gfile.exists(record):
    with tf.io.gfile.GFile(record) as f:
      return int(json.load(f)["total_train_steps"])
  config = os.path.join(model_dir, loop.OPERATIVE_CONFIG)
  if not tf.io.gfile.exists(config):
    return None
  with tf.io.gfile.GFile(config) as f:
    text = f.read()
  for name in ("total_run_steps", "train_steps"):
    found = re.search(rf"^utils\.run\.{name} = (\d+)$", text, re.M)
    if found:
      return int(found.group(1))
  return None


def _rates(schedule: Callable, steps: np.ndarray, total_train_steps: int) -> np.ndarray:
  """schedule(step, total_train_steps) at each of `steps`, evaluated in a graph of its own."""
  with tf.Graph().as_default():
    rate = schedule(step=tf.constant(steps, tf.float32), total_train_steps=total_train_steps)
    if not isinstance(rate, tf.Tensor):
      return np.broadcast_to(np.float32(rate), steps.shape)
    with tf.Session() as session:
      return np.broadcast_to(session.run(rate), steps.shape)


def horizon_change_message(schedule: Callable, step: int, previous: int, horizon: int) -> Optional[str]:
  """What resuming at `step` with `horizon` instead of `previous` does to the rate; None if nothing."""
  steps = np.unique(np.concatenate([[step], np.linspace(step, max(previous, horizon), _SAMPLES)]))
  before, after = _rates(schedule, steps, previous), _rates(schedule, steps, horizon)
  if np.allclose(before, after, rtol=1e-6, atol=0):
    return None
  keep = f"utils.run.total_run_steps = {previous}"
  message = (f"Learning-rate schedule: its horizon changed from {previous} to {horizon} steps "
             f"(utils.run.total_run_steps, else train_steps), so the rate at step {step} jumps from "
             f"{before[0]:.2e} to {after[0]:.2e}. To keep the previous schedule, bind {keep} "
             f"(--gin_param='{keep}').")
  if (before < 0).any():
    message += (f" It falls below 0 after step {previous}: to train past it, give total_run_steps "
                f"the length of the whole run from the start.")
  return message


def check_and_record(model_dir: str, schedule: Optional[Callable], horizon: int, train_steps: int,
                     print_fn: Callable = print) -> Optional[str]:
  """Before a training run: says (logging.warning and print_fn) when resuming changes the schedule's
  horizon, then records `horizon` for the next run. Returns the message, or None."""
  latest = checkpoints.latest_checkpoint(model_dir)
  step = checkpoints.get_step_from_checkpoint_path(latest) if latest else 0
  if step >= train_steps:
    return None  # nothing to train: the run changes neither the schedule nor the record
  previous = _recorded_horizon(model_dir) if step > 0 else None
  message = None
  if callable(schedule) and previous is not None and previous != horizon:
    message = horizon_change_message(schedule, step, previous, horizon)
  if message:
    logging.warning(message)
    print_fn(message)
  tf.io.gfile.makedirs(model_dir)
  checkpoints.write_atomically(os.path.join(model_dir, RECORD), json.dumps({"total_train_steps": horizon}))
  return message
