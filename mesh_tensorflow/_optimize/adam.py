"""Adam with decoupled weight decay (BERT style: no bias correction)."""

from __future__ import annotations

import re
from typing import Optional, Sequence

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow import ops_with_redefined_builtins as mtf
from mesh_tensorflow._optimize import base, schedules

__all__ = ["AdamWeightDecayOptimizer", "AdamWithMultiLRSchedule"]


@gin.configurable(module=base._GIN_MODULE)
class AdamWeightDecayOptimizer(base.Optimizer):
  """Adam whose weight decay is added to the update, not to the loss (so m and v never see it).

  m' = b1 m + (1-b1) g;  v' = b2 v + (1-b2) g²;  var -= lr (m' / (sqrt(v') + eps) + wd var).
  Slots `var.name + "/adam_m"` and `"/adam_v"` are float32. Variables whose name matches a
  regex in `exclude_from_weight_decay` get no decay.

  Args:
    learning_rate: a number or scalar tensor.
    weight_decay_rate: wd above; 0 disables weight decay.
    beta_1: decay of the first moment m.
    beta_2: decay of the second moment v.
    epsilon: added to sqrt(v') (keeps the division finite).
    exclude_from_weight_decay: regexes; matching variable names get no weight decay.
  """

  def __init__(self, learning_rate, weight_decay_rate: float = 0.0, beta_1: float = 0.9,
               beta_2: float = 0.999, epsilon: float = 1e-6,
               exclude_from_weight_decay: Optional[Sequence[str]] = None):
    self.learning_rate = learning_rate
    self.weight_decay_rate = weight_decay_rate
    self.beta_1 = beta_1
    self.beta_2 = beta_2
    self.epsilon = epsilon
    self.exclude_from_weight_decay = exclude_from_weight_decay

  def _learning_rate_for(self, var):
    return self.learning_rate

  def apply_grad(self, grad, var) -> list:
    if base.warn_if_no_gradient(grad, var):
      return []
    var = base.as_variable(var)
    grad = mtf.to_float(grad)
    m = base.slot_variable(var, "/adam_m")
    v = base.slot_variable(var, "/adam_v")
    next_m = m * self.beta_1 + grad * (1.0 - self.beta_1)
    next_v = v * self.beta_2 + mtf.square(grad) * (1.0 - self.beta_2)
    update = next_m / (mtf.sqrt(next_v) + self.epsilon)
    if self._do_use_weight_decay(var.name):
      update += mtf.to_float(var.value) * self.weight_decay_rate
    update_with_lr = update * base.scalar_as(self._learning_rate_for(var), tf.float32)
    return [mtf.assign_sub(var, update_with_lr), mtf.assign(m, next_m), mtf.assign(v, next_v)]

  def _do_use_weight_decay(self, param_name: str) -> bool:
    """Whether `param_name` gets weight decay (rate nonzero and no exclusion regex matches)."""
    if not self.weight_decay_rate:
      return False
    return not any(re.search(r, param_name) for r in self.exclude_from_weight_decay or [])


@gin.configurable(module=base._GIN_MODULE)
class AdamWithMultiLRSchedule(schedules.MultiLRScheduleMixin, AdamWeightDecayOptimizer):
  """AdamWeightDecayOptimizer with per-variable learning-rate schedules (see compute_lr_for_step).

  Variables whose name matches the regex variable_search[i] use alt_lr_schedules[i]; the others
  use `learning_rate`.

  Args:
    variable_search: regexes searched in variable names, in order.
    alt_lr_schedules: one schedule per regex (see compute_lr_for_step).
    **kwargs: AdamWeightDecayOptimizer's arguments.
  """

  def __init__(self, variable_search: Optional[Sequence[str]] = None,
               alt_lr_schedules: Optional[Sequence] = None, **kwargs):
    super().__init__(**kwargs)
    self._init_multi_lr(variable_search, alt_lr_schedules, self.learning_rate)
