"""Tensor: a named-shape, typed output of an Operation. Hashed by identity (tensors are dict keys)."""

from __future__ import annotations

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Shape


# The ops behind Tensor's arithmetic operators, registered by the op families (the core must not
# import them): add, sub, multiply, divide, floordiv, mod, negative, reciprocal.
_OPERATORS = {}


def register_operators(**fns) -> None:
  """Registers the functions Tensor's operators call, by name (e.g. add=binary.add)."""
  _OPERATORS.update(fns)


def _op(name: str):
  if name not in _OPERATORS:
    raise RuntimeError(f"mtf.Tensor operators need the op families; import mesh_tensorflow first "
                       f"({name!r} is not registered).")
  return _OPERATORS[name]


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

  # Operators delegate to the registered op functions (see register_operators).
  def __add__(self, other):
    return _op("add")(self, other)

  def __radd__(self, other):
    return _op("add")(self, other)

  def __sub__(self, other):
    return _op("sub")(self, other)

  def __rsub__(self, other):
    return _op("add")(_op("negative")(self), other)

  def __mul__(self, other):
    return _op("multiply")(self, other)

  def __rmul__(self, other):
    return _op("multiply")(self, other)

  def __truediv__(self, other):
    return _op("divide")(self, other)

  def __rtruediv__(self, other):
    return _op("multiply")(_op("reciprocal")(self), other)

  def __floordiv__(self, other):
    return _op("floordiv")(self, other)

  def __rfloordiv__(self, other):
    return _op("floordiv")(other, self)

  def __mod__(self, other):
    return _op("mod")(self, other)

  def __rmod__(self, other):
    return _op("mod")(other, self)

  def __neg__(self):
    return _op("negative")(self)
