"""Funnel-Transformer (arXiv:2006.03236): an encoder whose sequence is pooled between blocks.

The stack runs n_blocks blocks; block b has block_param_size[b] layers with distinct weights,
each applied block_repeat_size[b] times (weights shared across repeats). After every block but
the last, the length dimension is pooled by pooling_size (mean or max) and the context's
length_dim, sequence_id and position follow, so later layers and an attending decoder see the
shorter sequence. Unlike the paper, pooling happens after a block, not inside its first layer's
query.
"""

from __future__ import annotations

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer

GIN_MODULE = "mesh_tensorflow.transformer.funnel_transformer"
_POOL_FNS = {"mean": mtf.reduce_mean, "max": mtf.reduce_max}


@gin.configurable(module=GIN_MODULE)
class FunnelTransformerLayerStack(transformer.LayerStack):
  """A LayerStack that pools the length dimension between blocks.

  Args:
    layers: TransformerLayers, n_submodules per layer (e.g. [SelfAttention, DenseReluDense]):
      layer k of the stack uses entries [k * n_submodules, (k + 1) * n_submodules), cycling
      through the list when it is shorter than the number of distinct layers.
    n_blocks: number of blocks.
    block_param_size: per block, the number of layers with distinct weights.
    block_repeat_size: per block, how many times each of those layers is applied.
    pooling_size: the length is divided by this after each block but the last.
    sublayers_initial / sublayers_per_layer / sublayers_final: as in LayerStack.
    pooling_type: "mean" or "max".
    n_submodules: TransformerLayers per layer.
  Variables of submodule s of distinct layer p of block b live in
  `funnel_block_{b:03d}/param_idx_{p:03d}/submodule_{s:03d}/<LayerClass>/...`.
  Raises ValueError on inconsistent sizes or an unknown pooling_type.
  """

  def __init__(self, layers, n_blocks=gin.REQUIRED, block_param_size=gin.REQUIRED,
               block_repeat_size=gin.REQUIRED, pooling_size=2, sublayers_initial=None,
               sublayers_per_layer=None, sublayers_final=None, pooling_type="mean", n_submodules=2):
    if len(block_param_size) != n_blocks or len(block_repeat_size) != n_blocks:
      raise ValueError(f"FunnelTransformerLayerStack: block_param_size={list(block_param_size)} and "
                       f"block_repeat_size={list(block_repeat_size)} need one entry per block "
                       f"(n_blocks={n_blocks}).")
    if pooling_type not in _POOL_FNS:
      raise ValueError(f"FunnelTransformerLayerStack: pooling_type={pooling_type!r} is not one of "
                       f"{sorted(_POOL_FNS)}.")
    if not layers or len(layers) % n_submodules:
      raise ValueError(f"FunnelTransformerLayerStack: {len(layers)} layers is not a positive multiple of "
                       f"n_submodules={n_submodules}.")
    super().__init__(layers, sublayers_initial=sublayers_initial, sublayers_per_layer=sublayers_per_layer,
                     sublayers_final=sublayers_final)
    self.n_blocks = n_blocks
    self.block_param_size = list(block_param_size)
    self.block_repeat_size = list(block_repeat_size)
    self.pooling_size = pooling_size
    self.pooling_type = pooling_type
    self.n_submodules = n_submodules
    self._context = None

  @property
  def pool_fn(self):
    return _POOL_FNS[self.pooling_type]

  def _check_length(self, context) -> None:
    divisor = self.pooling_size ** (self.n_blocks - 1)
    if context.length_dim.size % divisor:
      raise ValueError(f"FunnelTransformerLayerStack: {context.length_dim} must be a multiple of "
                       f"pooling_size ** (n_blocks - 1) = {divisor}; pad the inputs or change the sizes.")

  def call(self, context, x: mtf.Tensor) -> mtf.Tensor:
    """The blocks, pooling x and updating the context between them; returns the pooled x."""
    self._check_length(context)
    x = self._call_sublayers(self._sublayers_initial, x, context)
    context.layer_outputs.append(x)
    param_index = 0  # distinct layers so far
    calls_left = sum(p * r for p, r in zip(self.block_param_size, self.block_repeat_size)) * self.n_submodules
    for block_idx in range(self.n_blocks):
      for param_idx in range(self.block_param_size[block_idx]):
        for repeat_idx in range(self.block_repeat_size[block_idx]):
          for submodule_idx in range(self.n_submodules):
            layer = self._layers[(param_index * self.n_submodules + submodule_idx) % len(self._layers)]
            # The scope names the distinct weights: repeats of a layer reuse them.
            layer.set_name(f"funnel_block_{block_idx:03d}/param_idx_{param_idx:03d}/"
                           f"submodule_{submodule_idx:03d}")
            with tf.variable_scope(layer.name):
              x = self.layer_fn(x, layer, context)
            if (block_idx < self.n_blocks - 1 and param_idx == self.block_param_size[block_idx] - 1
                and repeat_idx == self.block_repeat_size[block_idx] - 1
                and submodule_idx == self.n_submodules - 1):
              x = mtf.pool_tensor_1d(x, pool_dim=context.length_dim, reduce_fn=self.pool_fn,
                                     pool_size=self.pooling_size)
              self.update_context(context, x, pool_dim_name=context.length_dim.name)
            calls_left -= 1
            if calls_left:
              context.layer_outputs.append(x)
            context.layer_index += 1
        param_index += 1
    x = self._call_sublayers(self._sublayers_final, x, context)
    x = transformer.sublayer_mask_padding(x, self, context)
    context.layer_outputs.append(x)
    self.set_context(context)
    return x

  def update_context(self, context, x: mtf.Tensor, pool_dim_name: str) -> None:
    """Points the context at x's pooled length dim and pools sequence_id and position to match.

    A pooled position is in segment max(segment ids of its window) (so it is padding only if
    the whole window is) and at position min(window positions) // pooling_size.
    """
    old_length_dim = context.length_dim
    new_length_dim = x.shape.get_dim_by_name(pool_dim_name)
    if isinstance(context.sequence_id, mtf.Tensor):
      context.sequence_id = mtf.pool_tensor_1d(context.sequence_id, pool_dim=old_length_dim,
                                               reduce_fn=mtf.reduce_max, pool_size=self.pooling_size)
    if context.position_is_default or not isinstance(context.position, mtf.Tensor):
      context.position = mtf.range(context.mesh, new_length_dim, dtype=tf.int32)
    else:
      first = mtf.pool_tensor_1d(context.position, pool_dim=old_length_dim, reduce_fn=mtf.reduce_min,
                                 pool_size=self.pooling_size)
      context.position = mtf.floordiv(first, self.pooling_size)
    context.length_dim = new_length_dim

  def set_context(self, context) -> None:
    """Keeps the context of the last call (its pooled sequence_id is the encoder's for a decoder)."""
    self._context = context

  @property
  def context(self):
    return self._context


