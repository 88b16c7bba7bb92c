"""Layers for Fixup initialization (Zhang et al. 2019, arXiv:1901.09321): training without norms.

Fixup scales each residual branch's initial weights by num_blocks**(-1 / (2m - 2)) (m: the
branch's number of matrix multiplications; num_blocks: the residual blocks of the model, e.g.
2 * encoder layers + 3 * decoder layers), zero-initializes each branch's last projection and
adds scalar shifts and scales (`sublayer_fixup_shift`, `sublayer_fixup_scale`). Gin names,
parameters and variable names are 0.1.21's (module
`mesh_tensorflow.transformer.fixup_layers`).
"""

from __future__ import annotations

import math

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import attention, transformer, transformer_layers

GIN_MODULE = "mesh_tensorflow.transformer.fixup_layers"
_DEFAULT_INITS = ("glorot", "he")


def get_single_scalar_bias(x: mtf.Tensor, name: str) -> mtf.Tensor:
  """A trainable zero-initialized bias of shape [single_bias:1] (x's mesh and dtype): a Fixup shift.

  Args:
    x: a Tensor, giving the mesh and dtype.
    name: the variable's name.
  Returns:
    the variable's Tensor.
  """
  return mtf.get_variable(x.mesh, name, mtf.Shape([mtf.Dimension("single_bias", 1)]),
                          initializer=tf.zeros_initializer(), dtype=x.dtype)


def dense_product_fixup(x: mtf.Tensor, reduced_dims, new_dims, kernel_initializer, activation_functions=None,
                        name: str = "dense_product", **kwargs) -> mtf.Tensor:
  """mtf.layers.dense_product with an explicit kernel initializer (the Fixup-scaled one).

  Args:
    x: a Tensor.
    reduced_dims: the dims of x to contract.
    new_dims: the output dims.
    kernel_initializer: the kernels' initializer.
    activation_functions: one activation (or a list, one dense per entry, multiplied).
    name: the variable scope (suffixed _0, _1, ... for several activations).
    **kwargs: more arguments of mtf.layers.dense.
  Returns:
    the product of the activated dense layers.
  """
  return mtf.layers.dense_product(x, reduced_dims, new_dims, activation_functions, name,
                                  kernel_initializer=kernel_initializer, **kwargs)


def _fixup_initializer(default_init: str, init_distribution: str, scale: float):
  """He (fan_in, 2 * scale) or Glorot (fan_avg, scale) variance scaling, shrunk by the Fixup `scale`."""
  if default_init == "glorot":
    return tf.initializers.variance_scaling(mode="fan_avg", distribution=init_distribution, scale=scale)
  if default_init == "he":
    return tf.initializers.variance_scaling(mode="fan_in", distribution=init_distribution, scale=2 * scale)
  raise ValueError(f"Fixup: default_init={default_init!r} is not supported; use one of {_DEFAULT_INITS}.")


class AttentionParamsFixup(attention.AttentionParams):
  """Attention projections with Fixup initialization.

  q, k, v (or kv) are He/Glorot-initialized with variance scaled by num_blocks**(-1/3) (m = 4
  matrix multiplications: the standard deviation shrinks by num_blocks**(-1/6)); o starts at
  zero. Variables `q_fixup`, `k_fixup`, `v_fixup` (or `kv_fixup`) and `o_fixup`. Incompatible
  with the unit-scaling convention and with fold_scaling_into_initializer.
  """

  def __init__(self, mesh, query_input_dim, memory_input_dim, output_dim, key_dim, value_dim,
               query_heads_dims, memory_heads_dims, variable_dtype, shared_kv=False,
               fold_scaling_into_initializer=False, num_blocks=None, default_init="he",
               init_distribution="uniform", **kwargs):
    self.num_blocks = num_blocks
    self.default_init = default_init
    self.init_distribution = init_distribution
    if mtf.layers.unit_scaling_convention():
      raise ValueError("AttentionParamsFixup: Fixup initialization is not compatible with the unit-scaling "
                       "convention; unbind unit_scaling_convention.value.")
    if fold_scaling_into_initializer:
      raise ValueError("AttentionParamsFixup: Fixup initialization is not compatible with "
                       "fold_scaling_into_initializer; set SelfAttentionFixup.fold_scaling_into_initializer "
                       "= False.")
    super().__init__(mesh, query_input_dim, memory_input_dim, output_dim, key_dim, value_dim,
                     query_heads_dims, memory_heads_dims, variable_dtype, shared_kv=shared_kv,
                     fold_scaling_into_initializer=fold_scaling_into_initializer, **kwargs)

  def init_weights(self):
    """Creates q_fixup, k_fixup, v_fixup (or kv_fixup) and the zero-initialized o_fixup."""
    # variance_scaling's limit is sqrt(3 * scale / fan): scaling the variance by num_blocks**(-1/3)
    # scales the weights by num_blocks**(-1/6).
    init = _fixup_initializer(self.default_init, self.init_distribution, math.pow(self.num_blocks, -1. / 3))

    def variable(name, shape, initializer):
      return mtf.get_variable(self.mesh, name, mtf.Shape(shape), initializer=initializer,
                              dtype=self.variable_dtype)
    if not self.no_query:
      self.wq = variable("q_fixup", self.q_shape, init)
    if self.shared_kv:
      self.wkv = variable("kv_fixup", self.k_shape, init)
    else:
      self.wk = variable("k_fixup", self.k_shape, init)
      self.wv = variable("v_fixup", self.v_shape, init)
    self.wo = variable("o_fixup", self.o_shape, tf.initializers.zeros())


