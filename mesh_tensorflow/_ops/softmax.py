"""Log-sum-exp, log-softmax and softmax over a named dimension.

softmax and log_softmax are one op (`SoftmaxOperation`): where the layout keeps the dimension
whole it is one TF kernel per slice, instead of the eight of the max/exp/sum/log composition;
where the dimension is split, the shards allreduce their maxima and sums of exponentials.
"""

from __future__ import annotations

from typing import Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, convert_to_dimension
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering.tf_helpers import transpose_unless_identity
from mesh_tensorflow._ops import _checks as checks
from mesh_tensorflow._ops import binary as binary_ops
from mesh_tensorflow._ops import control as control_ops
from mesh_tensorflow._ops import elementwise as elementwise_ops
from mesh_tensorflow._ops import reduce as reduce_ops

__all__ = ["SoftmaxOperation", "reduce_logsumexp", "log_softmax", "softmax"]


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


class SoftmaxOperation(Operation):
  """softmax(x), or log_softmax(x) with log=True, over reduced_dim; same shape and dtype as x."""

  def __init__(self, x: Tensor, reduced_dim: Dimension, log: bool, name: Optional[str] = None):
    super().__init__([x], name=name or ("log_softmax" if log else "softmax"))
    self._reduced_dim = reduced_dim
    self._log = log
    self._outputs = [Tensor(self, x.shape, x.dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def gradient(self, grad_ys):
    dy, y = grad_ys[0], self.outputs[0]
    if self._log:
      return [dy - elementwise_ops.exp(y) * reduce_ops.reduce_sum(dy, reduced_dim=self._reduced_dim)]
    return [y * (dy - reduce_ops.reduce_sum(dy * y, reduced_dim=self._reduced_dim))]

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    x = lowering.tensors[self.inputs[0]]
    axis = self.inputs[0].shape.dims.index(self._reduced_dim)
    mesh_axis = mesh_impl.tensor_dimension_to_mesh_axis(self._reduced_dim)
    if mesh_axis is None:
      y = mesh_impl.slicewise(lambda t: _softmax_kernel(t, axis, self._log), x)
    else:
      comm = lowering.comm(self)
      max_x = comm.allreduce(mesh_impl.slicewise(lambda t: tf.reduce_max(t, axis, keepdims=True), x),
                             [mesh_axis], "MAX", "softmax_op")
      shifted = mesh_impl.slicewise(tf.subtract, x, max_x)
      sum_exp = comm.allreduce(
          mesh_impl.slicewise(lambda t: tf.reduce_sum(tf.exp(t), axis, keepdims=True), shifted),
          [mesh_axis], "SUM", "softmax_op")
      if self._log:
        y = mesh_impl.slicewise(lambda t, s: t - tf.math.log(s), shifted, sum_exp)
      else:
        y = mesh_impl.slicewise(lambda t, s: tf.exp(t) / s, shifted, sum_exp)
    lowering.set_tensor_lowering(self.outputs[0], y)


_MAX_SOFTMAX_RANK = 5  # oneDNN's CPU softmax (TF's on AVX-512 CPUs) refuses more dimensions


def _softmax_kernel(t, axis: int, log: bool):
  """tf.nn.softmax (or log_softmax) of t along axis; above rank 5 as a matrix of rows along axis."""
  kernel = tf.nn.log_softmax if log else tf.nn.softmax
  if t.shape.rank <= _MAX_SOFTMAX_RANK:
    return kernel(t, axis=axis)
  perm = [i for i in range(t.shape.rank) if i != axis] + [axis]
  moved = transpose_unless_identity(t, perm)
  y = tf.reshape(kernel(tf.reshape(moved, [-1, moved.shape[-1]])), moved.shape)
  return transpose_unless_identity(y, [perm.index(i) for i in range(len(perm))])


def log_softmax(x: Tensor, reduced_dim, extra_logit=None, name: Optional[str] = None) -> Tensor:
  """x - logsumexp(x) over reduced_dim."""
  if extra_logit is None:
    return _softmax_op(x, reduced_dim, True, name)
  return x - reduce_logsumexp(x, reduced_dim, extra_logit=extra_logit, name=name)


def softmax(x: Tensor, reduced_dim, extra_logit=None, name: Optional[str] = None) -> Tensor:
  """exp(log_softmax(x)) over reduced_dim."""
  if extra_logit is None:
    return _softmax_op(x, reduced_dim, False, name)
  with tf.variable_scope(name, default_name="softmax"):
    return elementwise_ops.exp(log_softmax(x, reduced_dim, extra_logit=extra_logit))


def _softmax_op(x: Tensor, reduced_dim, log: bool, name: Optional[str]) -> Tensor:
  reduced_dim = convert_to_dimension(reduced_dim)
  fn_name = "log_softmax" if log else "softmax"
  checks.check_dim_in(fn_name, "reduced_dim", reduced_dim, x)
  if not x.dtype.is_floating:
    raise ValueError(f"{fn_name}: tensor {x.name!r} has dtype {x.dtype.name}; it needs a floating "
                     f"dtype (use mtf.to_float first).")
  return SoftmaxOperation(x, reduced_dim, log, name=name).outputs[0]