@gin.configurable(module=GIN_MODULE)
class BitransformerFunnel(transformer.Bitransformer):
  """A Bitransformer whose encoder stack is a FunnelTransformerLayerStack.

  The decoder attends to the pooled encoder output, masked with the pooled encoder sequence_id
  (from the stack's context after the encoder call).
  """

  def _encode(self, inputs, mode, variable_dtype, encoder_sequence_id, encoder_position, shared_params,
              encoder_layer_outputs, compute_loss, num_microbatches):
    layer_stack = self.encoder.layer_stack
    if not isinstance(layer_stack, FunnelTransformerLayerStack):
      raise ValueError(f"BitransformerFunnel: the encoder's layer_stack is a {type(layer_stack).__name__}; "
                       f"use a FunnelTransformerLayerStack (e.g. encoder/make_layer_stack.layer_stack_cls).")
    encoder_output, _, encoder_loss = super()._encode(
        inputs, mode, variable_dtype, encoder_sequence_id, encoder_position, shared_params,
        encoder_layer_outputs, compute_loss, num_microbatches)
    pooled_sequence_id = layer_stack.context.sequence_id
    return encoder_output, mtf.layers.rename_length_to_memory_length(pooled_sequence_id), encoder_loss

  @gin.configurable(module="BitransformerFunnel")
  def decode(self, inputs, variable_dtype=mtf.VariableDType(tf.float32), beam_size=1, alpha=0.6,
             temperature=0.0, sampling_keep_top_k=-1, decode_length_multiplier=1.5, decode_length_constant=10,
             max_decode_length=None):
    """Bitransformer.decode with the pooled encoder (gin: `BitransformerFunnel.decode.*`)."""
    return super().decode(
        inputs, variable_dtype=variable_dtype, beam_size=beam_size, alpha=alpha, temperature=temperature,
        sampling_keep_top_k=sampling_keep_top_k, decode_length_multiplier=decode_length_multiplier,
        decode_length_constant=decode_length_constant, max_decode_length=max_decode_length)
