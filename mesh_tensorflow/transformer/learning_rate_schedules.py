"""Learning-rate schedules, gin-configurable as `learning_rate_schedules.<name>`.

Every schedule has the signature `(step, total_train_steps, **hyperparameters)`. `step` may be a tf
scalar (the global step) or a python number; the result is a float32 tf scalar (or a python float
for the constant schedules), so the training driver can evaluate it in graph mode.

Example (gin):
  utils.run.learning_rate_schedule = @learning_rate_schedules.product_learning_rate
  product_learning_rate.factors = [@linear_warmup, @truncated_rsqrt]
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, Union

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow import optimize

Step = Union[int, float, tf.Tensor]


def _float_step(step: Step) -> tf.Tensor:
  return tf.cast(step, tf.float32)


def _steps(steps_or_fraction: float, total_train_steps: int) -> float:
  """A value <= 1 is a fraction of training; a larger one is a number of steps."""
  if steps_or_fraction <= 1:
    return steps_or_fraction * total_train_steps
  return steps_or_fraction


@gin.configurable
def product_learning_rate(step: Step, total_train_steps: int,
                          factors: Sequence[Callable] = gin.REQUIRED, offset: int = 0):
  """The product of `factors`, each called as factor(step - offset, total_train_steps - offset).

  The same as mtf.optimize.product_learning_rate, gin-configurable under this module's name too.
  """
  return optimize.product_learning_rate(step, total_train_steps, factors=factors, offset=offset)


@gin.configurable
def linear_decay(step: Step, total_train_steps: int, steps_or_fraction: float = 0.1) -> tf.Tensor:
  """1.0, then a linear decay to 0 over the last `steps_or_fraction` of training."""
  decay_steps = _steps(steps_or_fraction, total_train_steps)
  return tf.minimum(1.0, (total_train_steps - _float_step(step)) / decay_steps)


@gin.configurable
def linear_warmup(step: Step, total_train_steps: int, steps_or_fraction: float = 10000) -> tf.Tensor:
  """A linear ramp from 0 to 1.0 over the first `steps_or_fraction` of training, then 1.0."""
  warmup_steps = _steps(steps_or_fraction, total_train_steps)
  return tf.minimum(1.0, _float_step(step) / warmup_steps)


@gin.configurable
def truncated_rsqrt(step: Step, total_train_steps: int, warmup_steps: int = 10000) -> tf.Tensor:
  """1/sqrt(max(step, warmup_steps)): constant during warmup, then inverse square root decay."""
  del total_train_steps
  return tf.math.rsqrt(tf.maximum(_float_step(step), float(warmup_steps)))


@gin.configurable
def constant(step: Step, total_train_steps: int, value: float = 1.0) -> float:
  """A constant factor, typically one of product_learning_rate's factors."""
  del step, total_train_steps
  return value


@gin.configurable
def constant_learning_rate(step: Step, total_train_steps: int, learning_rate: float = gin.REQUIRED) -> float:
  """A constant learning rate."""
  del step, total_train_steps
  return learning_rate


@gin.configurable
def linear_decay_learning_rate(step: Step, total_train_steps: int, initial_lr: float = 0.1,
                               offset: int = 0) -> tf.Tensor:
  """initial_lr until step `offset`, then a linear decay reaching 0 at total_train_steps."""
  return initial_lr * tf.minimum(
      1.0, (total_train_steps - _float_step(step)) / float(total_train_steps - offset))


@gin.configurable
def learning_rate_schedule_noam(step: Step, total_train_steps: int | None = None, warmup_steps: int = 10000,
                                linear_decay_fraction: float = 0.1, multiplier: float = 1.0,
                                offset: int = 0) -> tf.Tensor:
  """Inverse-square-root decay after a constant warmup, with a linear decay to 0 at the end.

  rate = multiplier * rsqrt(max(s, warmup_steps)) * min(1, (total - s) / (total * linear_decay_fraction)),
  where s = step - offset. The linear part is dropped when total_train_steps is None or the
  fraction is 0.
  """
  step = _float_step(step) - offset
  learning_rate = tf.math.rsqrt(tf.maximum(step, float(warmup_steps))) * multiplier
  if total_train_steps is not None and linear_decay_fraction > 0:
    decay_steps = total_train_steps * linear_decay_fraction
    learning_rate *= tf.minimum(1.0, (total_train_steps - step) / decay_steps)
  return learning_rate


@gin.configurable
def slanted_triangular(step: Step, total_train_steps: int, cut_fraction: float = 0.1, ratio: float = 32,
                       max_learning_rate: float = 0.01, start_step: int = 0) -> tf.Tensor:
  """Slanted triangular rates (Howard & Ruder, 2018): a short linear rise, then a long linear fall.

  With T = total_train_steps - start_step, cut = floor(T * cut_fraction) and s = step - start_step,
  p = s / cut before the cut and 1 - (s - cut) / (cut * (1 / cut_fraction - 1)) after it;
  rate = max_learning_rate * (1 + p * (ratio - 1)) / ratio.
  """
  train_steps = total_train_steps - start_step
  step = _float_step(step) - start_step
  cut = float(math.floor(train_steps * cut_fraction))
  p = tf.where_v2(step < cut, step / cut, 1.0 - (step - cut) / (cut * (1.0 / cut_fraction - 1.0)))
  return max_learning_rate * (1.0 + p * (ratio - 1.0)) / ratio
