"""`mtf.layers`: neural-network layers built from mtf ops (a facade over `mesh_tensorflow._layers`).

Dense layers obtain their kernels through `get_dense_kernel_weights` at call time, and setting
`mtf.layers.get_dense_kernel_weights` (as 0.1.21's tests do with mock.patch.object) sets it in
`_layers.dense` too, so a patch here affects every layer built on `dense`.
"""

import sys
import types

from mesh_tensorflow._layers import dense as _dense
from mesh_tensorflow._layers.dense import (
    unit_scaling_convention as unit_scaling_convention, us_einsum as us_einsum,
    DenseInitializer as DenseInitializer, VarianceScalingInitializer as VarianceScalingInitializer,
    dense as dense, get_dense_kernel_weights as get_dense_kernel_weights, dense_product as dense_product,
    dense_relu_dense as dense_relu_dense)
from mesh_tensorflow._layers.norm import (
    layer_norm as layer_norm, batch_norm as batch_norm, corr as corr)
from mesh_tensorflow._layers.losses import (
    softmax_cross_entropy_with_logits as softmax_cross_entropy_with_logits,
    sigmoid_cross_entropy_with_logits as sigmoid_cross_entropy_with_logits,
    weights_nonzero as weights_nonzero)
from mesh_tensorflow._layers.embedding import (
    embedding_weights as embedding_weights, embedding as embedding)
from mesh_tensorflow._layers.attention import (
    dot_product_attention as dot_product_attention, multihead_attention_vars as multihead_attention_vars,
    multihead_attention_params as multihead_attention_params, multihead_attention as multihead_attention,
    multihead_self_attention_incremental as multihead_self_attention_incremental,
    multihead_encdec_attention_incremental as multihead_encdec_attention_incremental,
    masked_local_attention_1d as masked_local_attention_1d,
    masked_local_attention_1d_incremental as masked_local_attention_1d_incremental,
    local_self_attention_spatial_blocks as local_self_attention_spatial_blocks,
    local_2d_self_attention_spatial_blocks as local_2d_self_attention_spatial_blocks,
    local_1d_halo_exchange as local_1d_halo_exchange, local_2d_halo_exchange as local_2d_halo_exchange,
    multihead_self_attention_memory_compressed as multihead_self_attention_memory_compressed,
    compress_mean as compress_mean, attention_mask_ignore_padding as attention_mask_ignore_padding,
    attention_mask_autoregressive as attention_mask_autoregressive,
    attention_mask_same_segment as attention_mask_same_segment,
    attention_bias_local_block as attention_bias_local_block,
    attention_bias_local_2d_block as attention_bias_local_2d_block,
    rename_length_to_memory_length as rename_length_to_memory_length)
from mesh_tensorflow._layers.conv import (
    conv1d as conv1d, separable_conv1d as separable_conv1d, conv2d as conv2d,
    conv2d_with_blocks as conv2d_with_blocks, conv2d_transpose as conv2d_transpose,
    conv2d_transpose_with_blocks as conv2d_transpose_with_blocks, conv3d as conv3d,
    conv3d_with_blocks as conv3d_with_blocks, conv3d_transpose as conv3d_transpose,
    conv3d_transpose_with_blocks as conv3d_transpose_with_blocks)
from mesh_tensorflow._layers.pool import (
    max_pool2d as max_pool2d, max_pool3d as max_pool3d, avg_pool2d as avg_pool2d, avg_pool3d as avg_pool3d)
from mesh_tensorflow._layers.misc import (
    multiplicative_jitter as multiplicative_jitter,
    reversible_half_residual_and_swap as reversible_half_residual_and_swap,
    clip_activation_gradient as clip_activation_gradient,
    summary_for_clip_activation_gradient as summary_for_clip_activation_gradient,
    annealed_dropout as annealed_dropout)


# Names that `_layers.dense` looks up in its own module at call time.
_SHARED_WITH_DENSE = frozenset({"get_dense_kernel_weights"})


class _LayersModule(types.ModuleType):
  """This module's type: setting a name it shares with `_layers.dense` sets it there as well.

  The dependency points down (the facade writes into the layer module), and a patch of the public
  name reaches the dense layers without them importing this facade.
  """

  def __setattr__(self, name, value):
    super().__setattr__(name, value)
    if name in _SHARED_WITH_DENSE:
      setattr(_dense, name, value)


sys.modules[__name__].__class__ = _LayersModule
