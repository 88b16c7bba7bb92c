"""Counter-based random numbers: an element's value is a hash of (stream key, its global index).

A random tensor's values depend only on its stream key (the op's seed, the evaluation number,
the loop iterations; see `_lowering/random_stream.py`) and on each element's position in the
*whole* tensor, never on how the tensor is split: every processor hashes the global indices of
its own slice. So a dropout mask is the same on one device and on any mesh, and processors
holding the same slice compute the same values without communicating.

The hash is SplitMix64's output function applied to `key + (index + 1) * golden_gamma`: each key
is a SplitMix64 stream, and two streams overlap only if their keys differ by fewer than
(number of elements) multiples of the gamma, a chance of about 2^-40 for a 2^24-element tensor.

The draw of a slice (indices, hash, conversion to a uniform number in the target precision, and
erfinv for normals) is one XLA-compiled function per slice geometry: XLA computes every element
with the same instructions whatever the slice's size, where TF's own erfinv kernel takes a
vectorised path for most elements and a scalar one for the rest (1 ulp apart, so a normal value
would depend on the layout). Inside a tf.compat.v1 while_loop, where an XLA call does not run,
the same function is built from plain TF ops: uniform and integer values are the same bits,
normal values may differ in the last bit. In eager mode NumPy computes the stream keys, and the
uniform (and integer) values of a slice not worth compiling (up to 2^16 elements, or a larger one
until it is drawn again; see `_compiles`): the same bits again, without TF's uint64 kernels, whose
first use in a process takes about 30 ms. The affine map of uniforms and normals (minval/maxval,
mean/stddev) is a plain TF multiply and add, exact per element.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import math
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf2
import tensorflow.compat.v1 as tf

_U64 = tf.uint64
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# Standard uniforms carry as many random bits as the dtype's significand holds, so every value
# is exact in that dtype and the draws never round up to 1.
_SIGNIFICAND_BITS = {tf.float64: 53, tf.float32: 24, tf.bfloat16: 8, tf.float16: 11}
# erf(sqrt(2)): TF's truncated normal keeps values within two standard deviations.
_ERF_SQRT2 = 0.9544997361036416

KINDS = ("uniform", "normal", "truncated_normal")


def mix64(z):
  """SplitMix64's output function on a uint64 tensor (a bijection with good avalanche)."""
  z = _xor_shift(z, 30) * tf.constant(_MIX1, _U64)
  z = _xor_shift(z, 27) * tf.constant(_MIX2, _U64)
  return _xor_shift(z, 31)


def _xor_shift(z, bits: int):
  return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, tf.constant(bits, _U64)))


def _mix64_numpy(z: np.ndarray) -> np.ndarray:
  """mix64 on a uint64 array (its products wrap, as TF's do)."""
  z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
  z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
  return z ^ (z >> np.uint64(31))


def op_key(graph_seed: Optional[int], op_name: str, fallback: int) -> int:
  """A 64-bit key per random op: from the graph seed and the op's key name, else `fallback`.

  A cryptographic hash (not Python's hash()), so every process of a mesh agrees.
  """
  if graph_seed is None:
    return fallback
  digest = hashlib.blake2b(f"{graph_seed}/{op_name}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little")


def stream_key(key: int, counters: Sequence) -> tf.Tensor:
  """A uint64 scalar: `key` advanced by each counter in turn (evaluation number, loop iterations).

  Distinct counter values give distinct keys: each step is a bijection of the previous key.
  Eagerly NumPy computes it (the same bits, none of TF's uint64 kernels to start).
  """
  if tf.executing_eagerly():
    ret = np.array(key, np.uint64)
    with np.errstate(over="ignore"):
      for counter in counters:
        step = np.array(int(counter), np.int64).astype(np.uint64) + np.uint64(1)
        ret = _mix64_numpy(ret + step * np.uint64(GOLDEN_GAMMA))
    return tf.constant(ret, _U64)
  ret = tf.constant(key, _U64)
  for counter in counters:
    step = tf.cast(tf.cast(counter, tf.int64), _U64) + tf.constant(1, _U64)
    ret = mix64(ret + step * tf.constant(GOLDEN_GAMMA, _U64))
  return ret


def kind_of(tf_fn) -> Optional[str]:
  """"uniform", "normal" or "truncated_normal" for TF's random functions, else None."""
  return {"random_uniform": "uniform", "random_normal": "normal",
          "truncated_normal": "truncated_normal"}.get(getattr(tf_fn, "__name__", None))


_ARGUMENTS = {"uniform": ("minval", "maxval"), "normal": ("mean", "stddev"),
              "truncated_normal": ("mean", "stddev")}


