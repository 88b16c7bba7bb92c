"""transformer.utils model-side helpers: mesh and batch arithmetic, features, decodes, checkpoints, models."""

from __future__ import annotations

import os
from unittest import mock

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer, utils
from mesh_tensorflow.transformer import transformer_layers  # noqa: F401  (gin registrations)
from mesh_tensorflow.transformer.vocabulary import ByteVocabulary
from tests.harness import MODES, lower_and_evaluate
from tests.transformer.model_check import gin_config


@pytest.mark.parametrize("topology, model_parallelism, ensemble, expected", [
    ("v3-128", 8, None, "batch:16;model:8"),
    ("4x4", 1, None, "batch:32"),  # chips: 2 cores each
    ("2x2", 8, None, "model:8"),
    ("v2-32", 2, 4, "ensemble:4;batch:4;model:2"),
])
def test_tpu_mesh_shape(topology, model_parallelism, ensemble, expected):
  assert utils.tpu_mesh_shape(topology, model_parallelism, ensemble) == mtf.convert_to_shape(expected)


def test_tpu_mesh_shape_hierarchical_spec_and_bad_input():
  spec = [("batch", None), ("model", [1, 2, 2])]
  assert utils.tpu_mesh_shape("v3-32", spec) == mtf.convert_to_shape("batch:8;model:4")
  with pytest.raises(ValueError, match="do not divide"):
    utils.tpu_mesh_shape("v3-8", 3)
  with pytest.raises(ValueError, match="must look like 'v3-128'"):
    utils.tpu_mesh_shape("big", 1)


@pytest.mark.parametrize("method, value, expected", [
    ("sequences_per_batch", 24, 24),
    ("tokens_per_batch", 4096, 8),  # / 512 (the longest feature)
    ("sequences_per_replica", 3, 3 * 4),  # batch split 2 ways x outer_batch 2 ways
    ("tokens_per_replica", 2048, 4 * 4),
])
def test_compute_batch_size_for_every_method(method, value, expected):
  size = utils.compute_batch_size({"inputs": 256, "targets": 512}, "outer:2;rows:2;cols:2",
                                  "outer_batch:outer;batch:rows;d_ff:cols", (method, value))
  assert size == expected


def test_compute_batch_size_replicas_and_unknown_method():
  assert utils.compute_batch_size(128, "model:8", "heads:model", ("tokens_per_replica", 1024)) == 8
  with pytest.raises(ValueError, match="unknown batch size method 'tokens'"):
    utils.compute_batch_size(128, "", "", ("tokens", 1))


@pytest.mark.parametrize("tokens, expected", [(None, 1), (2048, 2), (1536, 4), (100, 8), (8192, 1)])
def test_serialize_num_microbatches(tokens, expected):
  # 32 sequences split 4 ways: 8 per replica; microbatches hold the largest divisor of 8 that fits.
  n = utils.serialize_num_microbatches(mtf.Dimension("batch", 32), {"targets": 512}, "b:4;m:2", "batch:b",
                                       tokens_per_microbatch_per_replica=tokens)
  assert n == expected


def test_auto_train_steps_and_variable_dtype():
  assert utils.auto_train_steps(64, 512) == 2 ** 36 // (64 * 512)
  assert utils.auto_train_steps(8, {"inputs": 4, "targets": 16}, train_tokens=1280) == 10
  dtype = utils.get_variable_dtype("float32", "bfloat16", activation_dtype="bfloat16")
  assert (dtype.master_dtype, dtype.slice_dtype, dtype.activation_dtype) == (tf.float32, tf.bfloat16,
                                                                             tf.bfloat16)


