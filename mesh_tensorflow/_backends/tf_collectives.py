"""Collectives over one group of processors, for devices in one process or spread over several.

Each function takes `xs`, the group members' tensors *that this process holds* (None for a member
another process holds), and the members' `devices`, and returns one result per member (None where
`xs` had None), placed on that member's device.

Two paths, chosen per group:

* every member in this process: plain TF ops on one device plus `tf.identity` copies. Measured by
  `benchmarks/bench_collectives.py` on 8 virtual CPU devices: an allreduce of 32 gradients (8 MB)
  as `add_n` on one device plus copies was ~10x faster than TF's `CollectiveReduceV2` and than a
  ring of copies, because copies between devices of one process cost almost nothing;
* members in several processes: TF collective ops with the same group and instance keys in every
  process, each moving only what its members need: for allreduce, one `CollectiveReduceV2` per
  process, of the sum (max, min) of its members; otherwise one op per local member:
  `CollectiveGatherV2` (allgather, allconcat), `CollectiveAllToAllV2` (alltoall: member i's j-th
  piece goes to member j alone), and for `receive` (shifts, halo exchanges) one
  `CollectiveBcastSendV2` / `CollectiveBcastRecvV2` pair per transfer between processes, in a group
  of just its source and destination (transfers within this process stay copies). TF picks NCCL
  on GPUs and rings over gRPC between hosts.

Keys are deterministic: a group's key is a hash of its device list, and instance keys come from
one process-wide counter that every process advances identically (each process lowers the same
graph, so it asks for the same collectives in the same order, whether or not it holds a member).
TF ranks a group's members by task, then device index, whatever order the mesh lists them in;
gathers and all-to-alls reorder their pieces accordingly (`_rank_order`).
"""

from __future__ import annotations

import itertools
import zlib
from typing import Optional, Sequence

import tensorflow.compat.v1 as tf

from mesh_tensorflow._lowering.tf_helpers import reduction_fn

_MERGE_OPS = {"SUM": "Add", "MAX": "Max", "MIN": "Min"}
# dtypes the TF collective kernels accept; others travel as a wider type and are cast back.
_REDUCE_DTYPES = (tf.bfloat16, tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)  # and all-to-all
_GATHER_DTYPES = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)
_BCAST_DTYPES = (tf.bool, tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)

_instance_keys = itertools.count(1)


def next_instance_key() -> int:
  """A fresh instance key (the same sequence in every process that builds the same collectives)."""
  return next(_instance_keys)


def group_key(devices: Sequence[str]) -> int:
  """A key identifying a group by its members' devices (equal in every process)."""
  return 1 + zlib.crc32("|".join(devices).encode()) % (2 ** 30)


def _fast_path(xs: Sequence, settings: Optional[CollectiveSettings]) -> bool:
  """True if every member is in this process and the in-process path is allowed."""
  return all(x is not None for x in xs) and (settings is None or settings.in_process_fast_path)


class CollectiveSettings:
  """How cross-process collectives run.

  Args:
    timeout_seconds: a collective that waits longer than this for a peer fails (0: wait forever).
    communication_hint: "auto" (NCCL on GPUs), "ring" or "nccl".
    in_process_fast_path: what this process holds of a group is combined with plain ops and
      copies: a group held wholly needs no TF collective op, an allreduce across processes one
      per process, and a shift's transfers within this process are copies (False: every member
      takes part in TF collective ops, e.g. to test or measure them on one machine).
  """

  def __init__(self, timeout_seconds: float = 0.0, communication_hint: str = "auto",
               in_process_fast_path: bool = True):
    self.timeout_seconds = float(timeout_seconds)
    self.communication_hint = communication_hint
    self.in_process_fast_path = in_process_fast_path


def _wire_dtype(dtype, allowed):
  """The dtype a tensor travels as: itself if the kernel accepts it, else a wider one."""
  if dtype in allowed:
    return dtype
  if dtype.is_floating:
    return tf.float32
  return tf.int64 if dtype in (tf.int64, tf.uint32, tf.uint64) else tf.int32


