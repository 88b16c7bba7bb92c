"""Checkpoints in `model_dir`: crash-safe saves of whole master variables, checked restores.

A checkpoint is `model_dir/model.ckpt-<step>.{index,data-*}` written by a plain `tf.train.Saver`
over the global variables: whole master variables, or slices saved as parts of whole variables
(SaveSliceInfo, `PlacementMeshImpl(masters="sliced")`), plus the global step. Either way it holds
each variable whole, so `tf.train.load_checkpoint` reads it and a checkpoint written under one mesh
restores under any other. A save is atomic:

1. the Saver writes to `model_dir/.tmp-<pid>-model.ckpt-<step>.*` (never listed as a checkpoint);
2. the data files, then the index, are renamed to their final names (`os.replace` is atomic);
3. the `checkpoint` state file is rewritten through a temporary file and `os.replace`.

A process killed anywhere in between leaves the previous checkpoint as the latest one, intact;
leftover temporary files are removed by the next run.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Callable, Optional, Sequence

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow._lowering import random_stream
from mesh_tensorflow.transformer._utils import GIN_MODULE
from mesh_tensorflow._tf_compat import saveable_object

CHECKPOINT_PREFIX = "model.ckpt"
_TMP_PREFIX = ".tmp-"


class CheckpointMismatchError(ValueError):
  """A checkpoint does not hold the variables (names and shapes) the model expects."""


def checkpoint_path(model_dir: str, step: int) -> str:
  return os.path.join(model_dir, "%s-%d" % (CHECKPOINT_PREFIX, step))


def get_step_from_checkpoint_path(checkpoint_path: str) -> int:
  """The step in a path containing `model.ckpt-<step>` (the last such; `.index` etc. may follow).

  Raises:
    ValueError: the path names no step.
  """
  match = re.match(r".*%s-(\d+)" % re.escape(CHECKPOINT_PREFIX), checkpoint_path)
  if not match:
    raise ValueError(f"{checkpoint_path!r} is not a checkpoint path of the form "
                     f".../{CHECKPOINT_PREFIX}-<step>.")
  return int(match.group(1))


def list_checkpoints(model_dir: str) -> list:
  """Complete checkpoints in model_dir (their index file exists), as paths sorted by step."""
  paths = []
  for index in tf.io.gfile.glob(os.path.join(model_dir, CHECKPOINT_PREFIX + "-*.index")):
    path = index[:-len(".index")]
    if re.search(r"-\d+$", path):
      paths.append(path)
  return sorted(paths, key=get_step_from_checkpoint_path)


def latest_checkpoint(model_dir: str) -> Optional[str]:
  """The checkpoint named latest by the state file if it is complete, else the newest complete one."""
  state = tf.train.get_checkpoint_state(model_dir) if tf.io.gfile.exists(model_dir) else None
  if state and state.model_checkpoint_path:
    path = state.model_checkpoint_path
    if not os.path.isabs(path):
      path = os.path.join(model_dir, path)
    if tf.io.gfile.exists(path + ".index"):
      return path
  complete = list_checkpoints(model_dir) if tf.io.gfile.exists(model_dir) else []
  return complete[-1] if complete else None


def skipped_checkpoints(model_dir: str) -> list:
  """A message per checkpoint of model_dir that is skipped because its files are incomplete.

  A checkpoint counts once its index exists; data files without one (a copy cut short, a save
  from before atomic saves) are not one.
  """
  if not tf.io.gfile.exists(model_dir):
    return []
  complete = set(list_checkpoints(model_dir))
  partial = {re.sub(r"\.data-\d+-of-\d+$", "", p)
             for p in tf.io.gfile.glob(os.path.join(model_dir, CHECKPOINT_PREFIX + "-*.data-*"))}
  latest = latest_checkpoint(model_dir)
  return [f"Skipping {p}: its data files have no {os.path.basename(p)}.index, so it is incomplete; "
          f"{'using ' + latest if latest else 'no complete checkpoint is left'}."
          for p in sorted(partial - complete, key=get_step_from_checkpoint_path)]


def remove_partial_saves(model_dir: str) -> list:
  """Deletes temporary files left by a save that was interrupted; returns their paths."""
  leftovers = glob.glob(os.path.join(model_dir, _TMP_PREFIX + "*"))
  for path in leftovers:
    os.remove(path)
  return leftovers


def _saved_variables(variables: Sequence) -> dict:
  """{name the checkpoint holds: (whole shape, [the tf.Variables saved under it])}.

  A variable is saved under its op name, or, with a SaveSliceInfo, as a part of the whole variable
  that info names; a layer stack's part (sliced masters) as parts of the several layers' variables
  its save_slice_infos name.
  """
  ret = {}
  for var in variables:
    info = getattr(var, "_save_slice_info", None)
    infos = getattr(var, "save_slice_infos", None) or ([info] if info else [])
    entries = [(i.full_name, i.full_shape) for i in infos] or [(var.op.name, var.shape.as_list())]
    for name, shape in entries:
      ret.setdefault(name, (list(shape), []))[1].append(var)
  return ret


def _saved_tensors(variables: Sequence) -> list:
  """(checkpoint name, the tensor saved under it) of every variable and SaveableObject (a CastPart
  or a layer stack's part saves tensors of its own)."""
  ret = []
  for v in variables:
    if isinstance(v, saveable_object.SaveableObject):
      ret += [(spec.name, spec.tensor) for spec in v.specs]
    else:
      ret.append((v.op.name, v))
  return ret


def _whole_name(name: str, tensor) -> str:
  """The whole variable's name for a slice saved as its part (what messages should name)."""
  info = getattr(tensor, "_save_slice_info", None)
  return info.full_name if info else name


def _unique(saved: list) -> list:
  """saved without repeats (a layer stack's part is listed under each of its layers' names)."""
  return list({id(v): v for v in saved}.values())


def _check_shape(path: str, checkpoint_shapes: dict, checkpoint_name: str, model_name: str,
                 model_shape: list) -> None:
  saved_shape = list(checkpoint_shapes[checkpoint_name])
  if saved_shape != model_shape:
    raise CheckpointMismatchError(
        f"Checkpoint {path} holds variable {checkpoint_name!r} with shape {saved_shape}, but the "
        f"model's {model_name!r} has shape {model_shape}. The checkpoint is from a different "
        f"model: use another model_dir, or the gin configuration that wrote it.")


# Checkpoint entries that are no model variable: the step, and the random counter of graphs that
# draw random numbers (a graph without random ops has none).
_BOOKKEEPING = ("global_step", random_stream.COUNTER_NAME)
# What optimizers append to a variable's name for its slots (Adafactor, Adam, momentum).
_SLOT_SEPARATORS = ("_slot_", "/adam_", "_momentum")


def is_bookkeeping_or_optimizer_state(name: str) -> bool:
  """Whether checkpoint entry `name` is no model weight: the step, the random counter or a slot."""
  return name in _BOOKKEEPING or any(separator in name for separator in _SLOT_SEPARATORS)


class NonFiniteCheckpointError(ValueError):
  """Variables to be saved hold NaN or infinite values (the save is refused)."""


class CheckpointCorruptError(ValueError):
  """A checkpoint's files cannot be read (truncated or missing data)."""


def check_checkpoint_matches(path: str, variables: Sequence,
                             optimizer_state_may_be_extra: bool = False) -> None:
  """Checks that checkpoint `path` holds exactly `variables`, under their names, with their shapes.

  Raises CheckpointMismatchError naming the variable and both shapes on a shape mismatch, or naming
  the variables only one side has (a checkpoint of a deeper model is refused as much as one of a
  shallower model). optimizer_state_may_be_extra: the checkpoint may also hold the optimizer's
  slots of the variables (restoring a training checkpoint into an eval or infer graph).
  """
  shapes = tf.train.load_checkpoint(path).get_variable_to_shape_map()
  saved = _saved_variables(variables)
  for name, (shape, _) in saved.items():
    if name in shapes:
      _check_shape(path, shapes, name, name, shape)
  missing = [name for name in saved if name not in shapes and not _may_be_absent(saved[name][1])]
  extra = sorted(name for name in shapes if name not in saved and name not in _BOOKKEEPING
                 and not (optimizer_state_may_be_extra and _is_slot_of_any(name, saved)))
  if missing or extra:
    sides = []
    if missing:
      sides.append(f"lacks {len(missing)} of the model's variables, e.g. {sorted(missing)[:3]}")
    if extra:
      sides.append(f"holds {len(extra)} variables the model does not have, e.g. {extra[:3]}")
    model_names = sorted(name for name in saved if name not in _BOOKKEEPING)
    raise CheckpointMismatchError(
        f"Checkpoint {path} {' and '.join(sides)} (the model has {len(model_names)} variables, e.g. "
        f"{model_names[:3]}). It was written by a different model (another depth or width?): use the "
        f"gin configuration that wrote it, another model_dir, or pass it as init_checkpoint to load "
        f"only the variables both have.")


def _is_slot_of_any(name: str, model_names) -> bool:
  """Whether `name` is an optimizer slot of one of model_names (a name plus a slot suffix)."""
  return any(separator in name and name.split(separator)[0] in model_names for separator in _SLOT_SEPARATORS)


def _may_be_absent(variables: Sequence) -> bool:
  """The random counter is absent from checkpoints written before it existed (or by 0.1.21)."""
  return all(random_stream.is_counter(v) for v in variables)


def restore_checkpoint(session, path: str, variables: Sequence, saver=None,
                       optimizer_state_may_be_extra: bool = False) -> None:
  """Restores `variables` from checkpoint `path` after checking names and shapes both ways.

  A random counter the checkpoint lacks keeps its value (the stream starts over). `saver`: a
  Saver over exactly `variables`, used when the checkpoint holds them all. Files that cannot be
  read raise CheckpointCorruptError naming them.
  """
  check_checkpoint_matches(path, variables, optimizer_state_may_be_extra)
  names = tf.train.load_checkpoint(path).get_variable_to_shape_map()
  present = _unique([v for name, (_, saved) in _saved_variables(variables).items() if name in names
                     for v in saved])
  if saver is None or len(present) < len(variables):
    saver = tf.train.Saver(present)
  try:
    saver.restore(session, path)
  except (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.OutOfRangeError) as e:
    files = sorted(tf.io.gfile.glob(path + ".*"))
    raise CheckpointCorruptError(
        f"Checkpoint {path} cannot be read: {unreadable_reason(path) or e.message.splitlines()[0]}. Its "
        f"files: {files}. Restore them from a backup, or run again with --restore_fallback (gin: "
        f"restore_fallback.enabled = True) to resume from the newest readable checkpoint.") from None


def unreadable_reason(path: str) -> Optional[str]:
  """Why checkpoint `path` cannot be read (every tensor is read, so checksums are checked), or None."""
  try:
    reader = tf.train.load_checkpoint(path)
    for name in reader.get_variable_to_shape_map():
      reader.get_tensor(name)
  except Exception as e:  # TF's reader raises OpError, ValueError or IndexError (a truncated file)
    return (str(getattr(e, "message", e)).splitlines() or [type(e).__name__])[0]
  return None


@gin.configurable("restore_fallback", module=GIN_MODULE)
def restore_fallback(enabled: bool = False) -> bool:
  """Whether training resumes from the newest readable checkpoint when the latest cannot be read
  (off by default, so that no checkpoint is passed over without a person deciding it)."""
  return bool(enabled)


def resume_checkpoint(model_dir: str, fallback: bool, print_fn: Callable = print) -> Optional[str]:
  """The checkpoint a training run resumes from: the latest; with `fallback`, the newest one that
  reads back whole, saying which newer ones are skipped and why."""
  latest = latest_checkpoint(model_dir)
  if not fallback or latest is None:
    return latest
  newest = get_step_from_checkpoint_path(latest)
  candidates = [p for p in list_checkpoints(model_dir) if get_step_from_checkpoint_path(p) <= newest]
  reasons = []
  for path in reversed(candidates):
    reason = unreadable_reason(path)
    if reason is None:
      return path
    reasons.append(reason)
    print_fn(f"Skipping {path} (restore_fallback): it cannot be read: {reason}.")
  raise CheckpointCorruptError(
      f"No checkpoint in {model_dir} can be read ({len(reasons)} tried, newest first: {reasons[:2]}). "
      f"Restore them from a backup, or train in a new model_dir.")


def write_atomically(path: str, text: str) -> None:
  """Writes through a temporary file of this process's own, then renames it into place."""
  tmp = os.path.join(os.path.dirname(path), f"{_TMP_PREFIX}{os.getpid()}-{os.path.basename(path)}")
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_state_file(model_dir: str, paths: Sequence[str]) -> None:
  """The `checkpoint` file tf.train.get_checkpoint_state reads; the last path is the latest."""
  names = [os.path.basename(p) for p in paths]
  lines = ['model_checkpoint_path: "%s"' % names[-1]]
  lines += ['all_model_checkpoint_paths: "%s"' % n for n in names]
  write_atomically(os.path.join(model_dir, "checkpoint"), "\n".join(lines) + "\n")


class CheckpointManager:
  """Saves and restores `variables` (tf master variables + global step) in model_dir.

  Args:
    model_dir: directory of the checkpoints and their `checkpoint` state file.
    variables: the tf.Variables to save (use `tf.global_variables()`: the masters, or the slices
      saved as their parts, are global; the other per-device slices are not).
    keep_checkpoint_max: keep this many newest checkpoints (None or 0: keep all).
    before_save: a TF op run before every save (the lowering's copy_slices_to_masters).
  """

  def __init__(self, model_dir: str, variables: Sequence, keep_checkpoint_max: Optional[int] = None,
               before_save=None):
    if keep_checkpoint_max is not None and keep_checkpoint_max < 0:
      raise ValueError(f"keep_checkpoint_max = {keep_checkpoint_max}: expected None or 0 (keep all) or a "
                       f"positive count.")
    self._model_dir = model_dir
    self._variables = list(variables)
    self._keep = keep_checkpoint_max or None
    self._before_save = before_save
    self._saver = tf.train.Saver(self._variables, max_to_keep=None, save_relative_paths=True)
    self._finite = [(_whole_name(name, t), tf.reduce_all(tf.math.is_finite(t)))
                    for name, t in _saved_tensors(self._variables) if t.dtype.base_dtype.is_floating]

  def save(self, session, step: int) -> str:
    """Writes model.ckpt-<step> atomically and makes it the latest; returns its path."""
    tf.io.gfile.makedirs(self._model_dir)
    if self._before_save is not None:
      session.run(self._before_save)
    final = checkpoint_path(self._model_dir, step)
    self._check_finite(session, final)
    tmp = os.path.join(self._model_dir, f"{_TMP_PREFIX}{os.getpid()}-{os.path.basename(final)}")
    self._saver.save(session, tmp, write_meta_graph=False, write_state=False)
    data_files = sorted(glob.glob(glob.escape(tmp) + ".data-*"))
    for data in data_files:  # the index last: a checkpoint counts as complete once its index exists
      os.replace(data, final + data[len(tmp):])
    os.replace(tmp + ".index", final + ".index")
    check_checkpoint_matches(final, self._variables)  # it restores: only now may older ones go
    kept = [p for p in list_checkpoints(self._model_dir) if get_step_from_checkpoint_path(p) != step]
    kept.append(final)
    if self._keep:
      for old in kept[:-self._keep]:
        for f in glob.glob(glob.escape(old) + ".*"):
          os.remove(f)
      kept = kept[-self._keep:]
    write_state_file(self._model_dir, kept)
    return final

  def _check_finite(self, session, path: str) -> None:
    """Refuses to write a checkpoint holding a NaN or an infinity: it would replace good ones."""
    finite = session.run([check for _, check in self._finite])
    bad = sorted({name for (name, _), ok in zip(self._finite, finite) if not ok})
    if bad:
      latest = latest_checkpoint(self._model_dir)
      raise NonFiniteCheckpointError(
          f"Not saving {path}: {len(bad)} variables hold NaN or infinite values, e.g. {bad[:3]}; the "
          f"latest checkpoint is still {latest}. Lower the learning rate (non_finite_steps.skip = True "
          f"skips steps whose loss or gradients are not finite).")

  def restore(self, session, path: str) -> None:
    """Restores every variable from `path` (CheckpointMismatchError if names or shapes differ)."""
    restore_checkpoint(session, path, self._variables, self._saver)


def restore_available(session, path: str, variables: Sequence,
                      checkpoint_name: Callable[[str], str] = lambda name: name,
                      should_load: Callable[[str], bool] = lambda name: True) -> list:
  """Restores each variable that should_load(name) selects and `path` holds under
  checkpoint_name(name) (shapes checked), leaving the others as they are.

  This is how `init_checkpoint` warm-starts a model from another one. Returns the restored ones.
  """
  shapes = tf.train.load_checkpoint(path).get_variable_to_shape_map()
  mapping, restored, stack_parts = {}, [], {}
  for model_name, (shape, saved) in _saved_variables(variables).items():
    name = checkpoint_name(model_name)
    if should_load(model_name) and name in shapes:
      _check_shape(path, shapes, name, model_name, shape)
      for var in saved:
        if getattr(var, "save_slice_infos", None):
          stack_parts.setdefault(id(var), (var, []))[1].append((model_name, name))
      if not any(getattr(var, "save_slice_infos", None) for var in saved):
        mapping[name] = saved if getattr(saved[0], "_save_slice_info", None) else saved[0]
      restored += saved
  # A Saver given a list keys its SaveableObjects by name, and a sliced variable's part saveables
  # share the checkpoint name: all but one would be dropped. A {name: [parts]} dict keeps them.
  for part, names in stack_parts.values():
    _check_whole_layer_stack_part(part, names)
    mapping[part.name] = part
  if mapping:
    tf.train.Saver(mapping).restore(session, path)
  return _unique(restored)


def _check_whole_layer_stack_part(part, names: list) -> None:
  """A layer stack's part restores all its layers at once, from their own names."""
  held = [info.full_name for info in part.save_slice_infos]
  if [model_name for model_name, _ in names] != held or any(a != b for a, b in names):
    raise CheckpointMismatchError(
        f"init_checkpoint: the pipelined layers {held} share one variable per processor, so they are "
        f"warm-started together and under their own names; the checkpoint (after "
        f"init_checkpoint_variable_mapping and the variable filter) offers only {names}. Warm-start "
        f"all of them, or leave the model unpipelined for this run.")
