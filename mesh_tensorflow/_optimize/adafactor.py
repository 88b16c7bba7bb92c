"""Adafactor (Shazeer & Stern 2018): factored second moments, update clipping, relative step size."""

from __future__ import annotations

from typing import Optional, Sequence

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow import ops_with_redefined_builtins as mtf
from mesh_tensorflow._layers.dense import unit_scaling_convention
from mesh_tensorflow._optimize import base, schedules
from mesh_tensorflow._optimize.step import training_step

__all__ = [
    "AdafactorOptimizer", "AdafactorWithMultiLRSchedule", "adafactor_optimizer_from_hparams",
    "make_optimizer",
]


@gin.configurable(module=base._GIN_MODULE)
class AdafactorOptimizer(base.Optimizer):
  """Adafactor: Adam-like steps with factored second moments, so optimizer state stays small.

  Second moments of a variable whose two largest (non-stacked) dimensions d0, d1 both have at
  least `min_dim_size_to_factor` entries are factored: slot `var.name + "_slot_vr"` (shape
  var - d0) holds g² averaged over d0, `"_slot_vc"` (var - d1) g² averaged over d1, and
  v ~ vr * vc / mean_d1(vr). Smaller variables keep the full `"_slot_v"`. With beta1, `"_slot_m"`
  holds momentum of the scaled update. Per step (decay rate d, learning rate lr):
    x = g / sqrt(v);  x /= max(1, rms(x) / clipping_threshold);
    var -= x * lr * max(rms(var), epsilon2)   (or x * lr without multiply_by_parameter_scale).

  The default learning rate and decay rate depend on the training step: the TF global step
  (`tf.train.get_or_create_global_step()`) unless `step` is given. A hand-written loop must
  increment it (`tf.assign_add(global_step, 1)` after the updates); if an update runs twice at
  the same global step, a warning says so once.

  Args:
    multiply_by_parameter_scale: scale each step by the variable's RMS (relative step size).
    learning_rate: a number or scalar tensor; default min(1/sqrt(step + 1), 0.01), times 0.05
      without multiply_by_parameter_scale (unless mtf.layers.unit_scaling_convention()).
    decay_rate: second-moment decay, a number or scalar tensor; default
      `adafactor_decay_rate_pow()`, 1 - (step + 1)^-0.8.
    beta1: momentum of the update; 0 keeps no momentum slot.
    clipping_threshold: the largest RMS of the normalised update; None disables clipping.
    factored: factor the second moments of matrices (False keeps full ones).
    epsilon1: added to g² (keeps the division finite).
    epsilon2: the floor of the parameter scale (lets zero-initialised variables move).
    min_dim_size_to_factor: factor only if the second-largest dimension is at least this big.
    stacked_dim_names: dimension names never factored over (e.g. stacked layers).
    exclude_from_parameter_scale: variables whose name contains one of these strings take
      absolute steps.
    step: the training step the default rates follow (a Python number or scalar tf.Tensor);
      None follows the TF global step.

  Example:
    updates = mtf.optimize.AdafactorOptimizer().apply_grads(grads, graph.trainable_variables)
  """

  def __init__(self, multiply_by_parameter_scale: bool = True, learning_rate=None, decay_rate=None,
               beta1: float = 0.0, clipping_threshold: Optional[float] = 1.0, factored: bool = True,
               epsilon1: float = 1e-30, epsilon2: float = 1e-3, min_dim_size_to_factor: int = 128,
               stacked_dim_names: Optional[Sequence[str]] = None,
               exclude_from_parameter_scale: Optional[Sequence[str]] = None, step=None):
    if learning_rate is None or decay_rate is None:
      step = training_step(step)  # read once: both defaults see one value (and one watched read)
    self._step = step
    self._multiply_by_parameter_scale = multiply_by_parameter_scale
    if learning_rate is None:
      learning_rate = self._learning_rate_default(multiply_by_parameter_scale)
    self._learning_rate = learning_rate
    if decay_rate is None:
      decay_rate = self._decay_rate_default()
    self._decay_rate = decay_rate
    self._beta1 = beta1
    self._clipping_threshold = clipping_threshold
    self._factored = factored
    self._epsilon1 = epsilon1
    self._epsilon2 = epsilon2
    self._min_dim_size_to_factor = min_dim_size_to_factor
    self._stacked_dim_names = set(stacked_dim_names or [])
    self._exclude_from_parameter_scale = list(exclude_from_parameter_scale or [])

  def _learning_rate_for(self, var):
    return self._learning_rate

  def _factored_dims(self, shape: mtf.Shape, layer_dims=()) -> Optional[list]:
    """[d0, d1], the two largest non-stacked dims if the second has >= min_dim_size_to_factor, else None.

    layer_dims (a layer stack's) are never factored: each layer is factored alone.
    """
    own_dims = [d for d in shape.dims if d not in layer_dims]
    if not self._factored or len(own_dims) < 2:
      return None
    sorted_dims = sorted(own_dims, key=lambda d: -d.size)
    sorted_dims = [d for d in sorted_dims if d.name not in self._stacked_dim_names]
    if len(sorted_dims) < 2 or sorted_dims[1].size < self._min_dim_size_to_factor:
      return None
    return sorted_dims[:2]

  def _parameter_scale(self, var) -> mtf.Tensor:
    """max(rms(var), epsilon2): the floor lets zero-initialised variables move."""
    return mtf.maximum(base.reduce_rms_per_layer(mtf.to_float(var.value), var), self._epsilon2)

  def _uses_parameter_scale(self, var) -> bool:
    return self._multiply_by_parameter_scale and not any(
        s in var.name for s in self._exclude_from_parameter_scale)

  def apply_grad(self, grad, var) -> list:
    if base.warn_if_no_gradient(grad, var):
      return []
    var = base.as_variable(var)
    grad = mtf.to_float(grad)
    factored_dims = self._factored_dims(var.shape, base.layer_dims(var))
    if factored_dims:
      d0, d1 = factored_dims
      vr = base.slot_variable(var, "_slot_vr", var.shape - d0)
      vc = base.slot_variable(var, "_slot_vc", var.shape - d1)
    else:
      v = base.slot_variable(var, "_slot_v")
    if self._beta1:
      m = base.slot_variable(var, "_slot_m")

    with tf.variable_scope(var.name + "/adafactor"):
      learning_rate = base.scalar_as(self._learning_rate_for(var), tf.float32)
      decay_rate = base.scalar_as(self._decay_rate, tf.float32)
      mixing_rate = 1.0 - decay_rate
      grad_squared = mtf.square(grad) + self._epsilon1
      if self._uses_parameter_scale(var):
        update_scale = self._parameter_scale(var) * learning_rate
      else:
        update_scale = learning_rate
      updates = []
      if factored_dims:
        new_vr = vr * decay_rate + mtf.reduce_mean(grad_squared, output_shape=vr.shape) * mixing_rate
        new_vc = vc * decay_rate + mtf.reduce_mean(grad_squared, output_shape=vc.shape) * mixing_rate
        updates += [mtf.assign(vr, new_vr), mtf.assign(vc, new_vc)]
        long_term_mean = mtf.reduce_mean(new_vr, reduced_dim=d1)
        x = grad * mtf.rsqrt(new_vr / long_term_mean) * mtf.rsqrt(new_vc)
      else:
        new_v = v * decay_rate + grad_squared * mixing_rate
        updates.append(mtf.assign(v, new_v))
        x = grad * mtf.rsqrt(new_v)
      if self._clipping_threshold is not None:
        x /= mtf.maximum(1.0, base.reduce_rms_per_layer(x, var) / self._clipping_threshold)
      subtrahend = x * update_scale
      if self._beta1:
        subtrahend = m * self._beta1 + subtrahend * (1.0 - self._beta1)
        updates.append(mtf.assign(m, subtrahend))
      # assign_sub (not assign(var - x)): a bfloat16 slice is rounded once per step, not twice.
      updates.append(mtf.assign_sub(var, subtrahend))
      return updates

  def _decay_rate_default(self):
    return schedules.adafactor_decay_rate_pow(step=self._step)

  def _learning_rate_default(self, multiply_by_parameter_scale: bool):
    """min(1/sqrt(step + 1), 0.01), times 0.05 for absolute steps without unit scaling."""
    learning_rate = tf.minimum(tf.math.rsqrt(training_step(self._step) + 1.0), 0.01)
    if not multiply_by_parameter_scale and not unit_scaling_convention():
      learning_rate *= 0.05
    return learning_rate