def _group_attrs(devices, key: int, settings: CollectiveSettings) -> dict:
  """The attributes of every TF collective op: its group, instance, transport and timeout."""
  return dict(group_size=len(devices), group_key=group_key(devices), instance_key=key,
              communication_hint=settings.communication_hint, timeout_seconds=settings.timeout_seconds)


def _collective(op, x, devices, key: int, settings: CollectiveSettings, allowed, **attrs):
  """op (a collective taking an input and an ordering token) on x, cast to a dtype it accepts."""
  wire = _wire_dtype(x.dtype, allowed)
  y = op(input=tf.cast(x, wire), ordering_token=[], **_group_attrs(devices, key, settings), **attrs)
  return tf.cast(y, x.dtype)


def _rank_order(devices) -> list:
  """Member indices in the order TF ranks them in a group: by job, task, then device index.

  Gathered pieces (and all-to-all pieces) come in this order, not in the mesh's member order.
  """
  def rank_key(member):
    spec = tf.DeviceSpec.from_string(devices[member])
    return (spec.job or "", spec.replica or 0, spec.task or 0, spec.device_type or "",
            spec.device_index or 0)
  return sorted(range(len(devices)), key=rank_key)


def allreduce(xs: list, devices: list, reduction_fn_string: str,
              settings: Optional[CollectiveSettings] = None, share_result: bool = False) -> list:
  """Every member gets the reduction ("SUM", "MAX", "MIN") of all members' tensors.

  share_result: with the in-process path, this process's members get the one reduced tensor
  itself, on the first member's device, rather than a copy each (for CPU devices of one process,
  where that is no copy; a device program then computes what follows from it once).

  With `in_process_fast_path` (the default), this process reduces its own members' tensors on its
  first member's device, and when other processes hold members, one `CollectiveReduceV2` per
  process (a group of each process's first member) combines those partial results, which are then
  copied to the local members. Measured on loopback, 32 gradients of [256, 256]: ~115 ms this way
  against ~340 ms with every member in one `CollectiveReduceV2` (2 processes x 4 devices), ~315
  against ~460 ms (4 x 2).
  """
  n = len(xs)
  if reduction_fn_string not in _MERGE_OPS:
    raise ValueError(f"Unknown reduction {reduction_fn_string!r}; expected one of {sorted(_MERGE_OPS)}.")
  key = next_instance_key()
  local = [i for i, x in enumerate(xs) if x is not None]
  if n == 1 or not local:
    return list(xs)
  settings = settings or CollectiveSettings()
  if not settings.in_process_fast_path:
    return _on_each_member(
        xs, devices, lambda x, _: _collective(tf.raw_ops.CollectiveReduceV2, x, devices, key, settings,
                                              _REDUCE_DTYPES, merge_op=_MERGE_OPS[reduction_fn_string],
                                              final_op="Id"))
  with tf.device(devices[local[0]]):
    held = [xs[i] for i in local]
    if reduction_fn_string == "SUM":
      total = tf.add_n(held)
    else:
      total = reduction_fn(reduction_fn_string)(tf.stack(held), 0)
    if len(local) < n:
      total = _collective(tf.raw_ops.CollectiveReduceV2, total, _first_member_per_process(devices), key,
                          settings, _REDUCE_DTYPES, merge_op=_MERGE_OPS[reduction_fn_string],
                          final_op="Id")
  return _to_local_members(total, xs, devices, share_result)


def _to_local_members(value, xs: list, devices: list, share_result: bool) -> list:
  """value for each member this process holds (None for the others): itself, or a copy each."""
  ret = [None] * len(xs)
  for i, x in enumerate(xs):
    if x is None:
      continue
    if share_result:
      ret[i] = value
      continue
    with tf.device(devices[i]):
      ret[i] = tf.identity(value)
  return ret


