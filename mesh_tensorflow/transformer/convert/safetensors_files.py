"""Hugging Face's weight files: safetensors, sharded with an index above a size (5 GB, the Hub's).

The writer stages each tensor in a memory-mapped file as it arrives, so only one tensor is in
memory at a time; each shard is then written by safetensors from those maps (it copies nothing).
`peak_bytes` is the most tensor memory the writer held at once, its own accounting.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
from safetensors import TensorSpec, safe_open, serialize_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HUB_SHARD_BYTES = 5 * 10 ** 9


class ShardedWriter:
  """Collects named arrays with add(), then close() writes the shards (and index) into `directory`."""

  def __init__(self, directory: str, max_shard_bytes: int = HUB_SHARD_BYTES):
    self.directory = directory
    self.max_shard_bytes = max_shard_bytes
    self.peak_bytes = 0
    self._staging = tempfile.mkdtemp(prefix=".staging-", dir=directory)
    self._staged = {}  # name -> np.memmap

  def add(self, name: str, array: np.ndarray) -> None:
    """Stages `array` under `name` (in C order, as its dtype); the caller may drop it afterwards."""
    self.peak_bytes = max(self.peak_bytes, array.nbytes)
    path = os.path.join(self._staging, f"{len(self._staged):06d}.bin")
    # Raw bytes, not .npy: the .npy format cannot say bfloat16 (it reads back as void16).
    staged = np.memmap(path, mode="w+", dtype=array.dtype, shape=array.shape)
    staged[...] = array
    staged.flush()
    self._staged[name] = np.memmap(path, mode="r", dtype=array.dtype, shape=array.shape)

  def _shards(self) -> list:
    shards, current, size = [], [], 0
    for name, array in self._staged.items():
      if current and size + array.nbytes > self.max_shard_bytes:
        shards.append(current)
        current, size = [], 0
      current.append(name)
      size += array.nbytes
    return shards + [current]

  def close(self) -> list:
    """Writes the files; returns their names (the index last, where there is one)."""
    shards = self._shards()
    files = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, names in zip(files, shards):
      specs = {}
      for name in names:
        array = self._staged[name]
        specs[name] = TensorSpec(dtype=array.dtype.name, shape=list(array.shape), data_ptr=array.ctypes.data,
                                 data_len=array.nbytes)
      serialize_file(specs, os.path.join(self.directory, file), metadata={"format": "pt"})
    if len(shards) > 1:
      index = {"metadata": {"total_size": sum(a.nbytes for a in self._staged.values())},
               "weight_map": {name: file for file, names in zip(files, shards) for name in names}}
      with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
      files.append(INDEX_FILE)
    self.discard()
    return files

  def discard(self) -> None:
    """Removes the staged tensors (after close, or when the conversion fails)."""
    self._staged.clear()
    shutil.rmtree(self._staging, ignore_errors=True)


def weight_files(directory: str) -> dict:
  """{tensor name: file path} of a Hugging Face model directory ({} where it has no weights)."""
  index = os.path.join(directory, INDEX_FILE)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(directory, file) for name, file in weight_map.items()}
  single = os.path.join(directory, SINGLE_FILE)
  if not os.path.exists(single):
    return {}
  with safe_open(single, framework="numpy") as f:
    return {name: single for name in f.keys()}


def read(path: str, name: str) -> np.ndarray:
  """One tensor of a safetensors file (only that tensor is read into memory)."""
  with safe_open(path, framework="numpy") as f:
    return f.get_tensor(name)


def shape(path: str, name: str) -> list:
  """The shape of one tensor of a safetensors file, read from its header."""
  with safe_open(path, framework="numpy") as f:
    return list(f.get_slice(name).get_shape())


def read_rows(path: str, name: str, chunk_bytes: int = 16 * 2 ** 20):
  """One tensor of a safetensors file in blocks of its first axis: yields (start, stop, block),
  each block about chunk_bytes, so a caller copying them out holds no whole second copy."""
  with safe_open(path, framework="numpy") as f:
    tensor = f.get_slice(name)
    dims = tensor.get_shape()
    if not dims:
      raise ValueError(f"{path}: {name!r} is a scalar; read it whole (read), not by rows.")
    row_bytes = max(1, int(np.prod(dims[1:])) * _ITEM_BYTES.get(tensor.get_dtype(), 8))
    step = max(1, chunk_bytes // row_bytes)
    for start in range(0, dims[0], step):
      stop = min(start + step, dims[0])
      yield start, stop, tensor[start:stop]


_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1}  # safetensors' dtype names: bytes per element
