"""Which Hugging Face T5 weight each of our variables is, and how the two layouts differ.

Our kernels are [in, out] and Hugging Face's nn.Linear weights [out, in]; our relative bias is
[heads, buckets] and theirs an nn.Embedding [buckets, heads]: both are transposed. Embedding and
norm scales keep their shape. HF keeps the relative bias only in block 0 of each stack, which is
where our `bias_shared` creates it.
"""

from __future__ import annotations

import dataclasses
import re

from mesh_tensorflow.transformer.convert.errors import ConversionError

_LAYER_WEIGHTS = {"q": "q", "k": "k", "v": "v", "o": "o",
                  "relative_attention_bias": "relative_attention_bias",
                  "wi/kernel": "wi", "wi_0/kernel": "wi_0", "wi_1/kernel": "wi_1", "wo/kernel": "wo"}
_NORM = re.compile(r"^[^/]+/scale$")


@dataclasses.dataclass(frozen=True)
class Weight:
  """Our variable `ours`, Hugging Face's tensor `hf`; `transpose`: the 2-D layouts are transposed."""

  ours: str
  hf: str
  transpose: bool


def _stack_weights(stack: str, layers: list, block_size: int, names: set) -> list:
  weights = []
  for i, layer in enumerate(layers):
    block, index = divmod(i, block_size)
    prefix, hf_prefix = f"{stack}/{layer.name}/", f"{stack}.block.{block}.layer.{index}."
    cls = type(layer).__name__
    for name in sorted(n for n in names if n.startswith(prefix)):
      rest = name[len(prefix):]
      if rest.startswith(cls + "/") and rest[len(cls) + 1:] in _LAYER_WEIGHTS:
        weights.append(Weight(name, f"{hf_prefix}{cls}.{_LAYER_WEIGHTS[rest[len(cls) + 1:]]}.weight", True))
      elif _NORM.match(rest):
        weights.append(Weight(name, hf_prefix + "layer_norm.weight", False))
  claimed = {w.ours for w in weights}
  for name in names:
    if name.startswith(stack + "/") and name not in claimed and _NORM.match(name[len(stack) + 1:]):
      weights.append(Weight(name, f"{stack}.final_layer_norm.weight", False))
  return weights


def weights(model, variable_names) -> list:
  """Every Weight of `model` (a checked Bitransformer) whose variables are `variable_names`.

  A variable with no Hugging Face counterpart is refused, naming it.
  """
  names = set(variable_names)
  found = [Weight("shared/embedding", "shared.weight", False)] if "shared/embedding" in names else []
  if "decoder/logits/kernel" in names:
    found.append(Weight("decoder/logits/kernel", "lm_head.weight", True))
  found += _stack_weights("encoder", model.encoder.layer_stack.layers, 2, names)
  found += _stack_weights("decoder", model.decoder.layer_stack.layers, 3, names)
  unmapped = sorted(names - {w.ours for w in found})
  if unmapped:
    raise ConversionError(f"variable {unmapped[0]!r} (and {len(unmapped) - 1} more) has no counterpart in "
                          f"Hugging Face's T5; its layer cannot be converted.")
  return found


def zero_relative_biases(spec) -> list:
  """(HF name, shape) of the relative biases HF needs where our model has none (all zeros = no bias)."""
  if spec.relative_bias:
    return []
  shape = [spec.relative_attention_num_buckets, spec.num_heads]
  return [(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", shape)
          for stack in ("encoder", "decoder")]
