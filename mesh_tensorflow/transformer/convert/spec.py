"""T5Spec: the architecture both sides share, and its Hugging Face `config.json` form.

A T5Spec holds exactly what Hugging Face's T5Config can express; anything else is refused before a
spec is made (gin_model.py on our side, from_hf_config here on theirs).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mesh_tensorflow.transformer.convert.errors import ConversionError

# Our DenseReluDense activations and the feed_forward_proj Hugging Face names them by.
ACTIVATIONS = {"relu": "relu", ("gelu", "linear"): "gated-gelu", ("relu", "linear"): "gated-relu"}
FEED_FORWARD_PROJ = {proj: activation for activation, proj in ACTIVATIONS.items()}


@dataclasses.dataclass(frozen=True)
class T5Spec:
  """An encoder-decoder T5: sizes, activation, embedding ties and relative-attention options.

  tied_logits: the decoder's logits come from the shared embedding, scaled by d_model**-0.5
  (T5 v1.0); otherwise a separate `logits` kernel (v1.1, mT5, ByT5). relative_bias: whether the
  self-attention layers have T5's shared per-stack relative position bias (else no bias at all).
  """

  vocab_size: int
  d_model: int
  d_kv: int
  d_ff: int
  num_heads: int
  num_layers: int
  num_decoder_layers: int
  activation: object  # "relu" or a tuple such as ("gelu", "linear")
  tied_logits: bool
  layer_norm_epsilon: float = 1e-6
  relative_bias: bool = True
  relative_attention_num_buckets: int = 32

  @property
  def gated(self) -> bool:
    return isinstance(self.activation, tuple)


def hf_config(spec: T5Spec, dtype: str) -> dict:
  """The `config.json` of T5ForConditionalGeneration for `spec` (weights stored as `dtype`)."""
  return {
      "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "is_encoder_decoder": True,
      "vocab_size": spec.vocab_size, "d_model": spec.d_model, "d_kv": spec.d_kv, "d_ff": spec.d_ff,
      "num_heads": spec.num_heads, "num_layers": spec.num_layers,
      "num_decoder_layers": spec.num_decoder_layers, "feed_forward_proj": ACTIVATIONS[spec.activation],
      "tie_word_embeddings": spec.tied_logits, "layer_norm_epsilon": spec.layer_norm_epsilon,
      "relative_attention_num_buckets": spec.relative_attention_num_buckets,
      "relative_attention_max_distance": 128, "dropout_rate": 0.0, "pad_token_id": 0, "eos_token_id": 1,
      "decoder_start_token_id": 0, "dtype": dtype,
  }


def from_hf_config(config: dict, path: str) -> T5Spec:
  """The T5Spec of a Hugging Face T5 `config.json` (at `path`, named in errors)."""
  if config.get("model_type") != "t5":
    raise ConversionError(f"{path}: model_type {config.get('model_type')!r} is not 't5'; only T5 converts.")
  proj = config.get("feed_forward_proj", "relu")
  if proj not in FEED_FORWARD_PROJ:
    raise ConversionError(f"{path}: feed_forward_proj {proj!r} has no Mesh TensorFlow DenseReluDense "
                          f"activation; supported: {sorted(FEED_FORWARD_PROJ)}.")
  if config.get("relative_attention_max_distance", 128) != 128:
    raise ConversionError(f"{path}: relative_attention_max_distance "
                          f"{config['relative_attention_max_distance']} is not 128, the only distance Mesh "
                          "TensorFlow's relative attention buckets use.")
  num_layers = config.get("num_layers", 6)
  decoder_layers: Optional[int] = config.get("num_decoder_layers")
  # transformers >= 5 writes scale_decoder_outputs; older ones only tie_word_embeddings.
  tied = config.get("scale_decoder_outputs", config.get("tie_word_embeddings", True))
  return T5Spec(
      vocab_size=config["vocab_size"], d_model=config["d_model"], d_kv=config["d_kv"], d_ff=config["d_ff"],
      num_heads=config["num_heads"], num_layers=num_layers,
      num_decoder_layers=num_layers if decoder_layers is None else decoder_layers,
      activation=FEED_FORWARD_PROJ[proj], tied_logits=bool(tied),
      layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-6),
      relative_attention_num_buckets=config.get("relative_attention_num_buckets", 32))
