"""Layers for `transformer.LayerStack`: feed-forward, attention variants and convolutions.

Every layer is gin-configurable as `transformer_layers.<Name>` (module
`mesh_tensorflow.transformer.transformer_layers`) and has `call(context, x, losses=None)`
returning a tensor shaped like x. The feed-forward, attention and convolution families live in
private modules and are re-exported here; their variable names are a checkpoint contract.
"""

from __future__ import annotations

import contextlib

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer
from mesh_tensorflow.transformer._attention_layers import (
    GIN_MODULE, _relative_position_bucket as _relative_position_bucket,
    attention_params as attention_params, SelfAttention as SelfAttention,
    EncDecAttention as EncDecAttention, LocalSelfAttention as LocalSelfAttention,
    enc_dec_attention as enc_dec_attention, enc_dec_attention_bias as enc_dec_attention_bias,
    relative_position_spans as relative_position_spans)
from mesh_tensorflow.transformer._attention_variants import (
    ExpertsSelfAttention as ExpertsSelfAttention, ExpertsEncDecAttention as ExpertsEncDecAttention,
    Synthesizer as Synthesizer, TransparentEncDecAttention as TransparentEncDecAttention,
    BranchedSelfAttention as BranchedSelfAttention, BranchedEncDecAttention as BranchedEncDecAttention)
from mesh_tensorflow.transformer._talking_heads_layers import (
    TalkingHeadsSelfAttention as TalkingHeadsSelfAttention,
    TalkingHeadsEncDecAttention as TalkingHeadsEncDecAttention,
    GeneralBilinearSelfAttention as GeneralBilinearSelfAttention,
    GeneralBilinearEncDecAttention as GeneralBilinearEncDecAttention)
from mesh_tensorflow.transformer._feed_forward import DenseReluDense as DenseReluDense
from mesh_tensorflow.transformer._conv_layers import (
    Conv1D as Conv1D, Conv1DLayer as Conv1DLayer, SeparableConv1DLayer as SeparableConv1DLayer,
    Conv1DLocalAttn as Conv1DLocalAttn, LightweightConv1DLocalAttn as LightweightConv1DLocalAttn,
    DynamicConv1DLocalAttn as DynamicConv1DLocalAttn, LocalConvAttnBlock as LocalConvAttnBlock)


@gin.configurable(module=GIN_MODULE)
class ParallelLayer(transformer.TransformerLayer):
  """Several layers applied to the same input, outputs summed.

  Each layer runs in variable scope `parallel_layer_<i>` (unless use_scope is False).
  """

  def __init__(self, layer_classes=(DenseReluDense, SelfAttention), use_scope: bool = True):
    self.layer_classes = [cls() for cls in layer_classes]
    self.use_scope = use_scope

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    outputs = []
    for i, layer in enumerate(self.layer_classes):
      scope = tf.variable_scope("parallel_layer_%d" % i) if self.use_scope else contextlib.nullcontext()
      with scope:
        outputs.append(layer.call(context, x, losses=losses))
    return mtf.add_n(outputs)
