"""Our checkpoints, one variable at a time: finding the one to read, reading, and writing one.

Writing saves each variable into a checkpoint of its own (SaveV2) and merges them into one
(MergeV2Checkpoints), so no more than one variable is in memory; the result is the checkpoint
tf.train.Saver writes, with `global_step`, and the `checkpoint` file naming it.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Optional

import numpy as np
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer._train.checkpoints import is_bookkeeping_or_optimizer_state, write_state_file
from mesh_tensorflow.transformer.convert.errors import ConversionError



def checkpoint_path(model_dir: str, step: Optional[int] = None) -> str:
  """The checkpoint of `model_dir` at `step` (default: the latest), or ConversionError naming the dir."""
  if step is None:
    path = tf.train.latest_checkpoint(model_dir)
    if path is None:
      raise ConversionError(f"{model_dir}: no checkpoint (no `checkpoint` file naming a model.ckpt-N); "
                            f"give the model_dir a training run wrote, or --checkpoint_step.")
    return path
  path = os.path.join(model_dir, f"model.ckpt-{step}")
  if not tf.io.gfile.exists(path + ".index"):
    raise ConversionError(f"{path}: no checkpoint at step {step} in {model_dir}.")
  return path


class Reader:
  """Reads a checkpoint's variables one by one (as float32 or their stored dtype)."""

  def __init__(self, path: str):
    self.path = path
    self._reader = tf.train.load_checkpoint(path)
    self.shapes = self._reader.get_variable_to_shape_map()
    self.dtypes = {name: tf.as_dtype(d).name for name, d in self._reader.get_variable_to_dtype_map().items()}

  def model_variables(self) -> list:
    """The names that are model weights (no optimizer slot, step or random counter)."""
    return sorted(name for name in self.shapes if not is_bookkeeping_or_optimizer_state(name))

  def dropped(self) -> list:
    return sorted(name for name in self.shapes if is_bookkeeping_or_optimizer_state(name))

  def read(self, name: str) -> np.ndarray:
    return self._reader.get_tensor(name)


FEED_ALIGNMENT = 64  # bytes: a session feeds a C-contiguous array aligned so without copying it


def aligned_empty(shape, dtype) -> np.ndarray:
  """An uninitialised C-contiguous array at a FEED_ALIGNMENT-byte boundary.

  numpy aligns its buffers to 16 bytes; a session copies any feed that TensorFlow's allocator
  would not have aligned, which would hold a variable twice while it is saved.
  """
  dtype = np.dtype(dtype)
  size = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(size + FEED_ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % FEED_ALIGNMENT
  return raw[start:start + size].view(dtype).reshape(shape)


def aligned_copy(value: np.ndarray, dtype) -> np.ndarray:
  """value as an aligned_empty array of `dtype`, in one copy."""
  out = aligned_empty(value.shape, dtype)
  np.copyto(out, value, casting="unsafe")
  return out


def write(prefix: str, names: Iterable[str], read: Callable[[str], np.ndarray], step: int = 0) -> None:
  """Writes the checkpoint `prefix` (e.g. DIR/model.ckpt-0) of `names`, each value from read(name).

  Each variable is saved alone (fed to a SaveV2 op of a graph of its own, so this runs whether or
  not eager execution is on), then the parts are merged; the `checkpoint` file of DIR names it.
  A value from aligned_copy is saved without another copy of it.
  """
  part_dir = prefix + ".parts"
  with tf.Graph().as_default(), tf.Session() as session:
    parts = []
    for i, name in enumerate(list(names) + ["global_step"]):
      value = np.array(step, np.int64) if name == "global_step" else read(name)
      part = os.path.join(part_dir, f"part-{i:06d}")
      fed = tf.placeholder(tf.as_dtype(value.dtype), value.shape)
      session.run(tf.raw_ops.SaveV2(prefix=part, tensor_names=[name], shape_and_slices=[""], tensors=[fed]),
                  {fed: value})
      parts.append(part)
      del value
    session.run(tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts, destination_prefix=prefix,
                                              delete_old_dirs=True))
  if tf.io.gfile.exists(part_dir):
    tf.io.gfile.rmtree(part_dir)
  write_state_file(os.path.dirname(prefix), [prefix])
