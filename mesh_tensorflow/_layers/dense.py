"""Dense (einsum) layers, their kernel initializers, and the unit-scaling convention."""

from __future__ import annotations

import functools
import numbers
from typing import Optional, Sequence

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow import ops_with_redefined_builtins as mtf

__all__ = [
    "unit_scaling_convention", "us_einsum", "DenseInitializer", "VarianceScalingInitializer",
    "dense", "get_dense_kernel_weights", "dense_product", "dense_relu_dense",
]

_FAN_MODES = ("fan_in", "fan_out", "fan_avg")
_DISTRIBUTIONS = ("normal", "uniform")


@gin.configurable(module="mesh_tensorflow.layers")
def unit_scaling_convention(value: bool = False) -> bool:
  """Whether einsums scale by 1/sqrt(reduced size) and initializers use unit variance (gin knob)."""
  return value


def us_einsum(xs: Sequence[mtf.Tensor], *args, **kwargs) -> mtf.Tensor:
  """`mtf.einsum`, scaled by 1/sqrt(product of reduced dim sizes) under the unit-scaling convention."""
  y = mtf.einsum(xs, *args, **kwargs)
  if unit_scaling_convention():
    reduced_dims = {d for x in xs for d in x.shape.dims} - set(y.shape.dims)
    y *= mtf.list_product(d.size for d in reduced_dims) ** -0.5
  return y


class DenseInitializer:
  """Makes a TF initializer for a dense kernel from its reduced (fan-in) and new (fan-out) dims."""

  def __call__(self, reduced_dims, new_dims):
    raise NotImplementedError(f"{type(self).__name__} must implement __call__(reduced_dims, new_dims).")


@gin.configurable(module="mesh_tensorflow.layers")
class VarianceScalingInitializer(DenseInitializer):
  """Variance `scale / fan` initializer, like tf.variance_scaling_initializer but for named dims.

  fan is the product of the reduced dims ("fan_in"), the new dims ("fan_out") or their mean
  ("fan_avg"), at least 1. Under the unit-scaling convention only "fan_in" is allowed and the
  variance is `scale` (the einsum does the scaling instead).

  Example: `VarianceScalingInitializer(2.0)([d_model], [d_ff])` is
  `tf.truncated_normal_initializer(stddev=sqrt(2 / d_model.size))`.
  """

  def __init__(self, scale: float = 1.0, mode: str = "fan_in", distribution: str = "normal"):
    self.scale = scale
    self.mode = mode.lower()
    self.distribution = distribution.lower()

  def __call__(self, reduced_dims, new_dims):
    _check_choice("VarianceScalingInitializer", "mode", self.mode, _FAN_MODES)
    _check_choice("VarianceScalingInitializer", "distribution", self.distribution, _DISTRIBUTIONS)
    fan_in = mtf.list_product(d.size for d in reduced_dims)
    fan_out = mtf.list_product(d.size for d in new_dims)
    variance = self.scale
    if unit_scaling_convention():
      if self.mode != "fan_in":
        raise ValueError(
            f"VarianceScalingInitializer(mode={self.mode!r}) conflicts with the unit-scaling "
            f"convention, which scales einsums by fan-in; use mode='fan_in' or unbind "
            f"unit_scaling_convention.value.")
    else:
      fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2.0}[self.mode]
      variance /= max(1.0, fan)
    stddev = variance ** 0.5
    if self.distribution == "normal":
      return tf.truncated_normal_initializer(stddev=stddev)
    limit = stddev * 3.0 ** 0.5
    return tf.random_uniform_initializer(minval=-limit, maxval=limit)


def _check_choice(owner: str, what: str, value: str, choices: tuple) -> None:
  if value not in choices:
    raise ValueError(f"{owner}: {what}={value!r} is not one of {choices}.")


def _as_dim_list(dims) -> list:
  """None, one Dimension or a list of them -> a list; a bare size or name raises, saying what to write."""
  if dims is None:
    return []
  if isinstance(dims, (mtf.Dimension, str, numbers.Integral)):
    return [mtf.convert_to_dimension(dims)]
  return [mtf.convert_to_dimension(d) for d in dims]


def _check_dims_in_input(layer: str, x: mtf.Tensor, dims: list, what: str) -> None:
  missing = [d for d in dims if d not in x.shape.dims]
  if missing:
    raise ValueError(f"{layer}: {what} {missing} are not dims of the input {x.shape}; "
                     f"pass dims of x (same name and size).")


