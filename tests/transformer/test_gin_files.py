"""The shipped gin files: each parses on top of defaults.gin, and each model/layout file builds a model.

Model files are built (the mtf graph, with small sizes bound on top) and tiny.gin is also lowered
and run. Every layout is checked against a model graph built for it (each split dimension divisible
by its mesh dimension); the CPU layout is lowered and run on the 8 virtual CPUs.
"""

from __future__ import annotations

import glob
import os
import sys

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from absl.testing import flagsaver

import mesh_tensorflow as mtf
import mesh_tensorflow.transformer as mtf_transformer
from mesh_tensorflow.transformer import dataset, t2t_vocabulary, utils
from mesh_tensorflow.transformer._train import model_fn
from mesh_tensorflow.transformer._train import run as _run  # noqa: F401  (registers utils.run with gin)
from mesh_tensorflow.transformer._utils.gin_config import packaged_gin_dir
from tests.harness import session_config

GIN_DIR = packaged_gin_dir()
ALL_FILES = sorted(os.path.relpath(p, GIN_DIR) for p in glob.glob(os.path.join(GIN_DIR, "**", "*.gin"),
                                                                   recursive=True))
MODEL_FILES = [f for f in ALL_FILES if f.startswith("models/")]
# Every layout: the layouts/ files and the top-level one.
LAYOUT_FILES = [f for f in ALL_FILES if f.startswith("layouts/")] + ["8x8_dp_r4.gin"]
PROBLEM_FILES = [f for f in ALL_FILES if f.startswith("problems/")]

# Small sizes bound after a model file (macros are read when the model is built).
SMALL_SIZES = """
num_layers = 1
d_model = 16
d_kv = 4
moe.MoE1D.num_experts = 2
moe.MoE1D.group_size = 8
"""
VOCAB_SIZE = 40
BATCH, LENGTH = 8, 8


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _parse(*files, bindings=""):
  with gin.unlock_config():
    gin.parse_config_file(os.path.join(GIN_DIR, "defaults.gin"))
    for f in files:
      gin.parse_config_file(os.path.join(GIN_DIR, f))
    gin.parse_config(bindings)


def _features(batch=BATCH):
  rng = np.random.RandomState(0)
  ids = rng.randint(2, VOCAB_SIZE, size=(batch, LENGTH)).astype(np.int32)
  return {"inputs": tf.constant(ids), "targets": tf.constant(np.roll(ids, 1, axis=1))}


def _model_type():
  try:
    return gin.query_parameter("utils.run.model_type")
  except ValueError:
    return "bitransformer"  # utils.run's default


def _build(layout_rules=None, mesh_shape=None):
  return utils.build_model(_model_type(), input_vocab_size=VOCAB_SIZE, output_vocab_size=VOCAB_SIZE,
                           layout_rules=layout_rules, mesh_shape=mesh_shape)


def _lower_and_run(model, mesh_shape, layout_rules, devices):
  """Builds the eval graph, lowers it and returns the per-example log-likelihoods."""
  with tf.Graph().as_default():
    impl = model_fn.make_mesh_impl(mesh_shape, layout_rules, devices)
    lowered = model_fn.build_model_graph(model, _features(), "eval", impl, utils.get_variable_dtype())
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowered.lowering.copy_masters_to_slices())
      return sess.run(lowered.outputs["log_likelihood"])


@pytest.mark.parametrize("name", ALL_FILES)
def test_gin_file_parses_on_top_of_defaults(name):
  _parse(name)
  assert gin.query_parameter("transformer.Unitransformer.max_length") == 512


