"""A MeshModule's variables: eager tf.Variables that every lowering traced for the module reuses.

mtf creates a variable's master with `tf.get_variable` while the mtf graph is built and each
processor's slice variable while it is lowered. Inside a traced TF function both would be new
variables of that function's graph at every trace. `VariableStore.owning()` makes them eager
tf.Variables instead, created once (outside the graph, under `tf.init_scope`) and found by name
at every later trace, so the module owns them and the traced function only captures them.

Checkpoints hold each mtf variable's whole value under its name, as the project's other
checkpoints do (docs/checkpoints.md), whatever the layout: `WholeValue` is that checkpoint entry.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import tensorflow as tf2
import tensorflow.compat.v1 as tf

from mesh_tensorflow._lowering import laid_out
from mesh_tensorflow._tf_compat import resource_variable_ops


class VariableStore:
  """name -> eager tf.Variable, shared by every lowering of one module (not itself checkpointed)."""

  def __init__(self):
    self._variables = {}
    self.created = []  # names created during the current owning() block

  def __contains__(self, name: str) -> bool:
    return name in self._variables

  @property
  def variables(self) -> list:
    return list(self._variables.values())

  @contextlib.contextmanager
  def owning(self):
    """Masters (any tf variable creation) and slice variables made within come from this store."""
    self.created = []
    with tf2.variable_creator_scope(self._master_creator), \
        laid_out.slice_variable_owner(self._slice_variable):
      yield

  def _existing(self, name: str, shape, dtype):
    variable = self._variables.get(name)
    if variable is None:
      return None
    if variable.shape.as_list() != list(shape) or variable.dtype.base_dtype != dtype:
      raise ValueError(
          f"MeshModule: variable {name!r} exists with shape {variable.shape} and dtype "
          f"{variable.dtype.name}, but this function asks for shape {list(shape)} and dtype "
          f"{tf.as_dtype(dtype).name}; give the variable another name (a tf.variable_scope) or "
          f"the same shape and dtype.")
    return variable

  def _create(self, name: str, make: Callable):
    with tf.init_scope():
      variable = make()
    self._variables[name] = variable
    self.created.append(name)
    return variable

  def _master_creator(self, next_creator, **kwargs):  # noqa: ARG002 (variable_creator_scope's contract)
    """Every tf variable the mtf graph creates: an eager one of this store, made once per name."""
    name = kwargs.get("name")
    if not name:
      raise ValueError("MeshModule: a variable created inside a mesh function needs a name "
                       "(mtf.get_variable always gives one); pass name= to tf.Variable.")
    initial_value = kwargs["initial_value"]
    dtype = tf.as_dtype(kwargs.get("dtype") or getattr(initial_value, "dtype", tf.float32))
    shape = kwargs.get("shape")
    if shape is not None and tf.TensorShape(shape).is_fully_defined():
      existing = self._existing(name, tf.TensorShape(shape).as_list(), dtype)
      if existing is not None:
        return existing
    elif name in self._variables:
      return self._variables[name]

    def make():
      value = initial_value() if callable(initial_value) else initial_value
      return _variable(value, dtype=dtype, trainable=kwargs.get("trainable", True), name=name)
    return self._create(name, make)

  def _slice_variable(self, name: str, shape, dtype, device: str):
    """A processor's slice variable (laid_out.slice_variable's contract: not initialised)."""
    existing = self._existing(name, shape, tf.as_dtype(dtype))
    if existing is not None:
      return existing

    def make():
      with tf.device(device):
        return _variable(tf.zeros(shape, dtype), dtype=dtype, trainable=False, name=name)
    return self._create(name, make)


def _variable(initial_value, **kwargs):
  # The class itself, not tf.Variable: tf.Variable would call the creator scope (ours) again.
  return resource_variable_ops.ResourceVariable(initial_value, **kwargs)


class WholeValue(tf2.__internal__.tracking.Trackable):
  """One mtf variable's checkpoint entry: its whole value, the same under every layout.

  Saving asks the module to copy the slices into the masters first (`sync_masters`); restoring
  writes the master and marks the slices stale, so the module copies the masters into them
  before its next call (`masters_restored`). The entry's key ends in `VARIABLE_VALUE`, as a
  tf.Variable's does.
  """

  def __init__(self, master, sync_masters: Callable, masters_restored: Callable):
    self._master = master
    self._sync_masters = sync_masters
    self._masters_restored = masters_restored

  def _serialize_to_tensors(self):
    self._sync_masters()
    return {"VARIABLE_VALUE": self._master.read_value()}

  def _restore_from_tensors(self, restored_tensors):
    op = self._master.assign(restored_tensors["VARIABLE_VALUE"])
    self._masters_restored()
    return op
