"""Causal 1-D convolution layers over the length dimension, with incremental-decoding states.

Re-exported (and gin-registered) as `mesh_tensorflow.transformer.transformer_layers.<Name>`.
x is [batch..., length, channels]: the layers take the length dim from x. In decoding, a
convolution keeps as its state the last inputs it saw (window dim `<length>_filter_width` when
recorded here; a state whose window dim has another name, e.g. 0.1.21's `length`, is read the
same): "first_part" records the inputs before `initial_position`, each "incremental" step
shifts the window by one and appends the current input.
"""

from __future__ import annotations

import gin
import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer
from mesh_tensorflow.transformer._attention_layers import GIN_MODULE

CONV_TYPES = ("conv", "lightweight", "dynamic")


def _apply_activation(x: mtf.Tensor, activation: str) -> mtf.Tensor:
  return x if activation == "linear" else getattr(mtf, activation)(x)


def _output_dim(x: mtf.Tensor, output_size: int) -> mtf.Dimension:
  """The output channels keep the name of x's channel dim, so the layer's output is shaped like x."""
  return mtf.Dimension(x.shape.dims[-1].name, output_size)


@gin.configurable(module=GIN_MODULE)
class Conv1D(transformer.TransformerLayer):
  """Base class of the convolution layers: the decoding state of a window of `filter_size` inputs."""

  def record_states_first_part_mode(self, context, x: mtf.Tensor, filter_size: int,
                                    length_dim_name: str = "length") -> None:
    """Records x[initial_position - filter_size : initial_position] (zeros before the start).

    x is [batch..., length, channels]; the state is [batch..., <length>_filter_width, channels].
    """
    length_dim = x.shape.dims[-2]
    filter_dim = mtf.Dimension(length_dim_name + "_filter_width", filter_size)
    # Positions before 0 select nothing (gather is a one-hot einsum), so the state is zero-padded.
    indices = context.initial_position - filter_size + mtf.range(x.mesh, filter_dim, tf.int32)
    state_shape = mtf.Shape(x.shape.dims[:-2] + [filter_dim] + x.shape.dims[-1:])
    context.record_new_states([mtf.gather(x, indices, length_dim, output_shape=state_shape)])

  def record_states_incremental_mode(self, context, x: mtf.Tensor, filter_size: int,
                                     length_dim_name: str = "length") -> mtf.Tensor:
    """The window ending at the current input x [batch..., channels]; recorded as the new state.

    The state's window is its second-last dim, whatever its name.
    """
    old_state, = context.get_states(1)
    filter_dim = old_state.shape.dims[-2]
    if filter_dim.size != filter_size:
      raise ValueError(f"{type(self).__name__}: the decoding state {old_state.shape} has a window dim "
                       f"{filter_dim} of size {filter_dim.size}, but the filter needs {filter_size} "
                       f"inputs; record the state with the same layer in 'first_part' mode.")
    last = mtf.constant(x.mesh, filter_size - 1, shape=mtf.Shape(x.shape.dims[:-1]), dtype=tf.int32)
    state = self.update_state(old_state, x, last, filter_dim, context.activation_dtype)
    context.record_new_states([state])
    return state

  def update_state(self, old_state: mtf.Tensor, x: mtf.Tensor, position: mtf.Tensor, filter_dim,
                   dtype) -> mtf.Tensor:
    """old_state shifted one step back along filter_dim (a Dimension or its name), x written at position."""
    if isinstance(filter_dim, str):
      filter_dim = old_state.shape.get_dim_by_name(filter_dim)
    shifted = mtf.shift(old_state, -1, filter_dim, wrap=False)
    one_hot = mtf.one_hot(position, filter_dim, dtype=dtype)
    return shifted * (1.0 - one_hot) + x * one_hot


@gin.configurable(module=GIN_MODULE)
class Conv1DLayer(Conv1D):
  """Causal convolution: output t sees inputs t-filter_size+1..t (zero-padded on the left).

  Variable `conv2d/kernel` [1, filter_size, d_model, output_size] (glorot-uniform; float32
  master, x's dtype in the computation). Packed sequences are not separated: information may
  cross example boundaries. Reads only context.mode, activation_dtype (and, decoding,
  initial_position and the states), so a stand-in context works.
  """

  def __init__(self, filter_size: int, output_size: int, activation: str = "linear"):
    self.filter_size = filter_size
    self.output_size = output_size
    self.activation = activation

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    output_dim = _output_dim(x, self.output_size)
    if context.mode == "first_part":
      self.record_states_first_part_mode(context, x, self.filter_size)
    if context.mode == "incremental":
      x = self.record_states_incremental_mode(context, x, self.filter_size)
    else:
      x = mtf.pad(x, [self.filter_size - 1, 0], x.shape.dims[-2].name)
    channels = x.shape.dims[-1]
    x = mtf.rename_dimension(x, channels.name, "_" + channels.name)  # the kernel holds in and out channels
    y = mtf.layers.conv1d(x, output_dim=output_dim, filter_size=self.filter_size, padding="VALID",
                          filter_initializer=tf.glorot_uniform_initializer())
    if context.mode == "incremental":
      y = mtf.reshape(y, y.shape - [y.shape.dims[-2]])  # the one output position of the window
    return _apply_activation(y, self.activation)


