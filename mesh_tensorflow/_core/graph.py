"""The lazy graph: Graph (op list + naming + variable lists) and Mesh (a name for a processor set)."""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.tensor import Tensor


class Graph:
  """An mtf graph: operations in creation order, plus the variables they created."""

  def __init__(self):
    self._operations = []
    self._trainable_variables = []
    self._all_variables = []
    self.name_to_variable = {}
    self._names_in_use = {}
    self.captured_variable_scope = tf.get_variable_scope()

  def __repr__(self):
    return self.to_string

  @property
  def operations(self) -> list:
    return self._operations

  @contextlib.contextmanager
  def trial(self):
    """Operations made within are dropped from the graph afterwards, names included.

    For a trial run of model code that only records what it asks for (the pipelined
    Transformer finds the variables a layer makes this way). It must make no variable.
    """
    num_operations, names = len(self._operations), dict(self._names_in_use)
    num_variables = len(self._all_variables)
    try:
      yield
    finally:
      if len(self._all_variables) != num_variables:
        raise ValueError("Graph.trial: the trial made variables; intercept mtf.get_variable in it.")
      del self._operations[num_operations:]
      self._names_in_use = names

  @property
  def trainable_variables(self) -> list:
    return self._trainable_variables

  @property
  def all_variables(self) -> list:
    return self._all_variables

  @property
  def to_string(self) -> str:
    return "\n".join(op.to_string for op in self._operations)

  def unique_name(self, name: str, mark_as_used: bool = True) -> str:
    """`name` inside the current variable scope, suffixed _1, _2, ... if taken (case-insensitively)."""
    scope_name = tf.get_variable_scope().name
    if scope_name:
      name = scope_name + "/" + name
    name_key = name.lower()
    i = self._names_in_use.get(name_key, 0)
    if mark_as_used:
      self._names_in_use[name_key] = i + 1
    if i > 0:
      base_name_key = name_key
      while name_key in self._names_in_use:
        name_key = "%s_%d" % (base_name_key, i)
        i += 1
      if mark_as_used:
        self._names_in_use[name_key] = 1
      name = "%s_%d" % (name, i - 1)
    return name

  def make_variables_untrainable(self, variables) -> None:
    for v in variables:
      if v in self._trainable_variables:
        self._trainable_variables.remove(v)
        v._trainable = False

  def capture_operations(self, fn: Callable):
    """Runs fn() and returns (its result, the operations it added to this graph)."""
    n = len(self._operations)
    result = fn()
    return result, self._operations[n:]

  def drop_unneeded(self, ops, needed) -> None:
    """Removes from the graph those of `ops` that no tensor in `needed` depends on.

    `ops` are the graph's newest operations (capture_operations'), read by no other op yet.

    Only this package's pure ops go: an op without outputs (an assignment), a variable or a
    random op (`is_not_cloned`), a summary or print (`has_side_effects`) and any op class
    defined elsewhere stay, with what they read. mtf.gradients uses this for the gradients an
    op's gradient function builds for inputs nobody differentiates (an einsum's gradient with
    respect to imported activations): every op of the graph is lowered, so a dead one would run.
    """
    candidates = set(ops)
    keep = set()
    stack = [t.operation for t in needed] + [op for op in ops if not _is_pure(op)]
    while stack:
      op = stack.pop()
      if op in candidates and op not in keep:
        keep.add(op)
        stack.extend(t.operation for t in op.inputs)
    dropped = candidates - keep
    if dropped:
      self._operations[:] = [op for op in self._operations if op not in dropped]

  def clone_operations(self, ops, input_mapping: dict):
    """Copies `ops` reading inputs through `input_mapping`; returns (new_ops, extended mapping).

    Variables and random ops are shared, not cloned, so a recomputation sees the same values.
    New ops keep the original names.
    """
    mapping = dict(input_mapping)
    new_ops = []
    for op in ops:
      if getattr(op, "is_not_cloned", False):
        continue
      new_op = copy.copy(op)
      self._operations.append(new_op)
      new_op._inputs = [mapping.get(t, t) for t in op._inputs]
      new_op._outputs = []
      for i, t in enumerate(op.outputs):
        new_t = Tensor(new_op, t.shape, t.dtype, t.name, i)
        new_op._outputs.append(new_t)
        if t in mapping:
          raise ValueError(f"clone_operations: output {t.name} of {op.name} is already mapped.")
        mapping[t] = new_t
      new_ops.append(new_op)
    return new_ops, mapping

  @gin.configurable(module="mesh_tensorflow.ops")  # upstream's gin name: rewrite_stack_variables.*
  def rewrite_stack_variables(self, max_combined_variable_size=2 ** 29,
                              max_combined_slice_size=2 ** 27, mesh_to_impl=None) -> None:
    """Stacks same-shaped variables into one (fewer, larger slice variables); see _ops/stacking.py."""
    _registered_rewrite("rewrite_stack_variables")(
        self, max_combined_variable_size, max_combined_slice_size, mesh_to_impl)

  def combine_assignments(self, assignments) -> list:
    """Replaces Assign ops with one Assign per distinct assign_fn; see _ops/stacking.py."""
    return _registered_rewrite("combine_assignments")(self, assignments)


def _is_pure(op) -> bool:
  """Whether dropping op, when nothing reads its outputs, changes nothing but the work done."""
  return (bool(op.outputs) and type(op).__module__.startswith("mesh_tensorflow.")
          and not getattr(op, "is_not_cloned", False) and not getattr(op, "has_side_effects", False))


# Graph rewrites implemented by op families (which the core must not import), by method name.
_REWRITES = {}


def register_graph_rewrite(name: str, fn: Callable) -> None:
  """Makes `fn(graph, ...)` the implementation of `Graph.<name>`; called by the op family defining it."""
  _REWRITES[name] = fn


def _registered_rewrite(name: str) -> Callable:
  if name not in _REWRITES:
    raise RuntimeError(f"Graph.{name} is implemented by the op families; import mesh_tensorflow first.")
  return _REWRITES[name]


class Mesh:
  """A named set of processors; its shape and devices come later, from a MeshImpl at lowering.

  Args:
    graph: the mtf.Graph whose ops run on this mesh.
    name: a name for the mesh (for messages; meshes are told apart by identity).
    variable_placer: an object with a `device_function(op)`, e.g. mtf.utils.BalancedVariablePlacer,
      choosing the device of each master variable; default: all masters on "cpu:0".

  Example:
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
  """

  def __init__(self, graph: Graph, name: str, variable_placer=None):
    _check_is_mtf_graph(graph, name)
    self._graph = graph
    self._name = name
    self._variable_placer = variable_placer

  @property
  def graph(self) -> Graph:
    return self._graph

  @property
  def name(self) -> str:
    return self._name

  @property
  def variable_placer_fn(self):
    if self._variable_placer is not None:
      return self._variable_placer.device_function
    return "cpu:0"

  def __repr__(self):
    return f"Mesh({self._name!r})"


def _check_is_mtf_graph(graph, mesh_name) -> None:
  if not isinstance(graph, Graph):
    raise TypeError(
        f"mtf.Mesh({mesh_name!r}) needs an mtf.Graph, got {type(graph).__module__}."
        f"{type(graph).__name__}; write mtf.Mesh(mtf.Graph(), {mesh_name!r}) (the TF graph is the "
        f"default one at lowering time).")
