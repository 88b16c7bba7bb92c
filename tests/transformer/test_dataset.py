"""Dataset packing and padding against hand-computed examples; text-line, TSV and TFRecord inputs."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import dataset
from mesh_tensorflow.transformer.vocabulary import ByteVocabulary
from tests.transformer.model_check import gin_config


def _dataset(examples, keys=("inputs", "targets"), dtype=tf.int64):
  def gen():
    yield from examples
  return tf.data.Dataset.from_generator(gen, output_signature={k: tf.TensorSpec([None], dtype) for k in keys})


def _as_lists(ds):
  return [{k: v.tolist() if hasattr(v, "tolist") else v for k, v in ex.items()}
          for ex in ds.as_numpy_iterator()]


def _assert_packed(actual, key, tokens, segmentation, position):
  assert actual[key] == tokens
  assert actual[key + "_segmentation"] == segmentation
  assert actual[key + "_position"] == position


def test_pack_dataset_combines_examples_like_upstream_docstring():
  ds = _dataset([{"inputs": [8, 7, 1], "targets": [4, 1]},
                 {"inputs": [2, 3, 4, 1], "targets": [5, 6, 1]}])
  packed = dataset.pack_dataset(ds, 10)
  for k in ("inputs", "targets"):
    for suffix in ("", "_segmentation", "_position"):
      assert tf.data.get_output_types(packed)[k + suffix] == tf.int32
      assert tf.data.get_output_shapes(packed)[k + suffix].as_list() == [10]
  (ex,) = _as_lists(packed)
  _assert_packed(ex, "inputs", [8, 7, 1, 2, 3, 4, 1, 0, 0, 0], [1, 1, 1, 2, 2, 2, 2, 0, 0, 0],
                 [0, 1, 2, 0, 1, 2, 3, 0, 0, 0])
  _assert_packed(ex, "targets", [4, 1, 5, 6, 1, 0, 0, 0, 0, 0], [1, 1, 2, 2, 2, 0, 0, 0, 0, 0],
                 [0, 1, 0, 1, 2, 0, 0, 0, 0, 0])


def test_pack_dataset_starts_a_new_example_when_any_key_overflows():
  # The second example's targets do not fit after the first's, although its inputs would.
  ds = _dataset([{"inputs": [5, 1], "targets": [6, 6, 6, 1]},
                 {"inputs": [7, 1], "targets": [8, 8, 1]},
                 {"inputs": [9, 9, 1], "targets": [3]}])
  ex1, ex2 = _as_lists(dataset.pack_dataset(ds, {"inputs": 6, "targets": 5}))
  _assert_packed(ex1, "inputs", [5, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0])
  _assert_packed(ex1, "targets", [6, 6, 6, 1, 0], [1, 1, 1, 1, 0], [0, 1, 2, 3, 0])
  _assert_packed(ex2, "inputs", [7, 1, 9, 9, 1, 0], [1, 1, 2, 2, 2, 0], [0, 1, 0, 1, 2, 0])
  _assert_packed(ex2, "targets", [8, 8, 1, 3, 0], [1, 1, 1, 2, 0], [0, 1, 2, 0, 0])


def test_pack_dataset_truncates_examples_longer_than_length_cutting_their_eos():
  # Upstream's dataset_test.test_pack_dataset_long_seq: nothing is split, both examples are cut.
  ds = _dataset([{"inputs": [7, 8, 5, 6, 9, 4, 1], "targets": [3, 9, 1]},
                 {"inputs": [8, 4, 9, 3, 5, 7, 9, 1], "targets": [4, 1]}])
  ex1, ex2 = _as_lists(dataset.pack_dataset(ds, {"inputs": 7, "targets": 3}))
  _assert_packed(ex1, "inputs", [7, 8, 5, 6, 9, 4, 1], [1] * 7, list(range(7)))
  _assert_packed(ex1, "targets", [3, 9, 1], [1, 1, 1], [0, 1, 2])
  _assert_packed(ex2, "inputs", [8, 4, 9, 3, 5, 7, 9], [1] * 7, list(range(7)))  # EOS cut
  _assert_packed(ex2, "targets", [4, 1, 0], [1, 1, 0], [0, 1, 0])


def test_pack_dataset_with_a_length_per_feature_drops_unpacked_features():
  # Upstream's dataset_test.test_pack_dataset: "idx" is not in keys, so it is dropped.
  ds = _dataset([{"inputs": [7, 8, 5, 1], "targets": [3, 9, 1], "idx": [0]},
                 {"inputs": [8, 4, 9, 3, 1], "targets": [4, 1], "idx": [1]}],
                keys=("inputs", "targets", "idx"))
  packed = dataset.pack_dataset(ds, length={"inputs": 10, "targets": 7}, keys=("inputs", "targets"))
  assert tf.data.get_output_shapes(packed)["targets_position"].as_list() == [7]
  (ex,) = _as_lists(packed)
  suffixes = ("", "_segmentation", "_position")
  assert sorted(ex) == sorted(k + suffix for k in ("inputs", "targets") for suffix in suffixes)
  _assert_packed(ex, "inputs", [7, 8, 5, 1, 8, 4, 9, 3, 1, 0], [1, 1, 1, 1, 2, 2, 2, 2, 2, 0],
                 [0, 1, 2, 3, 0, 1, 2, 3, 4, 0])
  _assert_packed(ex, "targets", [3, 9, 1, 4, 1, 0, 0], [1, 1, 1, 2, 2, 0, 0], [0, 1, 2, 0, 1, 0, 0])


def test_pack_dataset_treats_zero_ids_as_upstream_does():
  # A sequence with n non-zero ids contributes its first n ids; a zero id in it gets segment 0.
  ds = _dataset([{"targets": [5, 0, 6, 1]}, {"targets": [0, 7, 1]}], keys=("targets",))
  (ex,) = _as_lists(dataset.pack_dataset(ds, 8))
  _assert_packed(ex, "targets", [5, 0, 6, 0, 7, 0, 0, 0], [1, 0, 1, 0, 2, 0, 0, 0], [0, 1, 2, 0, 1, 0, 0, 0])


def test_pack_dataset_segment_ids_count_each_keys_non_empty_sequences_as_upstream():
  # Upstream numbers segments per key, so an empty feature takes no id: the targets of example 2
  # get id 1 (the same as in upstream's _pack_with_tf_ops).
  ds = _dataset([{"inputs": [4, 1], "targets": []}, {"inputs": [5, 1], "targets": [6, 1]}])
  (ex,) = _as_lists(dataset.pack_dataset(ds, 6))
  assert ex["inputs_segmentation"] == [1, 1, 2, 2, 0, 0]
  assert ex["targets_segmentation"] == [1, 1, 0, 0, 0, 0]


def test_pack_dataset_keys_select_features_and_unknown_keys_are_rejected():
  ds = _dataset([{"inputs": [4, 1], "targets": [5, 1]}])
  (ex,) = _as_lists(dataset.pack_dataset(ds, 3, keys=["targets"]))
  assert sorted(ex) == ["targets", "targets_position", "targets_segmentation"]
  with pytest.raises(ValueError, match="feature 'answers' is not in the dataset"):
    dataset.pack_dataset(ds, 3, keys=["answers"])
  with pytest.raises(ValueError, match="no entry for feature 'inputs'"):
    dataset.pack_dataset(ds, {"targets": 3})
  with pytest.raises(ValueError, match="keys is empty"):
    dataset.pack_dataset(ds, 3, keys=[])


def test_pack_dataset_runs_in_graph_mode_with_many_examples():
  rng = np.random.RandomState(0)
  examples = [{"targets": list(rng.randint(2, 50, size=rng.randint(1, 9)))} for _ in range(40)]
  with tf.Graph().as_default():
    ds = dataset.pack_dataset(_dataset(examples, keys=("targets",)), 8)
    next_ex = tf.data.make_one_shot_iterator(ds).get_next()
    packed = []
    with tf.Session() as sess:
      while True:
        try:
          packed.append(sess.run(next_ex))
        except tf.errors.OutOfRangeError:
          break
  # Reference: greedy packing of each batch of `length` examples (none is longer than 8).
  expected = []
  for start in range(0, len(examples), 8):
    bins = []
    for ex in examples[start:start + 8]:
      if not bins or sum(map(len, bins[-1])) + len(ex["targets"]) > 8:
        bins.append([])
      bins[-1].append(ex["targets"])
    expected += bins
  assert len(packed) == len(expected)
  for ex, segments in zip(packed, expected):
    tokens = [t for seg in segments for t in seg]
    pad = [0] * (8 - len(tokens))
    assert ex["targets"].tolist() == tokens + pad
    assert ex["targets_segmentation"].tolist() == [i + 1 for i, seg in enumerate(segments) for _ in seg] + pad
    assert ex["targets_position"].tolist() == [p for seg in segments for p in range(len(seg))] + pad


def test_trim_and_pad_and_pack_or_pad_without_packing():
  ds = _dataset([{"inputs": [3, 4, 5, 6, 1], "targets": [7, 1]}])
  (ex,) = _as_lists(dataset.pack_or_pad(ds, {"inputs": 3, "targets": 4}, pack=False))
  assert ex == {"inputs": [3, 4, 5], "targets": [7, 1, 0, 0]}
  (ex,) = _as_lists(dataset.trim_and_pad_dataset(ds, 4, feature_keys=["targets"]))
  assert ex == {"inputs": [3, 4, 5, 6, 1], "targets": [7, 1, 0, 0]}
  assert dataset.pack_or_pad(ds, 0) is ds


def test_ensure_eos_replaces_a_final_non_pad_token():
  ds = _dataset([{"inputs": [3, 4, 5], "targets": [7, 0]}])
  (ex,) = _as_lists(dataset.ensure_dataset_eos(ds))
  assert ex == {"inputs": [3, 4, 1], "targets": [7, 0]}
  (ex,) = _as_lists(dataset.pack_or_pad(ds, 4, pack=False, feature_keys=["inputs"], ensure_eos=True))
  assert ex == {"inputs": [3, 4, 1, 0], "targets": [7, 0]}


def _write_lines(path, lines):
  path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
  return str(path)


def test_packed_parallel_tsv_dataset_encodes_appends_eos_and_packs(tmp_path):
  glob = _write_lines(tmp_path / "pairs.tsv", ["ab\tx", "c\tyz", "toolong\tq"])
  v = ByteVocabulary()
  lines = dataset.simple_text_line_dataset(glob, shuffle_buffer_size=0)
  ds = dataset.packed_parallel_tsv_dataset(lines, "train", sequence_length={"inputs": 8, "targets": 6},
                                           vocabulary=v, max_encoded_len=4)
  (ex,) = _as_lists(ds)
  a, b, c, x, y, z = (ord(ch) + 3 for ch in "abcxyz")
  _assert_packed(ex, "inputs", [a, b, 1, c, 1, 0, 0, 0], [1, 1, 1, 2, 2, 0, 0, 0], [0, 1, 2, 0, 1, 0, 0, 0])
  _assert_packed(ex, "targets", [x, 1, y, z, 1, 0], [1, 1, 2, 2, 2, 0], [0, 1, 0, 1, 2, 0])


def test_packed_parallel_tsv_dataset_with_separate_vocabularies_and_batches(tmp_path):
  glob = _write_lines(tmp_path / "pairs.tsv", ["a\tb"] * 5)

  class Shifted(ByteVocabulary):
    num_reserved_ids = 10

  ds = dataset.packed_parallel_tsv_dataset(
      dataset.simple_text_line_dataset(glob, shuffle_buffer_size=0), "train", batch_size=2, sequence_length=2,
      vocabulary=(ByteVocabulary(), Shifted()), append_eos=False)
  batches = _as_lists(ds)
  assert [len(b["inputs"]) for b in batches] == [2, 1]
  assert batches[0]["inputs"][0] == [ord("a") + 3, ord("a") + 3]
  assert batches[0]["targets"][0] == [ord("b") + 10, ord("b") + 10]


def test_text_line_datasets_read_and_mix_files(tmp_path):
  first = _write_lines(tmp_path / "a.txt", ["a1", "a2"])
  _write_lines(tmp_path / "b.txt", ["b1"])
  lines = sorted(dataset.simple_text_line_dataset(str(tmp_path / "*.txt")).as_numpy_iterator())
  assert lines == [b"a1", b"a2", b"b1"]
  mixed = dataset.sample_from_text_line_datasets([(first, 1.0), (str(tmp_path / "b.txt"), 0.0)],
                                                 shuffle_buffer_size=10, prefetch=1)
  assert set(mixed.take(20).as_numpy_iterator()) == {b"a1", b"a2"}  # endless: repeats
  # A small shuffle buffer: the default (100000) fills from the endless stream first.
  with gin_config("dataset.sample_from_text_line_datasets.shuffle_buffer_size = 4"):
    repeated = dataset.make_text_line_dataset(str(tmp_path / "b.txt"))
  assert list(repeated.take(3).as_numpy_iterator()) == [b"b1"] * 3
  with pytest.raises(ValueError, match="no file matches"):
    dataset.simple_text_line_dataset(str(tmp_path / "missing*"))


def test_supervised_pairs_become_encoded_dicts_with_eos():
  pairs = tf.data.Dataset.from_tensor_slices((["hi", "yo"], ["a", "bc"]))
  assert _as_lists(dataset.supervised_to_dict(pairs, text2self=True))[0] == {"targets": b"a"}
  encoded = _as_lists(dataset.encode_all_features(dataset.supervised_to_dict(pairs, False), ByteVocabulary()))
  assert encoded[1] == {"inputs": [ord("y") + 3, ord("o") + 3, 1], "targets": [ord("b") + 3, ord("c") + 3, 1]}
  text = tf.data.Dataset.from_tensor_slices({"targets": ["ok"], "id": [7]})
  assert _as_lists(dataset.encode_dataset(text, ByteVocabulary())) == [
      {"targets": [ord("o") + 3, ord("k") + 3], "id": 7}]


def _write_tfrecords(path, examples):
  with tf.io.TFRecordWriter(str(path)) as writer:
    for ex in examples:
      features = {k: tf.train.Feature(int64_list=tf.train.Int64List(value=v)) for k, v in ex.items()}
      writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())


def test_pretokenized_t2t_dataset_reads_tfrecords_shifts_ids_and_appends_eos(tmp_path):
  _write_tfrecords(tmp_path / "copy-dev-00000-of-00001", [{"inputs": [5, 6], "targets": [7]},
                                                          {"inputs": [8], "targets": [9, 9]}])
  ds = dataset.pretokenized_t2t_dataset("copy", data_dir=str(tmp_path), dataset_split="dev",
                                        sequence_length=8, eos_included=False, vocab_shift=1)
  (ex,) = _as_lists(ds)
  _assert_packed(ex, "inputs", [6, 7, 1, 9, 1, 0, 0, 0], [1, 1, 1, 2, 2, 0, 0, 0], [0, 1, 2, 0, 1, 0, 0, 0])
  _assert_packed(ex, "targets", [8, 1, 10, 10, 1, 0, 0, 0], [1, 1, 2, 2, 2, 0, 0, 0],
                 [0, 1, 0, 1, 2, 0, 0, 0])
  text2self = dataset.pretokenized_tfrecord_dataset([str(tmp_path / "copy-dev-00000-of-00001")], True, True,
                                                    repeat=True, batch_size=3, sequence_length=2)
  batch = next(text2self.as_numpy_iterator())
  assert sorted(batch) == ["targets", "targets_position", "targets_segmentation"]
  assert batch["targets"].tolist() == [[7, 0], [9, 9], [7, 0]]  # repeated
  with pytest.raises(ValueError, match="no file matches"):
    dataset.pretokenized_t2t_dataset("copy", data_dir=str(tmp_path), dataset_split="train", sequence_length=8)


def test_pad_dataset_with_zeroed_out_examples_appends_endless_zeros():
  ds = _dataset([{"targets": [3, 4]}], keys=("targets",))
  padded = _as_lists(dataset.pad_dataset_with_zeroed_out_examples(ds).take(3))
  assert padded == [{"targets": [3, 4]}, {"targets": [0, 0]}, {"targets": [0, 0]}]


def test_eval_dataset_is_a_namedtuple():
  ev = dataset.EvalDataset("copy", lambda: None, str, [])
  assert ev._fields == ("name", "dataset_fn", "postprocess_fn", "metric_fns") and ev.name == "copy"
