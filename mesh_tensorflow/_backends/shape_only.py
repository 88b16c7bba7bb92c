"""ShapeOnlyMeshImpl: a backend whose laid-out values carry only one slice's shape and dtype.

It lets `mtf.dry_run` walk every op's normal `lower` code -- the same calls to the communication
layer, in the same order, so the same events -- without devices, sessions or real data.

Its cost does not depend on the number of processors. One value stands for every processor's
slice (layouts split tensors evenly, so all slices of a tensor have one shape), collectives
compute their output slice shapes from the mesh arithmetic instead of building per-processor
pieces, and the communication layer derives bytes from (group size, slice bytes, processors).

Its cost grows little with repeated structure either (the layers of a Transformer): values are
placeholders shared per (shape, dtype), and `slicewise` builds `fn` once per distinct call --
the function's code, the values it closes over and its input TF values (shared placeholders of
one shape are one value) -- and hands later identical calls the same outputs. Only the shapes
matter here, and the same function of the same values gives the same shapes. Calls whose function
holds something that cannot be compared by value (an array, an unhashable object, an empty cell)
are built afresh each time. Use it only under a throwaway default graph (dry_run makes one).
"""

from __future__ import annotations

import functools
import types
from typing import Optional

import numpy as np
import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering import laid_out
from mesh_tensorflow._lowering.lazy import convert_args_to_laid_out_tensors
from mesh_tensorflow._lowering.mesh_impl import MeshImpl


class _NotComparable(Exception):
  """A value a slicewise function holds that cannot be compared by value."""


_LIBRARIES = frozenset({"tensorflow", "numpy", "keras", "tf_keras"})
_EXACT_ATOMS = frozenset({type(None), bool, int, float, str, bytes})
_ATOMS = (type(None), bool, int, float, complex, str, bytes, tf.DType, np.generic)


def _freeze(value, depth: int = 0):
  """A hashable key equal for values that make a TF function build the same shapes."""
  kind = type(value)
  if kind in _EXACT_ATOMS:
    return kind, value
  if depth > 8:
    raise _NotComparable()
  if kind is _Identity:
    return value
  if isinstance(value, tf.Tensor):
    return _Identity(value)  # a placeholder standing for a slice (equal shapes: the same one)
  if isinstance(value, _ATOMS):
    return kind, value
  if isinstance(value, (tuple, list)):
    return type(value), tuple(_freeze(v, depth + 1) for v in value)
  if isinstance(value, dict):
    return dict, tuple(sorted(((repr(k), _freeze(v, depth + 1)) for k, v in value.items()),
                              key=lambda item: item[0]))
  if isinstance(value, (set, frozenset)):
    return frozenset, frozenset(_freeze(v, depth + 1) for v in value)
  if isinstance(value, Tensor):
    return Tensor, value.shape, value.dtype
  if isinstance(value, Operation):  # what an op's per-slice function reads: its attributes
    return kind, tuple((k, _freeze(v, depth + 1)) for k, v in sorted(vars(value).items())
                       if k != "_name")
  if isinstance(value, types.FunctionType):
    if (value.__module__ or "").split(".")[0] in _LIBRARIES:
      return _Identity(value)  # a library's function, the same object throughout
    return _function_key(value, depth + 1)
  if isinstance(value, types.MethodType):
    return "method", _freeze(value.__func__, depth + 1), _freeze(value.__self__, depth + 1)
  if isinstance(value, functools.partial):
    return ("partial", _freeze(value.func, depth + 1), _freeze(value.args, depth + 1),
            _freeze(value.keywords, depth + 1))
  if isinstance(value, (tf.Operation, tf.Variable)):
    return _Identity(value)
  if isinstance(value, np.ndarray):
    raise _NotComparable()
  if isinstance(value, (types.BuiltinFunctionType, types.ModuleType, type)):
    return "id", value  # module-level: one object for the whole program
  if type(value).__hash__ is object.__hash__:
    return _Identity(value)
  try:
    hash(value)
  except TypeError:
    raise _NotComparable() from None
  return type(value), value


class _Identity:
  """An object compared by identity, kept alive by the key that holds it (so its id is not reused)."""

  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value

  def __eq__(self, other):
    return isinstance(other, _Identity) and other.value is self.value

  def __hash__(self):
    return id(self.value)


def _scope():
  """Where a TF value may be reused: its graph and control-flow context (a v1 while loop's body)."""
  graph = tf.get_default_graph()
  return graph, graph._get_control_flow_context()  # pylint: disable=protected-access


def _function_key(fn, depth: int):
  closure = tuple(_cell_value(c, depth) for c in fn.__closure__ or ())
  return ("fn", fn.__code__, _freeze(fn.__defaults__, depth), _freeze(fn.__kwdefaults__, depth),
          closure)


def _cell_value(cell, depth: int):
  try:
    contents = cell.cell_contents
  except ValueError:  # an empty cell (a name assigned after the function was made)
    raise _NotComparable() from None
  return _freeze(contents, depth)


class ShapeValues:
  """Shape-only values and what slicewise built from them, in one throwaway TF graph.

  A value depends on shapes alone, not on the mesh, so dry runs of one graph under many layouts
  (explain --search) can share them: a later dry run builds only the calls no earlier one made.
  """

  MAX_OPS = 200_000  # a graph grown past this is replaced by an empty one (`fresh`)

  def __init__(self):
    self.graph = tf.Graph()
    self.placeholders = {}  # (scope, shape, dtype) -> its one placeholder
    self.built = {}  # (scope, function key, input shapes) -> fn's output(s)
    self.no_ops = {}  # scope -> its one no-op

  def fresh(self) -> ShapeValues:
    """self, or a new ShapeValues once self's graph holds MAX_OPS ops."""
    return self if self.graph.version < self.MAX_OPS else ShapeValues()  # version: ops made


