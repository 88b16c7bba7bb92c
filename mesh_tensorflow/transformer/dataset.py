"""Input pipelines for the Transformer: packing, padding, text-line, TSV, TFRecord and tfds datasets.

A dataset function used by `utils.run` returns a tf.data.Dataset of feature dicts ("inputs",
"targets", and for packed data "<key>_segmentation" / "<key>_position") whose int sequences all have
the fixed length the model was built for. Ids 0 and 1 are PAD and EOS.

tensorflow_datasets is optional: it is imported only by the tfds dataset functions, which raise an
ImportError naming the package when it is missing.
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence, Union

import gin
import tensorflow as tf2
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import vocabulary as vocab_lib

Length = Union[int, Mapping[str, int]]
Dataset = tf.data.Dataset

# name: str; dataset_fn(sequence_length, vocabulary) -> Dataset; postprocess_fn(decoded string) -> value;
# metric_fns: list of fn(targets, predictions) -> {metric name: value}.
EvalDataset = collections.namedtuple("EvalDataset", ["name", "dataset_fn", "postprocess_fn", "metric_fns"])

_AUTOTUNE = tf.data.experimental.AUTOTUNE


def _feature_length(length: Length, key: str) -> int:
  if isinstance(length, Mapping):
    if key not in length:
      raise ValueError(f"sequence length has no entry for feature {key!r}: {dict(length)}; add one")
    return int(length[key])
  return int(length)


def _check_features(dataset: Dataset, keys: Sequence[str], caller: str) -> None:
  shapes = tf.data.get_output_shapes(dataset)
  for k in keys:
    if k not in shapes:
      raise ValueError(f"{caller}: feature {k!r} is not in the dataset; its features are {sorted(shapes)}")
    if shapes[k].rank is not None and shapes[k].rank != 1:
      raise ValueError(f"{caller}: feature {k!r} must be a 1-D sequence, got shape {shapes[k]}")


@gin.configurable
def pack_dataset(dataset: Dataset, length: Length, keys: Sequence[str] | None = None,
                 use_custom_ops: bool = False) -> Dataset:
  """Greedily packs consecutive examples into examples of fixed `length` (pure TF ops), as upstream.

  Each example is first truncated to `length` (its EOS may be cut); an example is never split.
  For each packed key k the output has int32 features k, k_segmentation (1-based id of the example
  within the packed example, 0 on padding) and k_position (0-based position within that example).
  Examples are taken in groups of max(length) and packed within a group: an example joins the
  current packed example when all its keys still fit, else it starts a new one. Features not in
  `keys` are dropped. Example with length 10:
    {"inputs": [8, 7, 1], "targets": [4, 1]} and {"inputs": [2, 3, 4, 1], "targets": [5, 6, 1]}
    -> inputs               [8, 7, 1, 2, 3, 4, 1, 0, 0, 0]
       inputs_segmentation  [1, 1, 1, 2, 2, 2, 2, 0, 0, 0]
       inputs_position      [0, 1, 2, 0, 1, 2, 3, 0, 0, 0]
       targets              [4, 1, 5, 6, 1, 0, 0, 0, 0, 0]   (targets_segmentation [1, 1, 2, 2, 2, 0...])

  Id 0 is padding, as upstream: a (truncated) sequence with n non-zero ids contributes its first n
  ids, a zero id inside it gets segmentation 0, and segment ids count, per key, the non-empty
  sequences of the packed example (so an empty feature takes no segment id in that key).

  Args:
    dataset: examples as dicts of 1-D int sequences.
    length: an int, or a dict {key: int}.
    keys: the features to pack (default: all).
    use_custom_ops: accepted for gin compatibility. Upstream then used tensor2tensor's C++ packing
      op (1 or 2 keys), which packs more densely (an example may go into an earlier packed example
      that still has room); that op is not available, so the TF-op packer is always used.
  Returns:
    The packed dataset.
  """
  keys = list(tf.data.get_output_shapes(dataset)) if keys is None else list(keys)
  if not keys:
    raise ValueError("pack_dataset: keys is empty; pass the features to pack, or None for all")
  if use_custom_ops and len(keys) <= 2:
    tf.logging.warning("pack_dataset: use_custom_ops=True: tensor2tensor's packing op is not available; "
                       "packing with TF ops (consecutive examples only, less dense).")
  _check_features(dataset, keys, "pack_dataset")
  lengths = [_feature_length(length, k) for k in keys]
  pieces = dataset.map(lambda ex: _truncate(ex, keys, lengths), num_parallel_calls=_AUTOTUNE)
  # A batch of max(lengths) non-empty examples fills at least one packed example.
  batches = pieces.batch(max(lengths))
  return batches.map(lambda values, sizes: _pack_batch(values, sizes, keys, lengths),
                     num_parallel_calls=_AUTOTUNE).unbatch()


def _truncate(example, keys, lengths):
  """One example -> (values {k: [length_k]} zero-padded, sizes [num_keys]): each key cut to length_k.

  A key's size is its number of non-zero ids after the cut (upstream's rule: ids past it are dropped).
  """
  values, sizes = {}, []
  for k, n in zip(keys, lengths):
    v = tf.cast(example[k][:n], tf.int32)
    values[k] = tf.reshape(tf.pad(v, [[0, n - tf.size(v)]]), [n])
    sizes.append(tf.math.count_nonzero(v, dtype=tf.int32))
  return values, tf.stack(sizes)


def _pack_batch(values, sizes, keys, lengths):
  """Packs a batch of examples ({k: [b, length_k]}, sizes [b, num_keys]) into {k...: [packed, length_k]}.

  Only the first sizes[:, i] ids of an example's key i are packed.
  """
  capacity = tf.constant(lengths, tf.int32)

  def place(state, size):
    packed_index, used = state
    fits = tf.reduce_all(used + size <= capacity)
    return (tf.where_v2(fits, packed_index, packed_index + 1), tf.where_v2(fits, used + size, size))

  init = (tf.constant(0), tf.zeros([len(keys)], tf.int32))
  packed_index, used = tf.scan(place, sizes, initializer=init)
  offsets = used - sizes  # where each example starts in its packed example
  num_packed = packed_index[-1] + 1
  out = {}
  for i, (k, n) in enumerate(zip(keys, lengths)):
    position = tf.range(n)[tf.newaxis, :]
    valid = position < sizes[:, i:i + 1]
    target = tf.stack([tf.broadcast_to(packed_index[:, tf.newaxis], tf.shape(valid)),
                       offsets[:, i:i + 1] + position], axis=-1)
    target = tf.boolean_mask(target, valid)
    shape = tf.stack([num_packed, n])
    for name, source in ((k, values[k]), (k + "_position", tf.broadcast_to(position, tf.shape(valid)))):
      packed = tf.scatter_nd(target, tf.boolean_mask(source, valid), shape)
      packed.set_shape([None, n])
      out[name] = packed
    # Upstream's segment ids: count the sequence starts (position 0) so far; 0 where the id is 0.
    starts = tf.cast(tf.equal(out[k + "_position"], 0), tf.int32)
    out[k + "_segmentation"] = tf.cumsum(starts, axis=1) * tf.cast(tf.not_equal(out[k], 0), tf.int32)
  return out


def trim_and_pad_dataset(dataset: Dataset, length: Length,
                         feature_keys: Sequence[str] | None = None) -> Dataset:
  """Truncates or zero-pads the first axis of each feature in `feature_keys` (default all) to `length`."""
  def trim_and_pad(k, t):
    if feature_keys and k not in feature_keys:
      return t
    n = _feature_length(length, k)
    t = t[:n]
    padded = tf.pad(t, [[0, n - tf.shape(t)[0]]] + [[0, 0]] * (t.shape.rank - 1))
    padded.set_shape([n] + t.shape.as_list()[1:])
    return padded
  return dataset.map(lambda ex: {k: trim_and_pad(k, t) for k, t in ex.items()}, num_parallel_calls=_AUTOTUNE)


def ensure_dataset_eos(dataset: Dataset, feature_keys: Sequence[str] | None = None) -> Dataset:
  """Makes the last token of each feature EOS (1) unless it is PAD (0): clips it into [0, 1]."""
  def ensure_eos(k, v):
    if feature_keys and k not in feature_keys:
      return v
    return tf.concat([v[:-1], tf.clip_by_value(v[-1:], 0, 1)], axis=0)
  return dataset.map(lambda ex: {k: ensure_eos(k, v) for k, v in ex.items()}, num_parallel_calls=_AUTOTUNE)


@gin.configurable
def pack_or_pad(dataset: Dataset, length: Length, pack: bool = True,
                feature_keys: Sequence[str] | None = None, ensure_eos: bool = False) -> Dataset:
  """Packs (pack_dataset) or trims and pads (trim_and_pad_dataset) to `length`; a falsy length is a no-op."""
  if not length:
    return dataset
  keys = list(feature_keys) if feature_keys else list(tf.data.get_output_shapes(dataset))
  if ensure_eos:
    dataset = ensure_dataset_eos(dataset, keys)
  if pack:
    return pack_dataset(dataset, length=length, keys=keys)
  return trim_and_pad_dataset(dataset, length=length, feature_keys=keys)


def _maybe_batch(dataset: Dataset, batch_size: int | None) -> Dataset:
  """Batches when a (deprecated) batch_size is given; utils.run batches itself."""
  return dataset.batch(batch_size, drop_remainder=False) if batch_size else dataset


def _append_eos(features, eos_id: int = vocab_lib.EOS_ID):
  return {k: tf.concat([v, tf.constant([eos_id], v.dtype)], 0) for k, v in features.items()}


def encode_dataset(dataset: Dataset, vocabulary) -> Dataset:
  """Encodes every string feature with vocabulary.encode_tf (an (inputs, targets) pair: each its own)."""
  def encode(features):
    return {k: vocab_lib.feature_vocabulary(vocabulary, k).encode_tf(v) if v.dtype == tf.string else v
            for k, v in features.items()}
  return dataset.map(encode, num_parallel_calls=_AUTOTUNE)


def encode_all_features(dataset: Dataset, vocabulary) -> Dataset:
  """Encodes every (string) feature as int64 ids and appends EOS."""
  def encode(features):
    return _append_eos({k: tf.cast(vocab_lib.feature_vocabulary(vocabulary, k).encode_tf(v), tf.int64)
                        for k, v in features.items()})
  return dataset.map(encode, num_parallel_calls=_AUTOTUNE)


def supervised_to_dict(dataset: Dataset, text2self: bool) -> Dataset:
  """(inputs, targets) pairs -> {"inputs", "targets"} dicts ({"targets"} only for text2self)."""
  if text2self:
    return dataset.map(lambda inputs, targets: {"targets": targets}, num_parallel_calls=_AUTOTUNE)
  return dataset.map(lambda inputs, targets: {"inputs": inputs, "targets": targets},
                     num_parallel_calls=_AUTOTUNE)


def pad_dataset_with_zeroed_out_examples(ds: Dataset) -> Dataset:
  """ds followed by endless all-zero copies of its examples (so eval can run a whole number of batches)."""
  return ds.concatenate(ds.map(lambda ex: {k: tf.zeros_like(v) for k, v in ex.items()}).repeat())


def _glob(glob: str, caller: str) -> list[str]:
  files = tf.io.gfile.glob(glob)
  if not files:
    raise ValueError(f"{caller}: no file matches {glob!r}")
  return files


@gin.configurable
def simple_text_line_dataset(glob: str = gin.REQUIRED, shuffle_buffer_size: int = 100000) -> Dataset:
  """The lines of the files matching `glob`, shuffled (buffer `shuffle_buffer_size`; 0 = no shuffle)."""
  dataset = tf.data.TextLineDataset(_glob(glob, "simple_text_line_dataset"))
  return dataset.shuffle(shuffle_buffer_size) if shuffle_buffer_size else dataset


@gin.configurable
def sample_from_text_line_datasets(glob_weight_list: Sequence[tuple[str, float]],
                                   shuffle_buffer_size: int = 100000, prefetch: int = 1000) -> Dataset:
  """An endless mixture of the (repeated, shuffled) lines of several globs, sampled with the given weights."""
  globs, weights = zip(*glob_weight_list)
  datasets = [tf.data.TextLineDataset(_glob(g, "sample_from_text_line_datasets")).repeat()
              .shuffle(shuffle_buffer_size).prefetch(prefetch) for g in globs]
  return tf2.data.Dataset.sample_from_datasets(datasets, weights=[float(w) for w in weights])


@gin.configurable
def make_text_line_dataset(glob: str = gin.REQUIRED) -> Dataset:
  """The endless, shuffled lines of the files matching `glob`."""
  return sample_from_text_line_datasets(glob_weight_list=[(glob, 1.0)])


@gin.configurable
def packed_parallel_tsv_dataset(dataset: Dataset = gin.REQUIRED, dataset_split: str = gin.REQUIRED,
                                batch_size: int | None = None, sequence_length: Length = gin.REQUIRED,
                                vocabulary=gin.REQUIRED, append_eos: bool = True, eos_id: int = 1,
                                max_encoded_len: int = 0) -> Dataset:
  """Lines "<inputs>\\t<targets>" -> encoded, EOS-terminated, packed {"inputs", "targets"} examples.

  Args:
    dataset: a dataset of tab-separated lines (e.g. simple_text_line_dataset()).
    dataset_split: unused (the caller chose the files); kept for the dataset_fn signature.
    batch_size: deprecated; batches the result when given.
    sequence_length: packed length, an int or {"inputs": n, "targets": m}.
    vocabulary: a Vocabulary or an (inputs, targets) pair.
    append_eos: append `eos_id` to both features.
    max_encoded_len: when > 0, drop examples with a feature longer than this (after EOS).
  """
  del dataset_split
  def parse(line):
    fields = tf.io.decode_csv(line, record_defaults=["", ""], field_delim="\t", use_quote_delim=False)
    return dict(zip(("inputs", "targets"), fields))
  dataset = dataset.map(parse, num_parallel_calls=_AUTOTUNE)
  dataset = encode_dataset(dataset, vocabulary)
  if append_eos:
    dataset = dataset.map(lambda ex: _append_eos(ex, eos_id), num_parallel_calls=_AUTOTUNE)
  if max_encoded_len:
    dataset = dataset.filter(
        lambda ex: tf.reduce_all([tf.size(v) <= max_encoded_len for v in ex.values()]))
  return _maybe_batch(pack_or_pad(dataset, sequence_length), batch_size)


def pretokenized_tfrecord_dataset(filenames: Sequence[str], text2self: bool, eos_included: bool, repeat: bool,
                                  batch_size: int | None, sequence_length: Length,
                                  vocab_shift: int = 0) -> Dataset:
  """TFRecords of tf.train.Examples with int64-list features "targets" (and "inputs"), packed.

  Ids are shifted by `vocab_shift`; EOS is appended unless `eos_included`.
  """
  keys = ["targets"] if text2self else ["inputs", "targets"]
  features = {k: tf.io.VarLenFeature(tf.int64) for k in keys}

  def decode(serialized):
    parsed = tf.io.parse_single_example(serialized, features)
    ex = {k: tf.sparse.to_dense(parsed[k]) + vocab_shift for k in keys}
    return ex if eos_included else _append_eos(ex)

  dataset = tf.data.TFRecordDataset(list(filenames), buffer_size=64 * 1024 * 1024)
  if repeat:
    dataset = dataset.repeat()
  dataset = dataset.map(decode, num_parallel_calls=_AUTOTUNE)
  return _maybe_batch(pack_or_pad(dataset, sequence_length), batch_size)


@gin.configurable
def pretokenized_t2t_dataset(dataset_name: str = gin.REQUIRED, text2self: bool = False,
                             data_dir: str = gin.REQUIRED, dataset_split: str = "train",
                             batch_size: int | None = None, sequence_length: Length = gin.REQUIRED,
                             vocabulary=None, eos_included: bool = True, vocab_shift: int = 0) -> Dataset:
  """The tensor2tensor TFRecords data_dir/<dataset_name>-<dataset_split>-*, packed (repeated for train)."""
  del vocabulary
  pattern = f"{data_dir.rstrip('/')}/{dataset_name}-{dataset_split}-*"
  filenames = _glob(pattern, "pretokenized_t2t_dataset")
  tf.logging.info("Found %d files matching %s", len(filenames), pattern)
  dataset = pretokenized_tfrecord_dataset(
      filenames=filenames, text2self=text2self, eos_included=eos_included, repeat=dataset_split == "train",
      batch_size=batch_size, sequence_length=sequence_length, vocab_shift=vocab_shift)
  return dataset.shuffle(1000) if dataset_split == "train" else dataset


def _load_tfds_supervised(caller: str, dataset_name: str, dataset_split: str, tfds_data_dir: str | None,
                          text2self: bool) -> Dataset:
  tfds = vocab_lib.import_optional("tensorflow_datasets", "tensorflow-datasets", caller)
  dataset = tfds.load(dataset_name, split=dataset_split, as_supervised=True, data_dir=tfds_data_dir)
  if dataset_split == "train":
    dataset = dataset.repeat().shuffle(1000)
  return supervised_to_dict(dataset, text2self)


@gin.configurable
def pretokenized_tfds_dataset(dataset_name: str = gin.REQUIRED, text2self: bool = gin.REQUIRED,
                              tfds_data_dir: str | None = gin.REQUIRED, dataset_split: str = gin.REQUIRED,
                              batch_size: int | None = None, sequence_length: Length = gin.REQUIRED,
                              vocabulary=None) -> Dataset:
  """A tokenized supervised tensorflow_datasets dataset, EOS appended, packed. Needs tensorflow-datasets."""
  del vocabulary
  dataset = _load_tfds_supervised("pretokenized_tfds_dataset", dataset_name, dataset_split, tfds_data_dir,
                                  text2self)
  dataset = dataset.map(_append_eos, num_parallel_calls=_AUTOTUNE)
  return _maybe_batch(pack_or_pad(dataset, sequence_length), batch_size)


@gin.configurable
def untokenized_tfds_dataset(dataset_name: str = gin.REQUIRED, text2self: bool = gin.REQUIRED,
                             tfds_data_dir: str | None = gin.REQUIRED, dataset_split: str = gin.REQUIRED,
                             batch_size: int | None = None, sequence_length: Length = gin.REQUIRED,
                             vocabulary=gin.REQUIRED, pack: bool = gin.REQUIRED) -> Dataset:
  """A text supervised tensorflow_datasets dataset, encoded, EOS appended, packed or padded."""
  dataset = _load_tfds_supervised("untokenized_tfds_dataset", dataset_name, dataset_split, tfds_data_dir,
                                  text2self)
  dataset = encode_all_features(dataset, vocabulary)
  return _maybe_batch(pack_or_pad(dataset, sequence_length, pack), batch_size)