def test_clean_decodes_pads_everything_after_the_first_eos():
  ids = np.array([[5, 6, 1, 7, 1, 8], [1, 4, 4, 4, 4, 4], [3, 3, 3, 3, 3, 3]], np.int32)
  with tf.Graph().as_default(), tf.Session() as sess:
    cleaned, by_column = sess.run([utils.clean_decodes(tf.constant(ids)),
                                   utils.clean_decodes(tf.constant(ids.T), length_axis=0, pad_id=9)])
  assert cleaned.tolist() == [[5, 6, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [3, 3, 3, 3, 3, 3]]
  assert by_column.T.tolist() == [[5, 6, 1, 9, 9, 9], [1, 9, 9, 9, 9, 9], [3, 3, 3, 3, 3, 3]]


def test_clean_decodes_accepts_nested_lists_and_numpy_arrays_eagerly():
  with tf.Graph().as_default(), tf.Session() as sess:
    from_list = sess.run(utils.clean_decodes([[5, 1, 7], [1, 2, 1]]))
  assert from_list.tolist() == [[5, 1, 0], [1, 0, 0]]
  cleaned = utils.clean_decodes(np.array([4, 2, 4, 2], np.int64), eos_id=2, pad_id=9)  # eager
  assert cleaned.dtype == tf.int64
  assert cleaned.numpy().tolist() == [4, 2, 9, 9]


def test_clean_decodes_is_gin_configurable_under_upstreams_name():
  with gin_config("utils.clean_decodes.pad_id = 7"):
    assert utils.clean_decodes([[3, 1, 3, 3]]).numpy().tolist() == [[3, 1, 7, 7]]


def _text2self_reference(inputs, targets, in_seg, tg_seg):
  """Per row and segment: the segment's inputs then its targets; positions continue; zeros after."""
  rows = {"targets": [], "targets_segmentation": [], "targets_position": []}
  for i_row, t_row, i_s, t_s in zip(inputs, targets, in_seg, tg_seg):
    tokens, seg, pos = [], [], []
    for s in sorted(set(i_s[i_s > 0]) | set(t_s[t_s > 0])):
      piece = list(i_row[i_s == s]) + list(t_row[t_s == s])
      tokens += piece
      seg += [s] * len(piece)
      pos += list(range(len(piece)))
    pad = [0] * (len(i_row) + len(t_row) - len(tokens))
    rows["targets"].append(tokens + pad)
    rows["targets_segmentation"].append(seg + pad)
    rows["targets_position"].append(pos + pad)
  return rows


def _run_text2self(features, mode):
  """{output feature: numpy value} of _dynamic_text2self on a 2-processor mesh."""
  names = sorted(features)
  out_names = []

  def build(mesh):
    batch, length = mtf.Dimension("batch", 2), mtf.Dimension("length", features["inputs"].shape[1])
    mtf_features = {k: mtf.import_tf_tensor(mesh, tf.constant(features[k]), mtf.Shape([batch, length]))
                    for k in names}
    out = utils._dynamic_text2self(mtf_features)
    assert [d.name for d in out["targets"].shape.dims] == ["batch", "length"]
    assert out["targets"].shape.dims[1].size == 2 * length.size
    out_names.extend(sorted(out))
    return [out[k] for k in out_names]

  values = lower_and_evaluate(build, "all:2", "batch:all", mode=mode)
  return dict(zip(out_names, values))


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_text2self_packed(mode):
  features = {
      "inputs": np.array([[3, 1, 4, 5, 1, 0], [6, 7, 1, 0, 0, 0]], np.int32),
      "inputs_segmentation": np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 0, 0, 0]], np.int32),
      "inputs_position": np.array([[0, 1, 0, 1, 2, 0], [0, 1, 2, 0, 0, 0]], np.int32),
      "targets": np.array([[8, 1, 9, 9, 9, 1], [2, 1, 0, 0, 0, 0]], np.int32),
      "targets_segmentation": np.array([[1, 1, 2, 2, 2, 2], [1, 1, 0, 0, 0, 0]], np.int32),
      "targets_position": np.array([[0, 1, 0, 1, 2, 3], [0, 1, 0, 0, 0, 0]], np.int32),
  }
  actual = _run_text2self(features, mode)
  expected = _text2self_reference(features["inputs"], features["targets"], features["inputs_segmentation"],
                                   features["targets_segmentation"])
  assert expected["targets"][0] == [3, 1, 8, 1, 4, 5, 1, 9, 9, 9, 1, 0]
  assert sorted(actual) == sorted(expected)
  for k, v in actual.items():
    assert v.tolist() == expected[k], k


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_text2self_unpacked(mode):
  features = {"inputs": np.array([[3, 1, 0, 0], [4, 4, 4, 1]], np.int32),
              "targets": np.array([[5, 6, 1, 0], [7, 1, 0, 0]], np.int32)}
  actual = _run_text2self(features, mode)
  assert list(actual) == ["targets"]
  assert actual["targets"].tolist() == [[3, 1, 5, 6, 1, 0, 0, 0], [4, 4, 4, 1, 7, 1, 0, 0]]


def test_dynamic_text2self_leaves_text2self_features_alone():
  features = {"targets": object()}
  assert utils._dynamic_text2self(features) is features


def test_maybe_add_pretokenized_features_decodes_missing_ones():
  vocabulary = mock.MagicMock()
  vocabulary.vocab_size = 100
  vocabulary.decode.side_effect = lambda ids: ["decoded %d" % i for i in ids]
  examples = [{"inputs": np.array([3, 4], np.int64), "targets": np.array([5], np.int8), "other": 1},
              {"targets": np.array([7], np.int32), "targets_pretokenized": "given"}]
  out = utils._maybe_add_pretokenized_features(examples, vocabulary)
  assert out[0] == {"inputs": out[0]["inputs"], "targets": out[0]["targets"], "other": 1,
                    "inputs_pretokenized": ["decoded 3", "decoded 4"], "targets_pretokenized": ["decoded 5"]}
  assert out[1]["targets_pretokenized"] == "given" and "inputs_pretokenized" not in out[1]
  vocabulary.decode.assert_any_call([3, 4])


