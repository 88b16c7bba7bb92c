"""to_hf: our T5 checkpoint and gin configuration -> a Hugging Face T5 directory."""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import gin
import ml_dtypes
import numpy as np
from absl import logging

from mesh_tensorflow.transformer._train.loop import OPERATIVE_CONFIG
from mesh_tensorflow.transformer.convert import gin_model, mtf_checkpoints, names, outputs, safetensors_files
from mesh_tensorflow.transformer.convert import vocab
from mesh_tensorflow.transformer.convert.errors import ConversionError
from mesh_tensorflow.transformer.convert.spec import T5Spec, hf_config

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _gin_files(model_dir: str, gin_files: Sequence[str]) -> list:
  if gin_files:
    return list(gin_files)
  path = os.path.join(model_dir, OPERATIVE_CONFIG)
  if not os.path.exists(path):
    raise ConversionError(f"{path}: no operative config; pass the model's configuration with --gin_file.")
  return [path]


def _is_hf_model_file(name: str) -> bool:
  return name in outputs.HF_MODEL_FILES or (name.startswith("model-") and name.endswith(".safetensors"))


def to_hf(model_dir: str, output_dir: str, checkpoint_step: Optional[int] = None,
          gin_files: Sequence[str] = (), gin_bindings: Sequence[str] = (), dtype: str = "float32",
          overwrite: bool = False, max_shard_bytes: int = safetensors_files.HUB_SHARD_BYTES) -> dict:
  """Converts the checkpoint of model_dir to `output_dir` (config.json, safetensors, tokenizer).

  The model is the one the operative config of model_dir (or gin_files and gin_bindings)
  configures. Everything is checked before anything is written; optimizer state is dropped.
  Returns a summary: the T5Spec, the weights written, the dropped variables, the files and the
  writer's peak tensor bytes. Clears gin's configuration (it parses the model's).
  """
  if dtype not in DTYPES:
    raise ConversionError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}.")
  outputs.check_writable(output_dir, _is_hf_model_file, overwrite)
  path = mtf_checkpoints.checkpoint_path(model_dir, checkpoint_step)
  reader = mtf_checkpoints.Reader(path)
  files = _gin_files(model_dir, gin_files)
  try:
    gin_model.parse_config(files, gin_bindings)
    spec, weights = _plan(reader, path)
    os.makedirs(output_dir, exist_ok=True)
    texts = [open(f).read() for f in files] + list(gin_bindings)
    tokenizer = vocab.write_hf_tokenizer(texts, output_dir)
  finally:
    gin.clear_config()
  dropped = reader.dropped()
  logging.info("to_hf: dropped %d optimizer slot and bookkeeping variables (e.g. %s).", len(dropped),
               dropped[:2])
  written = _write_weights(reader, spec, weights, output_dir, DTYPES[dtype], max_shard_bytes)
  with open(os.path.join(output_dir, "config.json"), "w") as f:
    json.dump(hf_config(spec, dtype), f, indent=2, sort_keys=True)
  return {"spec": spec, "checkpoint": path, "weights": len(weights), "dropped": dropped,
          "tokenizer": tokenizer, **written}


def _plan(reader: mtf_checkpoints.Reader, path: str) -> tuple:
  """(T5Spec, [Weight]) of the configured model, checked against the checkpoint's variables."""
  if "shared/embedding" not in reader.shapes:
    raise ConversionError(f"{path}: no variable 'shared/embedding'; only a Bitransformer with a shared "
                          f"embedding (Bitransformer.shared_embedding = True) converts.")
  vocab_size = reader.shapes["shared/embedding"][0]
  model = gin_model.build_model(vocab_size)
  spec: T5Spec = gin_model.spec(model, vocab_size)
  expected = gin_model.variables(model)
  saved = reader.model_variables()
  missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
  if missing or extra:
    raise ConversionError(f"{path} does not match the configured model: it lacks {missing[:3]} and holds "
                          f"{extra[:3]}; pass the gin configuration that trained it.")
  for name, shape in expected.items():
    if list(reader.shapes[name]) != shape:
      raise ConversionError(f"{path}: variable {name!r} has shape {reader.shapes[name]}, the configured "
                            f"model {shape}; pass the gin configuration that trained it.")
  return spec, names.weights(model, expected)


def _write_weights(reader, spec, weights, output_dir, dtype, max_shard_bytes) -> dict:
  writer = safetensors_files.ShardedWriter(output_dir, max_shard_bytes)
  try:
    for weight in weights:
      value = reader.read(weight.ours)
      # A view where the dtype matches: the writer copies it into its staging file, once.
      writer.add(weight.hf, (value.T if weight.transpose else value).astype(dtype, copy=False))
      del value
    for hf_name, shape in names.zero_relative_biases(spec):
      writer.add(hf_name, np.zeros(shape, dtype))
    files = writer.close()
  except BaseException:
    writer.discard()
    raise
  return {"files": files, "peak_tensor_bytes": writer.peak_bytes}
