"""Model features: the feature names a model reads, text<->id batches, decode clean-up, text2self."""

from __future__ import annotations

from typing import Optional, Sequence

import gin
import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import vocabulary as vocab_lib
from mesh_tensorflow.transformer._utils import GIN_MODULE

_MODEL_FEATURES = [
    "inputs", "inputs_position", "inputs_segmentation", "targets", "targets_position",
    "targets_segmentation", "targets_subsegmentation",
]


def _filter_features(ex: dict) -> dict:
  """The features of `ex` that models read (_MODEL_FEATURES)."""
  return {k: v for k, v in ex.items() if k in _MODEL_FEATURES}


@gin.configurable(module=GIN_MODULE)
def clean_decodes(ids, eos_id: int = 1, pad_id: int = 0, length_axis: int = -1) -> tf.Tensor:
  """Replaces everything after the first EOS along `length_axis` with pad_id (the EOS itself stays).

  Args:
    ids: int ids: a Tensor, or anything tf.convert_to_tensor accepts (nested lists, numpy arrays).
    eos_id: the EOS id.
    pad_id: the id written after the first EOS.
    length_axis: the axis along which sequences run.
  Returns:
    An int Tensor of ids with the dtype and shape of `ids`.
  """
  ids = tf.convert_to_tensor(ids)
  is_eos = tf.cast(tf.equal(ids, tf.cast(eos_id, ids.dtype)), tf.int32)
  after_eos = tf.cumsum(is_eos, axis=length_axis, exclusive=True) > 0
  return tf.where_v2(after_eos, tf.cast(pad_id, ids.dtype), ids)


def _pad_rows(rows: list[list[int]], batch_size: int, sequence_length: int) -> np.ndarray:
  """Rows cut / zero-padded to sequence_length; the first row repeated up to a multiple of batch_size."""
  rows = [row[:sequence_length] + [0] * (sequence_length - len(row)) for row in rows]
  rows += [rows[0]] * (-len(rows) % batch_size)
  return np.array(rows, dtype=np.int32)


def encode_inputs(inputs: Sequence[str], vocabulary, model_type: str, batch_size: int, sequence_length: int,
                  eos_id: int = 1, unscored_prefix: Optional[Sequence[str]] = None) -> np.ndarray:
  """Encodes input lines into an int32 [n rounded up to batch_size, sequence_length] array.

  Lines get EOS except for "lm" models, whose inputs are prefixes to continue.

  Args:
    inputs: the lines.
    vocabulary: a Vocabulary, or an (inputs, targets) pair of them.
    model_type: "lm" lines get no EOS.
    batch_size: rows are added (copies of the first) up to a multiple of it.
    sequence_length: rows are cut or zero-padded to it.
    eos_id: the EOS id appended.
    unscored_prefix: optional strings, one per line, encoded in front of it as negated ids: the
      scoring loss ignores targets <= 0, so a language model scores the line given the prefix.
  """
  vocab = vocab_lib.inputs_vocabulary(vocabulary)
  if unscored_prefix and len(unscored_prefix) < len(inputs):
    raise ValueError(f"encode_inputs: unscored_prefix has {len(unscored_prefix)} strings for "
                     f"{len(inputs)} inputs; give one prefix per input line.")
  rows = []
  for i, line in enumerate(inputs):
    prefix = [-token for token in vocab.encode(unscored_prefix[i].strip())] if unscored_prefix else []
    rows.append(prefix + vocab.encode(line.strip()) + ([] if model_type == "lm" else [eos_id]))
  return _pad_rows(rows, batch_size, sequence_length)


def encode_delimited_lm(inputs: Sequence[str], targets: Sequence[str], vocabulary, batch_size: int,
                        sequence_length: int, eos_id: int = 1, include_final_eos: bool = True) -> np.ndarray:
  """Encodes (input, target) line pairs as one "input EOS target [EOS]" sequence each, like encode_inputs."""
  rows = []
  for input_line, target_line in zip(inputs, targets):
    row = vocab_lib.inputs_vocabulary(vocabulary).encode(input_line.strip()) + [eos_id]
    row += vocab_lib.targets_vocabulary(vocabulary).encode(target_line.strip())
    rows.append(row + [eos_id] if include_final_eos else row)
  return _pad_rows(rows, batch_size, sequence_length)