def test_filter_features_keeps_model_features():
  ex = {k: 1 for k in utils._MODEL_FEATURES + ["inputs_pretokenized", "id"]}
  assert sorted(utils._filter_features(ex)) == sorted(utils._MODEL_FEATURES)
  assert len(utils._MODEL_FEATURES) == 7


def test_encode_inputs_and_delimited_lm_pad_to_batches():
  v = ByteVocabulary()
  a, b, c = (ord(ch) + 3 for ch in "abc")
  ids = utils.encode_inputs(["ab ", "abcabc"], v, "bitransformer", batch_size=3, sequence_length=4)
  assert ids.dtype == np.int32 and ids.tolist() == [[a, b, 1, 0], [a, b, c, a], [a, b, 1, 0]]
  assert utils.encode_inputs(["ab"], v, "lm", 1, 3).tolist() == [[a, b, 0]]
  ids = utils.encode_delimited_lm(["a"], ["bc"], (v, v), batch_size=2, sequence_length=6)
  assert ids.tolist() == [[a, 1, b, c, 1, 0]] * 2
  assert utils.encode_delimited_lm(["a"], ["b"], v, 1, 4, include_final_eos=False).tolist() == [[a, 1, b, 0]]


def test_encode_inputs_unscored_prefix_is_negated_in_front_of_each_line():
  v = ByteVocabulary()
  a, b, c = (ord(ch) + 3 for ch in "abc")
  ids = utils.encode_inputs(["c", "b"], v, "lm", 2, 4, unscored_prefix=[" ab ", "a"])
  assert ids.tolist() == [[-a, -b, c, 0], [-a, b, 0, 0]]
  ids = utils.encode_inputs(["c"], v, "bitransformer", 1, 3, eos_id=1, unscored_prefix=["ab"])
  assert ids.tolist() == [[-a, -b, c]]  # cut to sequence_length after the prefix, as 0.1.21
  with pytest.raises(ValueError, match="unscored_prefix has 1 strings for 2 inputs"):
    utils.encode_inputs(["a", "b"], v, "lm", 2, 4, unscored_prefix=["a"])


def test_input_and_output_files_round_trip(tmp_path):
  path = str(tmp_path / "lines.txt")
  utils.write_lines_to_file(["one", "two\nlines", 3], path)
  assert utils.get_inputs_from_file(path) == ["one", "two lines", "3"]
  utils.write_lines_to_file(["# comment", "kept"], path)  # replaces the file
  assert utils.get_inputs_from_file(path, ignore_comments=True) == ["kept"]
  utils.write_lines_to_file([], path)
  assert utils.get_inputs_from_file(path) is None


def test_metric_sum_and_max_accumulate_over_updates():
  with tf.Graph().as_default():
    values = tf.placeholder(tf.int32, [None])
    total, update_total = utils.metric_sum(values)
    peak, update_peak = utils.metric_max(values, name="peak")
    assert total.op.name == "metric_sum/accum" and peak.op.name == "peak/accum"
    assert not tf.trainable_variables()
    with tf.Session() as sess:
      sess.run(tf.local_variables_initializer())
      for batch in ([1, 2], [5], [3, 3]):
        sess.run([update_total, update_peak], {values: batch})
      assert sess.run([total, peak]) == [14.0, 5.0]


def _touch_checkpoints(model_dir, steps):
  for step in steps:
    for suffix in (".index", ".data-00000-of-00001"):
      open(os.path.join(model_dir, "model.ckpt-%d%s" % (step, suffix)), "w").close()
  open(os.path.join(model_dir, "model.ckpt-999.data-00000-of-00001"), "w").close()  # incomplete: no index


def test_get_checkpoint_iterator_selects_steps(tmp_path):
  model_dir = str(tmp_path)
  _touch_checkpoints(model_dir, [100, 200, 300])
  path = lambda step: os.path.join(model_dir, "model.ckpt-%d" % step)
  assert list(utils.get_checkpoint_iterator(200, model_dir)) == [path(200)]
  assert list(utils.get_checkpoint_iterator(260, model_dir)) == [path(300)]
  assert list(utils.get_checkpoint_iterator([90, 140, 1000], model_dir)) == [path(100), path(100), path(300)]
  assert list(utils.get_checkpoint_iterator("all", model_dir)) == [path(100), path(200), path(300)]
  assert list(utils.get_checkpoint_iterator("all", model_dir, skip_until=100)) == [path(200), path(300)]
  assert list(utils.get_checkpoint_iterator(-1, model_dir)) == [path(300)]
  assert list(utils.get_checkpoint_iterator(None, model_dir, skip_until=100, stop_after=200)) == [path(200)]
  with pytest.raises(ValueError, match=r"no checkpoint model.ckpt-250 .*\[100, 200, 300\]"):
    utils.get_checkpoint_iterator(250, model_dir, find_closest=False)
  assert utils.get_step_from_checkpoint_path(path(300)) == 300