def _first_member_per_process(devices) -> list:
  """The device of each process's (task's) first member, in member order: the same in every process."""
  first = {}
  for device in devices:
    spec = tf.DeviceSpec.from_string(device)
    first.setdefault((spec.job, spec.task), device)
  return list(first.values())


def _on_each_member(xs: list, devices: list, collective_fn) -> list:
  """collective_fn(x, device) on each member's device (a None member stays None), tied by _tie."""
  ret = []
  for x, device in zip(xs, devices):
    if x is None:
      ret.append(None)
      continue
    with tf.device(device):
      ret.append(collective_fn(x, device))
  return _tie(ret, devices)


def _tie(results: list, devices: list, ops: Optional[list] = None) -> list:
  """Each result waits for every local collective op of the group (default: the results).

  A member whose result nobody fetches would otherwise be pruned from the run, and its peers
  (here or in other processes) would wait for it forever.
  """
  if ops is None:
    ops = [r for r in results if r is not None]
  if not ops:
    return results
  ret = []
  for r, device in zip(results, devices):
    if r is None:
      ret.append(None)
      continue
    with tf.device(device), tf.control_dependencies(ops):
      ret.append(tf.identity(r))
  return ret


def allgather(xs: list, devices: list, settings: Optional[CollectiveSettings] = None) -> list:
  """Every member gets all members' tensors stacked on a new leading axis, in member order."""
  return _gather(xs, devices, next_instance_key(), settings)


def _gather(xs: list, devices: list, key: int, settings: Optional[CollectiveSettings]) -> list:
  n = len(xs)
  if _fast_path(xs, settings):
    ret = []
    for device in devices:
      with tf.device(device):
        ret.append(tf.stack([tf.identity(x) for x in xs]))
    return ret
  settings = settings or CollectiveSettings()

  order = _rank_order(devices)

  def gather(x, _):
    gathered = _collective(tf.raw_ops.CollectiveGatherV2, tf.expand_dims(x, 0), devices, key,
                           settings, _GATHER_DTYPES)
    gathered = tf.ensure_shape(gathered, [n] + x.shape.as_list())
    if order != sorted(order):  # rank order -> member order
      gathered = tf.gather(gathered, [order.index(m) for m in range(n)])
    return gathered
  return _on_each_member(xs, devices, gather)


def allconcat(xs: list, devices: list, concat_axis: int,
              settings: Optional[CollectiveSettings] = None, share_result: bool = False) -> list:
  """Every member gets all members' tensors concatenated along concat_axis, in member order.

  share_result: with every member in this process, one concat on the first member's device,
  whose result every member gets (as for allreduce).
  """
  n = len(xs)
  if n == 1 or _fast_path(xs, settings):
    next_instance_key()
    if n == 1:
      return list(xs)
    if share_result:
      with tf.device(devices[0]):
        return [tf.concat(xs, axis=concat_axis)] * n
    ret = []
    for device in devices:  # one concat per member, its inputs copied from their devices
      with tf.device(device):
        ret.append(tf.concat(xs, axis=concat_axis))
    return ret
  ret = []
  for y, device in zip(allgather(xs, devices, settings), devices):
    if y is None:
      ret.append(None)
      continue
    with tf.device(device):
      ret.append(tf.concat(tf.unstack(y, axis=0), axis=concat_axis))
  return ret


