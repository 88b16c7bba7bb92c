"""Random tensors and dropout: fresh values at every evaluation, the same under every layout.

Values depend on (graph seed, op key name, evaluation number, loop iterations, element index)
only: see `_lowering/random_bits.py` (the per-element draw) and `_lowering/random_stream.py` (the
evaluation counter). An op's key name is its TF variable scope and how many random ops that scope
made before it in its mtf Graph (`random_keys.py`): a program built again (eagerly, or in another
process) names its random ops alike, whatever name scopes TF made unique, and a layer draws the
same values wherever the graph puts it (inside an mtf.pipeline too).
"""

from __future__ import annotations

import functools
import numbers
import random as py_random
from typing import Callable, Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Shape, convert_to_shape
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering import random_bits
from mesh_tensorflow._lowering.random_stream import graph_random_seed
from mesh_tensorflow._ops import binary as binary_ops
from mesh_tensorflow._ops import elementwise as elementwise_ops
from mesh_tensorflow._ops import random_keys

__all__ = ["RandomOperation", "random_uniform", "random_normal", "dropout"]



class RandomOperation(Operation):
  """A tensor of random values following `tf_fn` (tf.random.uniform, normal, truncated_normal).

  Each evaluation (Session.run, eager lowering, tf.function call, while_loop iteration) draws
  new values; with a graph seed the sequence is the same in every process and every run. See
  MeshImpl.random for other tf_fns.
  """

  # A recomputation (recompute_grad) must see the same random values, so the op is shared, not cloned.
  is_not_cloned = True
  # Not part of a graph's structure for the lowering cache: rebuilt graphs draw fresh keys without a
  # graph seed, and the cached program keeps drawing fresh values per call from the first one's.
  lowering_cache_ignores = ("_unseeded_key",)

  def __init__(self, mesh, shape: Shape, tf_fn: Callable, **kwargs):
    super().__init__([], mesh=mesh, name=kwargs.get("name", "random"))
    self._tf_fn = tf_fn
    self._kwargs = kwargs
    random_bits.check_kwargs(random_bits.kind_of(tf_fn), kwargs, self.name)
    self._outputs = [Tensor(self, convert_to_shape(shape), tf.as_dtype(kwargs.get("dtype", tf.float32)))]
    self._key_name, self._stagewise = random_keys.key_name(self.graph, self._outputs[0].shape)
    # Without a graph seed, every lowering of this op (e.g. one per TPU replica) still draws alike.
    self._unseeded_key = py_random.getrandbits(64)
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    out = self.outputs[0]
    seed = graph_random_seed()
    if self._stagewise is None:
      key = lowering.random_key(random_bits.op_key(seed, self._key_name, self._unseeded_key))
      lowering.set_tensor_lowering(out, mesh_impl.random(out.shape, self._tf_fn, self._kwargs, key=key))
      return
    keys = [lowering.random_key(random_bits.op_key(seed, name or self._key_name, self._unseeded_key))
            for name in self._stagewise.names]
    key = None if keys[0] is None else tf.stack(keys)  # the dry run draws no values
    lowering.set_tensor_lowering(
        out, mesh_impl.random(out.shape, self._tf_fn, self._kwargs, key=key, stagewise=self._stagewise))


def random_uniform(mesh, shape, **kwargs) -> Tensor:
  """Uniform values in [minval, maxval) (default [0, 1)); kwargs as for tf.random.uniform, without seed."""
  dtype = tf.as_dtype(kwargs.get("dtype", tf.float32))
  if dtype.is_integer and kwargs.get("maxval") is None:
    raise ValueError(f"random_uniform of {shape}: integer dtype {dtype.name} needs an explicit maxval.")
  return RandomOperation(mesh, convert_to_shape(shape), tf.random.uniform, **kwargs).outputs[0]


def random_normal(mesh, shape, **kwargs) -> Tensor:
  """Normal values (default mean 0, stddev 1); kwargs as for tf.random.normal, without seed."""
  dtype = tf.as_dtype(kwargs.get("dtype", tf.float32))
  if not dtype.is_floating:
    raise ValueError(f"random_normal of {shape}: dtype must be floating, got {dtype.name}.")
  return RandomOperation(mesh, convert_to_shape(shape), tf.random.normal, **kwargs).outputs[0]


