"""Building the model utils.run trains from its model_type, and (inputs, targets) vocabulary pairs."""

from __future__ import annotations

import gin

from mesh_tensorflow.transformer import transformer
from mesh_tensorflow.transformer._utils import GIN_MODULE

MODEL_TYPES = ("bitransformer", "bi_student_teacher", "lm", "delimited_lm", "aligned")


def build_model(model_type: str = "bitransformer", input_vocab_size: int = gin.REQUIRED,
                output_vocab_size: int = gin.REQUIRED, layout_rules=None, mesh_shape=None):
  """The model for model_type (one of MODEL_TYPES), configured by gin.

  "bitransformer" / "bi_student_teacher": an encoder-decoder (make_bitransformer /
  make_bi_student_teacher). "lm" and "delimited_lm": an autoregressive Unitransformer; "aligned": a
  non-autoregressive one (one output per input position).
  """
  if model_type == "bitransformer":
    return transformer.make_bitransformer(input_vocab_size=input_vocab_size,
                                          output_vocab_size=output_vocab_size,
                                          mesh_shape=mesh_shape, layout=layout_rules)
  if model_type == "bi_student_teacher":
    return transformer.make_bi_student_teacher(input_vocab_size=input_vocab_size,
                                               output_vocab_size=output_vocab_size,
                                               mesh_shape=mesh_shape, layout=layout_rules)
  if model_type in ("lm", "delimited_lm", "aligned"):
    return transformer.Unitransformer(
        autoregressive=model_type != "aligned", layer_stack=transformer.make_layer_stack(),
        input_vocab_size=input_vocab_size, output_vocab_size=output_vocab_size,
        mesh_shape=mesh_shape, layout=layout_rules)
  raise ValueError(f"unknown model_type {model_type!r} (utils.run.model_type); use one of {MODEL_TYPES}")


@gin.configurable(module=GIN_MODULE)
def separate_vocabularies(inputs=gin.REQUIRED, targets=gin.REQUIRED) -> tuple:
  """An (inputs, targets) vocabulary pair, for utils.run.vocabulary = @utils.separate_vocabularies()."""
  return (inputs, targets)
