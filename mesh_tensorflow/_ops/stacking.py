"""Variable stacking: fewer, larger slice variables (a lowering-time graph rewrite).

Many small variables cost one slice variable per processor each. `rewrite_stack_variables`
replaces each group of interchangeable variables by one StackedVariable with a leading `stacked`
dimension, followed by an unstack whose outputs *are* the original variables' output Tensors, so
the rest of the graph is untouched. Masters (what checkpoints hold) stay the original variables.
"""

from __future__ import annotations

import collections
import math
from typing import Optional, Sequence

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, Shape
from mesh_tensorflow._core.graph import register_graph_rewrite
from mesh_tensorflow._ops import slicing
from mesh_tensorflow._ops import variables as variable_ops

__all__ = ["StackedVariable", "LayerStackVariable"]


class StackedVariable(variable_ops.Variable):
  """Several same-shaped variables as one, with new leading dimensions (by default `stacked`).

  It owns no master: `get_master()` stacks the originals' masters and `assign_to_master`
  writes the pieces back, so checkpoints keep the original variable names.

  Args:
    vs: the mtf Variables, in stacking order (row-major over stack_dims).
    stack_dims: the leading dimensions, whose sizes multiply to len(vs); default one `stacked`.
    name: the stacked variable's name; default "stacked/" + the first one's.
  """

  is_stacked = True  # backends must never use get_master() (a tf.stack) as the slice variable
  is_layer_stack = False  # made by the autostack rewrite (see LayerStackVariable)

  def __init__(self, vs: list, stack_dims: Optional[Sequence[Dimension]] = None,
               name: Optional[str] = None):
    self._originals = list(vs)
    self._stack_dims = list(stack_dims or [Dimension("stacked", len(vs))])
    if math.prod(d.size for d in self._stack_dims) != len(vs):
      raise ValueError(f"StackedVariable: stack dimensions {self._stack_dims} hold "
                       f"{math.prod(d.size for d in self._stack_dims)} variables, got {len(vs)}.")
    shape = Shape(self._stack_dims + vs[0].shape.dims)
    super().__init__(vs[0].mesh, name or "stacked/" + vs[0].name, shape, vs[0].dtype, None,
                     vs[0].trainable)

  def _create_master(self, mesh, name, shape, initializer, trainable, **kwargs):
    self._name = name
    self._master = None

  @property
  def originals(self) -> list:
    """The stacked mtf Variables, in stacking order (they own the masters and checkpoint names)."""
    return list(self._originals)

  @property
  def original_names(self) -> list:
    return [v.name for v in self._originals]

  @property
  def stack_dims(self) -> list:
    """The leading dimensions that index the originals."""
    return list(self._stack_dims)

  @property
  def master_device(self) -> str:
    return self._originals[0].master_device

  def get_master(self):
    with tf.device(self.master_device):
      return tf.reshape(tf.stack([v.get_master() for v in self._originals]), self.shape.to_integer_list)

  def assign_to_master(self, val):
    pieces = tf.unstack(tf.reshape(val, [len(self._originals)] + self._originals[0].shape.to_integer_list))
    return tf.group([v.assign_to_master(piece) for v, piece in zip(self._originals, pieces)])


class LayerStackVariable(StackedVariable):
  """One weight of every layer of a stack (mtf.pipeline), stacked over the stages.

  The originals (one per layer, named and shaped as an unstacked model names them) leave the
  graph: only this variable is lowered, trained and given optimizer state, while checkpoints
  hold the originals' masters, so a checkpoint moves between stacked and unstacked models.
  Optimizers treat the stack dimensions as separate variables (see optimize's slot_variable).
  """

  is_layer_stack = True

  def get_master(self):
    if self._master_holder is not None:  # sliced masters: the stack itself holds the values
      return self._master_holder.master_value()
    return super().get_master()

  def assign_to_master(self, val):
    if self._master_holder is not None:
      return self._master_holder.assign_master(val)
    return super().assign_to_master(val)

  def __init__(self, vs: list, stack_dims: Sequence[Dimension], name: str):
    super().__init__(vs, stack_dims, name)
    graph = self.graph
    for v in vs:
      for members in (graph.operations, graph.all_variables, graph.trainable_variables):
        if v in members:
          members.remove(v)
    graph.name_to_variable[name] = self


