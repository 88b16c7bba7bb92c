"""Our side's model: the gin configuration parsed, the Bitransformer built, checked and described.

The model is built by the package itself from the configuration (so gin macros, scopes and
references mean what they mean to utils.run), then every part Hugging Face's T5 cannot express is
refused naming the gin option that chose it. `variables` lists the checkpoint variables the model
has, from its mtf graph (nothing is lowered or allocated).
"""

from __future__ import annotations

import re
from typing import Sequence

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer
from mesh_tensorflow.transformer import transformer_layers as tl
from mesh_tensorflow.transformer._embedding import VocabEmbedding, get_vocab_embedding_cls
from mesh_tensorflow.transformer._layer_stack import (
    LayerStack, sublayer_call_layer, sublayer_dropout, sublayer_legacy_dropout,
    sublayer_legacy_final_rms_norm, sublayer_legacy_rms_norm, sublayer_residual, sublayer_rms_norm)
from mesh_tensorflow.transformer.convert.errors import ConversionError
from mesh_tensorflow.transformer.convert.spec import ACTIVATIONS, T5Spec

ENCODER_BLOCK = (tl.SelfAttention, tl.DenseReluDense)
DECODER_BLOCK = (tl.SelfAttention, tl.EncDecAttention, tl.DenseReluDense)
# The pre-norm residual block of T5 (the default sublayers, or the legacy ones LayerStack builds).
_PER_LAYER = ([sublayer_rms_norm, sublayer_call_layer, sublayer_dropout, sublayer_residual],
              [sublayer_legacy_rms_norm, sublayer_call_layer, sublayer_legacy_dropout, sublayer_residual])
_INITIAL = ([sublayer_dropout], [sublayer_legacy_dropout])
_FINAL = ([sublayer_rms_norm, sublayer_dropout], [sublayer_legacy_final_rms_norm, sublayer_legacy_dropout])
# Attention options Hugging Face's T5Attention has no counterpart for, with the value it has.
_ATTENTION_DEFAULTS = {"num_memory_heads": 0, "shared_kv": False, "attention_func": None,
                       "combine_dims": True, "keep_query_heads_dims": False, "use_hyperprompt": False,
                       "hyperprompt_length_encoder": None, "hyperprompt_length_decoder": None,
                       "attention_kwargs": {}}
# What building the model needs that a T5 configuration may leave unbound (T5 has no position table).
_BUILD_DEFAULTS = ["Unitransformer.max_length = 512"]


def parse_config(gin_files: Sequence[str], gin_bindings: Sequence[str] = ()) -> None:
  """Clears gin and parses the files and bindings; configurables this package lacks are skipped.

  `import` lines (T5's operative configs import its own modules) are dropped: only the model's
  bindings matter here, and those name this package's configurables.
  """
  gin.clear_config()
  texts = list(_BUILD_DEFAULTS)
  for path in gin_files:
    with tf.io.gfile.GFile(path) as f:
      texts.append(re.sub(r"(?m)^\s*(import|from)\s.*$", "", f.read()))
  try:
    with gin.unlock_config():
      gin.parse_config("\n".join(texts + list(gin_bindings)), skip_unknown=True)
  except (ValueError, SyntaxError) as e:
    raise ConversionError(f"gin configuration {list(gin_files)}: {str(e).splitlines()[0]}") from None


def _bound(name: str, default):
  """gin's binding of `name` (a `configurable.parameter`), or `default` where it has none."""
  try:
    return gin.query_parameter(name)
  except ValueError:
    return default


def build_model(vocab_size: int) -> transformer.Bitransformer:
  """The configured Bitransformer, refused if utils.run.model_type says another model."""
  model_type = _bound("utils.run.model_type", "bitransformer")
  if model_type != "bitransformer":
    raise ConversionError(f"utils.run.model_type = {model_type!r}: Hugging Face's T5ForConditionalGeneration "
                          f"is an encoder-decoder; only model_type 'bitransformer' converts.")
  try:
    model = transformer.make_bitransformer(input_vocab_size=vocab_size, output_vocab_size=vocab_size)
  except RuntimeError as e:  # gin: a required binding is missing
    first_line = str(e).splitlines()[0]
    raise ConversionError(f"the gin configuration does not build the model: {first_line}") from None
  if type(model) is not transformer.Bitransformer:
    raise ConversionError(f"make_bitransformer.bitransformer_cls = {type(model).__name__}: only "
                          "Bitransformer converts.")
  return model


