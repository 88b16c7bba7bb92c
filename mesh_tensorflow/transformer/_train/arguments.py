"""Checks of `utils.run`'s arguments before anything is built: a bad value is named with its fix.

Each rule is (what the value must be, a predicate); `check_run_arguments` raises RunArgumentError
naming the gin binding (`utils.run.<name>`), the value given and what it must be, instead of a
TypeError or ZeroDivisionError deep inside the driver.
"""

from __future__ import annotations

from typing import Callable

from mesh_tensorflow.transformer._utils.mesh_sizes import BATCH_SIZE_METHODS


class RunArgumentError(ValueError):
  """An argument of utils.run has a value it cannot use."""


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value) -> bool:
  return _is_int(value) and value > 0


def _non_negative_int(value) -> bool:
  return _is_int(value) and value >= 0


def _optional(predicate: Callable) -> Callable:
  return lambda value: value is None or predicate(value)


def _batch_size(value) -> bool:
  if _positive_int(value):
    return True
  return (isinstance(value, (tuple, list)) and len(value) == 2 and value[0] in BATCH_SIZE_METHODS
          and _positive_int(value[1]))


def _sequence_length(value) -> bool:
  if isinstance(value, dict):
    return bool(value) and all(isinstance(k, str) and _positive_int(v) for k, v in value.items())
  return value is None or _positive_int(value)


def _checkpoint_steps(value) -> bool:
  if isinstance(value, (list, tuple)):
    return bool(value) and all(_non_negative_int(v) for v in value)
  return value is None or value == "all" or (_is_int(value) and value >= -1)


_RULES = {
    "model_dir": ("a directory path (a non-empty string)", lambda v: isinstance(v, str) and bool(v)),
    "train_steps": ("a positive int, or a function of (batch_size, sequence_length) such as "
                    "utils.auto_train_steps", lambda v: callable(v) or _positive_int(v)),
    "total_run_steps": ("None or a positive int", _optional(_positive_int)),
    "iterations_per_loop": ("a positive int", _positive_int),
    "save_checkpoints_steps": ("a positive int", _positive_int),
    "keep_checkpoint_max": ("None or 0 (keep every checkpoint), or a positive int (keep that many)",
                            _optional(_non_negative_int)),
    "perplexity_eval_steps": ("a positive int", _positive_int),
    "seen_data_init_step": ("an int >= 0", _non_negative_int),
    "batch_size": (f"a positive int (sequences per batch) or (method, positive int) with method one of "
                   f"{BATCH_SIZE_METHODS}", _batch_size),
    "sequence_length": ("a positive int, or a dict of feature name -> positive int", _sequence_length),
    "eval_checkpoint_step": ("None (wait for new checkpoints), -1 (the latest), 'all', a step >= 0 or "
                             "a list of steps", _checkpoint_steps),
    "export_checkpoint_step": ("None (the latest) or a step >= 0", _optional(_non_negative_int)),
    "autostack": ("True or False", lambda v: isinstance(v, bool)),
    "random_seed": ("None (different in each run) or an int", _optional(_is_int)),
}


def check_run_arguments(**arguments) -> None:
  """Raises RunArgumentError for the first argument that breaks its rule (only those given)."""
  for name, value in arguments.items():
    expected, predicate = _RULES[name]
    if not predicate(value):
      raise RunArgumentError(f"utils.run.{name} = {value!r} ({type(value).__name__}): expected {expected}. "
                             f"Fix the binding `utils.run.{name} = ...` in your gin file or --gin_param.")


def check_vocabulary(vocabulary) -> None:
  """A run needs a vocabulary (or an (inputs, targets) pair of them) with vocab_size."""
  vocabularies = vocabulary if isinstance(vocabulary, (tuple, list)) else [vocabulary]
  if vocabulary is None or not all(hasattr(v, "vocab_size") for v in vocabularies):
    raise RunArgumentError(
        f"utils.run.vocabulary = {vocabulary!r}: expected a vocabulary object with vocab_size, encode "
        f"and decode (or an (inputs, targets) pair), e.g. `utils.run.vocabulary = "
        f"@data.byte_vocabulary()` (the bundled example's) or a SentencePiece vocabulary.")


def check_batch_size(batch_size: int, requested, sequence_length: dict) -> None:
  """The resolved batch must hold at least one sequence."""
  if batch_size < 1:
    raise RunArgumentError(
        f"utils.run.batch_size = {requested!r} gives {batch_size} sequences per batch: fewer tokens than "
        f"one sequence of length {max(v for v in sequence_length.values() if v)} (sequence_length = "
        f"{sequence_length}). Raise the token count or shorten utils.run.sequence_length.")


# Arguments of upstream's utils.run this driver does not implement, with the value that means
# "not used" (binding another value is an error, not silently ignored).
_NOT_IMPLEMENTED = {
    "ensemble_inputs": (None, "ensemble inputs"),
}


def check_not_implemented(**arguments) -> None:
  """Raises RunArgumentError for an argument bound to a value this driver would ignore."""
  for name, value in arguments.items():
    default, what = _NOT_IMPLEMENTED[name]
    if value is not default and value != default:
      raise RunArgumentError(f"utils.run.{name} = {value!r}: {what} is not implemented by this driver "
                             f"(only {default!r}); remove the binding.")
