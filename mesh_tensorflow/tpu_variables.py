"""ReplicatedVariable: one per-replica copy of a variable on each TPU core, used as one variable.

Inside a TPU replicate context (`tf.compat.v1.tpu.replicate`/`rewrite`) reads and assignments go
through a replicated handle, so each replica touches its own copy. Outside one (initialisation,
checkpoint copies, CPU tests) the wrapper behaves as its first copy. Importing this module needs
no TPU.
"""

from __future__ import annotations

from mesh_tensorflow._tf_compat import control_flow_ops, gen_resource_variable_ops, ops
from mesh_tensorflow._tf_compat import session as session_lib
from mesh_tensorflow._tf_compat import tensor_conversion_registry

# 0.1.21's flag for "TensorFlow >= 2.3" (tensorflow.python.types.core exists), on which it based
# ReplicatedVariable's tensor-like registration; always true on the TensorFlow this package needs.
TF_23 = True


def _enclosing_tpu_context():
  """The innermost XLA (TPU replicate) control-flow context around the default graph, or None."""
  graph = ops.get_default_graph()
  while graph is not None:
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    while context is not None:
      if isinstance(context, control_flow_ops.XLAControlFlowContext):
        return context
      context = context.outer_context
    graph = getattr(graph, "outer_graph", None)
  return None


class ReplicatedVariable:
  """Per-replica variables (one per TPU core, all the same shape and dtype) seen as one variable.

  Args:
    name: the common name (the mtf variable name).
    variables: the per-replica tf variables, in replica (physical pnum) order; resource
      variables, so that a replicated handle can be formed inside a TPU computation.
  """

  def __init__(self, name: str, variables: list):
    if not variables:
      raise ValueError(f"ReplicatedVariable {name!r} needs at least one per-replica variable.")
    self._name = name
    self._vars = list(variables)
    self._primary_var = self._vars[0]
    self._common_name = self._primary_var.name.split(":")[0]

  def __repr__(self):
    return f"ReplicatedVariable({self._name!r}, {len(self._vars)} replicas, {self.dtype.name}{self.shape})"

  @property
  def handle(self):
    """Inside a TPU computation the replicated input handle, else the first copy's handle."""
    tpu_context = _enclosing_tpu_context()
    if tpu_context is None:
      return self._primary_var.handle
    handle_id = getattr(self._primary_var, "_unique_id", self._common_name)
    return tpu_context.get_replicated_var_handle(self._name, handle_id, self._vars)

  @property
  def variables(self) -> list:
    return self._vars

  @property
  def initializer(self):
    return control_flow_ops.group([v.initializer for v in self._vars])

  @property
  def graph(self):
    return self._primary_var.graph

  @property
  def name(self) -> str:
    return self._name

  @property
  def _shared_name(self):
    return self._common_name

  @property
  def dtype(self):
    return self._primary_var.dtype.base_dtype

  @property
  def shape(self):
    return self._primary_var.shape

  def get_shape(self):
    return self._primary_var.get_shape()

  @property
  def constraint(self):
    return None

  @property
  def op(self):
    return self.get().op

  @property
  def _in_graph_mode(self):
    return self._primary_var._in_graph_mode  # pylint: disable=protected-access

  def get(self):
    """The first per-replica variable."""
    return self._primary_var

  def to_proto(self, export_scope=None):
    return self._primary_var.to_proto(export_scope=export_scope)

  def read_value(self):
    if _enclosing_tpu_context() is None:
      return self._primary_var.read_value()
    return gen_resource_variable_ops.read_variable_op(self.handle, self.dtype)

  def _assign_with(self, primary_method: str, resource_op, value, name, read_value):
    """Applies an assignment to the first copy (outside TPU) or the replicated handle (inside)."""
    if _enclosing_tpu_context() is None:
      return getattr(self._primary_var, primary_method)(value, name=name, read_value=read_value)
    assign_op = resource_op(self.handle, ops.convert_to_tensor(value, dtype=self.dtype), name=name)
    if read_value:
      with ops.control_dependencies([assign_op]):
        return self.read_value()
    return assign_op

  def assign(self, value, use_locking=None, name=None, read_value=False):
    del use_locking
    return self._assign_with("assign", gen_resource_variable_ops.assign_variable_op,
                             value, name, read_value)

  def assign_add(self, delta, use_locking=None, name=None, read_value=True):
    del use_locking
    return self._assign_with("assign_add", gen_resource_variable_ops.assign_add_variable_op,
                             delta, name, read_value)

  def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
    del use_locking
    return self._assign_with("assign_sub", gen_resource_variable_ops.assign_sub_variable_op,
                             delta, name, read_value)

  def _should_act_as_resource_variable(self):
    """Lets resource_variable_ops.is_resource_variable() accept this wrapper."""

  def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
    """The value as a tensor (the replicated handle when as_ref inside a TPU computation)."""
    if _enclosing_tpu_context() is None:
      return ops.convert_to_tensor(self._primary_var, dtype=dtype, name=name, as_ref=as_ref)
    if dtype is not None and dtype != self.dtype:
      return NotImplemented
    return self.handle if as_ref else self.read_value()


def _tensor_conversion(var, dtype=None, name=None, as_ref=False):
  return var._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)  # pylint: disable=protected-access


def _replicated_fetch_function(var):
  return [var._dense_var_to_tensor()], lambda values: values[0]  # pylint: disable=protected-access


tensor_conversion_registry.register_tensor_conversion_function(ReplicatedVariable, _tensor_conversion)
session_lib.register_session_run_conversion_functions(ReplicatedVariable, _replicated_fetch_function)
