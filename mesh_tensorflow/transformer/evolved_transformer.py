"""Layers of the Evolved Transformer (So et al. 2019, arXiv:1901.11117).

Gin-configurable under their names (module `mesh_tensorflow.transformer.evolved_transformer`),
with 0.1.21's parameters and variable names: `GatedLinearUnitLayer`, `EncoderConvolutionalLayer`,
`DecoderAttentionLayer` and `DecoderConvolutionalLayer`. Each `call(context, x, losses=None)`
returns a tensor shaped like x; the convolution branches are the Conv1DLayer and
SeparableConv1DLayer of transformer_layers.
"""

from __future__ import annotations

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer, transformer_layers

GIN_MODULE = "mesh_tensorflow.transformer.evolved_transformer"


@gin.configurable(module=GIN_MODULE)
class GatedLinearUnitLayer(transformer.TransformerLayer):
  """Gated linear unit (arXiv:1612.08083): (x W0 + b0) * sigmoid(x W1 + b1).

  Variables `glu_0/{kernel,bias}` and `glu_1/{kernel,bias}` [d_model, d_model].
  """

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    return mtf.layers.dense_product(
        x, reduced_dims=x.shape.dims[-1:], new_dims=x.shape.dims[-1:],
        activation_functions=["linear", "sigmoid"], variable_dtype=context.variable_dtype, name="glu",
        expert_dims=context.model.ensemble_dims)


@gin.configurable(module=GIN_MODULE)
class EncoderConvolutionalLayer(transformer.TransformerLayer):
  """The Evolved Transformer's encoder convolution block.

  Left branch: dense to 4 * d_model with ReLU (scope `conv1x1`, no bias). Right branch: a width-3
  Conv1DLayer to d_model / 2 channels (scope `conv3x1`), zero-padded to 4 * d_model channels.
  Their sum goes through a layer norm, then a width-9 (relative positions -4..4) separable
  convolution to d_model / 2 channels (scope `sep_conv9x1`), zero-padded back to d_model.
  Dropout (training) follows each branch and the output, shared along the length.
  """

  def __init__(self, d_model: int, dropout_rate: float, initializer_scale: float = 1.0,
               norm_epsilon: float = 1e-6):
    """Creates the block.

    Args:
      d_model: the model dimension's size.
      dropout_rate: dropout rate after each branch and the output (training only).
      initializer_scale: scale of the separable convolution's initializers.
      norm_epsilon: epsilon of the layer norm.
    """
    self._dropout_rate = dropout_rate
    self._norm_epsilon = norm_epsilon
    self._conv3x1 = transformer_layers.Conv1DLayer(filter_size=3, output_size=int(d_model / 2),
                                                   activation="relu")
    self._sep_conv9x1 = transformer_layers.SeparableConv1DLayer(
        min_relative_pos=-4, max_relative_pos=4, output_size=int(d_model / 2),
        depthwise_filter_initializer_scale=initializer_scale,
        pointwise_filter_initializer_scale=initializer_scale)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    model_dim = context.model.model_dim
    hidden_dim = mtf.Dimension(model_dim.name, 4 * model_dim.size)
    with tf.variable_scope("conv1x1"):
      left = mtf.layers.dense(x, reduced_dims=x.shape.dims[-1:], new_dims=[hidden_dim], activation=mtf.relu,
                              use_bias=False, variable_dtype=context.variable_dtype)
      left = _dropout(left, context, self._dropout_rate)
    with tf.variable_scope("conv3x1"):
      right = self._conv3x1.call(context, x, losses)
      right = _pad_channels_dim(_dropout(right, context, self._dropout_rate), hidden_dim.size)
    hidden = left + right
    hidden = mtf.layers.layer_norm(hidden, epsilon=self._norm_epsilon, dim=hidden.shape.dims[-1])
    with tf.variable_scope("sep_conv9x1"):
      output = self._sep_conv9x1.call(context, hidden, losses)
      return _pad_channels_dim(_dropout(output, context, self._dropout_rate), model_dim.size)