def _maybe_add_pretokenized_features(examples: Sequence[dict], vocabulary) -> Sequence[dict]:
  """Adds "<key>_pretokenized" = vocabulary.decode(ids) for "inputs"/"targets" where it is missing.

  Modifies the example dicts in place and returns them; other features are left untouched.
  """
  for example in examples:
    for key in ("inputs", "targets"):
      pretokenized = key + "_pretokenized"
      if key in example and pretokenized not in example:
        example[pretokenized] = vocab_lib.feature_vocabulary(vocabulary, key).decode(
            np.asarray(example[key]).tolist())
  return examples


def _dynamic_text2self(mtf_features: dict) -> dict:
  """Turns text2text features into text2self ones (for a "delimited_lm" model), inside the mtf graph.

  Each example's (each packed segment's) inputs and targets are concatenated into a new "targets"
  of twice the length, zero-padded at the end, with targets_segmentation / targets_position when the
  features are packed. Targets positions continue after their segment's inputs.
  Example (unpacked, length 4): inputs [3, 1, 0, 0], targets [5, 6, 1, 0] -> targets [3, 1, 5, 6, 1, 0, 0, 0].
  """
  if "inputs" not in mtf_features:
    return mtf_features
  inputs, targets = mtf_features["inputs"], mtf_features["targets"]
  mesh = inputs.mesh
  inputs_length_dim, targets_length_dim = inputs.shape.dims[-1], targets.shape.dims[-1]
  is_packed = "inputs_segmentation" in mtf_features
  if is_packed:
    inputs_segmentation, targets_segmentation = (mtf_features["inputs_segmentation"],
                                                 mtf_features["targets_segmentation"])
    inputs_position, targets_position = mtf_features["inputs_position"], mtf_features["targets_position"]
  else:
    inputs_segmentation = mtf.cast(mtf.not_equal(inputs, 0), tf.int32)
    targets_segmentation = mtf.cast(mtf.not_equal(targets, 0), tf.int32)
    inputs_position = mtf.range(mesh, inputs_length_dim, dtype=tf.int32) * inputs_segmentation
    targets_position = mtf.range(mesh, targets_length_dim, dtype=tf.int32) * targets_segmentation
  # Segment ids are < length + 1; segment 0 is padding.
  segments_dim = mtf.Dimension("segments", max(inputs_length_dim.size, targets_length_dim.size) + 1)
  segments = mtf.range(mesh, segments_dim, dtype=tf.int32)
  real_segment = mtf.cast(mtf.not_equal(segments, 0), tf.int32)

  def segment_lengths(segmentation, length_dim):
    return mtf.reduce_sum(mtf.one_hot(segmentation, segments_dim, dtype=tf.int32),
                          reduced_dim=length_dim) * real_segment

  inputs_segment_length = segment_lengths(inputs_segmentation, inputs_length_dim)
  combined_segment_length = inputs_segment_length + segment_lengths(targets_segmentation, targets_length_dim)
  targets_position += mtf.gather(inputs_segment_length, targets_segmentation, segments_dim)
  new_length_dim = mtf.Dimension("new_length", inputs_length_dim.size + targets_length_dim.size)
  # Where each segment starts in the new sequence; padding (segment 0) is sent out of range.
  segment_start = (mtf.cumsum(combined_segment_length, segments_dim, exclusive=True)
                   + new_length_dim.size * (1 - real_segment))
  new_positions = mtf.range(mesh, new_length_dim, dtype=tf.int32)

  def move(values, segmentation, position):
    destination = position + mtf.gather(segment_start, segmentation, segments_dim)
    permutation = mtf.cast(mtf.equal(new_positions, destination), tf.int32)
    moved = mtf.einsum([values, permutation], output_shape=values.shape.dims[:-1] + [new_length_dim])
    return mtf.rename_dimension(moved, "new_length", targets_length_dim.name)

  def combine(inputs_values, targets_values):
    return (move(inputs_values, inputs_segmentation, inputs_position)
            + move(targets_values, targets_segmentation, targets_position))

  new_features = {"targets": combine(inputs, targets)}
  if is_packed:
    new_features["targets_segmentation"] = combine(inputs_segmentation, targets_segmentation)
    new_features["targets_position"] = combine(inputs_position, targets_position)
  return new_features