@gin.configurable(module=base._GIN_MODULE)
class AdafactorWithMultiLRSchedule(schedules.MultiLRScheduleMixin, AdafactorOptimizer):
  """AdafactorOptimizer with per-variable learning-rate schedules (see compute_lr_for_step).

  Variables whose name matches the regex variable_search[i] use alt_lr_schedules[i]; the others
  use `learning_rate` (or Adafactor's default).

  Args:
    variable_search: regexes searched in variable names, in order.
    alt_lr_schedules: one schedule per regex (see compute_lr_for_step).
    **kwargs: AdafactorOptimizer's arguments.
  """

  def __init__(self, variable_search: Optional[Sequence[str]] = None,
               alt_lr_schedules: Optional[Sequence] = None, **kwargs):
    super().__init__(**kwargs)
    self._init_multi_lr(variable_search, alt_lr_schedules, self._learning_rate, step=self._step)


def adafactor_optimizer_from_hparams(hparams, lr) -> AdafactorOptimizer:
  """An AdafactorOptimizer from tensor2tensor-style `optimizer_adafactor_*` hparams.

  Args:
    hparams: an object with attributes optimizer_adafactor_{decay_type ("Adam" or "pow"), beta1,
      beta2, memory_exponent, multiply_by_parameter_scale, clipping_threshold, factored}.
    lr: the learning rate.

  Returns:
    An AdafactorOptimizer.
  """
  if hparams.optimizer_adafactor_decay_type == "Adam":
    decay_rate = schedules.adafactor_decay_rate_adam(hparams.optimizer_adafactor_beta2)
  elif hparams.optimizer_adafactor_decay_type == "pow":
    decay_rate = schedules.adafactor_decay_rate_pow(hparams.optimizer_adafactor_memory_exponent)
  else:
    raise ValueError(f"unknown optimizer_adafactor_decay_type "
                     f"{hparams.optimizer_adafactor_decay_type!r}; use 'Adam' or 'pow'.")
  return AdafactorOptimizer(
      multiply_by_parameter_scale=hparams.optimizer_adafactor_multiply_by_parameter_scale,
      learning_rate=lr,
      decay_rate=decay_rate,
      beta1=hparams.optimizer_adafactor_beta1,
      clipping_threshold=hparams.optimizer_adafactor_clipping_threshold,
      factored=hparams.optimizer_adafactor_factored)


def make_optimizer(hparams, lr) -> base.Optimizer:
  """The optimizer named by hparams.optimizer: "SGD" or "Adafactor".

  Args:
    hparams: tensor2tensor-style hparams (see adafactor_optimizer_from_hparams).
    lr: the learning rate.

  Returns:
    An SgdOptimizer or AdafactorOptimizer.
  """
  if hparams.optimizer == "SGD":
    return base.SgdOptimizer(lr)
  if hparams.optimizer == "Adafactor":
    return adafactor_optimizer_from_hparams(hparams, lr)
  raise ValueError(f"Unknown Optimizer {hparams.optimizer!r}; make_optimizer knows 'SGD' and "
                   f"'Adafactor' (build other optimizers directly).")
