"""Binary ops with broadcasting by dimension name, and ops with a scalar operand.

Broadcasting matches dimensions by name: the output has the union of the operands' dimensions
(`_infer_binary_broadcast_shape`), and each operand's slice is transposed/expanded to the
output's order before the TF function runs. Multiplication of two tensors is an einsum.
"""

from __future__ import annotations

import functools
import numbers
from typing import Callable, Optional

import numpy as np
import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Shape, convert_to_shape, is_subsequence
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor, register_operators
from mesh_tensorflow._lowering.mesh_impl import expand_dims_to
from mesh_tensorflow._ops import _checks as checks
from mesh_tensorflow._ops import einsum as einsum_ops
from mesh_tensorflow._ops import elementwise as elementwise_ops
from mesh_tensorflow._ops import io as io_ops
from mesh_tensorflow._ops import reduce as reduce_ops

__all__ = [
    "ScalarMultiplyOperation", "ScalarAddOperation", "BinaryOpWithBroadcasting", "AddOperation",
    "MinMaxOperation", "binary_op_with_broadcasting",
    "binary_arguments_to_tensors", "add", "sub", "multiply", "divide", "add_n", "minimum",
    "maximum", "less", "greater", "less_equal", "greater_equal", "equal", "not_equal",
    "logical_and", "logical_or", "floordiv", "mod", "where",
]


# ---- checks ----

def _check_scalar(op_name: str, x: Tensor, scalar) -> None:
  """`scalar` must be 0-d and representable in x's dtype (TF would refuse otherwise).

  Python and NumPy numbers skip tf.is_tensor: its protocol check costs about 22 us a call.
  """
  if not isinstance(scalar, (numbers.Number, np.generic, np.ndarray)) and tf.is_tensor(scalar):
    if scalar.shape.ndims not in (None, 0):
      raise ValueError(f"{op_name}: {scalar!r} combined with {x.name!r} must be a scalar; import "
                       f"non-scalar TF values with mtf.import_tf_tensor(mesh, value, shape).")
    if scalar.dtype.base_dtype != x.dtype:
      raise ValueError(f"{op_name}: TF scalar {scalar!r} has dtype {scalar.dtype.name} but tensor "
                       f"{x.name!r} has {x.dtype.name}; tf.cast one of them.")
    return
  if np.ndim(scalar) != 0:
    raise ValueError(f"{op_name}: {scalar!r} combined with {x.name!r} must be a scalar; import "
                     f"arrays with mtf.import_tf_tensor(mesh, value, shape).")
  if x.dtype == tf.bool:
    fits = isinstance(scalar, (bool, np.bool_))
  elif x.dtype.is_integer:
    fits = isinstance(scalar, (numbers.Integral, np.bool_))
  else:
    fits = isinstance(scalar, (numbers.Number, np.number, np.bool_))
  if not fits:
    raise ValueError(
        f"{op_name}: scalar {scalar!r} ({type(scalar).__name__}) does not fit tensor {x.name!r} of "
        f"dtype {x.dtype.name}; use a matching scalar, mtf.cast the tensor, or mtf.floordiv for "
        f"integer division.")


def _check_has_tensor(op_name: str, x1, x2) -> None:
  if not isinstance(x1, Tensor) and not isinstance(x2, Tensor):
    raise ValueError(f"{op_name}: at least one of x1={x1!r}, x2={x2!r} must be an mtf Tensor.")


def _check_tensor_pair(op_name: str, x1: Tensor, x2: Tensor) -> None:
  checks.check_same_dtype(op_name, [x1, x2])
  checks.check_same_dimension_sizes(op_name, [x1, x2])


# ---- scalar operand ----