def _build_graph(model, mesh_shape=None, layout_rules=None, batch=BATCH):
  """The model's mtf eval graph (with loss) on features [batch, LENGTH], checked against the layout."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  with tf.Graph().as_default():
    features = {k: mtf.import_tf_tensor(mesh, v, mtf.convert_to_shape(f"batch:{batch};length:{LENGTH}"))
                for k, v in _features(batch).items()}
    _, loss = model_fn._call_model(model, features, "eval", utils.get_variable_dtype(), compute_loss=True)
  assert loss.shape.dims == []
  if mesh_shape is not None:
    model_fn.check_layout_divides(graph, model_fn.make_mesh_impl(mesh_shape, layout_rules))
  return graph


@pytest.mark.parametrize("name", MODEL_FILES)
def test_model_file_builds_a_small_model_graph(name):
  _parse(name, bindings=SMALL_SIZES + "num_heads = 2\nd_ff = 8\n")
  expected_type = "lm" if os.path.basename(name).startswith("lm") else "bitransformer"
  assert _model_type() == expected_type
  graph = _build_graph(_build())
  shapes = {v.name: v.shape for v in graph.trainable_variables}
  prefixes = ["transformer/"] if expected_type == "lm" else ["encoder/", "decoder/"]
  for prefix in prefixes:
    assert any(n.startswith(prefix + "block_000/") for n in shapes), sorted(shapes)
  assert all(d.size == 16 for v in shapes.values() for d in v.dims if d.name == "d_model")
  has_experts = any("experts" in v.dimension_names for v in shapes.values())
  assert has_experts == ("moe" in name)


def test_tiny_model_file_lowers_and_runs():
  _parse("models/tiny.gin", bindings="utils.get_variable_dtype.activation_dtype = 'float32'")
  log_likelihood = _lower_and_run(_build(), "", "", [""])
  assert log_likelihood.shape == (BATCH,) and np.all(np.isfinite(log_likelihood))
  assert np.all(log_likelihood < 0)


def _mesh_dim_size(mesh_shape, layout_rules, tensor_dim_name, default):
  size = mtf.tensor_dim_to_mesh_dim_size(layout_rules, mesh_shape, mtf.Dimension(tensor_dim_name, 0))
  return size if size > 1 else default


def _parse_layout(name, extra=""):
  """Parses a layout file with model sizes it can split: returns (mesh_shape, layout_rules, batch)."""
  _parse(name)
  mesh_shape = mtf.convert_to_shape(gin.query_parameter("utils.run.mesh_shape"))
  layout_rules = mtf.convert_to_layout_rules(gin.query_parameter("utils.run.layout_rules"))
  heads = _mesh_dim_size(mesh_shape, layout_rules, "heads", 2)
  microbatches = 1
  try:  # a pipelined layout needs a block per stage, and a batch its microbatches can share
    extra += f"\nnum_layers = {gin.query_parameter('transformer.LayerStack.pipeline_stages')}\n"
    microbatches = gin.query_parameter("transformer.LayerStack.num_microbatches")
  except ValueError:
    pass
  gin.clear_config()
  _parse(name, bindings=SMALL_SIZES + f"num_heads = {heads}\nd_ff = {4 * heads}\n" + extra)
  return mesh_shape, layout_rules, microbatches * _mesh_dim_size(mesh_shape, layout_rules, "batch", 1)


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_layout_file_splits_a_built_model_evenly(name):
  mesh_shape, layout_rules, batch = _parse_layout(name)
  graph = _build_graph(_build(layout_rules, mesh_shape), mesh_shape, layout_rules, batch)
  impl = model_fn.make_mesh_impl(mesh_shape, layout_rules)
  split = {d.name for op in graph.operations for t in op.outputs for d in t.shape.dims
           if impl.tensor_dimension_to_mesh_axis(d) is not None}
  ruled = {tensor_dim for tensor_dim, _ in layout_rules} & {"outer_batch", "batch", "heads", "d_ff", "vocab",
                                                           "stages"}
  assert split == ruled


def test_cpu_layout_file_lowers_and_runs_on_8_virtual_cpus():
  mesh_shape, layout_rules, _ = _parse_layout("layouts/cpu8_dp_mp.gin")
  assert mesh_shape == mtf.convert_to_shape("batch:2;model:4")
  log_likelihood = _lower_and_run(_build(layout_rules, mesh_shape), mesh_shape, layout_rules,
                                  gin.query_parameter("utils.run.mesh_devices"))
  assert log_likelihood.shape == (BATCH,) and np.all(np.isfinite(log_likelihood))


def test_cpu_pipeline_layout_file_pipelines_the_stack_and_runs_on_8_virtual_cpus():
  mesh_shape, layout_rules, _ = _parse_layout("layouts/cpu8_pipeline.gin")
  assert mesh_shape == mtf.convert_to_shape("stage:2;batch:2;model:2")
  model = _build(layout_rules, mesh_shape)
  graph = _build_graph(model, mesh_shape, layout_rules)
  assert any(v.is_layer_stack and v.shape.dims[0] == mtf.Dimension("stages", 2) for v in graph.all_variables)
  devices = gin.query_parameter("utils.run.mesh_devices")
  log_likelihood = _lower_and_run(model, mesh_shape, layout_rules, devices)
  assert log_likelihood.shape == (BATCH,) and np.all(np.isfinite(log_likelihood))


def test_transparent_attention_file_sets_six_layers_per_stack_as_upstream():
  _parse("transparent_attention.gin")
  assert gin.query_parameter("transformer.make_layer_stack.num_layers") == 6
  assert [layer.selector for layer in gin.query_parameter("encoder/transformer.make_layer_stack.layers")] == [
      "transformer_layers.SelfAttention", "transformer_layers.DenseReluDense"]


def test_transparent_attention_file_builds_a_bitransformer():
  _parse("transparent_attention.gin", bindings=SMALL_SIZES + """
