"""T5 checkpoints converted to and from Hugging Face give HF's own T5 our numbers, and back.

Against `transformers.T5ForConditionalGeneration` itself (the `hf` extra: torch, transformers,
sentencepiece); without it these tests skip, saying how to install it.
"""

from __future__ import annotations

import json
import os

import gin
import ml_dtypes
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import convert, utils, vocabulary
from mesh_tensorflow.transformer.convert import cli, mtf_checkpoints, safetensors_files
from mesh_tensorflow.transformer._train.checkpoints import is_bookkeeping_or_optimizer_state
from mesh_tensorflow.transformer._utils.gin_config import packaged_gin_dir
from tests.transformer import convert_fixtures as fixtures

HF_MISSING = "needs the hf extra (pip install -e '.[hf]': torch, transformers, sentencepiece)"
torch = pytest.importorskip("torch", reason=HF_MISSING)
transformers = pytest.importorskip("transformers", reason=HF_MISSING)
spm = pytest.importorskip("sentencepiece", reason=HF_MISSING)

TOLERANCE = 1e-4
DECODE_LENGTH = 4


def hf_outputs(hf_dir, ids: dict, decode_length: int = DECODE_LENGTH) -> dict:
  """HF's teacher-forced logits (decoder fed the targets shifted right) and greedy generate."""
  model = transformers.T5ForConditionalGeneration.from_pretrained(str(hf_dir)).eval()
  inputs = torch.tensor(ids["inputs"], dtype=torch.long)
  shifted = np.concatenate([np.zeros_like(ids["targets"][:, :1]), ids["targets"][:, :-1]], axis=1)
  with torch.no_grad():
    logits = model(input_ids=inputs, decoder_input_ids=torch.tensor(shifted, dtype=torch.long)).logits
    generated = model.generate(inputs, max_new_tokens=decode_length, do_sample=False, num_beams=1)
  return {"logits": logits.numpy(), "greedy": generated.numpy()[:, 1:]}  # generate starts with id 0


def checkpoint_values(prefix) -> dict:
  reader = tf.train.load_checkpoint(str(prefix))
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


@pytest.mark.parametrize("variant", sorted(fixtures.VARIANTS))
def test_hf_logits_and_greedy_decodes_equal_ours_after_to_hf(tmp_path, variant):
  model_dir = tmp_path / "ours"
  fixtures.write_checkpoint(str(model_dir), fixtures.VARIANTS[variant])
  summary = convert.to_hf(str(model_dir), str(tmp_path / "hf"))
  ids = fixtures.batch()
  ours = fixtures.ours(str(model_dir), ids, decode_length=DECODE_LENGTH)
  hf = hf_outputs(tmp_path / "hf", ids)
  np.testing.assert_allclose(hf["logits"], ours["logits"], atol=TOLERANCE, rtol=0)
  np.testing.assert_array_equal(hf["greedy"], ours["greedy"])
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert config["feed_forward_proj"] == {"v1_0": "relu", "no_bias_legacy_norm": "relu",
                                         "v1_1": "gated-gelu", "uneven": "gated-relu"}[variant]
  assert summary["files"] == ["model.safetensors"]
  assert len(summary["dropped"]) == 2 * summary["weights"] + 1  # two slots each, and global_step
  assert "global_step" in summary["dropped"]


def test_hf_loads_every_weight_and_reports_none_missing_or_unexpected(tmp_path):
  fixtures.write_checkpoint(str(tmp_path / "ours"), fixtures.VARIANTS["uneven"])
  convert.to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"))
  _, info = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path / "hf"),
                                                                    output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"], info


# HF's T5 has no form for "no relative bias" (to_hf writes zero biases) nor for the legacy norm scope
# names: that variant comes back as a standard T5 with the same numbers (the test below).
EXACT_VARIANTS = sorted(set(fixtures.VARIANTS) - {"no_bias_legacy_norm"})


@pytest.mark.parametrize("variant", EXACT_VARIANTS)
def test_ours_to_hf_to_ours_is_bit_exact_for_every_model_variable(tmp_path, variant):
  prefix = fixtures.write_checkpoint(str(tmp_path / "ours"), fixtures.VARIANTS[variant])
  convert.to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"))
  back = convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
  before = {k: v for k, v in checkpoint_values(prefix).items() if not is_bookkeeping_or_optimizer_state(k)}
  after = {k: v for k, v in checkpoint_values(back["checkpoint"]).items() if k != "global_step"}
  assert sorted(after) == sorted(before)
  for name, value in before.items():
    assert after[name].dtype == value.dtype and np.array_equal(after[name], value), name