@gin.configurable(module="mesh_tensorflow.layers")
def dense(x: mtf.Tensor, new_dims, reduced_dims=None, expert_dims=None, use_bias: bool = True,
          activation=None, master_dtype=tf.float32, slice_dtype=tf.float32, variable_dtype=None,
          kernel_initializer=None, kernel_weights=None, name: Optional[str] = None) -> mtf.Tensor:
  """Dense layer: contracts `reduced_dims` of x against a kernel producing `new_dims`.

  The kernel is the variable `<scope>/kernel` of shape expert_dims + reduced_dims + new_dims
  (from `get_dense_kernel_weights`, looked up at call time, unless `kernel_weights` is given); the bias is
  `<scope>/bias` of shape expert_dims + new_dims, zero-initialised. The scope is `name` or a
  fresh `dense`. Output dims: x's dims without reduced_dims, then new_dims; `activation` last.
  A reduced dim that is also a new dim is first renamed "_<name>" in x.

  Example: `dense(x, new_dims=d_ff, reduced_dims=[d_model], name="wi")` maps
  [batch, length, d_model] to [batch, length, d_ff].
  """
  new_dims = _as_dim_list(new_dims)
  expert_dims = _as_dim_list(expert_dims)
  if reduced_dims is None:
    tf.logging.warning(
        "mtf.layers.dense without reduced_dims reduces the last dim of %s (in scope %s); pass "
        "reduced_dims=x.shape.dims[-1:] explicitly to not depend on dim order.", x.shape,
        tf.get_variable_scope().name)
    reduced_dims = x.shape.dims[-1:]
  reduced_dims = _as_dim_list(reduced_dims)
  _check_dims_in_input("dense", x, reduced_dims, "reduced_dims")
  # A reduced dim that is also a new dim gets a temporary name, so that the kernel [reduced...,
  # new...] never holds one Dimension twice; d_model=6 -> d_model=2 keeps both names (0.1.21).
  for i, d in enumerate(reduced_dims):
    if d in new_dims:
      reduced_dims[i] = mtf.Dimension("_" + d.name, d.size)
      x = mtf.rename_dimension(x, d.name, reduced_dims[i].name)
  output_shape = mtf.Shape([d for d in x.shape.dims if d not in reduced_dims] + new_dims)
  if variable_dtype is None:
    variable_dtype = mtf.VariableDType(master_dtype, slice_dtype, x.dtype)
  if name is None:  # claim a fresh "dense_<n>" once, so the kernel and the bias share it
    with tf.variable_scope(None, default_name="dense") as scope:
      name = scope.name.split("/")[-1]
  if kernel_weights is None:
    kernel_weights = get_dense_kernel_weights(
        x, new_dims, reduced_dims, expert_dims, kernel_initializer, name, variable_dtype, master_dtype,
        slice_dtype)
  with tf.variable_scope(name):
    y = us_einsum([x, kernel_weights], output_shape)
    if use_bias:
      bias = mtf.get_variable(x.mesh, "bias", mtf.Shape(expert_dims + new_dims),
                              initializer=tf.zeros_initializer(), dtype=variable_dtype)
      y += mtf.cast(bias, y.dtype)
    if activation is not None:
      y = activation(y)
    return y


def get_dense_kernel_weights(x: mtf.Tensor, new_dims, reduced_dims, expert_dims, kernel_initializer,
                             name=None, variable_dtype=None, master_dtype=tf.float32,
                             slice_dtype=tf.float32) -> mtf.Tensor:
  """The dense kernel variable `<name or dense>/kernel` [expert, reduced, new dims], cast to x.dtype.

  `kernel_initializer` defaults to VarianceScalingInitializer(); DenseInitializer instances are
  called with (reduced_dims, new_dims) to get the TF initializer.
  """
  new_dims = _as_dim_list(new_dims)
  reduced_dims = _as_dim_list(reduced_dims)
  expert_dims = _as_dim_list(expert_dims)
  if variable_dtype is None:
    variable_dtype = mtf.VariableDType(master_dtype, slice_dtype, x.dtype)
  with tf.variable_scope(name, default_name="dense"):
    if kernel_initializer is None:
      kernel_initializer = VarianceScalingInitializer()
    if isinstance(kernel_initializer, DenseInitializer):
      kernel_initializer = kernel_initializer(reduced_dims, new_dims)
    kernel = mtf.get_variable(x.mesh, "kernel", mtf.Shape(expert_dims + reduced_dims + new_dims),
                              initializer=kernel_initializer, dtype=variable_dtype)
    return mtf.cast(kernel, x.dtype)


def _activation_fn(activation):
  """"linear" or None -> None; other strings -> the mtf op of that name; callables unchanged."""
  if activation is None or activation == "linear":
    return None
  if isinstance(activation, str):
    if not callable(getattr(mtf, activation, None)):
      raise ValueError(f"dense_product: activation {activation!r} is not an mtf function; use e.g. "
                       f"'relu', 'gelu' or 'linear'.")
    return getattr(mtf, activation)
  return activation


def dense_product(x: mtf.Tensor, reduced_dims, new_dims, activation_functions=None,
                  name: str = "dense_product", **kwargs) -> mtf.Tensor:
  """Elementwise product of one dense layer per activation (e.g. ["gelu", "linear"] for GEGLU).

  Layers are named `name_0`, `name_1`, ... when there are several factors, else `name`.
  `kwargs` go to each `dense`.
  """
  if not isinstance(activation_functions, (list, tuple)):
    activation_functions = [activation_functions]
  factors = []
  for i, activation in enumerate(activation_functions):
    layer_name = "%s_%d" % (name, i) if len(activation_functions) > 1 else name
    factors.append(dense(x, reduced_dims=reduced_dims, new_dims=new_dims,
                         activation=_activation_fn(activation), name=layer_name, **kwargs))
  return functools.reduce(mtf.multiply, factors)


def dense_relu_dense(x: mtf.Tensor, hidden_channels, is_training, dropout: float = 0.0,
                     dropout_broadcast_dims=None, master_dtype=tf.float32, slice_dtype=tf.float32,
                     name: Optional[str] = None) -> mtf.Tensor:
  """Feed-forward block: dense `wi` (relu, no bias), dropout, dense `wo` back to x's last dim.

  Variables live in scope `name` (default `dense_relu_dense`). Output shape = x's shape.
  """
  with tf.variable_scope(name, default_name="dense_relu_dense"):
    io_channels = x.shape.dims[-1]
    h = dense(x, hidden_channels, reduced_dims=[io_channels], use_bias=False, activation=mtf.relu,
              master_dtype=master_dtype, slice_dtype=slice_dtype, name="wi")
    if dropout != 0.0:
      h = mtf.dropout(h, is_training, keep_prob=1.0 - dropout,
                      noise_shape=h.shape - dropout_broadcast_dims)
    return dense(h, io_channels, reduced_dims=h.shape.dims[-1:], use_bias=False, activation=None,
                 master_dtype=master_dtype, slice_dtype=slice_dtype, name="wo")