transformer.make_layer_stack.num_layers = 1
num_heads = 2
d_ff = 8
transformer_layers.TransparentEncDecAttention.layers_per_encoder_module = 1
transformer_layers.TransparentEncDecAttention.encoder_num_modules = 2
transformer_layers.TransparentEncDecAttention.layers_per_decoder_module = 3
transformer_layers.TransparentEncDecAttention.decoder_num_modules = 1
utils.get_variable_dtype.activation_dtype = 'float32'
""")
  model = _build()
  assert [type(layer).__name__ for layer in model.decoder.layer_stack.layers] == [
      "SelfAttention", "TransparentEncDecAttention", "DenseReluDense"]
  assert np.all(np.isfinite(_lower_and_run(model, "", "", [""])))


def test_learning_rate_schedule_files_bind_the_schedule():
  _parse("learning_rate_schedules/constant.gin")
  assert gin.query_parameter("utils.run.learning_rate_schedule").selector.endswith("constant_learning_rate")
  gin.clear_config()
  _parse("learning_rate_schedules/slanted_triangular.gin")
  assert gin.query_parameter("utils.run.learning_rate_schedule").selector.endswith("slanted_triangular")


def _write_t2t_data(data_dir, dataset_name, vocab_name, text2self):
  with tf.io.TFRecordWriter(os.path.join(data_dir, f"{dataset_name}-dev-00000-of-00001")) as writer:
    for ids in ([4, 5, 1], [6, 1]):
      keys = ["targets"] if text2self else ["inputs", "targets"]
      feature = {k: tf.train.Feature(int64_list=tf.train.Int64List(value=ids)) for k in keys}
      writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
  with open(os.path.join(data_dir, vocab_name), "w") as f:
    subtokens = ["<pad>", "<EOS>", "hi_", "_", "h", "i", "\\", "u", ";"] + list("0123456789")
    f.write("".join(f"'{s}'\n" for s in subtokens))


@pytest.mark.parametrize("name", [f for f in PROBLEM_FILES if "t2t" in f])
def test_t2t_problem_files_read_their_data_offline(name, tmp_path):
  _parse(name, bindings=f"t2t_data_dir = '{tmp_path}'")
  dataset_name = gin.query_parameter("dataset.pretokenized_t2t_dataset.dataset_name")
  vocab_name = gin.query_parameter("t2t_vocabulary.get_t2t_vocabulary.vocabulary_filename")
  text2self = gin.query_parameter("dataset.pretokenized_t2t_dataset.text2self")
  _write_t2t_data(str(tmp_path), dataset_name, vocab_name, text2self)
  vocab = t2t_vocabulary.get_t2t_vocabulary()
  assert vocab.decode(vocab.encode("hi")) == "hi"
  (ex,) = dataset.pretokenized_t2t_dataset(dataset_split="dev", sequence_length=8).as_numpy_iterator()
  assert ex["targets"].tolist() == [4, 5, 1, 6, 1, 0, 0, 0]
  assert ("inputs" in ex) == (not text2self)


@pytest.mark.parametrize("name", [f for f in PROBLEM_FILES if "t2t" not in f])
def test_tfds_problem_files_name_the_missing_package(name, monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails as if not installed
  _parse(name, bindings=f"t2t_data_dir = '{tmp_path}'")
  fn = dataset.untokenized_tfds_dataset if "untok" in name else dataset.pretokenized_tfds_dataset
  with pytest.raises(ImportError, match="pip install tensorflow-datasets"):
    fn(dataset_split="train", sequence_length=8, vocabulary=None)


def test_parse_gin_defaults_and_flags_finds_packaged_files_from_flags(tmp_path):
  extra = tmp_path / "mine.gin"
  extra.write_text("num_layers = 3\n")
  with flagsaver.flagsaver(gin_file=["models/bi_l12.gin", "layouts/2x2_dp_mp.gin", "mine.gin"],
                           gin_param=["d_model = 64"], gin_location_prefix=[str(tmp_path)]):
    utils.parse_gin_defaults_and_flags()
  assert gin.query_parameter("%num_layers") == 3  # files in order: mine.gin last
  assert gin.query_parameter("%d_model") == 64
  assert gin.query_parameter("utils.run.mesh_shape") == "batch:2,model:4"
  assert gin.query_parameter("utils.get_variable_dtype.activation_dtype") == "bfloat16"


def test_package_imports_every_submodule_in_spec_order():
  names = ["attention", "dataset", "learning_rate_schedules", "moe", "t2t_vocabulary", "transformer",
           "transformer_layers", "utils", "vocabulary"]
  assert all(getattr(mtf_transformer, n).__name__ == "mesh_tensorflow.transformer." + n for n in names)