def test_a_variant_hf_expresses_otherwise_comes_back_with_the_same_logits(tmp_path):
  fixtures.write_checkpoint(str(tmp_path / "ours"), fixtures.VARIANTS["no_bias_legacy_norm"])
  convert.to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"))
  convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
  ids = fixtures.batch()
  np.testing.assert_allclose(fixtures.ours(str(tmp_path / "back"), ids)["logits"],
                             fixtures.ours(str(tmp_path / "ours"), ids)["logits"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("tie, proj, sizes", [
    (True, "relu", {}),
    (False, "gated-gelu", {"num_decoder_layers": 1, "num_heads": 3, "d_kv": 4}),
    (False, "gated-relu", {"relative_attention_num_buckets": 16}),
], ids=["v1_0", "v1_1_uneven", "gated_relu_16_buckets"])
def test_ours_equal_hf_after_from_hf(tmp_path, tie, proj, sizes):
  fixtures.hf_native_model(tmp_path / "hf", tie, proj, **sizes)
  summary = convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
  assert summary["spec"].tied_logits is tie
  ids = fixtures.batch()
  ours = fixtures.ours(str(tmp_path / "ours"), ids, decode_length=DECODE_LENGTH)
  hf = hf_outputs(tmp_path / "hf", ids)
  np.testing.assert_allclose(ours["logits"], hf["logits"], atol=TOLERANCE, rtol=0)
  np.testing.assert_array_equal(ours["greedy"], hf["greedy"])


def test_bfloat16_masters_are_written_as_float32_unless_dtype_says_otherwise(tmp_path):
  prefix = fixtures.write_checkpoint(str(tmp_path / "ours"), fixtures.V1_1, dtype=ml_dtypes.bfloat16)
  masters = checkpoint_values(prefix)
  convert.to_hf(str(tmp_path / "ours"), str(tmp_path / "f32"))
  convert.to_hf(str(tmp_path / "ours"), str(tmp_path / "bf16"), dtype="bfloat16")
  for directory, dtype in (("f32", np.float32), ("bf16", ml_dtypes.bfloat16)):
    embedding = safetensors_files.read(str(tmp_path / directory / "model.safetensors"), "shared.weight")
    assert embedding.dtype == dtype
    expected = masters["shared/embedding"].astype(np.float32)
    np.testing.assert_array_equal(embedding.astype(np.float32), expected)
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
  model = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path / "bf16"))
  assert model.dtype == torch.bfloat16


def test_shards_with_an_index_above_the_shard_size_load_both_ways(tmp_path):
  fixtures.write_checkpoint(str(tmp_path / "ours"), fixtures.V1_1)
  summary = convert.to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"), max_shard_bytes=8 * 1024)
  shards = [f for f in summary["files"] if f.endswith(".safetensors")]
  assert len(shards) > 2 and summary["files"][-1] == "model.safetensors.index.json"
  largest = max(os.path.getsize(tmp_path / "hf" / f) for f in shards)
  ids = fixtures.batch()
  np.testing.assert_allclose(hf_outputs(tmp_path / "hf", ids)["logits"],
                             fixtures.ours(str(tmp_path / "ours"), ids)["logits"], atol=TOLERANCE, rtol=0)
  convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
  np.testing.assert_allclose(fixtures.ours(str(tmp_path / "back"), ids)["logits"],
                             fixtures.ours(str(tmp_path / "ours"), ids)["logits"], atol=0, rtol=0)
  # The writer holds one tensor at a time: its peak is the largest variable, not the model.
  shapes = fixtures_shapes(tmp_path / "ours")
  assert summary["peak_tensor_bytes"] == 4 * max(int(np.prod(s)) for s in shapes.values())
  assert largest < 3 * summary["peak_tensor_bytes"] + 8 * 1024


def fixtures_shapes(model_dir) -> dict:
  reader = mtf_checkpoints.Reader(str(tf.train.latest_checkpoint(str(model_dir))))
  return {name: reader.shapes[name] for name in reader.model_variables()}


