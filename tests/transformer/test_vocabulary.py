"""Vocabularies round-trip: bytes, a tfds-style encoder (shifted for EOS), t2t subword files."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import t2t_vocabulary, vocabulary

TEXTS = ["Hello world", "naïve café, 3.14 — ok?", "", "tabs\tand\nnewlines", "x_y\\z"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_vocabulary_round_trips_in_python_and_tf(text):
  v = vocabulary.ByteVocabulary()
  ids = v.encode(text)
  assert ids == [b + 3 for b in text.encode("utf-8")]
  assert v.decode(ids) == text
  with tf.Graph().as_default(), tf.Session() as sess:
    tf_ids, tf_text = sess.run([v.encode_tf(tf.constant(text)),
                                v.decode_tf(tf.constant(ids + [1, 0], tf.int32))])
  assert tf_ids.tolist() == ids
  assert tf_text.decode("utf-8") == text


def test_byte_vocabulary_decode_stops_at_eos_and_drops_reserved_ids():
  v = vocabulary.ByteVocabulary(extra_ids=2)
  assert v.vocab_size == 261
  ids = [2, ord("a") + 3, 0, ord("b") + 3, 259, 1, ord("c") + 3]
  assert v.decode(ids) == "ab"
  batch = tf.constant([ids, [ord("z") + 3, 1, 0, 0, 0, 0, 0]])
  assert [s.decode() for s in v.decode_tf(batch).numpy()] == ["ab", "z"]


def test_byte_vocabulary_encode_tf_runs_inside_a_dataset():
  v = vocabulary.ByteVocabulary()
  ds = tf.data.Dataset.from_tensor_slices(["ab", "xyz"]).map(v.encode_tf)
  assert [x.tolist() for x in ds.as_numpy_iterator()] == [v.encode("ab"), v.encode("xyz")]


class _WordEncoder:
  """A tfds-style encoder: id 0 is padding, words are 1..n."""

  def __init__(self, words):
    self._words = words

  @property
  def vocab_size(self):
    return len(self._words) + 1

  def encode(self, s):
    return [self._words.index(w) + 1 for w in s.split()]

  def decode(self, ids):
    return " ".join(self._words[i - 1] for i in ids)


def test_tfds_vocabulary_shifts_ids_past_eos_and_round_trips():
  v = vocabulary.TFDSVocabulary(_WordEncoder(["the", "cat", "sat"]))
  assert v.vocab_size == 5
  ids = v.encode("the cat sat")
  assert ids == [2, 3, 4]
  assert v.decode(ids + [1, 3, 0]) == "the cat sat"
  with tf.Graph().as_default(), tf.Session() as sess:
    tf_ids, tf_text = sess.run([v.encode_tf(tf.constant("sat the")), v.decode_tf(tf.constant([4, 2, 1, 0]))])
  assert tf_ids.tolist() == [4, 2] and tf_text.decode() == "sat the"


def test_vocabulary_pairs_select_inputs_and_targets():
  a, b = vocabulary.ByteVocabulary(), vocabulary.ByteVocabulary(extra_ids=1)
  assert vocabulary.inputs_vocabulary((a, b)) is a and vocabulary.targets_vocabulary((a, b)) is b
  assert vocabulary.inputs_vocabulary(a) is a and vocabulary.targets_vocabulary(a) is a
  assert vocabulary.feature_vocabulary((a, b), "targets") is b


def _write_t2t_vocab(tmp_path, subtokens):
  path = tmp_path / "vocab.subwords"
  path.write_text("".join("'%s'\n" % s for s in subtokens), encoding="utf-8")
  return str(path)


# Reserved ids, whole words, pieces, every single character of the alphabet and the escape characters.
SUBTOKENS = (["<pad>", "<EOS>", "hello_", "world_", "wor", "ld", "s_", "!_", " _", ", _", ".", "_"]
             + list("abcdefghijklmnopqrstuvwxyzHW!,. 0123456789\\u;"))


def test_t2t_vocabulary_encodes_with_longest_subtokens(tmp_path):
  v = t2t_vocabulary.T2tVocabulary(_write_t2t_vocab(tmp_path, SUBTOKENS))
  assert v.vocab_size == len(SUBTOKENS)
  ids = v.encode("hello world")  # two tokens; the inner space is implied
  assert [SUBTOKENS[i] for i in ids] == ["hello_", "world_"]
  ids = v.encode("worlds")
  assert [SUBTOKENS[i] for i in ids] == ["wor", "ld", "s_"]


@pytest.mark.parametrize("text", ["hello world", "hello, worlds!", "hello  world", "a_b\\c 42", "Hi. é x"])
def test_t2t_vocabulary_round_trips_including_escaped_characters(tmp_path, text):
  v = t2t_vocabulary.T2tVocabulary(_write_t2t_vocab(tmp_path, SUBTOKENS))
  ids = v.encode(text)
  assert all(2 <= i < v.vocab_size for i in ids)
  assert v.decode(ids) == text
  assert v.decode(ids + [1, 5, 0]) == text
  with tf.Graph().as_default(), tf.Session() as sess:
    tf_ids, tf_text = sess.run([v.encode_tf(tf.constant(text)), v.decode_tf(tf.constant(ids, tf.int32))])
  assert tf_ids.tolist() == ids and tf_text.decode("utf-8") == text


def test_t2t_vocabulary_reads_unquoted_files_and_gin_getter(tmp_path):
  (tmp_path / "plain.subwords").write_text("<pad>\n<EOS>\nab_\na\nb\n_\n\\\nu\n;\n" + "\n".join("0123456789"))
  v = t2t_vocabulary.get_t2t_vocabulary(str(tmp_path), "plain.subwords")
  assert v.encode("ab") == [2]
  assert v.decode(v.encode("ba ab")) == "ba ab"


def test_t2t_vocabulary_rejects_text_it_cannot_cut(tmp_path):
  v = t2t_vocabulary.T2tVocabulary(_write_t2t_vocab(tmp_path, ["<pad>", "<EOS>", "a", "_"]))
  with pytest.raises(ValueError, match="cannot cut"):
    v.encode("b")


def test_base_vocabulary_names_the_missing_method():
  with pytest.raises(NotImplementedError, match="Vocabulary must define encode"):
    vocabulary.Vocabulary().encode("x")
  assert np.array_equal(vocabulary.strip_special_ids([5, 0, 6, 1, 7]), [5, 6])