def test_checkpoint_variable_mapping_and_filters():
  assert utils.init_checkpoint_variable_mapping("a/b") == "a/b"
  assert utils.init_checkpoint_variable_mapping("a/b", mapping_fn=str.upper) == "A/B"
  assert utils.should_load_variable("x") and not utils.should_load_variable("x", filter_fn=lambda n: False)
  assert utils.variable_filter_max_size(mock.Mock(size=10), max_size=10)
  assert not utils.variable_filter_max_size(mock.Mock(size=11), max_size=10)


def test_flexible_ckpt_init_mapping_skips_new_layers(tmp_path):
  names = ["encoder/block_000/layer_000/SelfAttention/q", "encoder/block_001/layer_000/SelfAttention/q",
           "decoder/block_001/layer_001/EncDecAttention/k", "shared/embedding"]
  with tf.Graph().as_default():
    variables = [tf.get_variable(n, [1]) for n in names]
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      path = tf.train.Saver(variables).save(sess, str(tmp_path / "model.ckpt"))
  fn = utils.flexible_ckpt_init_mapping(new_layers=[1])
  assert fn("encoder/block_000/layer_000/SelfAttention/q") == "encoder/block_000/layer_000/SelfAttention/q"
  assert fn("encoder/block_001/layer_000/SelfAttention/q") is None
  assert fn("encoder/block_002/layer_000/SelfAttention/q") == "encoder/block_001/layer_000/SelfAttention/q"
  assert fn("shared/embedding") == "shared/embedding"
  mapping = utils.flexible_ckpt_init_mapping(path, new_layers=[0, 2], return_mapping_fn=False)
  assert mapping == {"encoder/block_001/layer_000/SelfAttention/q": names[0],
                     "encoder/block_003/layer_000/SelfAttention/q": names[1],
                     "decoder/block_003/layer_001/EncDecAttention/k": names[2],
                     "shared/embedding": names[3]}


def test_vocabulary_pairs():
  a, b = ByteVocabulary(), ByteVocabulary(extra_ids=1)
  assert utils.separate_vocabularies(a, b) == (a, b)
  assert utils.inputs_vocabulary((a, b)) is a and utils.targets_vocabulary((a, b)) is b


# Tiny gin configuration for build_model: one block per stack, d_model 16.
_TINY_MODEL_GIN = """
transformer.make_layer_stack.layers = [@transformer_layers.SelfAttention, @transformer_layers.DenseReluDense]
decoder/transformer.make_layer_stack.layers = [@transformer_layers.SelfAttention,
                                              @transformer_layers.EncDecAttention,
                                              @transformer_layers.DenseReluDense]
transformer.make_layer_stack.num_layers = 1
transformer.Unitransformer.d_model = 16
transformer.Unitransformer.max_length = 8
transformer_layers.SelfAttention.num_heads = 2
transformer_layers.SelfAttention.key_value_size = 4
transformer_layers.DenseReluDense.hidden_size = 32
"""


@pytest.fixture
def tiny_model_gin():
  gin.clear_config()
  with gin.unlock_config():
    gin.parse_config(_TINY_MODEL_GIN)
  yield
  gin.clear_config()


@pytest.mark.parametrize("model_type, cls, autoregressive", [
    ("bitransformer", transformer.Bitransformer, True),
    ("bi_student_teacher", transformer.StudentTeacher, True),
    ("lm", transformer.Unitransformer, True),
    ("delimited_lm", transformer.Unitransformer, True),
    ("aligned", transformer.Unitransformer, False),
])
def test_build_model_for_every_model_type(tiny_model_gin, model_type, cls, autoregressive):
  model = utils.build_model(model_type, input_vocab_size=20, output_vocab_size=30, layout_rules="batch:b",
                            mesh_shape="b:2")
  assert isinstance(model, cls)
  decoder = {"bitransformer": lambda m: m.decoder,
             "bi_student_teacher": lambda m: m.student.decoder}.get(model_type, lambda m: m)(model)
  assert decoder.autoregressive == autoregressive
  assert decoder.output_vocab_dim.size == 128  # 30 rounded up to vocab_divisor
  assert decoder.layout == "batch:b" and decoder.mesh_shape == "b:2"
  assert decoder.model_dim.size == 16


def test_build_model_rejects_an_unknown_model_type():
  with pytest.raises(ValueError, match=r"unknown model_type 'gpt'.*'bitransformer', 'bi_student_teacher', "
                                       r"'lm', 'delimited_lm', 'aligned'"):
    utils.build_model("gpt", input_vocab_size=8, output_vocab_size=8)