# ---- vocabularies ----

STRINGS = ["the lazy fox 42 jumps", "héllo wörld", ""]


def test_a_byte_vocabulary_becomes_a_byt5_tokenizer_and_comes_back(tmp_path):
  bindings = fixtures.V1_0 + ["utils.run.vocabulary = @convert.byte_vocabulary()",
                              "convert.byte_vocabulary.extra_ids = 0"]
  fixtures.write_checkpoint(str(tmp_path / "ours"), bindings)
  assert convert.to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"))["tokenizer"] == "ByT5Tokenizer"
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  ours = vocabulary.ByteVocabulary()
  for s in STRINGS:
    assert tokenizer(s, add_special_tokens=False).input_ids == ours.encode(s)
  convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
  config = (tmp_path / "back" / "operative_config.gin").read_text()
  assert "utils.run.vocabulary = @convert.byte_vocabulary()" in config


def train_sentencepiece(directory) -> str:
  corpus = directory / "corpus.txt"
  corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(200)))
  spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(directory / "tiny"), vocab_size=60,
                                 pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
  return str(directory / "tiny.model")


def test_a_sentencepiece_vocabulary_becomes_a_t5_tokenizer_and_comes_back(tmp_path):
  model_file = train_sentencepiece(tmp_path)
  bindings = fixtures.V1_0 + ["utils.run.vocabulary = @convert.sentencepiece_vocabulary()",
                              f"convert.sentencepiece_vocabulary.sentencepiece_model_file = '{model_file}'"]
  fixtures.write_checkpoint(str(tmp_path / "ours"), bindings)
  assert convert.to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"))["tokenizer"] == "T5Tokenizer"
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  ours = convert.SentencePieceVocabulary(model_file)
  for s in STRINGS:
    assert tokenizer(s, add_special_tokens=False).input_ids == ours.encode(s)
  assert ours.decode(ours.encode(STRINGS[0]) + [1, 0]) == STRINGS[0]
  convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
  config = (tmp_path / "back" / "operative_config.gin").read_text()
  copied = str(tmp_path / "back" / "spiece.model")
  assert f"convert.sentencepiece_vocabulary.sentencepiece_model_file = {copied!r}" in config
  assert convert.SentencePieceVocabulary(copied).encode(STRINGS[0]) == ours.encode(STRINGS[0])


# ---- what from_hf writes, utils.run uses ----

RUN = """
import examples.transformer.data
utils.run.vocabulary = @convert.byte_vocabulary()
utils.run.train_dataset_fn = @data.transduction_dataset
utils.run.sequence_length = {"inputs": 12, "targets": 12}
utils.run.batch_size = ("sequences_per_batch", 4)
utils.run.mesh_shape = "batch:2"
utils.run.layout_rules = "batch:batch"
utils.run.mesh_devices = ["cpu:0", "cpu:1"]
utils.run.iterations_per_loop = 1
utils.run.save_checkpoints_steps = 2
data.transduction_dataset.task = "reverse"
utils.get_variable_dtype.activation_dtype = "float32"  # defaults.gin says bfloat16
"""


DEFAULTS = os.path.join(packaged_gin_dir(), "defaults.gin")  # what transformer.main parses first


def run_from(converted, mode: str, bindings=(), model_dir=None, **kwargs):
  """utils.run of the model from_hf wrote in `converted`, with the run settings above."""
  gin.clear_config()
  with gin.unlock_config():
    gin.parse_config_files_and_bindings([DEFAULTS, str(converted / "operative_config.gin")], [RUN, *bindings])
  try:
    return utils.run(tpu_job_name=None, tpu=None, gcp_project=None, tpu_zone=None,
                     model_dir=str(model_dir or converted), mode=mode, **kwargs)
  finally:
    gin.clear_config()