class ShapeOnlyMeshImpl(MeshImpl):
  """A mesh of `shape` laid out by `layout`, with shape-only slices and no-op collectives.

  Its values live in the default TF graph of the lowering; `values` (a ShapeValues, whose graph
  must then be the default one) shares them with other dry runs.
  """

  def __init__(self, shape, layout_rules, values: Optional[ShapeValues] = None):
    super().__init__(shape, layout_rules)
    values = values or ShapeValues()
    self._placeholders = values.placeholders
    self._built = values.built
    self._no_ops = values.no_ops

  class LaidOutTensor(laid_out.LaidOutTensor):
    """One placeholder standing for every processor's slice."""

  class LaidOutVariable(laid_out.LaidOutVariable):
    """A variable's slice as a placeholder; assignments and copies are no-ops."""

    def __init__(self, variable, mesh_impl):
      self._variable = variable
      slice_shape = mesh_impl.slice_shape(variable.outputs[0].shape)
      self._laid_out_tensor = mesh_impl._laid_out(slice_shape, variable.slice_dtype)
      self._copy_master_to_slices = mesh_impl.register_copy_master_to_slices(mesh_impl.no_op)
      self._copy_slices_to_master = mesh_impl.no_op()
      self._no_op = mesh_impl.no_op

    def assign_to_slices(self, assign_fn, values):
      del assign_fn, values
      return self._no_op()

  @property
  def devices(self) -> list:
    return [""] * self.size

  def placeholder(self, shape, dtype) -> tf.Tensor:
    """The one placeholder of `shape` and `dtype` in the default TF graph."""
    dtype = tf.as_dtype(dtype).base_dtype
    shape = None if shape is None else tuple(shape)
    key = (_scope(), shape, dtype)
    if key not in self._placeholders:
      self._placeholders[key] = tf.placeholder(dtype, shape=None if shape is None else list(shape))
    return self._placeholders[key]

  def no_op(self) -> tf.Operation:
    """The one no-op of the default TF graph (what copies and assignments stand for)."""
    scope = _scope()
    if scope not in self._no_ops:
      self._no_ops[scope] = tf.no_op()
    return self._no_ops[scope]

  def _laid_out(self, shape, dtype):
    return self.LaidOutTensor([self.placeholder(shape, dtype)])

  def slicewise(self, fn, *inputs):
    """fn's outputs as shared placeholders of their shapes (fn is built once per distinct call)."""
    inputs = convert_args_to_laid_out_tensors(inputs)
    args = [x.tensor_list[0] if isinstance(x, self.LaidOutTensor) else x for x in inputs]
    try:
      key = (_scope(), _freeze(fn), _freeze(args))
    except _NotComparable:
      key = None
    ret = self._built.get(key) if key is not None else None
    if ret is None:
      ret = self._as_placeholders(fn(*args))
      if key is not None:
        self._built[key] = ret
    if isinstance(ret, tuple):
      return tuple(self.LaidOutTensor([t]) for t in ret)
    return self.LaidOutTensor([ret])

  def _as_placeholders(self, ret):
    """Every value is a placeholder, so equal shapes are one TF value and no constant flows on."""
    if isinstance(ret, tuple):
      return tuple(self._as_placeholders(t) for t in ret)
    if isinstance(ret, tf.Tensor):
      return self.placeholder(ret.shape.as_list() if ret.shape.rank is not None else None, ret.dtype)
    return ret

  def allreduce(self, x, mesh_axes, reduction_fn_string):
    del mesh_axes, reduction_fn_string
    return x.to_laid_out_tensor()

  def allconcat(self, x, mesh_axis, concat_axis):
    shape = list(x.slice_shape)
    shape[concat_axis] *= self.shape[mesh_axis].size
    return self._laid_out(shape, x.dtype)

  def alltoall(self, x, mesh_axis, split_axis, concat_axis):
    n = self.shape[mesh_axis].size
    shape = list(x.slice_shape)
    if shape[split_axis] % n:
      raise ValueError(f"alltoall over mesh axis {mesh_axis} (size {n}) cannot split slice axis "
                       f"{split_axis} of {shape}: the size is not a multiple of {n}.")
    shape[split_axis] //= n
    shape[concat_axis] *= n
    return self._laid_out(shape, x.dtype)

  def allsplit(self, x, mesh_axis, split_axis, which=None):
    del which
    x = x.to_laid_out_tensor()
    shape = list(x.slice_shape)
    shape[split_axis] //= self.shape[mesh_axis].size
    return self._laid_out(shape, x.dtype)

  def receive(self, x, mesh_axis, source_pcoord):
    del mesh_axis, source_pcoord
    return x.to_laid_out_tensor()

  def laid_out_pnum(self):
    return self._laid_out([], tf.int32)

  def import_tf_tensor(self, x, tf_x):
    return self._laid_out(self.slice_shape(x.shape), tf_x.dtype)

  def export_to_tf_tensor(self, x, laid_out_x):
    del laid_out_x
    return self.placeholder(x.shape.to_integer_list, x.dtype)

  def random(self, shape, tf_fn, kwargs, key=None, stagewise=None):
    """A placeholder of the slice: a dry run needs the shape, not the (XLA-compiled) draw."""
    del tf_fn, key, stagewise
    return self._laid_out(self.slice_shape(shape), kwargs.get("dtype", tf.float32))

  def Print(self, x, data, message, **kwargs):  # pylint: disable=invalid-name
    del data, message, kwargs
    return x