def variables(model: transformer.Bitransformer) -> dict:
  """{checkpoint name: shape} of the model's variables, from its mtf graph (float32 masters)."""
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "convert")
    batch, length = mtf.Dimension("batch", 1), mtf.Dimension("length", 1)
    ids = mtf.constant(mesh, 1, mtf.Shape([batch, length]), dtype=tf.int32)
    model.call_simple(inputs=ids, targets=ids, compute_loss=False, mode="eval")
    return {v.name: [d.size for d in v.shape.dims] for v in graph.all_variables}


def _layer_option(layer, scope: str, option: str) -> str:
  return f"{scope}/{type(layer).__name__}.{option}"


def _check_attention(layer, scope: str, self_attention: bool) -> None:
  for option, value in _ATTENTION_DEFAULTS.items():
    if getattr(layer, option) != value:
      raise ConversionError(f"{_layer_option(layer, scope, option)} = {getattr(layer, option)!r} (layer "
                            f"{layer.name}): Hugging Face's T5 attention has no such option (it needs "
                            f"{value!r}).")
  allowed = (None, "bias_shared") if self_attention else (None,)
  if layer.relative_attention_type not in allowed:
    raise ConversionError(
        f"{_layer_option(layer, scope, 'relative_attention_type')} = {layer.relative_attention_type!r} "
        f"(layer {layer.name}): Hugging Face's T5 has one relative position bias per stack in its first "
        f"self-attention layer; use {' or '.join(repr(a) for a in allowed)}.")


def _check_feed_forward(layer, scope: str) -> None:
  activation = layer.activation if isinstance(layer.activation, str) else tuple(layer.activation)
  if activation not in ACTIVATIONS:
    raise ConversionError(f"{_layer_option(layer, scope, 'activation')} = {layer.activation!r}: Hugging "
                          f"Face's T5 feed_forward_proj expresses only {sorted(map(str, ACTIVATIONS))}.")
  if layer.use_bias:
    raise ConversionError(f"{_layer_option(layer, scope, 'use_bias')} = True: Hugging Face's T5 dense layers "
                          f"have no biases.")


def _uniform(values: list, option: str):
  """The one value all layers give `option`; Hugging Face's config has one for the whole model."""
  if len(set(map(repr, values))) != 1:
    raise ConversionError(f"{option} differs between layers ({sorted(set(map(repr, values)))}): Hugging "
                          "Face's T5 config has one value for every layer.")
  return values[0]


def _check_stack(unitransformer, scope: str, block: tuple) -> list:
  """The stack's layers, checked to be T5 blocks (`block` repeated) in T5's pre-norm residual form."""
  stack = unitransformer.layer_stack
  if type(stack) is not LayerStack:
    raise ConversionError(f"{scope}/make_layer_stack.layer_stack_cls = {type(stack).__name__}: only "
                          "LayerStack converts (Hugging Face's T5 blocks are plain residual stacks).")
  layers = stack.layers
  names = "[" + ", ".join(c.__name__ for c in block) + "]"
  for i, layer in enumerate(layers):
    if type(layer) is not block[i % len(block)]:
      raise ConversionError(f"{scope}/make_layer_stack.layers: layer {layer.name} is {type(layer).__name__}; "
                            f"Hugging Face's T5 {scope} repeats {names} and has no other layer type.")
  if not layers or len(layers) % len(block):
    raise ConversionError(f"{scope}/make_layer_stack.layers: {len(layers)} layers do not make whole "
                          f"{names} blocks.")
  for option, sublayers, forms in (("sublayers_initial", stack._sublayers_initial, _INITIAL),
                                   ("sublayers_per_layer", stack._sublayers_per_layer, _PER_LAYER),
                                   ("sublayers_final", stack._sublayers_final, _FINAL)):
    if sublayers not in forms:
      raise ConversionError(f"{scope}/LayerStack.{option} = {[s.__name__ for s in sublayers]}: Hugging "
                            f"Face's T5 is the pre-norm residual block {[s.__name__ for s in forms[0]]}.")
  for i, layer in enumerate(layers):
    kind = block[i % len(block)]
    if kind is tl.DenseReluDense:
      _check_feed_forward(layer, scope)
    else:
      _check_attention(layer, scope, self_attention=kind is tl.SelfAttention)
  return layers


