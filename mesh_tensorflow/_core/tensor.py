"""Tensor: a named-shape, typed output of an Operation. Hashed by identity (tensors are dict keys)."""

from __future__ import annotations

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Shape


def _mtf():
  """The public op namespace, imported late because it imports this module."""
  from mesh_tensorflow import ops
  return ops


class Tensor:
  """The output `index` of `operation`, with a named Shape and a tf.DType."""

  def __init__(self, operation, shape: Shape, dtype: tf.DType, name: str | None = None, index: int = 0):
    if not isinstance(shape, Shape):
      raise ValueError(f"Tensor shape must be an mtf.Shape, got {shape!r}.")
    if not isinstance(dtype, tf.DType):
      raise ValueError(f"Tensor dtype must be a tf.DType, got {dtype!r}.")
    self._mesh = operation.mesh
    self._operation = operation
    self._shape = shape
    self._dtype = dtype
    self._name = name if name is not None else "%s:%d" % (operation.name, index)
    self.usable = True

  @property
  def shape(self) -> Shape:
    return self._shape

  @property
  def size(self) -> int:
    return self._shape.size

  @property
  def mesh(self):
    return self._mesh

  @property
  def graph(self):
    return self._mesh.graph

  @property
  def operation(self):
    return self._operation

  @property
  def dtype(self) -> tf.DType:
    return self._dtype

  @property
  def name(self) -> str:
    return self._name

  @property
  def to_string(self) -> str:
    return "Tensor[%s, %s, %s]" % (self._name, self._shape.to_string, self._dtype)

  def __repr__(self):
    return self.to_string

  # Operators delegate to the op library, imported lazily (the op library imports this module).
  def __add__(self, other):
    return _mtf().add(self, other)

  def __radd__(self, other):
    return _mtf().add(self, other)

  def __sub__(self, other):
    return _mtf().sub(self, other)

  def __rsub__(self, other):
    return _mtf().add(_mtf().negative(self), other)

  def __mul__(self, other):
    return _mtf().multiply(self, other)

  def __rmul__(self, other):
    return _mtf().multiply(self, other)

  def __truediv__(self, other):
    return _mtf().divide(self, other)

  def __rtruediv__(self, other):
    return _mtf().multiply(_mtf().reciprocal(self), other)

  def __floordiv__(self, other):
    return _mtf().floordiv(self, other)

  def __rfloordiv__(self, other):
    return _mtf().floordiv(other, self)

  def __mod__(self, other):
    return _mtf().mod(self, other)

  def __rmod__(self, other):
    return _mtf().mod(other, self)

  def __neg__(self):
    return _mtf().negative(self)
