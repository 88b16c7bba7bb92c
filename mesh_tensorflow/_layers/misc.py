"""Miscellaneous layers: jitter, reversible residual blocks, gradient clipping, annealed dropout."""

from __future__ import annotations

import functools
from typing import Callable, Optional

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow import ops_with_redefined_builtins as mtf

__all__ = [
    "multiplicative_jitter", "reversible_half_residual_and_swap", "clip_activation_gradient",
    "summary_for_clip_activation_gradient", "annealed_dropout",
]


def multiplicative_jitter(x: mtf.Tensor, epsilon: float = 1e-2) -> mtf.Tensor:
  """x times uniform noise in [1 - epsilon, 1 + epsilon] (identity when epsilon is 0)."""
  if epsilon == 0:
    return x
  return x * mtf.random_uniform(x.mesh, x.shape, minval=1.0 - epsilon, maxval=1.0 + epsilon,
                                dtype=x.dtype)


def _half_residual_and_swap(x1, x1_backwards, x2, x2_backwards, f):
  return x2, x2_backwards, x1 + f(x2), x1_backwards


def _reversible_half_residual_grad(explicit_inputs, all_inputs, forward_operations, outputs,
                                   output_grads):
  """Backprop of a revnet block that recomputes f(x2) and reconstructs x1 = y1 - f(x2).

  The "_backwards" outputs carry no gradient: their incoming "gradients" are the activations
  reconstructed by the next block (None for the last block, which uses its real outputs).
  """
  _, _, x2, _ = explicit_inputs
  extra_inputs = all_inputs[len(explicit_inputs):]
  _, _, y1, _ = outputs
  dy2, dy2_backwards, dy1, dy1_backwards = output_grads
  add_op = forward_operations[-1]
  if not isinstance(add_op, mtf.AddOperation):
    raise ValueError(f"reversible_half_residual_and_swap: the block must end with the residual "
                     f"addition x1 + f(x2), found {type(add_op).__name__}.")
  x2_reconstructed = x2 if dy2_backwards is None else dy2_backwards
  if dy1_backwards is not None:
    y1 = dy1_backwards
  f_again_ops, mapping = x2.graph.clone_operations(forward_operations[:-1], {x2: x2_reconstructed})
  fx2 = mapping[add_op.inputs[1]]
  grads = mtf.gradients(ys=[fx2], xs=[x2_reconstructed] + extra_inputs, grad_ys=[dy1],
                        operations=f_again_ops)
  dx2 = grads[0] if dy2 is None else dy2 + grads[0]
  return [dy1, y1 - fx2, dx2, x2_reconstructed] + grads[1:]


def reversible_half_residual_and_swap(x1: mtf.Tensor, x1_backwards, x2: mtf.Tensor, x2_backwards,
                                      f: Callable, recompute_grads: bool = True) -> tuple:
  """A RevNet block (arXiv:1707.04585): (y1, y2) = (x2, x1 + f(x2)).

  With recompute_grads, activations are not kept for backprop: the block's gradient rebuilds
  x1 from its outputs and recomputes f. Chain blocks by passing each block's four outputs as the
  next block's (x1, x1_backwards, x2, x2_backwards); pass None for the first block's
  "_backwards" inputs.

  Returns:
    (y1, y1_backwards, y2, y2_backwards).
  """
  if not recompute_grads:
    return _half_residual_and_swap(x1, x1_backwards, x2, x2_backwards, f)
  if x1_backwards is None:
    x1_backwards = mtf.zeros_like(x1)
  if x2_backwards is None:
    x2_backwards = mtf.zeros_like(x2)
  return mtf.custom_gradient(functools.partial(_half_residual_and_swap, f=f),
                             _reversible_half_residual_grad,
                             [x1, x1_backwards, x2, x2_backwards])


def _rms(t: mtf.Tensor, output_shape=None) -> mtf.Tensor:
  return mtf.sqrt(mtf.reduce_mean(mtf.square(t), output_shape=output_shape))


def _identity_with_grad_fn(x: mtf.Tensor, dy_fn: Callable) -> mtf.Tensor:
  """Identity forward; backward maps the incoming gradient through dy_fn."""
  def grad_fn(explicit_inputs, all_inputs, forward_operations, outputs, output_grads):
    del explicit_inputs, all_inputs, forward_operations, outputs
    return [dy_fn(output_grads[0])]
  return mtf.custom_gradient(mtf.identity, grad_fn, [x])


@gin.configurable(module="mesh_tensorflow.layers")
def clip_activation_gradient(x: mtf.Tensor, clip_rms_norm: Optional[float] = None) -> mtf.Tensor:
  """Identity forward; backward rescales the gradient so its RMS is at most clip_rms_norm.

  None or 0 disables clipping (returns x itself).
  """
  if not clip_rms_norm:
    return x
  return _identity_with_grad_fn(x, lambda dy: dy / mtf.maximum(_rms(dy) / clip_rms_norm, 1.0))


def summary_for_clip_activation_gradient(t: mtf.Tensor, name: Optional[str] = None,
                                         batch_dims=None) -> mtf.Tensor:
  """Identity forward; backward records the gradient's RMS as scalar summary `name`.

  Helps choose clip_rms_norm. With batch_dims, the RMS is taken per example (over the other
  dims) and the largest one is recorded. Default name: "<t's op name>/activation_gradient_rms".
  """
  name = name or "%s/activation_gradient_rms" % t.operation.name
  batch_shape = mtf.Shape(list(batch_dims or []))

  def record(dy):
    rms = mtf.reduce_max(_rms(dy, output_shape=batch_shape))
    with tf.variable_scope(dy.graph.captured_variable_scope):  # not under the gradient's scope
      mtf.scalar_summary(name, rms)
    return dy
  return _identity_with_grad_fn(t, record)


@gin.configurable(module="mesh_tensorflow.layers")
def annealed_dropout(x: mtf.Tensor, is_training, start_step: int, end_step: int,
                     init_rate: Optional[float] = None, noise_shape=None,
                     name: Optional[str] = None) -> mtf.Tensor:
  """Dropout whose rate decays linearly from init_rate (until start_step) to 0 (from end_step).

  The rate follows `tf.train.get_or_create_global_step()`. Identity when not training or when
  init_rate is None or 0. Kept values are scaled by 1 / keep_prob.
  """
  if not is_training or not init_rate:
    return x
  if end_step <= start_step:
    raise ValueError(f"annealed_dropout: end_step={end_step} must exceed start_step={start_step}.")
  step = tf.cast(tf.train.get_or_create_global_step(), tf.float32)
  progress = tf.clip_by_value((step - start_step) / float(end_step - start_step), 0.0, 1.0)
  keep_prob = mtf.import_tf_tensor(x.mesh, tf.cast(1.0 - init_rate * (1.0 - progress), x.dtype))
  return mtf.dropout(x, is_training, keep_prob=keep_prob, noise_shape=noise_shape,
                     name=name or "annealed_dropout")
