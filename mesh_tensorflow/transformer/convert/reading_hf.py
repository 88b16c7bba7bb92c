"""from_hf: a Hugging Face T5 directory -> our checkpoint and operative_config.gin."""

from __future__ import annotations

import json
import os

import gin
import numpy as np
from absl import logging

from mesh_tensorflow.transformer._train.loop import OPERATIVE_CONFIG
from mesh_tensorflow.transformer.convert import gin_model, gin_text, mtf_checkpoints, names, outputs
from mesh_tensorflow.transformer.convert import safetensors_files, vocab
from mesh_tensorflow.transformer.convert.errors import ConversionError
from mesh_tensorflow.transformer.convert.spec import from_hf_config

# Tensors HF files may hold that are copies of others (tied embeddings) or that HF itself ignores.
_IGNORED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
            "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")


def _is_our_model_file(name: str) -> bool:
  return name == "checkpoint" or name.startswith("model.ckpt") or name == OPERATIVE_CONFIG


def from_hf(hf_dir: str, model_dir: str, overwrite: bool = False) -> dict:
  """Converts the T5 in hf_dir to a checkpoint `model_dir/model.ckpt-0` and its operative_config.gin.

  utils.run then evaluates or decodes from model_dir, or fine-tunes it (as init_checkpoint). Checks
  everything before writing. Returns a summary (the T5Spec, the weights, the files). Clears gin.
  """
  config_path = os.path.join(hf_dir, "config.json")
  if not os.path.exists(config_path):
    raise ConversionError(f"{config_path}: no config.json; give the directory of a Hugging Face T5 model.")
  with open(config_path) as f:
    spec = from_hf_config(json.load(f), config_path)
  files = safetensors_files.weight_files(hf_dir)
  if not files:
    raise ConversionError(f"{hf_dir}: no model.safetensors (or its index); save the model with "
                          f"save_pretrained(safe_serialization=True).")
  outputs.check_writable(model_dir, _is_our_model_file, overwrite)
  bindings = gin_text.model_bindings(spec)
  try:
    gin_model.parse_config([], bindings)
    model = gin_model.build_model(spec.vocab_size)
    expected = gin_model.variables(model)
    weights = names.weights(model, expected)
  finally:
    gin.clear_config()
  sources = {w.ours: w for w in weights}  # each variable's HF tensor
  if "decoder/logits/kernel" in sources and "lm_head.weight" not in files:
    # transformers >= 5 ties lm_head to the embedding and saves the table once; the logits use it.
    sources["decoder/logits/kernel"] = names.Weight("decoder/logits/kernel", "shared.weight", True)
  _check_tensors(hf_dir, files, {w.hf for w in sources.values()})
  os.makedirs(model_dir, exist_ok=True)
  lines = bindings + vocab.gin_vocabulary(hf_dir, model_dir)
  prefix = os.path.join(model_dir, "model.ckpt-0")

  def read(ours: str) -> np.ndarray:
    """The variable as float32, copied block by block out of the file into an array SaveV2 is
    fed without another copy: one copy of it in memory."""
    weight = sources[ours]
    path = files[weight.hf]
    shape = safetensors_files.shape(path, weight.hf)
    if not shape:
      return mtf_checkpoints.aligned_copy(safetensors_files.read(path, weight.hf), np.float32)
    out = mtf_checkpoints.aligned_empty(shape[::-1] if weight.transpose else shape, np.float32)
    for start, stop, rows in safetensors_files.read_rows(path, weight.hf):
      if weight.transpose:
        out[..., start:stop] = rows.T
      else:
        out[start:stop] = rows
    return out

  mtf_checkpoints.write(prefix, sorted(sources), read)
  with open(os.path.join(model_dir, OPERATIVE_CONFIG), "w") as f:
    f.write(f"# Written by mesh_tensorflow.transformer.convert from_hf from {hf_dir}.\n")
    f.write("import mesh_tensorflow.transformer.convert\n")
    f.write("\n".join(lines) + "\n")
  logging.info("from_hf: wrote %d variables to %s", len(sources), prefix)
  return {"spec": spec, "checkpoint": prefix, "weights": len(sources)}


def _check_tensors(hf_dir: str, files: dict, needed: set) -> None:
  """Refuses weights that lack a tensor the config's T5 has, or hold one it has no place for."""
  missing = sorted(needed - set(files))
  if missing:
    raise ConversionError(f"{hf_dir}: the weights lack {missing[0]!r} (and {len(missing) - 1} more) that "
                          f"its config.json's T5 has.")
  extra = sorted(set(files) - needed - set(_IGNORED) - {"lm_head.weight"})
  if extra:
    raise ConversionError(f"{hf_dir}: tensor {extra[0]!r} (and {len(extra) - 1} more) has no place in "
                          f"the T5 its config.json describes.")
