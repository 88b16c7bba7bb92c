"""Normalisation layers: layer norm and batch norm (with moving statistics); Pearson correlation."""

from __future__ import annotations

from typing import Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow import ops_with_redefined_builtins as mtf

__all__ = ["layer_norm", "batch_norm", "corr"]


def _normalize(x: mtf.Tensor, mean: mtf.Tensor, variance: mtf.Tensor, epsilon: float) -> mtf.Tensor:
  return (x - mean) * mtf.rsqrt(variance + epsilon)


def _moments(x: mtf.Tensor, stats_shape: mtf.Shape) -> tuple:
  """Mean and (biased) variance of x, reduced to `stats_shape`."""
  mean = mtf.reduce_mean(x, output_shape=stats_shape)
  variance = mtf.reduce_mean(mtf.square(x - mean), output_shape=stats_shape)
  return mean, variance


def layer_norm(x: mtf.Tensor, dim, epsilon: float = 1e-6, name: str = "layer_prepostprocess") -> mtf.Tensor:
  """Normalises x over `dim`, then scales and shifts by learned [dim] vectors.

  Variables `<name>/layer_norm/layer_norm_scale` (ones) and `.../layer_norm_bias` (zeros).
  """
  dim = mtf.convert_to_dimension(dim)
  if dim not in x.shape.dims:
    raise ValueError(f"layer_norm: dim {dim} is not in the input {x.shape}; pass one of its dims.")
  with tf.variable_scope(name + "/layer_norm"):
    scale = mtf.get_variable(x.mesh, "layer_norm_scale", mtf.Shape([dim]),
                             initializer=tf.ones_initializer(), activation_dtype=x.dtype)
    bias = mtf.get_variable(x.mesh, "layer_norm_bias", mtf.Shape([dim]),
                            initializer=tf.zeros_initializer(), activation_dtype=x.dtype)
    mean, variance = _moments(x, x.shape - dim)
    return _normalize(x, mean, variance, epsilon) * scale + bias


def batch_norm(x: mtf.Tensor, is_training, momentum: float, epsilon: float = 1e-9,
               dims_idx_start: int = 0, dims_idx_end: int = -1, init_zero: bool = False,
               name: Optional[str] = None) -> tuple:
  """Batch normalisation over `x.shape.dims[dims_idx_start:dims_idx_end]`.

  Statistics (and the learned scale/bias) have the remaining dims. Training normalises with the
  batch statistics and returns two assign ops `<name>/bn_mean_update`, `<name>/bn_var_update`
  (moving = momentum * moving + (1 - momentum) * batch); inference uses the moving statistics
  and returns no ops. Variables: `batch_norm_scale` (ones, or zeros if init_zero),
  `batch_norm_bias` (zeros), untrainable `bn_moving_mean` (random normal) and
  `bn_moving_variance` (ones).

  Returns:
    (normalized Tensor, list of update Operations).
  """
  with tf.variable_scope(name, default_name="batch_norm") as scope:
    norm_dims = x.shape.dims[dims_idx_start:dims_idx_end]
    stats_shape = x.shape - norm_dims
    gamma_initializer = tf.zeros_initializer() if init_zero else tf.ones_initializer()
    scale = mtf.get_variable(x.mesh, "batch_norm_scale", stats_shape,
                             initializer=gamma_initializer, activation_dtype=x.dtype)
    bias = mtf.get_variable(x.mesh, "batch_norm_bias", stats_shape,
                            initializer=tf.zeros_initializer(), activation_dtype=x.dtype)
    moving_mean = mtf.get_variable(x.mesh, "bn_moving_mean", stats_shape,
                                   initializer=tf.random_normal_initializer(stddev=1.0),
                                   activation_dtype=x.dtype, trainable=False)
    moving_variance = mtf.get_variable(x.mesh, "bn_moving_variance", stats_shape,
                                       initializer=tf.ones_initializer(), activation_dtype=x.dtype,
                                       trainable=False)
    if is_training:
      mean, variance = _moments(x, stats_shape)
      norm_x = _normalize(x, mean, variance, epsilon)
      op_prefix = name or scope.name.split("/")[-1]
      update_ops = [
          mtf.assign(moving_mean, momentum * moving_mean + (1 - momentum) * mean,
                     name="%s/bn_mean_update" % op_prefix),
          mtf.assign(moving_variance, momentum * moving_variance + (1 - momentum) * variance,
                     name="%s/bn_var_update" % op_prefix),
      ]
    else:
      norm_x = _normalize(x, moving_mean, moving_variance, epsilon)
      update_ops = []
    return norm_x * scale + bias, update_ops


def corr(x: mtf.Tensor, dim: mtf.Dimension, epsilon: float = 1e-20,
         name: str = "pearson_correlation") -> mtf.Tensor:
  """Pearson correlation between the entries of `dim`, the other dims of x being samples.

  As tfp.stats.correlation with event axis `dim`.

  Args:
    x: a Tensor whose shape contains dim.
    dim: the event Dimension.
    epsilon: added to each standard deviation (times the sample count) against division by 0.
    name: variable scope.

  Returns:
    a [dim_1, dim_2] Tensor (dim renamed `<dim.name>_1` and `<dim.name>_2`), ones on the diagonal.
  """
  if dim not in x.shape.dims:
    raise ValueError(f"corr: dim {dim} is not in the input's shape {x.shape}; pass one of its dims.")
  with tf.variable_scope(name):
    centered = x - mtf.reduce_mean(x, output_shape=[dim])
    renamed = [mtf.Dimension(f"{dim.name}_{i}", dim.size) for i in (1, 2)]
    sides = [mtf.rename_dimension(centered, dim.name, d.name) for d in renamed]
    norms = [mtf.sqrt(mtf.reduce_sum(mtf.square(side), output_shape=[d])) + epsilon
             for side, d in zip(sides, renamed)]
    return mtf.matmul(sides[0], sides[1]) / mtf.matmul(norms[0], norms[1])
