"""Elementwise ops: a TF function applied independently to every slice.

`SlicewiseOperation` is the general form (any per-slice TF function, some dimensions may be
declared unsplittable); `cwise` is the common case where every dimension may be split. The
named ops below (exp, tanh, relu, cast, ...) are cwise with the closed-form gradient written
in mtf, so their backward pass is itself laid out like any other mtf computation.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, convert_to_shape
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor, register_operators
from mesh_tensorflow._ops import io as io_ops

__all__ = [
    "SlicewiseOperation", "slicewise", "cwise", "GenericGradOperation",
    "identity", "sin", "cos", "square", "sqrt", "rsqrt", "log", "exp", "sigmoid", "tanh",
    "negative", "reciprocal", "relu", "squared_relu", "leaky_relu", "logical_not", "sign", "elu", "selu",
    "softplus", "swish", "gelu", "mtf_abs", "mtf_pow",
    "cast", "to_float", "to_bfloat16", "to_int32",
]


class SlicewiseOperation(Operation):
  """Applies `tf_fn` to each slice; only `splittable_dims` may be split across the mesh.

  `grad_function(op, *dys) -> list of input grads`; None differentiates `tf_fn` per slice
  (GenericGradOperation); 0 declares the op non-differentiable.
  """

  def __init__(self, tf_fn: Callable, inputs, output_shapes, output_dtypes, splittable_dims,
               grad_function=None, name: Optional[str] = None):
    super().__init__(inputs, name=name or "slicewise")
    self._tf_fn = tf_fn
    self._grad_function = grad_function
    self._outputs = [Tensor(self, convert_to_shape(shape), dtype, index=i)
                     for i, (shape, dtype) in enumerate(zip(output_shapes, output_dtypes))]
    splittable_names = [d.name if isinstance(d, Dimension) else d for d in splittable_dims or ()]
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_splittable_and_unsplittable_dims("unsplittable", splittable_names))

  @property
  def tf_fn(self) -> Callable:
    return self._tf_fn

  def unsplittable_reason(self, dim_name: str) -> str:
    return (f"{dim_name!r} is not declared as splittable (splittable_dims: "
            f"{sorted(self.splittable_dims)}); tf_fn may need it whole")

  @property
  def has_gradient(self):
    if self._grad_function == 0:
      return False
    return super().has_gradient

  def gradient(self, grad_ys):
    if self._grad_function is not None:
      return self._grad_function(self, *grad_ys)
    return GenericGradOperation(self, grad_ys).outputs

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    values = mesh_impl.slicewise(self._tf_fn, *[lowering.tensors[x] for x in self.inputs])
    if len(self._outputs) == 1:
      values = (values,)
    for output, value in zip(self._outputs, values):
      lowering.set_tensor_lowering(output, value)


def slicewise(tf_fn: Callable, xs: Sequence[Tensor], output_shape=None, output_dtype=None,
              splittable_dims=None, grad_function=None, name: Optional[str] = None):
  """Calls `tf_fn(*slices)` on every processor's slices of `xs`.

  `output_dtype` given as a list means several outputs (then `output_shape` is None or a list as
  long, and a tuple is returned); missing shapes and dtypes default to those of xs[0].
  `splittable_dims` lists the Dimensions (or names) the layout may split; all others must stay
  replicated.

  Example: `mtf.slicewise(tf.nn.relu, [x], splittable_dims=x.shape.dims)`.
  """
  xs = list(xs)
  _check_tensor_inputs(name or "slicewise", xs)
  multiple_outputs = isinstance(output_dtype, list)
  output_dtypes = output_dtype if multiple_outputs else [output_dtype]
  if not multiple_outputs:
    output_shapes = [output_shape]
  elif output_shape is None:
    output_shapes = [None] * len(output_dtypes)
  else:
    output_shapes = output_shape
  if not isinstance(output_shapes, (list, tuple)) or len(output_shapes) != len(output_dtypes):
    raise ValueError(
        f"slicewise {name or 'slicewise'!r}: output_dtype lists {len(output_dtypes)} outputs, so "
        f"output_shape must be a list of as many shapes (or None entries), got {output_shape!r}.")
  op = SlicewiseOperation(
      tf_fn, xs,
      [convert_to_shape(shape) or xs[0].shape for shape in output_shapes],
      [dtype or xs[0].dtype for dtype in output_dtypes],
      splittable_dims, grad_function, name=name)
  return tuple(op.outputs) if multiple_outputs else op.outputs[0]


def cwise(tf_fn: Callable, xs: Sequence[Tensor], output_dtype=None, grad_function=None,
          name: Optional[str] = None):
  """Componentwise `tf_fn` on tensors of xs[0]'s shape: every dimension may be split."""
  xs = list(xs)
  _check_tensor_inputs(name or "cwise", xs)
  return slicewise(tf_fn, xs, output_dtype=output_dtype, splittable_dims=xs[0].shape.dims,
                   grad_function=grad_function, name=name or "cwise")


