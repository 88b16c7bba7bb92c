"""Every audited layer makes the variables (names and shapes) 0.1.21 makes, so its checkpoints restore.

The expected lists are data taken from reading 0.1.21's code for each layer (d_model 8, batch 2,
length 4, built in variable scope "layer"); only the mtf graph is built, nothing is lowered.
"""

from __future__ import annotations

import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import evolved_transformer, fixup_layers, moe
from mesh_tensorflow.transformer import transformer_layers as tl
from tests.transformer.layer_context import call_layer, make_context, model_stub

D = 8


def _separable(prefix: str, depth: int, out: int, window: int, kernels: bool = True) -> list:
  scope = prefix + "separable_conv1d/"
  names = []
  for i in range(window):
    if kernels:
      names.append((scope + "depthwise_conv_hack/depthwise_dense_%d/kernel" % i, [depth]))
    if i == 0:
      names.append((scope + "depthwise_conv_hack/depthwise_dense_0/bias", [depth]))
  return names + [(scope + "pointwise_dense/kernel", [depth, out]), (scope + "pointwise_dense/bias", [out])]


def _attention(prefix: str, inner: int, shared_kv: bool = False, suffix: str = "") -> list:
  kv = [(prefix + "kv" + suffix, [D, inner])] if shared_kv else [
      (prefix + "k" + suffix, [D, inner]), (prefix + "v" + suffix, [D, inner])]
  return [(prefix + "q" + suffix, [D, inner])] + kv + [(prefix + "o" + suffix, [inner, D])]


def _layer_norm(prefix: str, size: int) -> list:
  scope = prefix + "layer_prepostprocess/layer_norm/"
  return [(scope + "layer_norm_scale", [size]), (scope + "layer_norm_bias", [size])]


TH = dict(key_heads_dims=[("heads", 2)], softmax_heads_dims=[("softmax_heads", 3)],
          value_heads_dims=[("value_heads", 2)], key_size=4, value_size=5)