class ScalarMultiplyOperation(Operation):
  """x * scalar (a python number or a TF scalar); lazy allreduce sums stay lazy (it is linear)."""

  def __init__(self, x: Tensor, scalar, name: Optional[str] = None):
    _check_scalar(name or "scalar_mul", x, scalar)
    super().__init__([x], name=name or "scalar_mul")
    self._scalar = scalar
    self._outputs = [Tensor(self, x.shape, x.dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def gradient(self, grad_ys):
    return [grad_ys[0] * self._scalar]

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    lowering.set_tensor_lowering(self.outputs[0], mesh_impl.slicewise_delay_allreduce(
        lambda x: x * self._scalar, lowering.tensors[self.inputs[0]]))


class ScalarAddOperation(Operation):
  """x + scalar (a python number or a TF scalar)."""

  def __init__(self, x: Tensor, scalar, name: Optional[str] = None):
    _check_scalar(name or "scalar_add", x, scalar)
    super().__init__([x], name=name or "scalar_add")
    self._scalar = scalar
    self._outputs = [Tensor(self, x.shape, x.dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def gradient(self, grad_ys):
    return list(grad_ys)

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    lowering.set_tensor_lowering(self.outputs[0], mesh_impl.slicewise(
        lambda x: x + self._scalar, lowering.tensors[self.inputs[0]]))


# ---- two tensors ----

class BinaryOpWithBroadcasting(Operation):
  """tf_fn(x1, x2) after broadcasting both to `output_shape` by dimension name. No gradient."""

  def __init__(self, tf_fn: Callable, x1: Tensor, x2: Tensor, output_shape, output_dtype: tf.DType,
               name: Optional[str] = None):
    name = name or "binary_op"
    _check_tensor_pair(name, x1, x2)
    output_shape = _infer_binary_broadcast_shape(x1.shape, x2.shape, output_shape)
    checks.check_output_has_input_dims(name, [x1, x2], output_shape)
    if not isinstance(output_dtype, tf.DType):
      raise ValueError(f"{name}: output_dtype must be a tf.DType, got {output_dtype!r}.")
    super().__init__([x1, x2], name=name)
    self._tf_fn = tf_fn
    self._outputs = [Tensor(self, output_shape, output_dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def gradient(self, unused_grad_ys):
    raise ValueError(f"{type(self).__name__} {self.name!r} ({self._tf_fn}) has no gradient; wrap the "
                     f"inputs with mtf.stop_gradient or use a differentiable op.")

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    output_shape = self.outputs[0].shape
    laid_out = []
    for x in self.inputs:
      value = lowering.tensors[x]
      if x.shape != output_shape:
        value = mesh_impl.slicewise(
            functools.partial(expand_dims_to, input_shape=x.shape, output_shape=output_shape), value)
      laid_out.append(value)
    tf_fn = self._tf_fn
    if _dims_in_no_input(self.inputs, output_shape):
      slice_shape = mesh_impl.slice_shape(output_shape)
      tf_fn = lambda a, b: tf.broadcast_to(self._tf_fn(a, b), slice_shape)
    if self._tf_fn is tf.add:
      out = mesh_impl.slicewise_delay_allreduce(tf_fn, *laid_out)
    else:
      out = mesh_impl.slicewise(tf_fn, *laid_out)
    lowering.set_tensor_lowering(self.outputs[0], out)


def _dims_in_no_input(inputs, output_shape: Shape) -> list:
  return [d for d in output_shape if all(d not in x.shape.dims for x in inputs)]


class AddOperation(BinaryOpWithBroadcasting):
  """x1 + x2 with broadcasting; pending allreduce sums of both operands are combined lazily."""

  def __init__(self, x1: Tensor, x2: Tensor, output_shape, name: Optional[str] = None):
    super().__init__(tf.add, x1, x2, output_shape, x1.dtype, name=name or "add")

  def gradient(self, grad_ys):
    dy = grad_ys[0]
    return [reduce_ops.reduce_sum(dy, output_shape=x.shape) for x in self.inputs]


class MinMaxOperation(BinaryOpWithBroadcasting):
  """tf.minimum / tf.maximum with broadcasting; dy flows to each input where it equals the output."""

  def __init__(self, tf_fn: Callable, x1: Tensor, x2: Tensor, output_shape, name: Optional[str] = None):
    super().__init__(tf_fn, x1, x2, output_shape, x1.dtype, name=name or "add")

  def gradient(self, grad_ys):
    dy, y = grad_ys[0], self.outputs[0]
    return [reduce_ops.reduce_sum(
        dy * elementwise_ops.cast(equal(x, y, output_shape=y.shape), dy.dtype), output_shape=x.shape)
        for x in self.inputs]


def _infer_binary_broadcast_shape(shape1, shape2, given_output_shape=None) -> Shape:
  """The given shape if any; else the longer shape if the other is a subsequence; else the union."""
  shape1 = convert_to_shape(shape1)
  shape2 = convert_to_shape(shape2)
  given_output_shape = convert_to_shape(given_output_shape)
  if given_output_shape is not None:
    return given_output_shape
  if is_subsequence(shape1.dims, shape2.dims):
    return shape2
  if is_subsequence(shape2.dims, shape1.dims):
    return shape1
  return Shape(shape1.dims + [d for d in shape2.dims if d not in shape1.dims])


def binary_arguments_to_tensors(x1, x2):
  """(x1, x2) as mtf Tensors: a scalar operand becomes a 0-d tensor of the other's dtype."""
  _check_has_tensor("binary op", x1, x2)
  if isinstance(x1, Tensor) and isinstance(x2, Tensor):
    return x1, x2
  if isinstance(x1, Tensor):
    return x1, _scalar_to_tensor(x1, x2)
  return _scalar_to_tensor(x2, x1), x2


def _scalar_to_tensor(like: Tensor, scalar) -> Tensor:
  _check_scalar("binary op", like, scalar)
  return io_ops.import_tf_tensor(like.mesh, tf.convert_to_tensor(scalar, dtype=like.dtype), Shape([]))


def binary_op_with_broadcasting(tf_fn: Callable, x1, x2, output_shape=None, output_dtype=None) -> Tensor:
  """tf_fn(x1, x2) with broadcasting by dimension name; either operand may be a scalar."""
  x1, x2 = binary_arguments_to_tensors(x1, x2)
  output_dtype = output_dtype or x1.dtype
  return BinaryOpWithBroadcasting(tf_fn, x1, x2, convert_to_shape(output_shape), output_dtype).outputs[0]


def add(x1, x2, output_shape=None, name: Optional[str] = None) -> Tensor:
  """x1 + x2; a scalar operand uses ScalarAddOperation."""
  _check_has_tensor(name or "add", x1, x2)
  if not isinstance(x2, Tensor):
    return ScalarAddOperation(x1, x2, name=name).outputs[0]
  if not isinstance(x1, Tensor):
    return ScalarAddOperation(x2, x1, name=name).outputs[0]
  return AddOperation(x1, x2, convert_to_shape(output_shape), name=name).outputs[0]


def sub(x1, x2, output_shape=None, name: Optional[str] = None) -> Tensor:
  """x1 - x2, as x1 + (-x2)."""
  _check_has_tensor(name or "sub", x1, x2)
  if not isinstance(x2, Tensor):
    return add(x1, -x2, output_shape=output_shape, name=name)
  if isinstance(x1, Tensor):
    _check_tensor_pair(name or "sub", x1, x2)
  return add(x1, elementwise_ops.negative(x2), output_shape=output_shape, name=name)


def multiply(x1, x2, output_shape=None, name: Optional[str] = None) -> Tensor:
  """x1 * x2; scalar operand -> ScalarMultiplyOperation, else an einsum (which may also reduce)."""
  _check_has_tensor(name or "multiply", x1, x2)
  if not isinstance(x2, Tensor):
    return ScalarMultiplyOperation(x1, x2, name=name).outputs[0]
  if not isinstance(x1, Tensor):
    return ScalarMultiplyOperation(x2, x1, name=name).outputs[0]
  _check_tensor_pair(name or "multiply", x1, x2)
  # Like every binary op, multiply broadcasts to the output shape it is given: no BroadcastWarning.
  output_shape = _infer_binary_broadcast_shape(x1.shape, x2.shape, output_shape)
  return einsum_ops.einsum([x1, x2], output_shape=output_shape, name=name,
                           broadcast_dims=einsum_ops.new_dims([x1, x2], output_shape))


def divide(x1, x2, output_shape=None, name: Optional[str] = None) -> Tensor:
  """x1 / x2, as x1 * (1 / x2)."""
  _check_has_tensor(name or "divide", x1, x2)
  if not isinstance(x2, Tensor):
    return multiply(x1, 1.0 / x2, output_shape=output_shape, name=name)
  if isinstance(x1, Tensor):
    _check_tensor_pair(name or "divide", x1, x2)
  return multiply(x1, elementwise_ops.reciprocal(x2), output_shape=output_shape, name=name)


def add_n(xs) -> Tensor:
  """Sum of a list of tensors (python 0 for an empty list)."""
  if not xs:
    return 0
  return functools.reduce(add, xs)


def _min_max(tf_fn, x1, x2, output_shape, name) -> Tensor:
  x1, x2 = binary_arguments_to_tensors(x1, x2)
  return MinMaxOperation(tf_fn, x1, x2, convert_to_shape(output_shape), name=name).outputs[0]


def minimum(x1, x2, output_shape=None, name: Optional[str] = None) -> Tensor:
  return _min_max(tf.minimum, x1, x2, output_shape, name)


def maximum(x1, x2, output_shape=None, name: Optional[str] = None) -> Tensor:
  return _min_max(tf.maximum, x1, x2, output_shape, name)


def _bool_valued(tf_fn: Callable, name: str) -> Callable:
  """The public function `name`: tf_fn with broadcasting by name, returning a bool Tensor."""
  def fn(x1, x2, output_shape=None) -> Tensor:
    return binary_op_with_broadcasting(tf_fn, x1, x2, output_shape=output_shape, output_dtype=tf.bool)
  fn.__name__ = fn.__qualname__ = name
  fn.__doc__ = f"Elementwise {name} with broadcasting by dimension name; a bool Tensor."
  return fn


less = _bool_valued(tf.less, "less")
greater = _bool_valued(tf.greater, "greater")
less_equal = _bool_valued(tf.less_equal, "less_equal")
greater_equal = _bool_valued(tf.greater_equal, "greater_equal")
equal = _bool_valued(tf.equal, "equal")
not_equal = _bool_valued(tf.not_equal, "not_equal")
logical_and = _bool_valued(tf.logical_and, "logical_and")
logical_or = _bool_valued(tf.logical_or, "logical_or")


def floordiv(x1, x2, output_shape=None) -> Tensor:
  """Elementwise floor division with broadcasting (keeps the dtype)."""
  return binary_op_with_broadcasting(tf.floordiv, x1, x2, output_shape=output_shape)


def mod(x1, x2, output_shape=None) -> Tensor:
  """Elementwise floor modulo with broadcasting (keeps the dtype)."""
  return binary_op_with_broadcasting(tf.floormod, x1, x2, output_shape=output_shape)


def where(condition: Tensor, if_true, if_false, output_shape=None) -> Tensor:
  """if_true where condition else if_false, as if_true*c + if_false*(1-c) (both branches evaluated)."""
  _check_has_tensor("where", if_true, if_false)
  dtype = if_true.dtype if isinstance(if_true, Tensor) else if_false.dtype
  return add(
      multiply(if_true, elementwise_ops.cast(condition, dtype), output_shape=output_shape),
      multiply(if_false, elementwise_ops.cast(elementwise_ops.logical_not(condition), dtype),
               output_shape=output_shape),
      output_shape=output_shape)


register_operators(add=add, sub=sub, multiply=multiply, divide=divide, floordiv=floordiv, mod=mod)
