"""1-D convolution layers over the length dimension, with incremental-decoding states.

Re-exported (and gin-registered) as `mesh_tensorflow.transformer.transformer_layers.<Name>`.
x is [batch..., length, channels]: the layers take the length dim from x. As in 0.1.21, a full
(non-incremental) pass zeroes x where `context.inputs == 0` (padding; in a decoder also the
shifted-in start position) and convolves over the whole sequence: Conv1DLayer pads "SAME" (a
centred filter, which sees later positions), SeparableConv1DLayer covers its relative positions.
In decoding, a convolution keeps as its state the last inputs it saw (window dim
`<length>_filter_width` when recorded here; a state whose window dim has another name, e.g.
0.1.21's `length`, is read the same): "first_part" records the (unmasked) inputs before
`initial_position`, each "incremental" step shifts the window by one, appends the current input
and convolves the window causally: the output at step t sees inputs t-window+1..t only. So, as
in 0.1.21, incremental outputs equal the full pass only for a causal filter over unmasked inputs.
"""

from __future__ import annotations

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer
from mesh_tensorflow.transformer._attention_layers import GIN_MODULE

def _apply_activation(x: mtf.Tensor, activation: str) -> mtf.Tensor:
  return x if activation == "linear" else getattr(mtf, activation)(x)


def _mask_padding(layer, context, x: mtf.Tensor) -> mtf.Tensor:
  """x zeroed where context.inputs == 0 (0.1.21 masks every non-incremental pass this way)."""
  if context.inputs is None:
    raise ValueError(f"{type(layer).__name__}: a {context.mode!r} pass zeroes x where context.inputs == 0, "
                     f"but context.inputs is None; build the context with the layer stack's input ids.")
  return x * mtf.cast(mtf.not_equal(context.inputs, 0), context.activation_dtype)


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
  """1-D convolution over the length with the channels as depth (0.1.21's math and variable).

  Full pass: x zeroed where context.inputs == 0, then a "SAME" convolution (output t sees
  inputs t - (filter_size - 1) // 2 .. t + filter_size // 2). Incremental step t: a "VALID"
  convolution of the window of inputs t - filter_size + 1 .. t (causal; see the module doc).
  Variable `conv2d/kernel` [1, filter_size, d_model, output_size] (glorot-uniform; float32
  master, x's dtype in the computation). Packed sequences are not separated: information may
  cross example boundaries. Reads only context.inputs, mode and activation_dtype (and, decoding,
  initial_position and the states), so a stand-in context works.
  """

  def __init__(self, filter_size: int, output_size: int, activation: str = "linear"):
    self._filter_size = filter_size
    self.output_size = output_size
    self.activation = activation

  @property
  def filter_size(self) -> int:
    """The convolution's width (read-only, as 0.1.21's property)."""
    return self._filter_size

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    output_dim = _output_dim(x, self.output_size)
    if context.mode == "first_part":
      self.record_states_first_part_mode(context, x, self.filter_size)
    if context.mode == "incremental":
      x = self.record_states_incremental_mode(context, x, self.filter_size)
      padding = "VALID"
    else:
      x = _mask_padding(self, context, x)
      padding = "SAME"
    channels = x.shape.dims[-1]
    x = mtf.rename_dimension(x, channels.name, "_" + channels.name)  # the kernel holds in and out channels
    y = mtf.layers.conv1d(x, output_dim=output_dim, filter_size=self.filter_size, padding=padding,
                          filter_initializer=tf.glorot_uniform_initializer())
    if context.mode == "incremental":
      y = mtf.reshape(y, y.shape - [y.shape.dims[-2]])  # the one output position of the window
    return _apply_activation(y, self.activation)