@gin.configurable(module=GIN_MODULE)
class SeparableConv1DLayer(Conv1D):
  """Depthwise-separable convolution over relative positions [min_relative_pos, max_relative_pos].

  Wraps mtf.layers.separable_conv1d (variables `separable_conv1d/...`). Decoding needs a causal
  filter (max_relative_pos <= 0); its state holds the last 1 - min_relative_pos inputs.
  """

  def __init__(self, min_relative_pos: int, max_relative_pos: int, output_size: int,
               depthwise_filter_initializer_scale: float = 1.0,
               pointwise_filter_initializer_scale: float = 1.0, activation: str = "linear"):
    self.min_relative_pos = min_relative_pos
    self.max_relative_pos = max_relative_pos
    self.output_size = output_size
    self.depthwise_filter_initializer_scale = depthwise_filter_initializer_scale
    self.pointwise_filter_initializer_scale = pointwise_filter_initializer_scale
    self.activation = activation

  @property
  def window_size(self) -> int:
    return 1 - self.min_relative_pos

  def _check_causal(self, context) -> None:
    if self.max_relative_pos > 0 or self.min_relative_pos > 0:
      raise ValueError(f"{type(self).__name__}: {context.mode!r} decoding needs a causal filter "
                       f"(min_relative_pos <= max_relative_pos <= 0), got [{self.min_relative_pos}, "
                       f"{self.max_relative_pos}].")

  def call(self, context, x: mtf.Tensor, losses=None, all_kernel_wts=None) -> mtf.Tensor:
    output_dim = _output_dim(x, self.output_size)
    if context.mode in ("first_part", "incremental"):
      self._check_causal(context)
    if context.mode == "first_part":
      self.record_states_first_part_mode(context, x, self.window_size)
    if context.mode == "incremental":
      x = self.record_states_incremental_mode(context, x, self.window_size)
    y = mtf.layers.separable_conv1d(
        x, output_dim, min_relative_pos=self.min_relative_pos, max_relative_pos=self.max_relative_pos,
        depthwise_filter_initializer_scale=self.depthwise_filter_initializer_scale,
        pointwise_filter_initializer_scale=self.pointwise_filter_initializer_scale, use_bias=True,
        kernel_depth_weights=all_kernel_wts)
    if context.mode == "incremental":
      window_dim = y.shape.dims[-2]
      y = mtf.gather(y, window_dim.size - 1, window_dim)  # the output at the current position
    return _apply_activation(y, self.activation)


@gin.configurable(module=GIN_MODULE)
class Conv1DLocalAttn(SeparableConv1DLayer):
  """Separable convolution whose depthwise kernel is a softmax over the window, per channel.

  Each channel of the output mixes the window like an attention distribution (variable
  `conv_attn_kernel` [relative_position, d_model] of logits).
  """

  def relative_position_dim(self) -> mtf.Dimension:
    return mtf.Dimension("relative_position", self.max_relative_pos - self.min_relative_pos + 1)

  def kernel_logits(self, context, x: mtf.Tensor) -> mtf.Tensor:
    """Logits over the relative positions, with x's channel dim (or the heads dim to spread over it)."""
    shape = [self.relative_position_dim(), x.shape.dims[-1]]
    return mtf.get_variable(context.mesh, "conv_attn_kernel", shape,
                            initializer=tf.random_normal_initializer(), dtype=context.variable_dtype)

  def spread_heads(self, kernel: mtf.Tensor, x: mtf.Tensor) -> mtf.Tensor:
    return kernel

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    relative_position_dim = self.relative_position_dim()
    weights = mtf.softmax(self.kernel_logits(context, x), relative_position_dim)
    weights = mtf.cast(self.spread_heads(weights, x), x.dtype)
    return super().call(context, x, losses, all_kernel_wts=mtf.unstack(weights, relative_position_dim))


