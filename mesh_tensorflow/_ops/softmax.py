"""Log-sum-exp, log-softmax and softmax over a named dimension, built from reductions."""

from __future__ import annotations

from typing import Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import convert_to_dimension
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._ops import _checks as checks
from mesh_tensorflow._ops import binary as binary_ops
from mesh_tensorflow._ops import control as control_ops
from mesh_tensorflow._ops import elementwise as elementwise_ops
from mesh_tensorflow._ops import reduce as reduce_ops

__all__ = ["reduce_logsumexp", "log_softmax", "softmax"]


def reduce_logsumexp(x: Tensor, reduced_dim, extra_logit=None, name: Optional[str] = None) -> Tensor:
  """log(sum(exp(x))) over reduced_dim, computed stably by subtracting the maximum first.

  `extra_logit` (a scalar or a Tensor without reduced_dim) acts as one more logit in the sum.
  The maximum goes through stop_gradient: it cancels out mathematically, so it carries no gradient
  (extra_logit itself does get its gradient, through its term of the sum).
  """
  reduced_dim = convert_to_dimension(reduced_dim)
  checks.check_dim_in("reduce_logsumexp", "reduced_dim", reduced_dim, x)
  with tf.variable_scope(name, default_name="reduce_logsumexp"):
    reduced_shape = x.shape - reduced_dim
    max_logit = reduce_ops.reduce_max(control_ops.stop_gradient(x), output_shape=reduced_shape)
    if extra_logit is not None:
      stopped = (control_ops.stop_gradient(extra_logit) if isinstance(extra_logit, Tensor)
                 else extra_logit)
      max_logit = binary_ops.maximum(max_logit, stopped)
    sum_exp_x = reduce_ops.reduce_sum(elementwise_ops.exp(x - max_logit), output_shape=reduced_shape)
    if extra_logit is not None:
      sum_exp_x += elementwise_ops.exp(extra_logit - max_logit)
    return elementwise_ops.log(sum_exp_x) + max_logit


def log_softmax(x: Tensor, reduced_dim, extra_logit=None, name: Optional[str] = None) -> Tensor:
  """x - logsumexp(x) over reduced_dim."""
  return x - reduce_logsumexp(x, reduced_dim, extra_logit=extra_logit, name=name)


def softmax(x: Tensor, reduced_dim, extra_logit=None, name: Optional[str] = None) -> Tensor:
  """exp(log_softmax(x)) over reduced_dim."""
  with tf.variable_scope(name, default_name="softmax"):
    return elementwise_ops.exp(log_softmax(x, reduced_dim, extra_logit=extra_logit))