def test_utils_run_scores_like_hf_and_fine_tunes_the_converted_model_dir(tmp_path):
  fixtures.hf_native_model(tmp_path / "hf", True, "relu", vocab_size=260)  # the bytes, EOS, PAD and UNK
  (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
  convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
  scoring = ["utils.score_from_strings.inputs = ['abc']", "utils.score_from_strings.targets = ['cba']"]
  ours = run_from(tmp_path / "ours", "score_from_strings", scoring, eval_checkpoint_step=0)[0]
  model = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path / "hf"))
  byte_ids = vocabulary.ByteVocabulary().encode
  labels = torch.tensor([byte_ids("cba") + [1]])
  with torch.no_grad():
    loss = model(input_ids=torch.tensor([byte_ids("abc") + [1]]), labels=labels).loss
  np.testing.assert_allclose(ours[0], -loss.item() * labels.shape[1], rtol=1e-4)

  # Fine-tuning starts from it (the optimizer's slots are new: HF has none).
  result = run_from(tmp_path / "ours", "train", model_dir=tmp_path / "finetuned", train_steps=2,
                    init_checkpoint=str(tmp_path / "ours" / "model.ckpt-0"))
  assert result["step"] == 2 and np.isfinite(result["loss"])
  tuned = checkpoint_values(tf.train.latest_checkpoint(str(tmp_path / "finetuned")))
  start = checkpoint_values(tmp_path / "ours" / "model.ckpt-0")
  assert tuned["global_step"] == 2
  assert not np.array_equal(tuned["shared/embedding"], start["shared/embedding"])


# ---- the original's checkpoint ----

def test_a_checkpoint_the_original_wrote_converts_with_the_originals_logits(tmp_path):
  from tests.differential import sides
  sides.skip_unless_installed()
  from tests.differential import probe
  bindings = [b for b in fixtures.V1_0 if "vocab_divisor" not in b]  # the original pads vocab 20 to 128
  defaults = sides.ROOT / "mesh_tensorflow" / "transformer" / "gin" / "defaults.gin"
  args = [f"--gin_file={defaults}", "--mode=eval", "--write", f"--checkpoint={tmp_path / 'model.ckpt'}",
          f"--out={tmp_path / 'original.npz'}"]
  sides.run("original", "probe.py", args + [f"--gin_param={b}" for b in bindings])
  with np.load(tmp_path / "original.npz") as data:
    original = dict(data)
  convert.to_hf(str(tmp_path), str(tmp_path / "hf"), gin_files=[str(defaults)], gin_bindings=bindings)
  ids = probe.batch_ids()
  model = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path / "hf"))
  inputs = torch.tensor(ids["inputs"], dtype=torch.long)
  shifted = np.concatenate([np.zeros_like(ids["targets"][:, :1]), ids["targets"][:, :-1]], axis=1)
  with torch.no_grad():
    logits = model(input_ids=inputs, attention_mask=(inputs != 0).long(),
                   decoder_input_ids=torch.tensor(shifted, dtype=torch.long)).logits.numpy()
    greedy = model.generate(inputs, attention_mask=(inputs != 0).long(), max_new_tokens=probe.LENGTH,
                            do_sample=False, num_beams=1).numpy()[:, 1:]
  real = ids["targets"] != 0  # the original's decoder has no padding mask: compare real positions
  np.testing.assert_allclose(logits[real], original["logits"][real], atol=TOLERANCE, rtol=0)
  np.testing.assert_array_equal(greedy, original["decode/greedy"])


# ---- refused input: one line naming the path or option, nothing written ----

def run_cli(capsys, *argv) -> tuple:
  status = cli.main(list(argv))
  captured = capsys.readouterr()
  return status, captured.out, captured.err


def test_a_model_dir_without_a_checkpoint_is_refused_naming_it(tmp_path, capsys):
  (tmp_path / "empty").mkdir()
  status, _, err = run_cli(capsys, "to_hf", "--model_dir", str(tmp_path / "empty"),
                           "--output_dir", str(tmp_path / "hf"))
  assert status == 1 and err.count("\n") == 1
  assert err.startswith(f"error: {tmp_path / 'empty'}: no checkpoint")
  assert not (tmp_path / "hf").exists()


