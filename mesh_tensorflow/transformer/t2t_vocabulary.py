"""Tensor2tensor subword vocabularies, read and applied without tensor2tensor.

A vocab file lists one subtoken per line, optionally quoted ('abc_' or "abc_"); line i is id i, and
the files t2t writes start with '<pad>' (0) and '<EOS>' (1). Encoding follows t2t's
SubwordTextEncoder: the text is split into alternating alphanumeric / other runs (a single space
between two words is implied, not kept), each token is escaped ("\\" -> "\\\\", "_" -> "\\u",
characters outside the vocabulary's alphabet -> "\\<ord>;") and terminated with "_", and the escaped
token is cut greedily into the longest subtokens in the vocabulary.
"""

from __future__ import annotations

import os
import re
import unicodedata
from typing import Sequence

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import vocabulary

_ESCAPE_CHARS = set("\\_u;0123456789")
_UNESCAPE_RE = re.compile(r"\\u|\\\\|\\([0-9]+);")
_UNDEFINED_CHAR = "\u3013"


def _is_alnum(c: str) -> bool:
  return unicodedata.category(c)[0] in "LN"


def _tokenize(text: str) -> list[str]:
  """Splits text at every alphanumeric / non-alphanumeric boundary, dropping single inner spaces."""
  if not text:
    return []
  tokens, start = [], 0
  for pos in range(1, len(text)):
    if _is_alnum(text[pos]) != _is_alnum(text[pos - 1]):
      token = text[start:pos]
      if token != " " or start == 0:
        tokens.append(token)
      start = pos
  tokens.append(text[start:])
  return tokens


def _detokenize(tokens: Sequence[str]) -> str:
  """Inverse of _tokenize: a space goes back between two adjacent alphanumeric tokens."""
  pieces = []
  for i, token in enumerate(tokens):
    if i > 0 and _is_alnum(tokens[i - 1][0]) and _is_alnum(token[0]):
      pieces.append(" ")
    pieces.append(token)
  return "".join(pieces)


def _unescape_token(escaped: str) -> str:
  def replace(m):
    if m.group(1) is None:
      return "_" if m.group(0) == "\\u" else "\\"
    try:
      return chr(int(m.group(1)))
    except (ValueError, OverflowError):
      return _UNDEFINED_CHAR
  return _UNESCAPE_RE.sub(replace, escaped[:-1] if escaped.endswith("_") else escaped)


class T2tVocabulary(vocabulary.Vocabulary):
  """A tensor2tensor subword vocabulary file.

  Example:
    v = T2tVocabulary("/data/vocab.translate_ende_wmt32k.32768.subwords")
    v.decode(v.encode("Hello world")) == "Hello world"
  """

  def __init__(self, filepath: str):
    super().__init__()
    self._filepath = filepath
    with tf.io.gfile.GFile(filepath, "r") as f:
      self._subtokens = [self._unquote(line.rstrip("\r\n")) for line in f]
    if not self._subtokens:
      raise ValueError(f"T2tVocabulary: vocab file {filepath!r} is empty")
    self._ids = {s: i for i, s in enumerate(self._subtokens)}
    self._max_subtoken_len = max(len(s) for s in self._subtokens)
    self._alphabet = {c for s in self._subtokens for c in s} | _ESCAPE_CHARS

  @staticmethod
  def _unquote(line: str) -> str:
    line = line.rstrip()
    if len(line) >= 2 and line[0] == line[-1] and line[0] in "'\"":
      return line[1:-1]
    return line

  @property
  def vocab_size(self) -> int:
    return len(self._subtokens)

  def _escape(self, token: str) -> str:
    token = token.replace("\\", "\\\\").replace("_", "\\u")
    return "".join(c if c in self._alphabet and c != "\n" else "\\%d;" % ord(c) for c in token) + "_"

  def _subtoken_ids(self, escaped: str) -> list[int]:
    ids, start = [], 0
    while start < len(escaped):
      for end in range(min(len(escaped), start + self._max_subtoken_len), start, -1):
        subtoken_id = self._ids.get(escaped[start:end])
        if subtoken_id is not None:
          ids.append(subtoken_id)
          start = end
          break
      else:
        raise ValueError(
            f"T2tVocabulary {self._filepath!r}: cannot cut {escaped[start:]!r} into subtokens; the vocab "
            "file must contain every single character of its alphabet and the escape characters \\_u;0-9")
    return ids

  def encode(self, s: str) -> list[int]:
    return [i for token in _tokenize(s) for i in self._subtoken_ids(self._escape(token))]

  def decode(self, ids: Sequence[int]) -> str:
    text = "".join(self._subtokens[i] for i in vocabulary.strip_special_ids(ids) if i < self.vocab_size)
    tokens = [_unescape_token(t + "_") for t in text.split("_") if t]
    return _detokenize([t for t in tokens if t])


@gin.configurable
def get_t2t_vocabulary(data_dir: str = gin.REQUIRED,
                       vocabulary_filename: str = gin.REQUIRED) -> T2tVocabulary:
  """The T2tVocabulary stored as data_dir/vocabulary_filename."""
  return T2tVocabulary(os.path.join(data_dir, vocabulary_filename))