# name: (layer factory, [(variable name, shape)] as 0.1.21 creates them)
ORIGINAL_VARIABLES = {
    "DenseReluDense": (lambda: tl.DenseReluDense(hidden_size=16),
                       [("layer/wi/kernel", [D, 16]), ("layer/wo/kernel", [16, D])]),
    "DenseReluDense_geglu_bias": (
        lambda: tl.DenseReluDense(hidden_size=16, activation=["gelu", "linear"], use_bias=True),
        [("layer/wi_0/kernel", [D, 16]), ("layer/wi_0/bias", [16]), ("layer/wi_1/kernel", [D, 16]),
         ("layer/wi_1/bias", [16]), ("layer/wo/kernel", [16, D]), ("layer/wo/bias", [D])]),
    "SelfAttention": (lambda: tl.SelfAttention(num_heads=2, key_value_size=4), _attention("layer/", 8)),
    "SelfAttention_bias": (
        lambda: tl.SelfAttention(num_heads=2, key_value_size=4, relative_attention_type="bias"),
        _attention("layer/", 8) + [("layer/relative_attention_bias", [2, 32])]),
    "SelfAttention_shared_kv_bias_shared": (
        lambda: tl.SelfAttention(num_heads=2, key_value_size=4, shared_kv=True,
                                 relative_attention_type="bias_shared"),
        _attention("layer/", 8, shared_kv=True) + [("layer/relative_attention_bias", [2, 32])]),
    "SelfAttention_contextual": (
        lambda: tl.SelfAttention(num_heads=2, key_value_size=4, relative_attention_type="contextual"),
        _attention("layer/", 8) + [("layer/relative_attention_ak/kernel", [2, 4, 32])]),
    "SelfAttention_hybrid": (lambda: tl.SelfAttention(num_heads=2, key_value_size=4, attention_func="hybrid"),
                             _attention("layer/", 8) + [("layer/doubly_coeff", [])]),
    "EncDecAttention": (lambda: tl.EncDecAttention(num_heads=2, key_value_size=4), _attention("layer/", 8)),
    "LocalSelfAttention": (lambda: tl.LocalSelfAttention(radius=2, num_heads=2, key_value_size=4),
                           _attention("layer/", 8)),
    "TalkingHeadsSelfAttention": (
        lambda: tl.TalkingHeadsSelfAttention(dynamic_projections=["x2l", "m2l", "m2w"], **TH),
        [("layer/q/kernel", [D, 2, 4]), ("layer/k/kernel", [D, 2, 4]), ("layer/v/kernel", [D, 2, 5]),
         ("layer/logits/kernel", [2, 3]), ("layer/logits_dynamic_0/kernel", [D, 2, 3]),
         ("layer/logits_dynamic_1/kernel", [D, 2, 3]), ("layer/weights/kernel", [3, 2]),
         ("layer/weights_dynamic_0/kernel", [D, 3, 2]), ("layer/y/kernel", [2, 5, D])]),
    "TalkingHeadsEncDecAttention": (
        lambda: tl.TalkingHeadsEncDecAttention(**TH),
        [("layer/q/kernel", [D, 2, 4]), ("layer/k/kernel", [D, 2, 4]), ("layer/v/kernel", [D, 2, 5]),
         ("layer/logits/kernel", [2, 3]), ("layer/weights/kernel", [3, 2]), ("layer/y/kernel", [2, 5, D])]),
    "GeneralBilinearSelfAttention": (lambda: tl.GeneralBilinearSelfAttention(heads_dims=[("heads", 2)]),
                                     [("layer/q/kernel", [D, 2, D]), ("layer/y/kernel", [2, D, D])]),
    "GeneralBilinearEncDecAttention": (lambda: tl.GeneralBilinearEncDecAttention(heads_dims=[("heads", 2)]),
                                       [("layer/q/kernel", [D, 2, D]), ("layer/y/kernel", [2, D, D])]),
    "BranchedSelfAttention": (
        lambda: tl.BranchedSelfAttention(num_heads=2, key_value_size=4),
        [("layer/q", [D, 2, 4]), ("layer/k", [D, 2, 4]), ("layer/v", [D, 2, 4]), ("layer/o", [4, D]),
         ("layer/kappa", [2]), ("layer/wi/kernel", [D, 4096]), ("layer/wo/kernel", [4096, D]),
         ("layer/alpha", [2])]),
    "Conv1DLayer": (lambda: tl.Conv1DLayer(3, 6), [("layer/conv2d/kernel", [1, 3, D, 6])]),
    "SeparableConv1DLayer": (lambda: tl.SeparableConv1DLayer(-2, 0, 6), _separable("layer/", D, 6, 3)),
    "LightweightConv1DLocalAttn": (
        lambda: tl.LightweightConv1DLocalAttn(-1, 0, D, num_unique_depth_filters=2),
        [("layer/lightwt_depthwise_dense_0/kernel", [4]), ("layer/lightwt_depthwise_dense_1/kernel", [4])]
        + _separable("layer/", D, D, 2, kernels=False)),
    "DynamicConv1DLocalAttn": (
        lambda: tl.DynamicConv1DLocalAttn(-1, 0, D),
        [("layer/dyn_conv_depthwise_dense_0/kernel", [D, D]), ("layer/dyn_conv_depthwise_dense_0/bias", [D]),
         ("layer/dyn_conv_depthwise_dense_1/kernel", [D, D]), ("layer/dyn_conv_depthwise_dense_1/bias", [D])]
        + _separable("layer/", D, D, 2, kernels=False)),
    "LocalConvAttnBlock": (
        lambda: tl.LocalConvAttnBlock(-1, 0, D),
        [("layer/local_conv_inp_0/kernel", [D, D]), ("layer/local_conv_inp_0/bias", [D]),
         ("layer/local_conv_inp_1/kernel", [D, D]), ("layer/local_conv_inp_1/bias", [D]),
         ("layer/lightwt_depthwise_dense_0/kernel", [D]), ("layer/lightwt_depthwise_dense_1/kernel", [D])]
        + _separable("layer/", D, D, 2, kernels=False)
        + [("layer/local_conv_attn_op_projection/kernel", [D, D]),
           ("layer/local_conv_attn_op_projection/bias", [D])]),
    "ParallelLayer": (
        lambda: tl.ParallelLayer(),
        [("layer/parallel_layer_0/wi/kernel", [D, 4096]), ("layer/parallel_layer_0/wo/kernel", [4096, D])]
        + _attention("layer/parallel_layer_1/", 1024)),
    "MoE1D": (lambda: moe.MoE1D(num_experts=2, hidden_size=16, group_size=8),
              [("layer/top_2_gating/kernel", [D, 2]), ("layer/wi/kernel", [2, D, 16]),
               ("layer/wo/kernel", [2, 16, D])]),
    "MoE2D": (lambda: moe.MoE2D(expert_x=2, expert_y=3, hidden_size=16, group_size=8),
              [("layer/outer_gating/kernel", [D, 2]), ("layer/inner_gating/kernel", [2, D, 3]),
               ("layer/wi/kernel", [3, 2, D, 16]), ("layer/wo/kernel", [3, 2, 16, D])]),
    "GatedLinearUnitLayer": (
        evolved_transformer.GatedLinearUnitLayer,
        [("layer/glu_0/kernel", [D, D]), ("layer/glu_0/bias", [D]), ("layer/glu_1/kernel", [D, D]),
         ("layer/glu_1/bias", [D])]),
    "EncoderConvolutionalLayer": (
        lambda: evolved_transformer.EncoderConvolutionalLayer(D, 0.0),
        [("layer/conv1x1/dense/kernel", [D, 4 * D]), ("layer/conv3x1/conv2d/kernel", [1, 3, D, D // 2])]
        + _layer_norm("layer/", 4 * D) + _separable("layer/sep_conv9x1/", 4 * D, D // 2, 9)),
    "DecoderConvolutionalLayer": (
        lambda: evolved_transformer.DecoderConvolutionalLayer(D, 0.0),
        _separable("layer/sep_conv11x1/", D, 2 * D, 11) + _separable("layer/sep_conv7x1_1/", D, D // 2, 7)
        + _layer_norm("layer/", 2 * D) + _separable("layer/sep_conv7x1_2/", 2 * D, D, 7)),
    "DecoderAttentionLayer": (
        lambda: evolved_transformer.DecoderAttentionLayer(base_num_heads=1),
        _attention("layer/self_attention/", 2 * 128) + _attention("layer/enc_dec_attention/", 128)),
    "DenseReluDenseFixup": (
        lambda: fixup_layers.DenseReluDenseFixup(hidden_size=16, num_blocks=4),
        [("layer/wi/kernel", [D, 16]), ("layer/shift", [1]), ("layer/wo/kernel", [16, D])]),
    "SelfAttentionFixup": (
        lambda: fixup_layers.SelfAttentionFixup(num_blocks=4, num_heads=2, key_value_size=4,
                                                fold_scaling_into_initializer=False),
        _attention("layer/", 8, suffix="_fixup")),
    "EncDecAttentionFixup": (lambda: fixup_layers.EncDecAttentionFixup(num_heads=2, key_value_size=4),
                             _attention("layer/", 8)),
    "Synthesizer": (lambda: tl.Synthesizer(num_heads=2, key_value_size=4),
                    _attention("layer/", 8) + [("layer/R", [512, 2, 512]), ("layer/alpha", [1])]),
    "Synthesizer_random": (lambda: tl.Synthesizer(num_heads=2, key_value_size=4, synthesize_mode="random"),
                           [("layer/kv", [D, 8]), ("layer/o", [8, D]), ("layer/R", [512, 2, 512])]),
    "ExpertsEncDecAttention_kv": (
        lambda: tl.ExpertsEncDecAttention(num_heads=2, key_value_size=4, num_experts=2, hidden_size=16,
                                          group_size=8, expert_computation="kv"),
        [("layer/q", [D, 8]), ("layer/o", [8, D]), ("layer/switch_gating/kernel", [D, 2]),
         ("layer/wi/kernel", [2, D, 16]), ("layer/wo/kernel", [2, 16, 8])]),
}


@pytest.mark.parametrize("name", sorted(ORIGINAL_VARIABLES))
def test_layer_makes_the_original_variables(name):
  make_layer, expected = ORIGINAL_VARIABLES[name]
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    x = mtf.zeros(mesh, f"batch:2;length:4;d_model:{D}")
    encoder_output = mtf.zeros(mesh, f"batch:2;memory_length:4;d_model:{D}")
    inputs = mtf.ones(mesh, "batch:2;length:4", dtype=tf.int32)  # the convolutions' padding mask
    context = make_context(x, model_stub(D), encoder_output=encoder_output, inputs=inputs)
    call_layer(make_layer(), context, x)
    actual = [(v.name, v.shape.to_integer_list) for v in graph.all_variables]
  assert sorted(actual) == sorted(expected)