def test_a_directory_without_config_json_is_refused_naming_it(tmp_path, capsys):
  (tmp_path / "hf").mkdir()
  status, _, err = run_cli(capsys, "from_hf", "--hf_dir", str(tmp_path / "hf"),
                           "--model_dir", str(tmp_path / "o"))
  assert status == 1
  assert err == f"error: {tmp_path / 'hf' / 'config.json'}: no config.json; give the directory of a " \
                "Hugging Face T5 model.\n"
  assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("binding, option", [
    ("encoder/make_layer_stack.layers = [@transformer_layers.TalkingHeadsSelfAttention, "
     "@transformer_layers.DenseReluDense]", "encoder/make_layer_stack.layers"),
    ("decoder/make_layer_stack.layers = [@transformer_layers.SelfAttention, "
     "@transformer_layers.EncDecAttention, "
     "@moe.MoE1D]", "decoder/make_layer_stack.layers"),
    ("SelfAttention.num_memory_heads = 1", "SelfAttention.num_memory_heads"),
    ("DenseReluDense.activation = 'swish'", "DenseReluDense.activation"),
    ("Unitransformer.positional_embedding = True", "Unitransformer.positional_embedding"),
])
def test_an_option_hf_t5_cannot_express_is_refused_naming_it(tmp_path, capsys, binding, option):
  fixtures.write_checkpoint(str(tmp_path / "ours"), fixtures.V1_0)
  status, _, err = run_cli(capsys, "to_hf", "--model_dir", str(tmp_path / "ours"), "--output_dir",
                           str(tmp_path / "hf"), "--gin_param", binding)
  assert status == 1 and err.count("\n") == 1 and option in err, err
  assert not (tmp_path / "hf").exists()


def test_an_output_directory_holding_a_model_is_refused_unless_overwrite(tmp_path, capsys):
  fixtures.write_checkpoint(str(tmp_path / "ours"), fixtures.V1_0)
  args = ["to_hf", "--model_dir", str(tmp_path / "ours"), "--output_dir", str(tmp_path / "hf")]
  status, out, _ = run_cli(capsys, *args)
  assert status == 0
  assert out.startswith(f"wrote 47 weights of {tmp_path / 'ours' / 'model.ckpt-7'} to {tmp_path / 'hf'} "
                        f"(model.safetensors); dropped 95 optimizer slot and bookkeeping variables")
  before = (tmp_path / "hf" / "model.safetensors").read_bytes()
  status, _, err = run_cli(capsys, *args)
  assert status == 1 and err.startswith(f"error: {tmp_path / 'hf'} already holds a model (config.json, "
                                        f"model.safetensors); choose an empty directory or pass --overwrite.")
  assert (tmp_path / "hf" / "model.safetensors").read_bytes() == before
  assert run_cli(capsys, *args, "--overwrite")[0] == 0
  back = ["from_hf", "--hf_dir", str(tmp_path / "hf"), "--model_dir", str(tmp_path / "ours")]
  status, _, err = run_cli(capsys, *back)
  assert status == 1 and "already holds a model (checkpoint, model.ckpt-7" in err


@pytest.mark.parametrize("source_dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_from_hf_values_are_aligned_float32_copies_a_session_feeds_without_copying(source_dtype):
  """from_hf hands SaveV2 64-byte-aligned arrays: a session copies a feed TensorFlow's allocator
  would not have aligned (numpy's 16 bytes), which held a variable twice while it was saved."""
  value = np.arange(6 * 10, dtype=np.float32).reshape(6, 10).astype(source_dtype)
  for source in (value, value.T, value[1:]):
    copy = mtf_checkpoints.aligned_copy(source, np.float32)
    assert copy.ctypes.data % mtf_checkpoints.FEED_ALIGNMENT == 0 and copy.flags["C_CONTIGUOUS"]
    assert copy.dtype == np.float32 and copy.shape == source.shape
    np.testing.assert_array_equal(copy, source.astype(np.float32))


def test_a_safetensors_tensor_read_by_rows_is_the_whole_tensor_in_blocks(tmp_path):
  """from_hf copies each tensor out of its file block by block, never holding it twice."""
  from safetensors.numpy import save_file
  value = np.arange(7 * 3 * 2, dtype=np.float32).reshape(7, 3, 2).astype(ml_dtypes.bfloat16)
  path = str(tmp_path / "model.safetensors")
  save_file({"w": value}, path)
  blocks = list(safetensors_files.read_rows(path, "w", chunk_bytes=2 * 3 * 2 * 2))  # two rows a block
  assert [(start, stop) for start, stop, _ in blocks] == [(0, 2), (2, 4), (4, 6), (6, 7)]
  np.testing.assert_array_equal(np.concatenate([b for _, _, b in blocks]), value)
  assert safetensors_files.shape(path, "w") == [7, 3, 2]
