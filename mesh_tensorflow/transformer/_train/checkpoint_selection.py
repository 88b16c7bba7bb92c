"""Which checkpoints to evaluate, and how model variables map onto an initial checkpoint's names."""

from __future__ import annotations

import re
import time
from typing import Callable, Iterable, Sequence

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer._train.checkpoints import (
    get_step_from_checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
)
from mesh_tensorflow.transformer._utils import GIN_MODULE

# How often the checkpoint_step=None iterator looks for new checkpoints.
POLL_SECONDS = 30.0


def _closest(paths: Sequence[str], step: int, find_closest: bool, model_dir: str) -> str:
  """The checkpoint of `step`, or (find_closest) the closest one, said out loud."""
  steps = [get_step_from_checkpoint_path(p) for p in paths]
  if not paths or (not find_closest and step not in steps):
    raise ValueError(f"no checkpoint model.ckpt-{step} in {model_dir!r}; its checkpoint steps are {steps}"
                     + ("" if find_closest else " (find_closest=False wants an exact step)"))
  closest_step, closest = min(zip(steps, paths), key=lambda sp: abs(sp[0] - step))
  if closest_step != step:
    print(f"No checkpoint at step {step} in {model_dir} (saved steps: {steps}); using the closest, "
          f"{closest}.")
  return closest


def _new_checkpoints(model_dir: str, skip_until: int, stop_after: int | None) -> Iterable[str]:
  """Checkpoints as they appear, in step order, after skip_until; stops after one >= stop_after.

  Says what it waits for (once per wait) while no new checkpoint is there.
  """
  last, waiting = skip_until, False
  while True:
    fresh = [p for p in list_checkpoints(model_dir) if get_step_from_checkpoint_path(p) > last]
    for path in fresh:
      yield path
      last = get_step_from_checkpoint_path(path)
      if stop_after is not None and last >= stop_after:
        return
    if not fresh and not waiting:
      print(f"Waiting for a checkpoint after step {last} in {model_dir} (looking every {POLL_SECONDS:g} s). "
            f"Stop with Ctrl-C, or set eval_checkpoint_step (e.g. -1 for the latest, 'all') to evaluate "
            f"the checkpoints already there.", flush=True)
    waiting = not fresh
    if not fresh:
      time.sleep(POLL_SECONDS)


@gin.configurable(module=GIN_MODULE)
def get_checkpoint_iterator(checkpoint_step, model_dir: str, skip_until: int = 0,
                            stop_after: int | None = None, find_closest: bool = True) -> Iterable[str]:
  """Checkpoint paths (model_dir/model.ckpt-<step>) selected by checkpoint_step.

  Args:
    checkpoint_step: an int: [the checkpoint with that step] (the closest one if find_closest, else
      ValueError when it is absent); a list of ints: each replaced that way; -1: [the latest];
      "all": every checkpoint with step > skip_until, oldest first; None: a generator that waits for
      new checkpoints (step > skip_until) and stops after one with step >= stop_after.
    model_dir: the directory holding the checkpoints.
  """
  if checkpoint_step is None:
    return _new_checkpoints(model_dir, skip_until, stop_after)
  if checkpoint_step == "all":
    return [p for p in list_checkpoints(model_dir) if get_step_from_checkpoint_path(p) > skip_until]
  if checkpoint_step == -1:
    latest = latest_checkpoint(model_dir)
    if latest is None:
      raise ValueError(f"no checkpoint in {model_dir!r}")
    return [latest]
  paths = list_checkpoints(model_dir)
  if isinstance(checkpoint_step, int):
    return [_closest(paths, checkpoint_step, find_closest, model_dir)]
  return [_closest(paths, step, find_closest, model_dir) for step in checkpoint_step]


@gin.configurable(module=GIN_MODULE)
def init_checkpoint_variable_mapping(name: str, mapping_fn: Callable[[str], str] | None = None) -> str:
  """The initial checkpoint's name for model variable `name` (mapping_fn(name), default unchanged)."""
  return mapping_fn(name) if mapping_fn else name


@gin.configurable(module=GIN_MODULE)
def should_load_variable(name: str, filter_fn: Callable[[str], bool] | None = None) -> bool:
  """Whether variable `name` is initialised from the initial checkpoint (filter_fn(name), default yes)."""
  return filter_fn(name) if filter_fn else True


@gin.configurable(module=GIN_MODULE)
def variable_filter_max_size(v, max_size: float = 1e7) -> bool:
  """A variable filter keeping variables of at most max_size elements."""
  return v.size <= max_size


_LAYER_RE = re.compile(r"(block|layer)_(\d{3})")


@gin.configurable(module=GIN_MODULE)
def flexible_ckpt_init_mapping(ckpt_path: str = "", new_layers: Sequence[int] | None = None,
                               return_mapping_fn: bool = True):
  """Maps model variables onto a checkpoint trained with fewer layers (new layers inserted).

  Layers are numbered by the first "block_NNN" or "layer_NNN" in a variable name (per stack:
  encoder and decoder alike). `new_layers` are the new model's indices of layers absent from the
  checkpoint; the other layers map, in order, onto the checkpoint's layers 0, 1, ... Variables of
  new layers map to None (nothing to load); names without a layer number map to themselves.

  Returns:
    With return_mapping_fn, a function for init_checkpoint_variable_mapping.mapping_fn; otherwise the
    dict {model variable name: checkpoint name} for the names a model with new_layers would have,
    built from the checkpoint's variables.
  """
  new_layers = sorted(set(new_layers or []))

  def old_index(new_index: int) -> int | None:
    if new_index in new_layers:
      return None
    return new_index - sum(1 for n in new_layers if n < new_index)

  def mapping_fn(name: str) -> str | None:
    match = _LAYER_RE.search(name)
    if not match:
      return name
    index = old_index(int(match.group(2)))
    if index is None:
      return None
    return name[:match.start(2)] + "%03d" % index + name[match.end(2):]

  if return_mapping_fn:
    return mapping_fn

  def new_index(old: int) -> int:
    index = old
    for n in new_layers:
      if n <= index:
        index += 1
    return index

  mapping = {}
  for ckpt_name, _ in tf.train.list_variables(ckpt_path):
    match = _LAYER_RE.search(ckpt_name)
    model_name = ckpt_name if not match else (
        ckpt_name[:match.start(2)] + "%03d" % new_index(int(match.group(2))) + ckpt_name[match.end(2):])
    mapping[model_name] = ckpt_name
  return mapping