def check_kwargs(kind: Optional[str], kwargs: dict, op_name: str) -> None:
  """Raises TypeError for a keyword the TF function of `kind` does not take (None: any)."""
  if kind is None:
    return
  unknown = sorted(set(kwargs) - set(_ARGUMENTS[kind]) - {"dtype", "name"})
  if unknown:
    raise TypeError(f"Random op {op_name!r} ({kind}): unexpected keyword arguments {unknown}; it "
                    f"takes {list(_ARGUMENTS[kind])}, dtype and name (no seed: set a graph seed).")


class SliceGeometry:
  """Where a processor's slice sits in the whole tensor: the static part of a draw.

  Args:
    full_shape: the whole tensor's dimension sizes.
    slice_shape: the slice's sizes.
    split_axes: per tensor dimension, None, or (pnum divisor, mesh dimension size) of the mesh
      axis it is split over: the processor's coordinate is (pnum // divisor) % size.
  """

  def __init__(self, full_shape: Sequence[int], slice_shape: Sequence[int], split_axes: Sequence):
    self.full_shape = tuple(full_shape)
    self.slice_shape = tuple(slice_shape)
    self.split_axes = tuple(split_axes)

  @property
  def static_key(self) -> tuple:
    return self.full_shape, self.slice_shape, self.split_axes

  def _axis_positions(self, pnum, arange):
    """Per tensor dimension, last first: (positions, stride, shape). positions are the slice's
    elements' indices along that dimension of the whole tensor (built by arange(n), 0..n-1, in
    TF or NumPy), stride that dimension's stride in the flattened whole, shape the broadcast shape."""
    rank = len(self.full_shape)
    stride = 1
    for d in reversed(range(rank)):
      positions = arange(self.slice_shape[d])
      if self.split_axes[d] is not None:
        divisor, size = self.split_axes[d]
        positions += (pnum // divisor) % size * self.slice_shape[d]
      shape = [1] * rank
      shape[d] = self.slice_shape[d]
      yield positions, stride, shape
      stride *= self.full_shape[d]

  def global_indices(self, pnum):
    """uint64 tensor of the slice's shape: each element's index in the flattened whole tensor."""
    ret = tf.zeros([], _U64)
    arange = functools.partial(tf.range, dtype=tf.int64)
    for positions, stride, shape in self._axis_positions(tf.cast(pnum, tf.int64), arange):
      ret = ret + tf.reshape(tf.cast(positions, _U64) * tf.constant(stride, _U64), shape)
    return ret

  def global_indices_numpy(self, pnum: int) -> np.ndarray:
    """global_indices computed by NumPy, for eager draws."""
    index = np.zeros([1] * len(self.full_shape), np.uint64)
    arange = functools.partial(np.arange, dtype=np.int64)
    with np.errstate(over="ignore"):
      for positions, stride, shape in self._axis_positions(int(pnum), arange):
        index = index + (positions.astype(np.uint64) * np.uint64(stride)).reshape(shape)
    return index


  def element_keys(self, pnum, key):
    """The stream key of every element: the op's one key."""
    del pnum
    return key


class StagewiseGeometry(SliceGeometry):
  """A pipelined random op's slice: each stage draws its layer's unpipelined values.

  The op's shape is [stages, <the unpipelined op's dims, batch cut to a microbatch>]. Stage s
  uses key[s] (its layer's op key), and its element at microbatch row r is row r * M + m_s of
  the unpipelined tensor (m_s: the microbatch the stage runs), whose flat index it hashes. With
  microbatches given as the unpipelined op's leading dimension, that element's flat index is
  m_s times a microbatch's size plus its index within the microbatch.

  Args:
    full_shape, slice_shape, split_axes: as for SliceGeometry, of the pipelined op.
    keys: the op's random_keys.StagewiseKeys.
  """

  def __init__(self, full_shape, slice_shape, split_axes, keys):
    super().__init__(full_shape, slice_shape, split_axes)
    self.keys = keys

  @property
  def static_key(self) -> tuple:
    return super().static_key + (self.keys,)

  def _positions(self, pnum, d: int):
    positions = tf.range(self.slice_shape[d], dtype=tf.int64)
    if self.split_axes[d] is not None:
      divisor, size = self.split_axes[d]
      positions += (pnum // divisor) % size * self.slice_shape[d]
    return positions

  def _along(self, values, d: int):
    shape = [1] * len(self.full_shape)
    shape[d] = self.slice_shape[d]
    return tf.reshape(values, shape)

  def global_indices(self, pnum):
    pnum = tf.cast(pnum, tf.int64)
    k = self.keys
    stages = self._positions(pnum, k.stage_axis)
    micro = tf.gather(tf.constant(k.microbatches, tf.int64), stages)
    ret = tf.zeros([], _U64)
    stride = 1
    for d in reversed(range(len(self.full_shape))):
      if d == k.stage_axis:
        continue
      positions = self._along(self._positions(pnum, d), d)
      size = self.full_shape[d]
      if d == k.batch_axis:
        positions = positions * k.num_microbatches + self._along(micro, k.stage_axis)
        size *= k.num_microbatches
      ret = ret + tf.cast(positions, _U64) * tf.constant(stride, _U64)
      stride *= size
    if k.microbatch_major:
      ret = ret + tf.cast(self._along(micro, k.stage_axis), _U64) * tf.constant(stride, _U64)
    return ret

  def element_keys(self, pnum, key):
    stages = self._positions(tf.cast(pnum, tf.int64), self.keys.stage_axis)
    return self._along(tf.gather(key, stages), self.keys.stage_axis)


def _bits(geometry: SliceGeometry, pnum, key):
  """The slice's random uint64s: mix64(key + (global index + 1) * gamma)."""
  key = geometry.element_keys(pnum, key)
  index = geometry.global_indices(pnum)
  gamma = tf.constant(GOLDEN_GAMMA, _U64)
  return mix64(key + (index + tf.constant(1, _U64)) * gamma)


def _standard(kind: str, dtype, geometry: SliceGeometry, pnum, key, int_range):
  """The exact part of a draw, by kind and dtype.

  uniform, floating: values k / 2^b in [0, 1), b the dtype's significand bits (float32 for 8- and
    16-bit floats, cast exactly later);
  uniform, integer: minval + bits mod (maxval - minval), int_range = (minval, maxval) as int64;
  normal kinds: standard normal values, sqrt(2) erfinv(v (erf(sqrt 2) if truncated)) with
    v = (2k + 1 - 2^b) / 2^b in (-1, 1).
  """
  bits = _bits(geometry, pnum, key)
  if dtype.is_integer:
    minval, maxval = int_range[0], int_range[1]
    span = tf.bitcast(maxval - minval, _U64)
    return tf.cast(minval + tf.bitcast(tf.math.floormod(bits, span), tf.int64), dtype)
  compute_dtype = tf.float64 if dtype == tf.float64 else tf.float32
  # Normal values of 8- and 16-bit floats are rounded from float32 ones, drawn with float32's bits.
  b = _SIGNIFICAND_BITS[dtype if kind == "uniform" else compute_dtype]
  k = tf.bitcast(tf.bitwise.right_shift(bits, tf.constant(64 - b, _U64)), tf.int64)
  if kind == "uniform":
    return tf.cast(k, compute_dtype) * (2.0 ** -b)
  v = tf.cast(2 * k + (1 - 2 ** b), compute_dtype) * (2.0 ** -b)
  erf_bound = _ERF_SQRT2 if kind == "truncated_normal" else 1.0
  return (2.0 ** 0.5) * tf.math.erfinv(v * erf_bound)


def _uniform_numpy(dtype, geometry: SliceGeometry, pnum, key, bounds) -> np.ndarray:
  """_standard's uniform values of a SliceGeometry computed by NumPy (eager): the same bits.

  bounds: (minval, maxval) of an integer draw, else None.
  """
  index = geometry.global_indices_numpy(pnum)
  with np.errstate(over="ignore"):
    gamma = np.uint64(GOLDEN_GAMMA)
    bits = _mix64_numpy(np.uint64(key.numpy()) + (index + np.uint64(1)) * gamma)
    if dtype.is_integer:
      minval, maxval = (int(v) for v in bounds)
      span = np.uint64((maxval - minval) % 2 ** 64)
      values = np.int64(minval) + (bits % span).view(np.int64)
      return values.astype(dtype.as_numpy_dtype)
  compute_dtype = np.float64 if dtype == tf.float64 else np.float32
  b = _SIGNIFICAND_BITS[dtype]
  k = (bits >> np.uint64(64 - b)).view(np.int64)
  return k.astype(compute_dtype) * compute_dtype(2.0 ** -b)


_compiled = {}  # (kind, dtype, geometry) -> an XLA-compiled _standard
_eager_draws = collections.Counter()  # eager: draws per uniform configuration not compiled yet


def _standard_compiled(kind, dtype, geometry, pnum, key, int_range):
  """_standard through XLA: one fused loop instead of a dozen passes over 64-bit tensors.

  One tf.function per static configuration, each traced once; a partial (not a closure) keeps
  TF's retracing detector from counting all of them as one function that retraces.
  """
  cache_key = (kind, dtype, geometry.static_key)
  if cache_key not in _compiled:
    _compiled[cache_key] = tf2.function(functools.partial(_standard, kind, dtype, geometry),
                                        jit_compile=True, autograph=False)
  return _compiled[cache_key](pnum, key, int_range)


def draw(kind: str, geometry: SliceGeometry, pnum, key, dtype=tf.float32, **kwargs):
  """One processor's slice of a random tensor (kwargs as for tf.random.uniform / normal).

  Args:
    kind: one of KINDS.
    geometry: the slice's place in the whole tensor.
    pnum: the processor's number (int or int scalar tensor).
    key: the stream key (uint64 scalar tensor, see stream_key).
    dtype: the values' dtype.
    **kwargs: minval/maxval (uniform) or mean/stddev (normal kinds), numbers or tensors.
  """
  dtype = tf.as_dtype(dtype)
  if kind not in KINDS:
    raise ValueError(f"Unknown random kind {kind!r}; expected one of {KINDS}.")
  if kind != "uniform" and not dtype.is_floating:
    raise ValueError(f"A {kind} draw must be floating, got {dtype.name}.")
  bounds = None
  if dtype.is_integer:
    if kwargs.get("maxval") is None:
      raise ValueError(f"An integer uniform draw ({dtype.name}) needs an explicit maxval.")
    bounds = _uniform_bounds(kwargs)
  compiled = _compiles(kind, dtype, geometry)
  if (not compiled and kind == "uniform" and tf.executing_eagerly()
      and type(geometry) is SliceGeometry):
    standard = tf.constant(_uniform_numpy(dtype, geometry, pnum, key, bounds))
  else:
    int_range = (tf.zeros([2], tf.int64) if bounds is None
                 else tf.stack([tf.cast(v, tf.int64) for v in bounds]))
    args = (kind, dtype, geometry, tf.convert_to_tensor(pnum), key, int_range)
    standard = _standard_compiled(*args) if compiled else _standard(*args)
  if dtype.is_integer:
    return standard
  if kind == "uniform":
    minval, maxval = _uniform_bounds(kwargs)
    return _affine(tf.cast(standard, dtype), minval, maxval - minval, dtype)
  return _affine(tf.cast(standard, dtype), kwargs.get("mean", 0), kwargs.get("stddev", 1), dtype)


def _uniform_bounds(kwargs: dict) -> tuple:
  """(minval, maxval) with tf.random.uniform's defaults, 0 and 1."""
  minval, maxval = kwargs.get("minval"), kwargs.get("maxval")
  return (0 if minval is None else minval), (1 if maxval is None else maxval)


def _affine(x, offset, scale, dtype):
  """offset + scale * x, as TF's random functions compute it; identities (Python 0, 1) skipped."""
  if not (isinstance(scale, (int, float)) and scale == 1):
    x = x * tf.cast(scale, dtype)
  if not (isinstance(offset, (int, float)) and offset == 0):
    x = x + tf.cast(offset, dtype)
  return x


def _compiles(kind: str, dtype, geometry: SliceGeometry) -> bool:
  """Whether this draw runs the XLA function (compiled at its configuration's first use).

  Eagerly, a uniform (or integer) configuration is drawn by NumPy (`_uniform_numpy`; TF's own ops
  for a pipeline's stagewise slices) until it has been drawn `_eager_draws_before_compiling`
  times: its values are the same bits either way, and compiling (about 50 ms) pays only for a
  large slice drawn often, as a training loop does; an eager client that builds a new graph of
  new shapes at every call (GPT-Neo's tests) draws each a few times. Normal values always come
  from the XLA function, whose erfinv does not depend on the slice size.
  """
  if not _may_compile():
    return False
  if kind != "uniform" or not tf.executing_eagerly():
    return True
  cache_key = (kind, dtype, geometry.static_key)
  if cache_key in _compiled:
    return True
  limit = _eager_draws_before_compiling(geometry)
  if limit is None:
    return False
  _eager_draws[cache_key] += 1
  return _eager_draws[cache_key] >= limit


def _eager_draws_before_compiling(geometry: SliceGeometry) -> Optional[int]:
  """The eager draw of a uniform configuration that compiles it (None: never).

  NumPy draws a slice of up to 2^16 elements in at most 0.25 ms, no slower than the XLA call
  (0.15 to 0.2 ms): those are never compiled. A larger one (4.4 ms by NumPy for 2^18 elements
  against 1 to 2 ms) compiles once it has drawn 2^18 elements (the 2nd draw from 2^17 elements).
  TF's own ops, which draw stagewise slices, take about 0.2 ms more than the XLA function per
  small slice: those compile once 2^18 elements are drawn counting a slice as at least 2^14 (the
  16th draw of a small one).
  """
  elements = math.prod(geometry.slice_shape)
  if type(geometry) is SliceGeometry:
    if elements <= 2 ** 16:
      return None
  else:
    elements = max(elements, 2 ** 14)
  return max(2, -(-2 ** 18 // elements))


def _may_compile() -> bool:
  """XLA calls run everywhere but inside a tf.compat.v1 (control flow v1) loop or cond."""
  if tf.executing_eagerly():
    return True
  return tf.get_default_graph()._get_control_flow_context() is None  # pylint: disable=protected-access
