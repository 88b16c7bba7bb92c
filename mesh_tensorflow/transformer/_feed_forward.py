"""The feed-forward block of a Transformer layer stack (public as `transformer_layers.DenseReluDense`)."""

from __future__ import annotations

import gin

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer
from mesh_tensorflow.transformer._attention_layers import GIN_MODULE


@gin.configurable(module=GIN_MODULE)
class DenseReluDense(transformer.TransformerLayer):
  """Feed-forward block: dense `wi` to `d_ff` with `activation`, dropout (training), dense `wo`.

  `activation` may be a list (e.g. ["gelu", "linear"] for GEGLU): one `wi_<i>` per entry,
  multiplied elementwise.
  """

  def __init__(self, hidden_size: int = 4096, dropout_rate: float = 0.0, activation="relu",
               use_bias: bool = False):
    self.hidden_size = hidden_size
    self.dropout_rate = dropout_rate
    self.activation = activation
    self.use_bias = use_bias

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    io_channels = x.shape.dims[-1]
    h = mtf.layers.dense_product(
        x, reduced_dims=[io_channels], new_dims=mtf.Dimension("d_ff", self.hidden_size),
        activation_functions=self.activation, use_bias=self.use_bias,
        variable_dtype=context.variable_dtype, name="wi", expert_dims=context.model.ensemble_dims)
    if context.train and self.dropout_rate != 0.0:
      h = mtf.dropout(h, context.train, keep_prob=1.0 - self.dropout_rate,
                      noise_shape=h.shape - context.length_dim)
    return mtf.layers.dense(h, io_channels, reduced_dims=h.shape.dims[-1:], use_bias=self.use_bias,
                            activation=None, variable_dtype=context.variable_dtype, name="wo",
                            expert_dims=context.model.ensemble_dims)