@gin.configurable(module=GIN_MODULE)
class DenseReluDenseFixup(transformer.TransformerLayer):
  """DenseReluDense with Fixup initialization and a scalar shift before the down-projection.

  wi is He (fan_in, scale 2 / num_blocks) or Glorot (fan_avg, scale 1 / num_blocks) initialized
  (m = 2: weights shrink by 1/sqrt(num_blocks)); wo starts at zero. Variables `wi/kernel` (or
  `wi_<i>/kernel`), `shift` [single_bias:1] and `wo/kernel` (plus biases with use_bias).
  """

  def __init__(self, hidden_size: int = 4096, dropout_rate: float = 0.0, activation="relu",
               use_bias: bool = False, default_init: str = "he", init_distribution: str = "uniform",
               num_blocks: int = gin.REQUIRED):
    """Creates the layer.

    Args:
      hidden_size: size of the hidden dim d_ff.
      dropout_rate: dropout on the hidden layer (training only).
      activation: an activation or a list of them (see mtf.layers.dense_product).
      use_bias: whether the dense layers have biases.
      default_init: "he" or "glorot".
      init_distribution: the variance_scaling distribution ("uniform", "truncated_normal", ...).
      num_blocks: the model's number of residual blocks.
    """
    self.hidden_size = hidden_size
    self.dropout_rate = dropout_rate
    self.activation = activation
    self.use_bias = use_bias
    self.downproject_initializer = tf.initializers.zeros()
    self.upproject_initializer = _fixup_initializer(default_init, init_distribution, 1.0 / num_blocks)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    io_channels = x.shape.dims[-1]
    h = dense_product_fixup(
        x, reduced_dims=x.shape.dims[-1:], new_dims=mtf.Dimension("d_ff", self.hidden_size),
        activation_functions=self.activation, use_bias=self.use_bias, variable_dtype=context.variable_dtype,
        name="wi", kernel_initializer=self.upproject_initializer, expert_dims=context.model.ensemble_dims)
    if context.train and self.dropout_rate != 0.0:
      h = mtf.dropout(h, context.train, keep_prob=1.0 - self.dropout_rate,
                      noise_shape=h.shape - context.length_dim)
    h = mtf.reshape(h + get_single_scalar_bias(x, "shift"), h.shape)
    return mtf.layers.dense(h, io_channels, use_bias=self.use_bias, activation=None,
                            variable_dtype=context.variable_dtype, reduced_dims=h.shape.dims[-1:], name="wo",
                            expert_dims=context.model.ensemble_dims,
                            kernel_initializer=self.downproject_initializer)


@gin.configurable(module=GIN_MODULE)
class SelfAttentionFixup(transformer_layers.SelfAttention):
  """SelfAttention whose projections are AttentionParamsFixup (variables `q_fixup` ... `o_fixup`).

  Needs fold_scaling_into_initializer=False (SelfAttention's default is True), as in 0.1.21.
  """

  def __init__(self, num_blocks: int = gin.REQUIRED, default_init: str = "glorot",
               init_distribution: str = "uniform", **kwargs):
    """Creates the layer.

    Args:
      num_blocks: the model's number of residual blocks.
      default_init: "glorot" or "he".
      init_distribution: the variance_scaling distribution.
      **kwargs: SelfAttention's arguments.
    """
    super().__init__(**kwargs)
    self.num_blocks = num_blocks
    self.default_init = default_init
    self.init_distribution = init_distribution

  def make_params(self, context) -> AttentionParamsFixup:
    return transformer_layers.attention_params(
        context=context, kv_dim=self.kv_dim, num_heads=self.num_heads, num_memory_heads=self.num_memory_heads,
        shared_kv=self.shared_kv, combine_dims=self.combine_dims,
        keep_query_heads_dims=self.keep_query_heads_dims,
        fold_scaling_into_initializer=self.fold_scaling_into_initializer, params_cls=AttentionParamsFixup,
        num_blocks=self.num_blocks, default_init=self.default_init, init_distribution=self.init_distribution)


@gin.configurable(module=GIN_MODULE)
class EncDecAttentionFixup(transformer_layers.EncDecAttention):
  """Attention over the encoder output, gin-configurable apart from EncDecAttention.

  As in 0.1.21 its projections are the ordinary ones (`q`, `k`, `v`, `o`), not Fixup-initialized.
  """

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    memory_antecedent = self._get_memory_antecedent(context)
    return transformer_layers.enc_dec_attention(self, memory_antecedent, context, x, losses)


@gin.configurable(module=GIN_MODULE)
def sublayer_fixup_scale(x: mtf.Tensor, layer_stack, context) -> mtf.Tensor:
  """x times a trainable scalar `fixup_scale_weight` [single_scale:1], initially one."""
  del layer_stack
  weight = mtf.get_variable(x.mesh, "fixup_scale_weight", shape=mtf.Shape([mtf.Dimension("single_scale", 1)]),
                            dtype=context.variable_dtype, initializer=tf.constant_initializer(1.))
  return mtf.reshape(x * weight, x.shape)


@gin.configurable(module=GIN_MODULE)
def sublayer_fixup_shift(x: mtf.Tensor, layer_stack, context) -> mtf.Tensor:
  """x plus a trainable scalar `fixup_bias` [single_bias:1], initially zero."""
  del layer_stack
  bias = mtf.get_variable(x.mesh, "fixup_bias", shape=mtf.Shape([mtf.Dimension("single_bias", 1)]),
                          dtype=context.variable_dtype, initializer=tf.zeros_initializer())
  return mtf.reshape(x + bias, x.shape)
