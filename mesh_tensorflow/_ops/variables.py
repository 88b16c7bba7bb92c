"""Variables: float32 masters (checkpointed) plus per-processor slices; reads and assignments."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import numpy as np
import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Shape, convert_to_shape
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering.tf_helpers import outside_all_rewrites

__all__ = [
    "VariableDType", "Variable", "get_variable", "intercept_get_variable", "ReadVariable", "read_variable",
    "Assign",
    "assign", "assign_add", "assign_sub", "assign_slice", "assign_add_slice", "assign_sub_slice",
]


class VariableDType:
  """Dtypes of a variable's three roles: checkpointed master, per-device slice, graph activation.

  Args:
    master_dtype: the dtype of the master variable, which checkpoints hold.
    slice_dtype: the dtype of each processor's slice, which training updates (default master's);
      e.g. bfloat16 slices of a float32 master halve device memory.
    activation_dtype: the dtype of the Tensor the graph reads (default master's).
  """

  def __init__(self, master_dtype=tf.float32, slice_dtype=None, activation_dtype=None):
    self._master_dtype = master_dtype
    self._slice_dtype = slice_dtype or master_dtype
    self._activation_dtype = activation_dtype or master_dtype

  @property
  def master_dtype(self) -> tf.DType:
    return self._master_dtype

  @property
  def slice_dtype(self) -> tf.DType:
    return self._slice_dtype

  @property
  def activation_dtype(self) -> tf.DType:
    return self._activation_dtype

  def __repr__(self):
    return (f"VariableDType(master_dtype={self._master_dtype.name}, "
            f"slice_dtype={self._slice_dtype.name}, activation_dtype={self._activation_dtype.name})")


class Variable(Operation):
  """A trainable (or not) mtf variable; its op name is the master variable's name."""

  is_not_cloned = True  # recomputation reuses variables
  is_stacked = False  # a StackedVariable (stacking.py) is several variables in one
  is_layer_stack = False

  def __init__(self, mesh, name: str, shape: Shape, dtype: VariableDType, initializer, trainable: bool,
               **kwargs):
    super().__init__([], mesh, name="name_will_be_set_later")
    if not isinstance(dtype, VariableDType):
      raise ValueError(f"Variable {name!r}: dtype must be an mtf.VariableDType, got {dtype!r}.")
    _check_initializer_size(name, shape, initializer)
    self._variable_dtype = dtype
    self._trainable = trainable
    self._master_holder = None  # set by a backend that keeps no whole master (replace_master)
    self._create_master(mesh, name, shape, initializer, trainable, **kwargs)
    self._outputs = [Tensor(self, shape, dtype.activation_dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()
    self.graph.all_variables.append(self)
    if trainable:
      self.graph.trainable_variables.append(self)

  def _create_master(self, mesh, name, shape, initializer, trainable, **kwargs):
    # A resource variable (also under tf.disable_v2_behavior): its reads are snapshots, so the
    # backend may use it as a processor's slice (see PlacementMeshImpl.LaidOutVariable).
    kwargs.setdefault("use_resource", True)
    with tf.device(mesh.variable_placer_fn), outside_all_rewrites():
      self._master = tf.get_variable(name, shape.to_integer_list, dtype=self.master_dtype,
                                     initializer=initializer, trainable=trainable, **kwargs)
    self._master_device = self._master.device
    self._name = self._master.name[:self._master.name.find(":")]

  def __repr__(self):
    return "Variable(%s)" % self.value

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    with outside_all_rewrites():
      laid_out_variable = mesh_impl.LaidOutVariable(self, mesh_impl)
    lowering.variables[self] = laid_out_variable
    lowering.set_tensor_lowering(
        self.outputs[0],
        mesh_impl.slicewise(tf.cast, laid_out_variable.laid_out_tensor, self.activation_dtype))

  @property
  def value(self) -> Tensor:
    return self.outputs[0]

  @property
  def shape(self) -> Shape:
    return self.value.shape

  @property
  def size(self) -> int:
    return self.shape.size

  @property
  def dtype(self) -> VariableDType:
    return self._variable_dtype

  @property
  def master_dtype(self) -> tf.DType:
    return self._variable_dtype.master_dtype

  @property
  def slice_dtype(self) -> tf.DType:
    return self._variable_dtype.slice_dtype

  @property
  def activation_dtype(self) -> tf.DType:
    return self._variable_dtype.activation_dtype

  @property
  def trainable(self) -> bool:
    return self._trainable

  @property
  def master_device(self) -> str:
    """The device the master variable was created on (by mesh.variable_placer_fn)."""
    return self._master_device

  def get_master(self):
    """The whole variable in master_dtype: the master tf.Variable, which classic checkpoints hold.

    After a lowering that keeps no whole master (`PlacementMeshImpl(masters="sliced")`), a
    tf.Tensor instead: the whole value assembled from the slices that checkpoints hold. Read it;
    change it with assign_to_master.
    """
    if self._master_holder is not None:
      return self._master_holder.master_value()
    return self._master

  def assign_to_master(self, val):
    """An op assigning the whole value `val` to the master (sliced masters: to every slice)."""
    if self._master_holder is not None:
      return self._master_holder.assign_master(val)
    return tf.assign(self._master, val)

  def replace_master(self, holder):
    """For a backend that keeps no whole master: `holder` holds the variable from now on.

    get_master() then returns `holder.master_value()` and assign_to_master(val) returns
    `holder.assign_master(val)`. Returns the master tf.Variable created with this Variable, for the
    backend to retire (None if an earlier lowering replaced it); this Variable drops it, so an eager
    master's memory is freed.
    """
    master, self._master = self._master, None
    self._master_holder = holder
    return master


def _check_initializer_size(name: str, shape: Shape, initializer) -> None:
  """A constant initializer's value must be a scalar or have one element per variable element."""
  value = getattr(initializer, "value", None)
  if not isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, np.generic, list, tuple, int, float)):
    return  # not a constant initializer (a callable, or a test's mock whose attributes are mocks)
  num_elements = value.shape.num_elements() if isinstance(value, (tf.Tensor, tf.Variable)) else np.size(value)
  if num_elements not in (None, 1, shape.size):
    raise ValueError(
        f"Variable {name!r} of {shape} has {shape.size} elements, but its initializer's value has "
        f"{num_elements}; give a scalar or a value with {shape.size} elements (in the order of "
        f"the dims {shape.dimension_names}).")


def _check_reused_shape(full_name: str, existing: Variable, shape: Shape) -> None:
  if shape != existing.shape:
    raise ValueError(
        f"get_variable {full_name!r}: a variable of that name already exists with {existing.shape}, "
        f"but {shape} was asked for. Use another name or variable scope for a new variable, or "
        f"ask for the same shape to reuse it.")


def get_variable(mesh, name: str, shape, dtype=tf.float32, master_dtype=None, slice_dtype=None,
                 activation_dtype=None, initializer=None, trainable: bool = True, **kwargs) -> Tensor:
  """Creates (or reuses, by full scoped name) a Variable and returns its output Tensor.

  The master variable is a `tf.get_variable` named after the current TF variable scope and
  `name` (e.g. "encoder/w"), so checkpoints see that name; each processor gets a slice of it.

  Args:
    mesh: the mtf.Mesh the variable lives on.
    name: the name within the current TF variable scope.
    shape: an mtf.Shape, a list of Dimensions, or a string such as "d_model:512;d_ff:2048".
    dtype: a tf.DType for all three roles, an mtf.VariableDType, or None to build one from the
      three *_dtype arguments.
    master_dtype: overrides the checkpointed master's dtype.
    slice_dtype: overrides the dtype of the per-processor slices.
    activation_dtype: overrides the dtype the graph reads.
    initializer: a TF initializer for the master, e.g. tf.random_normal_initializer(stddev=0.02);
      None uses TF's default, glorot_uniform, which takes fan-in and fan-out from the dimension
      order (fan-out is the last dimension, as in [d_in, d_out]); this is logged at INFO level.
    trainable: whether the variable is in graph.trainable_variables (optimizers update those).
    **kwargs: passed on to tf.get_variable (e.g. collections).

  Returns:
    The variable's output mtf Tensor (activation dtype). `tensor.operation` is the mtf.Variable.

  Raises:
    ValueError: a bad dtype, a reused name with another shape, or an initializer of the wrong size.

  Example:
    w = mtf.get_variable(mesh, "w", [d_model, d_ff], initializer=tf.zeros_initializer())
  """
  if _interceptors:
    return _intercepted(mesh, name, shape, dtype=dtype, master_dtype=master_dtype, slice_dtype=slice_dtype,
                        activation_dtype=activation_dtype, initializer=initializer, trainable=trainable,
                        **kwargs)
  if dtype is None:
    dtype = VariableDType(master_dtype or tf.float32, slice_dtype, activation_dtype)
  elif isinstance(dtype, tf.DType):
    dtype = VariableDType(master_dtype or dtype, slice_dtype or dtype, activation_dtype or dtype)
  elif not isinstance(dtype, VariableDType):
    raise ValueError(f"get_variable {name!r}: dtype must be a tf.DType or an mtf.VariableDType, "
                     f"got {dtype!r}.")
  scope_name = tf.get_variable_scope().name
  full_name = scope_name + "/" + name if scope_name else name
  if initializer is None:  # the documented default: worth a debugging note, not a warning
    tf.logging.info("Using the default glorot_uniform_initializer for variable %s; it takes fan-in "
                    "and fan-out from the dimension order.", full_name)
  shape = convert_to_shape(shape)
  if full_name in mesh.graph.name_to_variable:
    existing = mesh.graph.name_to_variable[full_name]
    _check_reused_shape(full_name, existing, shape)
    return existing.outputs[0]
  var = Variable(mesh, name, shape, dtype, initializer, trainable, **kwargs)
  if var.name != full_name:
    raise ValueError(
        f"Variable {full_name!r} was created as {var.name!r}: the TF graph already holds a "
        f"variable of that name. Build each mtf graph in a fresh tf.Graph, or use another name.")
  mesh.graph.name_to_variable[full_name] = var
  return var.outputs[0]


_interceptors = []  # intercept_get_variable's functions, innermost last


@contextlib.contextmanager
def intercept_get_variable(fn: Callable):
  """Within it, `mtf.get_variable(mesh, name, shape, **kwargs)` returns fn(mesh, name, shape, **kwargs).

  This is how code that makes its variables with mtf.get_variable (the Transformer's layers)
  runs inside mtf.pipeline, which gives each layer's weight a stage dimension. fn may call
  mtf.get_variable itself: that call goes to the next outer interceptor, or makes the variable.
  """
  _interceptors.append(fn)
  try:
    yield
  finally:
    _interceptors.pop()


def _intercepted(mesh, name, shape, **kwargs):
  fn = _interceptors.pop()
  try:
    return fn(mesh, name, shape, **kwargs)
  finally:
    _interceptors.append(fn)


class ReadVariable(Operation):
  """Re-reads a variable's slices (e.g. after an assignment, ordered by control dependencies)."""

  def __init__(self, var: Variable, name: Optional[str] = None):
    super().__init__([var.outputs[0]], name=name or "read_variable")
    self._var = var
    self._outputs = [Tensor(self, var.shape, var.activation_dtype)]

  def gradient(self, grad_ys):
    return grad_ys

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    laid_out_variable = lowering.variables[self._var]
    lowering.set_tensor_lowering(
        self.outputs[0],
        mesh_impl.slicewise(tf.cast, laid_out_variable.read(), self._var.activation_dtype))


def read_variable(var: Variable) -> Tensor:
  return ReadVariable(var).outputs[0]


def assign_slice(variable: Variable, slice_var, val):
  return tf.assign(slice_var, tf.cast(val, variable.slice_dtype))


def assign_add_slice(variable: Variable, slice_var, val):
  return tf.assign_add(slice_var, tf.cast(val, variable.slice_dtype))


def assign_sub_slice(variable: Variable, slice_var, val):
  return tf.assign_sub(slice_var, tf.cast(val, variable.slice_dtype))


class Assign(Operation):
  """Assigns new values to variables' slices; lowers to a tf.group in lowering.operations."""

  def __init__(self, variables, new_values, assign_fn: Callable = assign_slice,
               name: Optional[str] = None):
    variables = list(variables)
    new_values = list(new_values)
    for var, val in zip(variables, new_values):
      if var.shape != val.shape:
        raise ValueError(
            f"Assigning {val.name!r} of {val.shape} to variable {var.name!r} of {var.shape}; the "
            f"shapes must be equal (use mtf.reshape/transpose/broadcast first).")
    super().__init__(new_values, variables[0].mesh, name=name or "assign")
    self._variables = variables
    self._assign_fn = assign_fn
    self._outputs = []

  def lower(self, lowering):
    ops = []
    for var, val in zip(self._variables, self.inputs):
      ops.append(lowering.variables[var].assign_to_slices(
          self._assign_fn, lowering.tensors[val].to_laid_out_tensor()))
    lowering.operations[self] = tf.group(ops)

  @property
  def assign_fn(self) -> Callable:
    return self._assign_fn

  @property
  def variables(self) -> list:
    return self._variables


def _to_variable(var) -> Variable:
  """A Variable, its output, or a chain of single-input ops (e.g. a cast) leading to one."""
  op = var.operation if isinstance(var, Tensor) else var
  while not isinstance(op, Variable):
    if not isinstance(op, Operation) or len(op.inputs) != 1:
      raise ValueError(f"assign: {var!r} is not an mtf Variable, its output, or a chain of "
                       f"single-input ops leading to one.")
    op = op.inputs[0].operation
  return op


def assign(var, new_val: Tensor, assign_fn: Callable = assign_slice, name: Optional[str] = None):
  return Assign([_to_variable(var)], [new_val], assign_fn=assign_fn, name=name)


def assign_add(var, new_val: Tensor):
  return assign(var, new_val, assign_fn=assign_add_slice)


def assign_sub(var, new_val: Tensor):
  return assign(var, new_val, assign_fn=assign_sub_slice)