def _accepts_pre_0_1_19_calls(dropout_fn: Callable) -> Callable:
  """Lets `dropout_fn` (0.1.19+'s signature) also take calls written for mesh_tensorflow <= 0.1.18.

  Up to 0.1.18 the signature was dropout(x, keep_prob=None, rate=None, noise_shape=None, name=None),
  always applied. Such a call is recognised by a float (or float Tensor) second positional
  argument, or by the absence of is_training; it is rebound by the old parameter names.
  """
  old_names = ("x", "keep_prob", "rate", "noise_shape", "name")

  @functools.wraps(dropout_fn)
  def wrapper(*args, **kwargs):
    if len(args) >= 2 and _is_keep_prob(args[1]):
      if len(args) > len(old_names):
        raise TypeError(f"dropout() got {len(args)} positional arguments for {old_names}.")
      for arg_name in old_names[:len(args)]:
        if arg_name in kwargs:
          raise TypeError(f"dropout() got multiple values for argument {arg_name!r}.")
      return dropout_fn(is_training=True, **dict(zip(old_names, args)), **kwargs)
    if len(args) < 2 and "is_training" not in kwargs:
      kwargs["is_training"] = True
    return dropout_fn(*args, **kwargs)

  return wrapper


@_accepts_pre_0_1_19_calls
def dropout(x: Tensor, is_training, keep_prob=None, rate=None, noise_shape=None,
            name: Optional[str] = None) -> Tensor:
  """Zeroes each element with probability rate (= 1 - keep_prob), scaling float x by 1/keep_prob.

  Calls of mesh_tensorflow <= 0.1.18, dropout(x, keep_prob=None, rate=None, noise_shape=None,
  name=None), are accepted too and always apply dropout (see _accepts_pre_0_1_19_calls).

  Args:
    x: the tensor to drop elements of.
    is_training: dropout is the identity unless this is true.
    keep_prob: the fraction of elements to keep; exactly one of keep_prob and rate must be given.
    rate: the fraction of elements to drop (1 - keep_prob).
    noise_shape: a subset of x's dims; elements differing only in the other dims are dropped together.
    name: variable scope of the dropout ops (default "dropout").
  """
  if (keep_prob is None) == (rate is None):
    raise ValueError(f"dropout of {x.name!r}: give exactly one of keep_prob and rate "
                     f"(got keep_prob={keep_prob!r}, rate={rate!r}).")
  if keep_prob is None:
    keep_prob = 1.0 - rate
  if isinstance(keep_prob, numbers.Real) and not 0.0 < keep_prob <= 1.0:
    raise ValueError(f"dropout of {x.name!r}: keep_prob must be in (0, 1] (rate in [0, 1)), "
                     f"got keep_prob={keep_prob}.")
  noise_shape = _check_noise_shape(x, convert_to_shape(noise_shape))
  with tf.variable_scope(name, default_name="dropout"):
    if not is_training or (isinstance(keep_prob, numbers.Real) and keep_prob == 1.0):
      return x
    noise_dtype = x.dtype if x.dtype.is_floating else tf.float32
    uniform = random_uniform(x.mesh, noise_shape, dtype=noise_dtype)
    noise = elementwise_ops.cast(binary_ops.less(uniform, keep_prob), x.dtype)
    if x.dtype.is_floating:
      noise = binary_ops.divide(noise, keep_prob)
    return binary_ops.multiply(x, noise, output_shape=x.shape)


def _is_keep_prob(value) -> bool:
  """Whether dropout's second argument is a keep probability (old signature), not is_training."""
  if isinstance(value, (Tensor, tf.Tensor)):
    return value.dtype.is_floating
  return isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)


def _check_noise_shape(x: Tensor, noise_shape: Optional[Shape]) -> Shape:
  if noise_shape is None:
    return x.shape
  extra = [d for d in noise_shape.dims if d not in x.shape.dims]
  if extra:
    raise ValueError(f"dropout of {x.name!r}: noise_shape {noise_shape} has dims {extra} that are not in "
                     f"x's shape {x.shape}; noise_shape must be a subset of x's dims.")
  return noise_shape