@gin.configurable(module=GIN_MODULE)
class SeparableConv1DLayer(Conv1D):
  """Depthwise-separable convolution over relative positions [min_relative_pos, max_relative_pos].

  Wraps mtf.layers.separable_conv1d (variables `separable_conv1d/...`); a full pass first zeroes
  x where context.inputs == 0. Decoding needs a causal filter (max_relative_pos <= 0); its
  state holds the last 1 - min_relative_pos inputs.
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
  def filter_size(self) -> int:
    """The number of relative positions the filter spans (0.1.21's property)."""
    return self.max_relative_pos - self.min_relative_pos + 1

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
    else:
      x = _mask_padding(self, context, x)
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
  """Separable convolution whose depthwise kernels are a softmax over the window, per channel.

  Base of LightweightConv1DLocalAttn and DynamicConv1DLocalAttn, which say how the kernel of
  relative position i (dim `repeated_kernel_dim` of size d_model / num_unique_depth_filters) is
  made (`get_kernel_wt`). That kernel is tiled num_unique_depth_filters times along d_model
  (channel c takes entry c mod the kernel's size), softmax-normalised over the window and used
  as the separable convolution's depthwise kernels. Kernel initializer: variance
  depthwise_filter_initializer_scale / filter size. x's channel dim must be named d_model.
  """

  def __init__(self, min_relative_pos: int, max_relative_pos: int, output_size: int,
               depthwise_filter_initializer_scale: float = 1.0,
               pointwise_filter_initializer_scale: float = 1.0, activation: str = "linear",
               num_unique_depth_filters: int = 1):
    """Creates the layer.

    Args:
      min_relative_pos: the first relative position of the window (<= 0 for decoding).
      max_relative_pos: the last relative position of the window.
      output_size: the output channels; num_unique_depth_filters must divide it.
      depthwise_filter_initializer_scale: scale of the kernels' initializer.
      pointwise_filter_initializer_scale: scale of the pointwise dense's initializer.
      activation: "linear" or the name of an mtf activation applied to the output.
      num_unique_depth_filters: how many times the kernel repeats along d_model.
    """
    super().__init__(min_relative_pos, max_relative_pos, output_size, depthwise_filter_initializer_scale,
                     pointwise_filter_initializer_scale, activation)
    if output_size % num_unique_depth_filters:
      raise ValueError(f"{type(self).__name__}: num_unique_depth_filters={num_unique_depth_filters} must "
                       f"divide output_size={output_size}.")
    self.num_unique_depth_filters = num_unique_depth_filters

  def get_kernel_wt(self, x: mtf.Tensor, repeated_kernel_dim, kernel_initializer, i: int, context,
                    variable_dtype, master_dtype=tf.float32, slice_dtype=tf.float32) -> mtf.Tensor:
    """The (unnormalised) kernel of relative position i, over repeated_kernel_dim (a list of one dim)."""
    raise NotImplementedError(f"{type(self).__name__}: use LightweightConv1DLocalAttn or "
                              f"DynamicConv1DLocalAttn, which define get_kernel_wt.")

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    depth_dim = x.shape.dims[-1]
    kernel_size = self.max_relative_pos - self.min_relative_pos + 1
    kernel_initializer = mtf.layers.VarianceScalingInitializer(
        scale=(self.depthwise_filter_initializer_scale or 1.0) / kernel_size)
    repeated_kernel_dim = [mtf.Dimension("repeated_kernel_dim",
                                         depth_dim.size // self.num_unique_depth_filters)]
    kernels = []
    for i in range(kernel_size):
      kernel = self.get_kernel_wt(x, repeated_kernel_dim=repeated_kernel_dim,
                                  kernel_initializer=kernel_initializer, i=i, context=context,
                                  variable_dtype=context.variable_dtype)
      tiled = mtf.concat([kernel] * self.num_unique_depth_filters, concat_dim_name="repeated_kernel_dim")
      kernels.append(mtf.rename_dimension(tiled, "repeated_kernel_dim", "d_model"))
    stacked = mtf.stack(kernels, "new_stack_dim")
    weights = mtf.unstack(mtf.softmax(stacked, reduced_dim=stacked.shape.dims[0]), stacked.shape.dims[0])
    return super().call(context, x, losses, all_kernel_wts=weights)


@gin.configurable(module=GIN_MODULE)
class LightweightConv1DLocalAttn(Conv1DLocalAttn):
  """Lightweight convolution (Wu et al. 2019): learned kernels `lightwt_depthwise_dense_<i>/kernel`.

  One variable per relative position i, over `repeated_kernel_dim`.
  """

  def get_kernel_wt(self, x: mtf.Tensor, repeated_kernel_dim, kernel_initializer, i: int, context,
                    variable_dtype, master_dtype=tf.float32, slice_dtype=tf.float32) -> mtf.Tensor:
    return mtf.layers.get_dense_kernel_weights(
        x, new_dims=[], reduced_dims=[], expert_dims=repeated_kernel_dim,
        kernel_initializer=kernel_initializer, name="lightwt_depthwise_dense_%d" % i,
        variable_dtype=context.variable_dtype, master_dtype=master_dtype, slice_dtype=slice_dtype)


@gin.configurable(module=GIN_MODULE)
class DynamicConv1DLocalAttn(Conv1DLocalAttn):
  """Dynamic convolution (Wu et al. 2019): per-position kernels predicted from the input.

  The kernel of relative position i at position t is a dense of x_t (with bias): variables
  `dyn_conv_depthwise_dense_<i>/{kernel,bias}` [d_model, repeated_kernel_dim].
  """

  def get_kernel_wt(self, x: mtf.Tensor, repeated_kernel_dim, kernel_initializer, i: int, context,
                    variable_dtype, master_dtype=tf.float32, slice_dtype=tf.float32) -> mtf.Tensor:
    return mtf.layers.dense(
        x, new_dims=repeated_kernel_dim, reduced_dims=[context.model.model_dim], expert_dims=[],
        kernel_initializer=kernel_initializer, name="dyn_conv_depthwise_dense_%d" % i,
        variable_dtype=context.variable_dtype, master_dtype=master_dtype, slice_dtype=slice_dtype)


ATTENTION_TYPES = {"lightweight_conv": LightweightConv1DLocalAttn, "dynamic_conv": DynamicConv1DLocalAttn}


@gin.configurable(module=GIN_MODULE)
class LocalConvAttnBlock(transformer.TransformerLayer):
  """Convolution block of Wu et al. 2019 (arXiv:1901.10430): GLU, conv attention, output projection.

  Variables: the GLU's `local_conv_inp_0` (linear) and `local_conv_inp_1` (sigmoid), the
  convolution's (`lightwt_depthwise_dense_<i>` or `dyn_conv_depthwise_dense_<i>`, and
  `separable_conv1d/...`) and the dense `local_conv_attn_op_projection`, all with biases. As in
  0.1.21 the convolution is built with one unique depth filter: num_unique_depth_filters is
  accepted but not passed on.
  """

  def __init__(self, min_relative_pos: int, max_relative_pos: int, output_size: int,
               depthwise_filter_initializer_scale: float = 1.0,
               pointwise_filter_initializer_scale: float = 1.0, activation: str = "linear",
               num_unique_depth_filters: int = 1, attention_type: str = "lightweight_conv"):
    """Creates the block.

    Args:
      min_relative_pos: the first relative position of the convolution window.
      max_relative_pos: the last relative position of the convolution window.
      output_size: the convolution's output channels (d_model, for the output projection).
      depthwise_filter_initializer_scale: scale of the convolution kernels' initializer.
      pointwise_filter_initializer_scale: scale of the pointwise dense's initializer.
      activation: activation of the convolution's output ("linear" for none).
      num_unique_depth_filters: accepted for 0.1.21's signature; not used (see above).
      attention_type: "lightweight_conv" or "dynamic_conv".
    """
    if attention_type not in ATTENTION_TYPES:
      raise ValueError(f"LocalConvAttnBlock: unknown attention_type {attention_type!r}; use one of "
                       f"{sorted(ATTENTION_TYPES)}.")
    self.num_unique_depth_filters = num_unique_depth_filters
    self.conv_local_attn_layer = ATTENTION_TYPES[attention_type](
        min_relative_pos, max_relative_pos, output_size, depthwise_filter_initializer_scale,
        pointwise_filter_initializer_scale, activation)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    model_dim = context.model.model_dim
    gated = mtf.layers.dense_product(x, reduced_dims=[model_dim], new_dims=[model_dim],
                                     activation_functions=["linear", "sigmoid"],
                                     variable_dtype=context.variable_dtype, name="local_conv_inp")
    attention_output = self.conv_local_attn_layer.call(context, gated, losses)
    return mtf.layers.dense(attention_output, reduced_dims=[model_dim], new_dims=[model_dim], activation=None,
                            variable_dtype=context.variable_dtype, name="local_conv_attn_op_projection")
