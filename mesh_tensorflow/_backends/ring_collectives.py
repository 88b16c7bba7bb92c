"""Collectives over a list of per-device TF tensors, built from tf.identity copies.

Each function takes `xs` (one tensor per group member, in group order) and the members'
`devices`, and returns one result tensor per member, placed on that member's device.
"""

from __future__ import annotations

import tensorflow.compat.v1 as tf

from mesh_tensorflow._lowering.tf_helpers import binary_reduction_fn, parallel

_CHUNKED_RING_MIN_ELEMENTS = 1024


def _num_elements(x) -> int:
  n = 1
  for d in x.shape.as_list():
    n *= d
  return n


def allreduce_ring_single_shard(xs: list, devices: list, reduction_fn_string: str = "SUM") -> list:
  """Reduces from both ends toward the centre, then copies the result back outward."""
  n = len(xs)
  binary_reduction = binary_reduction_fn(reduction_fn_string)
  assert len(devices) == n, "devices must be a list of length len(xs)"
  if n == 1:
    return xs
  result = [None] * n
  if n % 2 == 0:
    left_center, right_center = n // 2 - 1, n // 2
  else:
    left_center = right_center = n // 2
  left_sum = xs[0]
  for i in range(1, left_center + 1):
    with tf.device(devices[i]):
      left_sum = binary_reduction(left_sum, xs[i])
  right_sum = xs[n - 1]
  for i in reversed(range(left_center + 1, n - 1)):
    with tf.device(devices[i]):
      right_sum = binary_reduction(xs[i], right_sum)
  with tf.device(devices[left_center]):
    result[left_center] = binary_reduction(left_sum, right_sum)
  if n % 2 == 0:
    with tf.device(devices[right_center]):
      result[right_center] = binary_reduction(left_sum, right_sum)
  for i in reversed(range(left_center)):
    with tf.device(devices[i]):
      result[i] = tf.identity(result[i + 1])
  for i in range(right_center + 1, n):
    with tf.device(devices[i]):
      result[i] = tf.identity(result[i - 1])
  return result


def allreduce_ring(xs: list, devices: list, reduction_fn_string: str = "SUM") -> list:
  """Allreduce; large divisible shards are cut into n chunks, each reduced along a rotated ring."""
  n = len(xs)
  if len(devices) != n:
    raise ValueError(f"allreduce_ring: {n} tensors but {len(devices)} devices.")
  if n == 1:
    return xs
  shape = xs[0].shape
  size = _num_elements(xs[0])
  if size < _CHUNKED_RING_MIN_ELEMENTS or size % n:
    return allreduce_ring_single_shard(xs, devices, reduction_fn_string)

  def _circular_shift(l, k):
    k %= len(l)
    return l[-k:] + l[:-k]

  def _flatten_and_split(x):
    return tf.split(tf.reshape(x, [-1]), n)

  def _concat_and_reshape(chunks):
    return tf.reshape(tf.concat(chunks, 0), shape)

  x_split = parallel(devices, _flatten_and_split, xs)
  x_split_t = [list(x) for x in zip(*x_split)]
  y_split_t = []
  for shard in range(n):
    shard_xs = _circular_shift(x_split_t[shard], shard)
    shard_devices = _circular_shift(devices, shard)
    shard_ys = allreduce_ring_single_shard(shard_xs, shard_devices, reduction_fn_string)
    y_split_t.append(_circular_shift(shard_ys, -shard))
  y_split = [list(y) for y in zip(*y_split_t)]
  return parallel(devices, _concat_and_reshape, y_split)


def allconcat_ring(xs: list, devices: list, concat_axis: int) -> list:
  """Every member gets all pieces concatenated in group order along concat_axis."""
  n = len(xs)
  if n == 1:
    return xs
  # parts[i][j]: piece j as available on device i.
  parts = [[xs[target] if target == source else None for source in range(n)] for target in range(n)]
  for distance in range(1, n // 2 + 1):
    for target in range(n):
      source = (target + distance) % n
      if parts[target][source] is None:
        with tf.device(devices[target]):
          parts[target][source] = tf.identity(parts[(target + 1) % n][source])
      source = (target - distance) % n
      if parts[target][source] is None:
        with tf.device(devices[target]):
          parts[target][source] = tf.identity(parts[(target - 1) % n][source])
  return parallel(devices, tf.concat, parts, axis=[concat_axis] * n)


def alltoall_pointtwise(xs: list, devices: list, split_axis: int, concat_axis: int) -> list:
  """Member i sends its j-th piece (split along split_axis) to member j, directly."""
  n = len(xs)
  if n == 1:
    return xs
  parts = parallel(devices, tf.split, xs, [n] * n, axis=[split_axis] * n)
  parts = [list(p) for p in zip(*parts)]
  return parallel(devices, tf.concat, parts, axis=[concat_axis] * n)


def alltoall_ring(xs: list, devices: list, split_axis: int, concat_axis: int) -> list:
  """alltoall by passing pieces around the ring in both directions, one hop at a time."""
  n = len(xs)
  if n == 1:
    return xs
  # pieces[i][j]: the piece member i sends to member j.
  pieces = parallel(devices, tf.split, xs, [n] * n, axis=[split_axis] * n)
  received = [[None] * n for _ in range(n)]  # received[target][source]
  for i in range(n):
    received[i][i] = pieces[i][i]
  # Messages going right: in transit[(source, target)] currently on some device.
  for direction in (1, -1):
    max_hops = n // 2 if direction == 1 else (n - 1) // 2
    in_flight = {}
    for source in range(n):
      for hops in range(1, max_hops + 1):
        in_flight[(source, (source + direction * hops) % n)] = pieces[source][(source + direction * hops) % n]
    for hop in range(1, max_hops + 1):
      for (source, target), value in list(in_flight.items()):
        here = (source + direction * hop) % n
        with tf.device(devices[here]):
          value = tf.identity(value)
        if here == target:
          received[target][source] = value
          del in_flight[(source, target)]
        else:
          in_flight[(source, target)] = value
  return parallel(devices, tf.concat, received, axis=[concat_axis] * n)