@gin.configurable(module=GIN_MODULE)
class LightweightConv1DLocalAttn(Conv1DLocalAttn):
  """Lightweight convolution (Wu et al. 2019): one softmax-normalised kernel per head.

  The channels are split into `num_heads` equal groups sharing a kernel (variable
  `conv_attn_kernel` [relative_position, heads]).
  """

  def __init__(self, min_relative_pos: int, max_relative_pos: int, output_size: int,
               depthwise_filter_initializer_scale: float = 1.0,
               pointwise_filter_initializer_scale: float = 1.0, activation: str = "linear",
               num_heads: int = 1):
    super().__init__(min_relative_pos, max_relative_pos, output_size, depthwise_filter_initializer_scale,
                     pointwise_filter_initializer_scale, activation)
    self.num_heads = num_heads

  @property
  def heads_dim(self) -> mtf.Dimension:
    return mtf.Dimension("heads", self.num_heads)

  def kernel_logits(self, context, x: mtf.Tensor) -> mtf.Tensor:
    return mtf.get_variable(context.mesh, "conv_attn_kernel", [self.relative_position_dim(), self.heads_dim],
                            initializer=tf.random_normal_initializer(), dtype=context.variable_dtype)

  def spread_heads(self, kernel: mtf.Tensor, x: mtf.Tensor) -> mtf.Tensor:
    """Kernel over heads -> kernel over channels (channel c belongs to head c // (channels / heads))."""
    channels = x.shape.dims[-1]
    if channels.size % self.num_heads:
      raise ValueError(f"{type(self).__name__}: num_heads={self.num_heads} must divide the channel dim "
                       f"{channels}.")
    head_of_channel = np.arange(channels.size) // (channels.size // self.num_heads)
    membership = (head_of_channel[np.newaxis, :] == np.arange(self.num_heads)[:, np.newaxis])
    membership = mtf.constant(x.mesh, membership.astype(np.float32), mtf.Shape([self.heads_dim, channels]),
                              dtype=kernel.dtype)
    return mtf.einsum([kernel, membership], output_shape=kernel.shape - self.heads_dim + channels)


@gin.configurable(module=GIN_MODULE)
class DynamicConv1DLocalAttn(LightweightConv1DLocalAttn):
  """Dynamic convolution (Wu et al. 2019): per-position kernels predicted from the input.

  The kernel logits at position t are a dense of x_t (variable `conv_attn_kernel/kernel`
  [d_model, relative_position, heads]), softmax-normalised over the window.
  """

  def kernel_logits(self, context, x: mtf.Tensor) -> mtf.Tensor:
    return mtf.layers.dense(x, new_dims=[self.relative_position_dim(), self.heads_dim],
                            reduced_dims=x.shape.dims[-1:], use_bias=False,
                            variable_dtype=context.variable_dtype, name="conv_attn_kernel")


@gin.configurable(module=GIN_MODULE)
class LocalConvAttnBlock(transformer.TransformerLayer):
  """Convolution block of Wu et al. 2019: GLU input projection, then a convolutional local attention.

  conv_type: "conv" (Conv1DLocalAttn), "lightweight" or "dynamic". Variables: `glu_0`, `glu_1`
  (the GLU's linear and sigmoid halves) and the convolution's, in scope `conv`.
  """

  def __init__(self, min_relative_pos: int, max_relative_pos: int, num_heads: int = 1,
               conv_type: str = "lightweight", output_activation: str = "linear"):
    if conv_type not in CONV_TYPES:
      raise ValueError(f"LocalConvAttnBlock: unknown conv_type {conv_type!r}; use one of {CONV_TYPES}.")
    self.min_relative_pos = min_relative_pos
    self.max_relative_pos = max_relative_pos
    self.num_heads = num_heads
    self.conv_type = conv_type
    self.output_activation = output_activation

  def _conv_layer(self, output_size: int) -> Conv1DLocalAttn:
    args = (self.min_relative_pos, self.max_relative_pos, output_size)
    if self.conv_type == "conv":
      return Conv1DLocalAttn(*args, activation=self.output_activation)
    cls = LightweightConv1DLocalAttn if self.conv_type == "lightweight" else DynamicConv1DLocalAttn
    return cls(*args, activation=self.output_activation, num_heads=self.num_heads)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    channels = x.shape.dims[-1]
    gated = mtf.layers.dense_product(x, reduced_dims=[channels], new_dims=[channels],
                                     activation_functions=["linear", "sigmoid"], use_bias=False,
                                     variable_dtype=context.variable_dtype, name="glu")
    with tf.variable_scope("conv"):
      return self._conv_layer(channels.size).call(context, gated, losses)
