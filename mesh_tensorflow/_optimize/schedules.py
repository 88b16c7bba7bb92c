"""Step-dependent rates and per-variable schedules.

They read the training step of `step.training_step`: the TF global step unless one is given.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow._optimize import base
from mesh_tensorflow._optimize.step import training_step

__all__ = [
    "adafactor_decay_rate_adam", "adafactor_decay_rate_pow", "product_learning_rate",
    "compute_lr_for_step",
]


def adafactor_decay_rate_adam(beta2: float, step=None) -> tf.Tensor:
  """Second-moment decay like Adam's beta2, with Adam's bias correction folded in.

  At step t (1-based) it is beta2 * (1 - beta2^(t-1)) / (1 - beta2^t), so step 1 uses only g².

  Args:
    beta2: the decay rate it tends to.
    step: the 0-based training step; None follows the TF global step.

  Returns:
    A float32 scalar tf.Tensor.
  """
  t = training_step(step) + 1.0
  return beta2 * (1.0 - tf.pow(beta2, t - 1.0)) / (1.0 - tf.pow(beta2, t))


@gin.configurable(module=base._GIN_MODULE)
def adafactor_decay_rate_pow(exponent: float = 0.8, offset: int = 0, step=None) -> tf.Tensor:
  """Second-moment decay 1 - (step - offset + 1)^-exponent: the averaging window grows as step^exponent.

  Args:
    exponent: how fast the decay rate approaches 1.
    offset: the step at which the decay restarts from 0.
    step: the training step; None follows the TF global step.

  Returns:
    A float32 scalar tf.Tensor.
  """
  return 1.0 - tf.pow(training_step(step) - offset + 1.0, -exponent)


@gin.configurable(module=base._GIN_MODULE)
def product_learning_rate(step, total_train_steps, factors=gin.REQUIRED, offset=0):
  """The product of `factors`: numbers, or functions f(step, total_train_steps) -> rate.

  Args:
    step: the training step (number or tensor).
    total_train_steps: the number of training steps.
    factors: numbers and functions f(step, total_train_steps).
    offset: factors see step - offset and total_train_steps - offset.

  Returns:
    The product (number or tensor).
  """
  ret = 1.0
  for f in factors:
    ret *= f(step - offset, total_train_steps - offset) if callable(f) else f
  return ret


@gin.configurable(module=base._GIN_MODULE)
def compute_lr_for_step(schedules: Sequence, learning_rate, train_steps: int = 524288, step=None) -> list:
  """The learning rate of each schedule at the current training step.

  A schedule is None (use `learning_rate`), a number, a function f(step, total_train_steps), or
  a list of those multiplied together (see product_learning_rate).

  Args:
    schedules: one schedule per variable group.
    learning_rate: the rate of the None schedules.
    train_steps: total_train_steps given to schedule functions.
    step: the training step; None follows the TF global step (read once for all schedules).

  Returns:
    One rate (number or scalar tensor) per schedule.
  """
  current_step = None
  rates = []
  for schedule in schedules:
    if schedule is None:
      rates.append(learning_rate)
      continue
    if current_step is None:
      current_step = training_step(step)
    factors = schedule if isinstance(schedule, (list, tuple)) else [schedule]
    rates.append(product_learning_rate(current_step, train_steps, factors=factors))
  return rates


class MultiLRScheduleMixin:
  """Per-variable learning rates for an optimizer.

  The first `variable_search` regex found in a variable's name selects the matching entry of
  `alt_lr_schedules`; other variables keep the default rate.
  """

  def _init_multi_lr(self, variable_search: Optional[Sequence[str]], alt_lr_schedules: Optional[Sequence],
                     default_learning_rate, step=None) -> None:
    variable_search = list(variable_search or [])
    alt_lr_schedules = list(alt_lr_schedules or [])
    if len(variable_search) != len(alt_lr_schedules):
      raise ValueError(
          f"{type(self).__name__}: {len(variable_search)} variable_search patterns but "
          f"{len(alt_lr_schedules)} alt_lr_schedules; give one schedule per pattern.")
    self._variable_search = [re.compile(pattern) for pattern in variable_search]
    self._alt_learning_rates = compute_lr_for_step(alt_lr_schedules, default_learning_rate, step=step)

  def _learning_rate_for(self, var):
    for pattern, rate in zip(self._variable_search, self._alt_learning_rates):
      if pattern.search(var.name):
        return rate
    return super()._learning_rate_for(var)
