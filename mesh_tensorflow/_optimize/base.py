"""The Optimizer interface, SGD and momentum, and helpers every optimizer shares.

Slot variables (optimizer state) are mtf Variables named after the variable they serve and
shaped like it (or like a sub-shape of it), so layout rules split them exactly as they split
the variable: sharding a weight shards its optimizer state.
"""

from __future__ import annotations

from typing import Optional

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow import ops_with_redefined_builtins as mtf

__all__ = ["Optimizer", "SgdOptimizer", "MomentumOptimizer", "reduce_rms"]

_GIN_MODULE = "mesh_tensorflow.optimize"


def reduce_rms(x: mtf.Tensor, **kwargs) -> mtf.Tensor:
  """Root mean square of x; kwargs (reduced_dim, output_shape) go to mtf.reduce_mean."""
  return mtf.sqrt(mtf.reduce_mean(mtf.square(x), **kwargs))


def layer_dims(var: mtf.Variable) -> list:
  """The dimensions that index separate layers' weights: a LayerStackVariable's stack dims."""
  return var.stack_dims if var.is_layer_stack else []


def reduce_rms_per_layer(x: mtf.Tensor, var: mtf.Variable) -> mtf.Tensor:
  """reduce_rms of x (shaped like var) over everything but var's layer dims.

  A layer stack's layers so get the statistic each would get unstacked.
  """
  return reduce_rms(x, output_shape=mtf.Shape(layer_dims(var)))


def to_update_dtype(x: mtf.Tensor) -> mtf.Tensor:
  """Returns x in float32 if it is a 16-bit float: updates computed in bfloat16 lose small steps."""
  if x.dtype in (tf.bfloat16, tf.float16):
    return mtf.to_float(x)
  return x


def scalar_as(value, dtype: tf.DType):
  """A python, tf or mtf scalar (e.g. a learning rate) usable as a factor of a `dtype` tensor."""
  if isinstance(value, mtf.Tensor):
    return mtf.cast(value, dtype)
  if tf.is_tensor(value):
    return tf.cast(value, dtype)
  return value


def as_variable(var) -> mtf.Variable:
  """The mtf Variable behind `var` (the Variable op or its output Tensor)."""
  if isinstance(var, mtf.Tensor) and isinstance(var.operation, mtf.Variable):
    return var.operation
  if not isinstance(var, mtf.Variable):
    raise ValueError(f"Optimizer: {var!r} is not an mtf Variable; pass the Variable ops to update, "
                     f"e.g. graph.trainable_variables.")
  return var


def slot_variable(var: mtf.Variable, suffix: str, shape: Optional[mtf.Shape] = None,
                  dtype=tf.float32) -> mtf.Tensor:
  """Zero-initialised untrainable state `var.name + suffix` (reused if it exists), var's shape by default.

  A LayerStackVariable's state is a layer stack too: one variable per layer, named after that
  layer's variable, so a checkpoint's optimizer state moves between stacked and unstacked models.
  """
  shape = var.shape if shape is None else shape
  if not var.is_layer_stack:
    return mtf.get_variable(var.mesh, var.name + suffix, shape, dtype=dtype,
                            initializer=tf.zeros_initializer(), trainable=False)
  existing = var.graph.name_to_variable.get(var.name + suffix)
  if existing is not None:
    return existing.outputs[0]
  per_layer_shape = shape - var.stack_dims
  per_layer = [mtf.get_variable(var.mesh, v.name + suffix, per_layer_shape, dtype=dtype,
                                initializer=tf.zeros_initializer(), trainable=False).operation
               for v in var.originals]
  return mtf.LayerStackVariable(per_layer, var.stack_dims, var.name + suffix).outputs[0]


def warn_if_no_gradient(grad, var) -> bool:
  """True (after logging a warning) when grad is None: the variable then gets no update."""
  if grad is None:
    tf.logging.warning("Gradient is None for variable %s", getattr(var, "name", var))
    return True
  return False


class Optimizer:
  """Base class: turns gradients into mtf Assign ops on variables and their slots.

  Subclasses implement `apply_grad`; callers use `apply_grads`, which combines the
  assignments (one Assign per assign function) so that `Lowering` can stack variables.
  """

  def apply_grads(self, grads, variables) -> list:
    """Update ops for every (grad, variable) pair; None grads are skipped with a warning.

    Args:
      grads: list of mtf Tensors (or None), aligned with variables.
      variables: list of mtf Variables, e.g. graph.trainable_variables.

    Returns:
      list of mtf Assign operations (empty if nothing is updated).
    """
    grads, variables = list(grads), list(variables)
    if len(grads) != len(variables):
      raise ValueError(f"apply_grads: got {len(grads)} gradients for {len(variables)} variables; "
                       f"pass one gradient (or None) per variable.")
    ops = []
    for grad, var in zip(grads, variables):
      ops.extend(self.apply_grad(grad, var))
    if not ops:
      return ops
    return variables[0].graph.combine_assignments(ops)

  def apply_grad(self, grad, var) -> list:
    """Update ops for one variable.

    Args:
      grad: the variable's gradient, an mtf Tensor (None: no update, with a warning).
      var: the mtf Variable (or its output Tensor).

    Returns:
      A list of mtf Assign operations.
    """
    raise ValueError("apply_grad not implemented %s %s" % (grad, var))


@gin.configurable(module=_GIN_MODULE)
class SgdOptimizer(Optimizer):
  """Plain SGD: var -= learning_rate * grad.

  Args:
    learning_rate: a number, or a scalar tf or mtf tensor.

  Example:
    updates = mtf.optimize.SgdOptimizer(0.1).apply_grads(grads, graph.trainable_variables)
  """

  def __init__(self, learning_rate):
    self._lr = learning_rate

  @property
  def lr(self):
    return self._lr

  def apply_grad(self, grad, var) -> list:
    if warn_if_no_gradient(grad, var):
      return []
    grad = to_update_dtype(grad)
    # assign_sub (not assign(var - x)): a bfloat16 slice is rounded once per step, not twice.
    return [mtf.assign_sub(as_variable(var), grad * scalar_as(self.lr, grad.dtype))]


@gin.configurable(module=_GIN_MODULE)
class MomentumOptimizer(Optimizer):
  """SGD with momentum: v = learning_rate * grad + momentum * v; var -= v (the new v).

  Slot `var.name + "_momentum_v"` has the variable's VariableDType.

  Args:
    learning_rate: a number, or a scalar tf or mtf tensor.
    momentum: the decay of v.
  """

  def __init__(self, learning_rate, momentum):
    self._lr = learning_rate
    self._momentum = momentum

  @property
  def lr(self):
    return self._lr

  @property
  def momentum(self):
    return self._momentum

  def apply_grad(self, grad, var) -> list:
    if warn_if_no_gradient(grad, var):
      return []
    var = as_variable(var)
    v = slot_variable(var, "_momentum_v", dtype=var.dtype)
    with tf.variable_scope(var.name + "/sgd_momentum"):
      grad = to_update_dtype(grad)
      new_v = (grad * scalar_as(self.lr, grad.dtype)
               + mtf.cast(v, grad.dtype) * scalar_as(self.momentum, grad.dtype))
      return [mtf.assign(v, new_v), mtf.assign_sub(var, new_v)]