@gin.configurable(module=GIN_MODULE)
class DecoderAttentionLayer(transformer.TransformerLayer):
  """Self-attention with 2 * base_num_heads heads plus encoder-decoder attention with base_num_heads.

  The two run on the same input (scopes `self_attention` and `enc_dec_attention`); their
  outputs are summed.
  """

  def __init__(self, base_num_heads: int):
    """Creates the layer.

    Args:
      base_num_heads: the encoder-decoder attention's heads (self-attention has twice as many).
    """
    self._self_attention = transformer_layers.SelfAttention(num_heads=2 * base_num_heads)
    self._enc_dec_attention = transformer_layers.EncDecAttention(num_heads=base_num_heads)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    with tf.variable_scope("self_attention"):
      left = self._self_attention.call(context, x, losses)
    with tf.variable_scope("enc_dec_attention"):
      right = self._enc_dec_attention.call(context, x, losses)
    return left + right


@gin.configurable(module=GIN_MODULE)
class DecoderConvolutionalLayer(transformer.TransformerLayer):
  """The Evolved Transformer's decoder convolution block (causal, so it decodes incrementally).

  Left branch: a width-11 separable convolution (relative positions -10..0) to 2 * d_model
  channels with ReLU (scope `sep_conv11x1`). Right branch: a width-7 separable convolution to
  d_model / 2 channels (scope `sep_conv7x1_1`), zero-padded to 2 * d_model. Their sum goes
  through a layer norm, then a width-7 separable convolution to d_model (scope `sep_conv7x1_2`).
  Dropout (training) follows each branch and the output.
  """

  def __init__(self, d_model: int, dropout_rate: float, initializer_scale: float = 1.0,
               norm_epsilon: float = 1e-6):
    """Creates the block.

    Args:
      d_model: the model dimension's size.
      dropout_rate: dropout rate after each branch and the output (training only).
      initializer_scale: scale of the separable convolutions' initializers.
      norm_epsilon: epsilon of the layer norm.
    """
    self._d_model = d_model
    self._dropout_rate = dropout_rate
    self._norm_epsilon = norm_epsilon

    def separable(min_relative_pos: int, output_size: int, activation: str = "linear"):
      return transformer_layers.SeparableConv1DLayer(
          min_relative_pos=min_relative_pos, max_relative_pos=0, output_size=output_size,
          depthwise_filter_initializer_scale=initializer_scale,
          pointwise_filter_initializer_scale=initializer_scale, activation=activation)
    self._sep_conv11x1 = separable(-10, int(2 * d_model), activation="relu")
    self._sep_conv7x1_1 = separable(-6, int(d_model / 2))
    self._sep_conv7x1_2 = separable(-6, d_model)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    with tf.variable_scope("sep_conv11x1"):
      left = _dropout(self._sep_conv11x1.call(context, x, losses), context, self._dropout_rate)
    with tf.variable_scope("sep_conv7x1_1"):
      right = _dropout(self._sep_conv7x1_1.call(context, x, losses), context, self._dropout_rate)
      right = _pad_channels_dim(right, left.shape.dims[-1].size)
    hidden = left + right
    hidden = mtf.layers.layer_norm(hidden, epsilon=self._norm_epsilon, dim=hidden.shape.dims[-1])
    with tf.variable_scope("sep_conv7x1_2"):
      return _dropout(self._sep_conv7x1_2.call(context, hidden, losses), context, self._dropout_rate)


def _pad_channels_dim(tensor: mtf.Tensor, size: int) -> mtf.Tensor:
  """tensor with its last (channels) dim zero-padded at the end to `size`."""
  channels_dim = tensor.shape.dims[-1]
  if channels_dim.size > size:
    raise ValueError(f"evolved_transformer: cannot pad the channels dim {channels_dim} to size {size}, "
                     f"which is smaller; check d_model against the block's output sizes.")
  if channels_dim.size == size:
    return tensor
  return mtf.pad(tensor, [0, size - channels_dim.size], channels_dim.name)


def _dropout(x: mtf.Tensor, context, dropout_rate: float) -> mtf.Tensor:
  """Training-time dropout with one mask per example and channel (shared along the length)."""
  if context.train and dropout_rate > 0:
    return mtf.dropout(x, context.train, rate=dropout_rate,
                       noise_shape=mtf.Shape(context.batch_dims + x.shape.dims[-1:]))
  return x