def rewrite_stack_variables(graph, max_combined_variable_size: Optional[int] = 2 ** 29,
                            max_combined_slice_size: int = 2 ** 27, mesh_to_impl=None) -> None:
  """Stacks groups of variables with equal (mesh, shape, dtype, trainable, set of Assigns).

  A group's stacked size is at most max_combined_variable_size and its slice size at most
  max_combined_slice_size; variables on 1-processor meshes are not stacked (nothing to gain).
  Assign ops are rewritten to assign one stack(...) of the new values to the stacked variable.
  """
  operations = list(graph.operations)
  if any(isinstance(op, StackedVariable) and not op.is_layer_stack for op in operations):
    raise ValueError("rewrite_stack_variables: this graph's variables are already stacked; it may be "
                     "called once per graph (Lowering(autostack=True) calls it: lower the graph "
                     "again with autostack=False).")
  assigns_of = collections.defaultdict(set)
  for op in operations:
    if isinstance(op, variable_ops.Assign):
      for v in op.variables:
        assigns_of[v].add(op)

  def key(v):
    dtype = v.dtype
    return (v.mesh, v.shape, dtype.master_dtype, dtype.slice_dtype, dtype.activation_dtype,
            v.trainable, frozenset(assigns_of[v]))

  similar = collections.defaultdict(collections.deque)
  for v in graph.all_variables:
    similar[(v.is_layer_stack, v) if v.is_stacked else key(v)].append(v)  # a layer stack stays whole

  # Rebuild the op and variable lists in place; new ops append themselves to graph.operations.
  graph.operations.clear()
  graph.all_variables.clear()
  graph.trainable_variables.clear()
  stacked_of = {}  # original variable -> (its StackedVariable, the variables stacked in it)
  for op in operations:
    if isinstance(op, variable_ops.Variable):
      if op in stacked_of:
        continue
      group = similar[(op.is_layer_stack, op) if op.is_stacked else key(op)]
      n = _num_to_stack(op, len(group), max_combined_variable_size, max_combined_slice_size,
                        mesh_to_impl)
      to_stack = [group.popleft() for _ in range(n)]
      assert to_stack[0] is op
      if n == 1:
        graph.operations.append(op)
        graph.all_variables.append(op)
        if op.trainable:
          graph.trainable_variables.append(op)
        continue
      stacked_var = _stack(to_stack)
      for v in to_stack:
        stacked_of[v] = (stacked_var, to_stack)
    elif isinstance(op, variable_ops.ReadVariable) and op._var in stacked_of:  # pylint: disable=protected-access
      _rewrite_read(op, stacked_of)
    else:
      if isinstance(op, variable_ops.Assign):
        _rewrite_assign(op, stacked_of)
      graph.operations.append(op)


def _num_to_stack(v, num_similar: int, max_combined_variable_size, max_combined_slice_size,
                  mesh_to_impl) -> int:
  n = num_similar
  if max_combined_variable_size is not None:
    n = min(n, max_combined_variable_size // max(v.size, 1))
  if mesh_to_impl is not None:
    mesh_impl = mesh_to_impl[v.mesh]
    if mesh_impl.size == 1:
      return 1
    n = min(n, max_combined_slice_size // max(mesh_impl.slice_size(v.shape), 1))
  return max(1, n)


def _stack(vs: list) -> StackedVariable:
  """A StackedVariable plus an unstack whose outputs are (re-owned) the originals' output Tensors."""
  stacked_var = StackedVariable(vs)
  unstack_op = slicing.UnstackOperation(stacked_var.outputs[0], stacked_var.shape.dims[0])
  unstack_op._outputs = [v.outputs[0] for v in vs]  # pylint: disable=protected-access
  for t in unstack_op.outputs:
    t._operation = unstack_op  # pylint: disable=protected-access
  return stacked_var


def _rewrite_read(op, stacked_of: dict) -> None:
  """Replaces a ReadVariable of a stacked piece by a read of the stacked variable, unstacked."""
  var = op._var  # pylint: disable=protected-access
  stacked_var, members = stacked_of[var]
  read = variable_ops.read_variable(stacked_var)
  unstack_op = slicing.UnstackOperation(read, read.shape.dims[0])
  unstack_op._outputs[members.index(var)] = op.outputs[0]  # pylint: disable=protected-access
  op.outputs[0]._operation = unstack_op  # pylint: disable=protected-access


def _rewrite_assign(op, stacked_of: dict) -> None:
  """Makes `op` assign stack(new values) to each stacked variable instead of its pieces."""
  value_of = dict(zip(op.variables, op.inputs))
  new_variables, new_values = [], []
  for var, val in zip(op.variables, op.inputs):
    if var not in stacked_of:
      new_variables.append(var)
      new_values.append(val)
      continue
    stacked_var, members = stacked_of[var]
    if var is members[0]:
      new_variables.append(stacked_var)
      new_values.append(slicing.stack([value_of[v] for v in members],
                                      stacked_var.shape.dims[0].name, 0))
  op._variables = new_variables  # pylint: disable=protected-access
  op._inputs = new_values  # pylint: disable=protected-access


def combine_assignments(graph, assignments) -> list:
  """Removes `assignments` (Assign ops) from the graph; returns one new Assign per assign_fn."""
  by_fn = collections.defaultdict(list)
  for a in assignments:
    if not isinstance(a, variable_ops.Assign):
      raise ValueError(f"combine_assignments: {a!r} is not an mtf.Assign; pass only Assign ops.")
    by_fn[a.assign_fn].append(a)
  removed = set(assignments)
  graph.operations[:] = [op for op in graph.operations if op not in removed]
  ret = []
  for fn, ops in by_fn.items():
    variables = [v for a in ops for v in a.variables]
    values = [x for a in ops for x in a.inputs]
    ret.append(variable_ops.Assign(variables, values, fn))
  return ret


register_graph_rewrite("rewrite_stack_variables", rewrite_stack_variables)
register_graph_rewrite("combine_assignments", combine_assignments)