def _check_tensor_inputs(op_name: str, xs: list) -> None:
  if not xs:
    raise ValueError(f"{op_name!r} needs at least one input Tensor.")
  for x in xs:
    if not isinstance(x, Tensor):
      raise ValueError(f"{op_name!r}: inputs must be mtf Tensors, got {x!r}; import TF values with "
                       f"mtf.import_tf_tensor or make them with mtf.constant.")


class GenericGradOperation(Operation):
  """Gradient of a SlicewiseOperation, by TF autodiff of its function on every slice.

  Graph mode differentiates the forward slices already built (tf.gradients); eager mode, where
  tf.gradients is unavailable, recomputes the forward function under a GradientTape.
  """

  def __init__(self, forward_op: SlicewiseOperation, grad_ys, name: Optional[str] = None):
    grad_ys = [dy if dy is not None else io_ops.zeros_like(y)
               for y, dy in zip(forward_op.outputs, grad_ys)]
    super().__init__(forward_op.inputs + forward_op.outputs + grad_ys,
                     name=name or "generic_grad")
    self._forward_op = forward_op
    self._grad_ys = grad_ys
    self._outputs = [Tensor(self, x.shape, x.dtype, index=i)
                     for i, x in enumerate(forward_op.inputs)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  @property
  def layout_unsplittable_dims(self) -> frozenset:
    """It runs TF autodiff of the forward function per slice: what the forward op can't split, neither
    can its gradient (declared all-splittable all the same, as in the original library)."""
    return self._forward_op.layout_unsplittable_dims

  def unsplittable_reason(self, dim_name: str) -> str:
    return (f"it differentiates {self._forward_op.name!r} slice by slice, and for that op "
            f"{self._forward_op.unsplittable_reason(dim_name)}")

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    if tf.executing_eagerly():
      grad_xs = self._lower_eager(lowering, mesh_impl)
    else:
      grad_xs = self._lower_graph(lowering, mesh_impl)
    for out, grad_x in zip(self.outputs, grad_xs):
      lowering.set_tensor_lowering(out, grad_x)

  def _lower_graph(self, lowering, mesh_impl) -> list:
    """Per slice, tf.gradients of the forward op's slices (already in the TF graph)."""
    num_outputs, num_inputs = len(self._forward_op.outputs), len(self._forward_op.inputs)

    def slice_grad(*args):
      ys, xs = list(args[:num_outputs]), list(args[num_outputs:num_outputs + num_inputs])
      return tuple(tf.gradients(ys=ys, xs=xs, grad_ys=list(args[num_outputs + num_inputs:]),
                                unconnected_gradients=tf.UnconnectedGradients.ZERO))
    inputs = [lowering.tensors[t] for t in
              self._forward_op.outputs + self._forward_op.inputs + self._grad_ys]
    return list(mesh_impl.slicewise(slice_grad, *inputs))

  def _lower_eager(self, lowering, mesh_impl) -> list:
    num_inputs = len(self._forward_op.inputs)
    forward_fn = self._forward_op.tf_fn

    def slice_grad(*args):
      xs, dys = list(args[:num_inputs]), list(args[num_inputs:])
      with tf.GradientTape() as tape:
        for x in xs:
          if x.dtype.is_floating:
            tape.watch(x)
        ys = forward_fn(*xs)
      ys = list(ys) if isinstance(ys, (list, tuple)) else [ys]
      return tuple(tape.gradient(ys, xs, output_gradients=dys,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO))
    inputs = [lowering.tensors[t] for t in self._forward_op.inputs + self._grad_ys]
    return list(mesh_impl.slicewise(slice_grad, *inputs))


def _check_floating(op_name: str, x: Tensor) -> None:
  if not (x.dtype.is_floating or x.dtype.is_complex):
    raise ValueError(
        f"{op_name}: tensor {x.name!r} has dtype {x.dtype.name}, but {op_name} needs a floating "
        f"point input; convert it first, e.g. mtf.to_float(x) or mtf.cast(x, tf.float32).")


def _unary(tf_fn: Callable, x: Tensor, name: str, grad_function=None, needs_float: bool = True):
  """cwise over a single tensor, refusing integer inputs where `tf_fn` needs floats."""
  _check_tensor_inputs(name, [x])
  if needs_float:
    _check_floating(name, x)
  return cwise(tf_fn, [x], name=name, grad_function=grad_function)


def identity(x: Tensor, name: str = "identity") -> Tensor:
  return _unary(tf.identity, x, name, lambda op, dy: [dy], needs_float=False)


def sin(x: Tensor, name: str = "sin") -> Tensor:
  return _unary(tf.sin, x, name, lambda op, dy: [dy * cos(op.inputs[0])])


def cos(x: Tensor, name: str = "cos") -> Tensor:
  return _unary(tf.cos, x, name, lambda op, dy: [dy * negative(sin(op.inputs[0]))])


def square(x: Tensor, name: str = "square") -> Tensor:
  return _unary(tf.square, x, name, lambda op, dy: [dy * op.inputs[0] * 2], needs_float=False)


def sqrt(x: Tensor, name: str = "sqrt") -> Tensor:
  return _unary(tf.sqrt, x, name, lambda op, dy: [dy * 0.5 / op.outputs[0]])


def rsqrt(x: Tensor, name: str = "rsqrt") -> Tensor:
  def grad(op, dy):
    y = op.outputs[0]
    return [dy * -0.5 * y * y * y]
  return _unary(tf.math.rsqrt, x, name, grad)


def log(x: Tensor, name: str = "log") -> Tensor:
  return _unary(tf.math.log, x, name, lambda op, dy: [dy * reciprocal(op.inputs[0])])


def exp(x: Tensor, name: str = "exp") -> Tensor:
  return _unary(tf.exp, x, name, lambda op, dy: [dy * op.outputs[0]])


def sigmoid(x: Tensor, name: str = "sigmoid") -> Tensor:
  def grad(op, dy):
    y = op.outputs[0]
    return [dy * y * (1.0 - y)]
  return _unary(tf.sigmoid, x, name, grad)


def tanh(x: Tensor, name: str = "tanh") -> Tensor:
  return _unary(tf.tanh, x, name, lambda op, dy: [dy * (1.0 - square(op.outputs[0]))])


def negative(x: Tensor, name: str = "negative") -> Tensor:
  return _unary(tf.negative, x, name, lambda op, dy: [negative(dy)], needs_float=False)


def reciprocal(x: Tensor, name: str = "reciprocal") -> Tensor:
  return _unary(tf.math.reciprocal, x, name,
                lambda op, dy: [negative(dy * square(op.outputs[0]))])


def _relu_grad(dy: Tensor, x: Tensor, alpha: float = 0.0) -> Tensor:
  """dy where x > 0, else alpha * dy: (leaky) relu's gradient as one TF kernel per slice.

  It is linear in dy (so its own gradient is itself, with x fixed) and constant in x.
  """
  def grad_kernel(g, t):
    if alpha:
      return tf.raw_ops.LeakyReluGrad(gradients=g, features=t, alpha=alpha)
    return tf.raw_ops.ReluGrad(gradients=g, features=t)
  return cwise(grad_kernel, [dy, x], name="leaky_relu_grad" if alpha else "relu_grad",
               grad_function=lambda op, ddx: [_relu_grad(ddx, op.inputs[1], alpha), None])


def relu(x: Tensor, name: str = "relu") -> Tensor:
  return _unary(tf.nn.relu, x, name, lambda op, dy: [_relu_grad(dy, op.inputs[0])], needs_float=False)


def squared_relu(x: Tensor) -> Tensor:
  """relu(x) ** 2, the Primer activation (https://arxiv.org/abs/2109.08668)."""
  return square(relu(x))


def leaky_relu(x: Tensor, alpha: float = 0.2, name: str = "leaky_relu") -> Tensor:
  """max(x, alpha * x); the gradient is dy where x > 0 and alpha * dy elsewhere."""
  return _unary(lambda t: tf.nn.leaky_relu(t, alpha), x, name,
                lambda op, dy: [_relu_grad(dy, op.inputs[0], alpha)])


def logical_not(x: Tensor, name: str = "logical_not") -> Tensor:
  _check_tensor_inputs(name, [x])
  if x.dtype != tf.bool:
    raise ValueError(f"{name}: tensor {x.name!r} has dtype {x.dtype.name}, expected bool; compare "
                     f"first (e.g. mtf.greater(x, 0)) or use mtf.cast(x, tf.bool).")
  return cwise(tf.logical_not, [x], name=name)


def sign(x: Tensor, name: str = "sign") -> Tensor:
  return _unary(tf.sign, x, name, grad_function=0, needs_float=False)


def elu(x: Tensor) -> Tensor:
  return _unary(tf.nn.elu, x, "elu")


def selu(x: Tensor) -> Tensor:
  return _unary(tf.nn.selu, x, "selu")


def softplus(x: Tensor) -> Tensor:
  return _unary(tf.nn.softplus, x, "softplus")


def swish(x: Tensor) -> Tensor:
  """x * sigmoid(x)."""
  return x * sigmoid(x)


def gelu(x: Tensor) -> Tensor:
  """Gaussian error linear unit, tanh approximation: 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))."""
  _check_tensor_inputs("gelu", [x])
  _check_floating("gelu", x)
  cdf = (tanh((x + x * x * x * 0.044715) * float(np.sqrt(2 / np.pi))) + 1.0) * 0.5
  return x * cdf


def mtf_abs(x: Tensor) -> Tensor:
  """|x| as x * sign(x) (so the gradient is dy * sign(x)); `mtf.abs`."""
  return x * sign(x)


def mtf_pow(x: Tensor, y) -> Tensor:
  """x ** y as exp(log(x) * y), for x > 0; y is a Tensor or a scalar; `mtf.pow`."""
  return exp(log(x) * y)


def cast(x: Tensor, dtype: tf.DType, name: str = "cast") -> Tensor:
  """x converted to `dtype` (x itself if already so); the gradient is cast back."""
  _check_tensor_inputs(name, [x])
  dtype = tf.as_dtype(dtype)
  if dtype == x.dtype:
    return x
  return cwise(lambda t: tf.cast(t, dtype), [x], output_dtype=dtype, name=name,
               grad_function=lambda op, dy: [cast(dy, op.inputs[0].dtype)])


def to_float(x: Tensor, name: str = "to_float") -> Tensor:
  return cast(x, tf.float32, name=name)


def to_bfloat16(x: Tensor, name: str = "to_bfloat16") -> Tensor:
  return cast(x, tf.bfloat16, name=name)


def to_int32(x: Tensor, name: str = "to_int32") -> Tensor:
  return cast(x, tf.int32, name=name)


register_operators(negative=negative, reciprocal=reciprocal)
