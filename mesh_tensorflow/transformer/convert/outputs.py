"""Output directories: refuse one that already holds a model unless told to overwrite it."""

from __future__ import annotations

import os

from mesh_tensorflow.transformer.convert.errors import ConversionError

HF_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


def check_writable(directory: str, model_files, overwrite: bool, option: str = "--overwrite") -> None:
  """Refuses `directory` when it holds one of model_files (names or a predicate) and not `overwrite`."""
  if overwrite or not os.path.isdir(directory):
    return
  held = sorted(name for name in os.listdir(directory) if model_files(name))
  if held:
    raise ConversionError(f"{directory} already holds a model ({', '.join(held[:3])}); choose an empty "
                          f"directory or pass {option}.")
