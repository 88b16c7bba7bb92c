"""Small TensorFlow helpers shared by the lowering, the backends and the op families."""

from __future__ import annotations

from typing import Callable

import tensorflow.compat.v1 as tf


def parallel(devices: list, fn: Callable, *args, **kwargs) -> list:
  """Calls fn once per device, under tf.device(device); list args/kwargs are indexed per device."""
  if not isinstance(devices, list):
    raise ValueError(f"devices must be a list, got {devices!r}.")
  for x in list(args) + list(kwargs.values()):
    if not isinstance(x, list) or len(x) != len(devices):
      raise ValueError(
          f"parallel(): every argument must be a list with one entry per device "
          f"({len(devices)} devices), got {x!r}.")
  ret = []
  for i, device in enumerate(devices):
    with tf.device(device), tf.variable_scope("parallel_%d" % i):
      ret.append(fn(*[x[i] for x in args], **{k: v[i] for k, v in kwargs.items()}))
  return ret


def transpose_unless_identity(x, perm: list):
  """tf.transpose(x, perm), or x itself when perm keeps every axis in place (no TF op)."""
  return x if perm == sorted(perm) else tf.transpose(x, perm)


def transpose_list_of_lists(lol: list) -> list:
  if not lol:
    raise ValueError("transpose_list_of_lists needs a non-empty list.")
  return [list(x) for x in zip(*lol)]


_BINARY_REDUCTIONS = {"SUM": tf.add, "MAX": tf.maximum, "MIN": tf.minimum}
_REDUCTIONS = {"SUM": tf.reduce_sum, "MAX": tf.reduce_max, "MIN": tf.reduce_min}


def _lookup(table: dict, key: str, what: str):
  try:
    return table[key]
  except KeyError:
    raise ValueError(f"Unknown {what} {key!r}; expected one of {sorted(table)}.") from None


def binary_reduction_fn(reduction_fn_string: str) -> Callable:
  return _lookup(_BINARY_REDUCTIONS, reduction_fn_string, "reduction")


def reduction_fn(reduction_fn_string: str) -> Callable:
  return _lookup(_REDUCTIONS, reduction_fn_string, "reduction")


def _pool(tf_pool_fn, spatial_rank: int):
  """A pool over the `spatial_rank` dims before the channels; leading dims are flattened into batch."""
  def fn(x, ksize, strides):
    shape = x.shape.as_list()
    batch_shape = shape[:-(spatial_rank + 1)]
    flat = tf.reshape(x, [-1] + shape[-(spatial_rank + 1):])
    y = tf_pool_fn(flat, ksize=ksize, strides=strides, padding="VALID")
    return tf.reshape(y, batch_shape + y.shape.as_list()[1:])
  return fn


_POOLS = {
    "AVG_2D": _pool(tf.nn.avg_pool2d, 2),
    "MAX_2D": _pool(tf.nn.max_pool2d, 2),
    "AVG_3D": _pool(tf.nn.avg_pool3d, 3),
    "MAX_3D": _pool(tf.nn.max_pool3d, 3),
}


def pool_fn(pool_fn_string: str) -> Callable:
  """fn(x, ksize, strides) for "AVG_2D", "MAX_2D", "AVG_3D" or "MAX_3D" (VALID padding)."""
  return _lookup(_POOLS, pool_fn_string, "pool function")


def _log_info_also_to_file(fmt: str, *args, log_file=None) -> None:
  tf.logging.info(fmt, *args)
  if log_file:
    log_file.write(fmt % args + "\n")


def log_variable_sizes(var_list, tag: str, verbose: bool = True, mesh_to_impl=None,
                       log_file=None) -> None:
  """Logs each variable's size and slice size, then the totals."""
  if not var_list:
    return
  total_size = total_slice_size = 0
  for v in sorted(var_list, key=lambda v: v.name):
    slice_size = mesh_to_impl[v.mesh].slice_size(v.shape) if mesh_to_impl else 0
    total_size += v.shape.size
    total_slice_size += slice_size
    if verbose:
      _log_info_also_to_file("Variable %s size %s slice_size %s %s", v.name.ljust(60),
                             str(v.shape.size).ljust(12), str(slice_size).ljust(12),
                             str(v.shape).ljust(60), log_file=log_file)
  _log_info_also_to_file("%s count: %s  Total size: %s  Total slice_size: %s", tag.ljust(30),
                         str(len(var_list)).ljust(6), str(total_size).ljust(15),
                         str(total_slice_size).ljust(15), log_file=log_file)




def outside_all_rewrites():
  """Clears control dependencies and control-flow context, so variables are created at top level."""
  return tf.control_dependencies(None)