def alltoall(xs: list, devices: list, split_axis: int, concat_axis: int,
             settings: Optional[CollectiveSettings] = None) -> list:
  """Member i sends its j-th piece along split_axis to member j, which concatenates them in order.

  Between processes, one `CollectiveAllToAllV2` per local member: each piece travels only to the
  member that needs it.
  """
  n = len(xs)
  key = next_instance_key()
  if n == 1:
    return list(xs)
  if _fast_path(xs, settings):
    pieces = []
    for x, device in zip(xs, devices):
      with tf.device(device):
        pieces.append(tf.split(x, n, axis=split_axis))
    ret = []
    for j, device in enumerate(devices):
      with tf.device(device):
        ret.append(tf.concat([pieces[i][j] for i in range(n)], axis=concat_axis))
    return ret
  local = [device for x, device in zip(xs, devices) if x is not None]
  if not local:
    return list(xs)
  settings = settings or CollectiveSettings()
  marker = _collective_executor_marker(local[0], key, settings)
  order = _rank_order(devices)  # the kernel sends its r-th piece to (and stacks what it gets from) rank r

  def exchange(x, _):
    pieces = tf.split(x, n, axis=split_axis)
    with tf.control_dependencies([marker]):
      got = _collective(tf.raw_ops.CollectiveAllToAllV2, tf.stack([pieces[m] for m in order]),
                        devices, key, settings, _REDUCE_DTYPES)
    got = tf.unstack(got, n)
    return tf.concat([got[order.index(m)] for m in range(n)], axis=concat_axis)
  return _on_each_member(xs, devices, exchange)


def _collective_executor_marker(device: str, key: int, settings: CollectiveSettings):
  """A `CollectiveReduceV2` over a group of just `device`, for the all-to-alls of one call.

  TF gives a step its collective executor only if the graph holds an op that TF 2.21 counts as a
  collective (`CollectiveReduceV2`, `CollectiveGatherV2`, `CollectiveBcastSendV2/RecvV2`; not
  `CollectiveAllToAllV2`): a step whose only collective is an all-to-all fails with "INTERNAL:
  Failed to get CollectiveExecutor from OpKernelContext for Op CollectiveAllToAllV2" (measured,
  graph-mode sessions in one process and across processes). The marker, a control input of the
  call's all-to-alls, makes every step that runs them have an executor; it reduces a scalar over a
  group of one (no other group has a single member), so nothing travels. One per call, not per
  member: each costs about a millisecond here (2 processes x 4 devices, loopback).
  """
  with tf.device(device):
    return tf.raw_ops.CollectiveReduceV2(
        input=tf.constant(0, tf.int32), ordering_token=[], merge_op="Add", final_op="Id",
        **_group_attrs([device], key, settings))


def receive(xs: list, devices: list, source_pcoord: Sequence,
            settings: Optional[CollectiveSettings] = None) -> list:
  """Member k gets member source_pcoord[k]'s tensor (zeros where the source is None).

  A transfer within this process is a copy (with `in_process_fast_path`); one between processes
  is a broadcast in a group of two, its source and its destination, so each slice crosses once
  and only to the members that receive it.
  """
  key = next_instance_key()
  held = [x for x in xs if x is not None]
  if not held:
    return list(xs)
  settings = settings or CollectiveSettings()
  shape, dtype = held[0].shape, held[0].dtype  # every member's slice has the same shape and dtype
  wire = _wire_dtype(dtype, _BCAST_DTYPES)
  ret, ops = [None] * len(xs), []
  for k, source in enumerate(source_pcoord):
    if xs[k] is None and (source is None or xs[source] is None):
      continue  # neither end is here
    if source is None:
      with tf.device(devices[k]):
        ret[k] = tf.zeros(shape, dtype)
    elif xs[k] is not None and xs[source] is not None and (source == k or settings.in_process_fast_path):
      with tf.device(devices[k]):
        ret[k] = tf.identity(xs[source])
    else:
      pair = _group_attrs([devices[source], devices[k]], key, settings)
      if xs[source] is not None:
        with tf.device(devices[source]):
          ops.append(tf.raw_ops.CollectiveBcastSendV2(input=tf.cast(xs[source], wire), **pair))
      if xs[k] is not None:
        with tf.device(devices[k]):
          ret[k] = tf.cast(tf.raw_ops.CollectiveBcastRecvV2(shape=shape.as_list(), T=wire, **pair), dtype)
          ops.append(ret[k])
  return _tie(ret, devices, ops)
