"""Vocabularies travel with the weights: bytes <-> ByT5Tokenizer, SentencePiece <-> T5Tokenizer.

Our side names its vocabulary in gin (`utils.run.vocabulary`); Hugging Face's in the files
`tokenizer_config.json` (and `spiece.model` for SentencePiece) beside the weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional, Sequence

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import vocabulary

GIN_MODULE = "mesh_tensorflow.transformer.convert"
SPIECE = "spiece.model"
TOKENIZER_CONFIG = "tokenizer_config.json"


@gin.configurable(module=GIN_MODULE)
def byte_vocabulary(extra_ids: int = 0) -> vocabulary.ByteVocabulary:
  """ByteVocabulary for gin (`utils.run.vocabulary = @convert.byte_vocabulary()`), as from_hf writes it."""
  return vocabulary.ByteVocabulary(extra_ids=extra_ids)


class SentencePieceVocabulary(vocabulary.Vocabulary):
  """A SentencePiece model file as a vocabulary (ids as T5's own SentencePieceVocabulary gives them).

  from_hf names it for a Hugging Face T5Tokenizer's spiece.model, so utils.run needs neither T5 nor
  a TF-text op; encoding runs in Python (the `sentencepiece` package, installed with the hf extra).
  """

  def __init__(self, sentencepiece_model_file: str, extra_ids: int = 0):
    super().__init__(extra_ids)
    spm = vocabulary.import_optional("sentencepiece", "sentencepiece", "SentencePieceVocabulary")
    with tf.io.gfile.GFile(sentencepiece_model_file, "rb") as f:
      self._processor = spm.SentencePieceProcessor(model_proto=f.read())
    self.sentencepiece_model_file = sentencepiece_model_file

  @property
  def vocab_size(self) -> int:
    return self._processor.GetPieceSize() + self.extra_ids

  def encode(self, s: str) -> list:
    return self._processor.EncodeAsIds(s)

  def decode(self, ids) -> str:
    pieces = self._processor.GetPieceSize()
    return self._processor.DecodeIds([i for i in vocabulary.strip_special_ids(ids) if i < pieces])


@gin.configurable(module=GIN_MODULE)
def sentencepiece_vocabulary(sentencepiece_model_file: str = gin.REQUIRED,
                             extra_ids: int = 0) -> SentencePieceVocabulary:
  """SentencePieceVocabulary for gin (`utils.run.vocabulary = @convert.sentencepiece_vocabulary()`)."""
  return SentencePieceVocabulary(sentencepiece_model_file, extra_ids)


def _reference_name() -> Optional[str]:
  try:
    reference = gin.query_parameter("utils.run.vocabulary")
  except ValueError:
    return None
  return getattr(reference, "name", None) or getattr(reference, "selector", None)


def _binding(texts: Sequence[str], pattern: str) -> Optional[str]:
  for text in texts:
    match = re.search(pattern, text)
    if match:
      return match.group(1)
  return None


def write_hf_tokenizer(gin_texts: Sequence[str], output_dir: str) -> Optional[str]:
  """Writes the HF tokenizer files of the configured vocabulary; returns what it wrote, or None.

  ByteVocabulary (ours, or the example's `data.byte_vocabulary`) -> ByT5Tokenizer; a
  `...sentencepiece_model_file` binding (T5's SentencePieceVocabulary, or ours) -> spiece.model +
  T5Tokenizer.
  """
  name = _reference_name() or ""
  extra_ids = _binding(gin_texts, r"(?m)^\S*Vocabulary\.extra_ids\s*=\s*(\d+)")
  extra_ids = int(extra_ids) if extra_ids else 0
  if name.endswith("byte_vocabulary") or name.endswith("ByteVocabulary"):
    config = {"tokenizer_class": "ByT5Tokenizer", "extra_ids": extra_ids, "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>"}
  else:
    model_file = _binding(gin_texts, r"(?m)^\S*sentencepiece_model_file\s*=\s*['\"]([^'\"]+)['\"]")
    if model_file is None:
      return None
    tf.io.gfile.copy(model_file, os.path.join(output_dir, SPIECE), overwrite=True)
    config = {"tokenizer_class": "T5Tokenizer", "extra_ids": extra_ids, "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>"}
  with open(os.path.join(output_dir, TOKENIZER_CONFIG), "w") as f:
    json.dump(config, f, indent=2)
  return config["tokenizer_class"]


def gin_vocabulary(hf_dir: str, model_dir: str) -> list:
  """The gin lines of the vocabulary of the HF tokenizer in hf_dir ([] where it has none).

  A SentencePiece model is copied into model_dir and named by a convert.sentencepiece_vocabulary
  binding (a `sentencepiece_model_file` binding, as T5's configs have, so to_hf finds it again).
  """
  path = os.path.join(hf_dir, TOKENIZER_CONFIG)
  config = {}
  if os.path.exists(path):
    with open(path) as f:
      config = json.load(f)
  extra_ids = int(config.get("extra_ids", 0))
  if config.get("tokenizer_class") == "ByT5Tokenizer":
    return ["utils.run.vocabulary = @convert.byte_vocabulary()", f"convert.byte_vocabulary.extra_ids = "
                                                                 f"{extra_ids}"]
  if os.path.exists(os.path.join(hf_dir, SPIECE)):
    target = os.path.join(model_dir, SPIECE)
    shutil.copyfile(os.path.join(hf_dir, SPIECE), target)
    return ["utils.run.vocabulary = @convert.sentencepiece_vocabulary()",
            f"convert.sentencepiece_vocabulary.sentencepiece_model_file = {target!r}",
            f"convert.sentencepiece_vocabulary.extra_ids = {extra_ids}"]
  return []