def _check_unitransformer(unitransformer, scope: str) -> None:
  if unitransformer.positional_embedding:
    raise ConversionError(f"{scope}/Unitransformer.positional_embedding = True: Hugging Face's T5 has no "
                          "absolute position embedding (set it False; T5 uses relative attention).")
  if unitransformer.ensemble_dim is not None:
    raise ConversionError(f"{scope}/Unitransformer.ensemble = {unitransformer.ensemble_dim.size}: an "
                          "ensemble has no Hugging Face T5 form.")
  if unitransformer.input_full_attention:
    raise ConversionError(f"{scope}/Unitransformer.input_full_attention = True has no Hugging Face T5 form.")


def _norm_epsilon(stack: LayerStack) -> float:
  if stack.norm_epsilon is not None:
    return stack.norm_epsilon
  return _bound("sublayer_rms_norm.epsilon", 1e-6)


def spec(model: transformer.Bitransformer, vocab_size: int) -> T5Spec:
  """The T5Spec of a configured Bitransformer, or ConversionError naming what HF T5 cannot express."""
  if not model.shared_embedding:
    raise ConversionError("Bitransformer.shared_embedding = False: Hugging Face's T5 has one embedding table "
                          "for encoder and decoder.")
  if get_vocab_embedding_cls() is not VocabEmbedding:
    raise ConversionError(f"get_vocab_embedding_cls.cls = {get_vocab_embedding_cls().__name__}: only "
                          f"VocabEmbedding converts.")
  if _bound("VocabEmbedding.scale_variable_like_classifier_weights", False):
    raise ConversionError("VocabEmbedding.scale_variable_like_classifier_weights = True scales embeddings by "
                          "d_model**0.5, which Hugging Face's T5 does not.")
  encoder, decoder = model.encoder, model.decoder
  _check_unitransformer(encoder, "encoder")
  _check_unitransformer(decoder, "decoder")
  if encoder.model_dim != decoder.model_dim:
    raise ConversionError(f"d_model differs: encoder {encoder.model_dim.size}, decoder "
                          f"{decoder.model_dim.size} (encoder/ and decoder/Unitransformer.d_model); Hugging "
                          "Face's T5 has one d_model.")
  encoder_layers = _check_stack(encoder, "encoder", ENCODER_BLOCK)
  decoder_layers = _check_stack(decoder, "decoder", DECODER_BLOCK)
  layers = encoder_layers + decoder_layers
  attention = [layer for layer in layers if not isinstance(layer, tl.DenseReluDense)]
  feed_forward = [layer for layer in layers if isinstance(layer, tl.DenseReluDense)]
  self_attention = [layer for layer in attention if type(layer) is tl.SelfAttention]
  activation = _uniform([a if isinstance(a, str) else tuple(a) for a in (f.activation for f in feed_forward)],
                        "DenseReluDense.activation")
  relative = _uniform([layer.relative_attention_type for layer in self_attention],
                      "SelfAttention.relative_attention_type")
  return T5Spec(
      vocab_size=vocab_size, d_model=encoder.model_dim.size,
      d_kv=_uniform([layer.key_value_size for layer in attention], "key_value_size"),
      d_ff=_uniform([layer.hidden_size for layer in feed_forward], "DenseReluDense.hidden_size"),
      num_heads=_uniform([layer.num_heads for layer in attention], "num_heads"),
      num_layers=len(encoder_layers) // len(ENCODER_BLOCK),
      num_decoder_layers=len(decoder_layers) // len(DECODER_BLOCK), activation=activation,
      tied_logits=decoder.shared_embedding_and_softmax_weights,
      layer_norm_epsilon=_uniform([_norm_epsilon(encoder.layer_stack), _norm_epsilon(decoder.layer_stack)],
                                  "the rms norm epsilon"),
      relative_bias=relative is not None,
      relative_attention_num_buckets=_uniform(
          [layer.relative_attention_num_buckets for layer in self_attention],
          "SelfAttention.relative_attention_num_buckets"))
