"""Control ops: stop_gradient, depend (control dependencies), Print, scalar_summary, while_loop."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import tensorflow.compat.v1 as tf

from mesh_tensorflow import utils
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering.lazy import LazyAllreduceSum
from mesh_tensorflow._ops import random as random_ops
from mesh_tensorflow._ops import variables as variable_ops

__all__ = [
    "StopGradient", "stop_gradient", "Depend", "depend", "PrintOperation", "Print",
    "ScalarSummaryOperation", "scalar_summary", "WhileLoopOperation", "while_loop",
]

class StopGradient(Operation):
  """Identity whose output is treated as a constant by mtf.gradients."""

  def __init__(self, x: Tensor, name: Optional[str] = None):
    super().__init__([x], name=name or "stop_gradient")
    self._outputs = [Tensor(self, x.shape, x.dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  @property
  def has_gradient(self):
    return False

  def lower(self, lowering):
    # Passing the (possibly lazy) value through keeps a pending allreduce pending.
    lowering.set_tensor_lowering(self.outputs[0], lowering.tensors[self.inputs[0]])


def stop_gradient(x: Tensor) -> Tensor:
  return StopGradient(x).outputs[0]


class Depend(Operation):
  """Identity of x that runs only after `dependencies` (mtf Operations or Tensors) have run."""

  # Subclasses may set this False to drop the dependencies on backends without control dependencies.
  requires_control_dependencies = True

  def __init__(self, x: Tensor, dependencies: Sequence, name: Optional[str] = None):
    super().__init__([x], x.mesh, name=name or "depend")
    dependencies = list(dependencies)
    for d in dependencies:
      if not isinstance(d, (Operation, Tensor)):
        raise ValueError(
            f"depend {self.name!r}: dependencies must be mtf Operations or mtf Tensors, got {d!r}.")
    self.dependencies = dependencies
    self._outputs = [Tensor(self, x.shape, x.dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def gradient(self, grad_ys):
    return grad_ys

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    x = lowering.tensors[self.inputs[0]]
    if not mesh_impl.supports_control_dependencies:
      if self.requires_control_dependencies:
        raise ValueError(
            f"depend {self.name!r}: {type(mesh_impl).__name__} does not support control "
            f"dependencies (XLA ignores them); order the computation through data dependencies.")
      lowering.set_tensor_lowering(self.outputs[0], x)
      return
    control_inputs = []
    for d in self.dependencies:
      if isinstance(d, Tensor):
        control_inputs.extend(mesh_impl.control_inputs(lowering.tensors[d]))
      elif d in lowering.operations:
        control_inputs.append(lowering.operations[d])
      else:
        for out in d.outputs:
          control_inputs.extend(mesh_impl.control_inputs(lowering.tensors[out]))
    # Eager execution is already in program order (tf.group there returns None).
    control_inputs = [c for c in control_inputs if c is not None]
    with tf.control_dependencies(control_inputs):
      lowering.set_tensor_lowering(self.outputs[0], mesh_impl.slicewise(tf.identity, x))


def depend(x: Tensor, dependencies: Sequence) -> Tensor:
  """x, computed only after every dependency (Operation or Tensor) has been computed."""
  return Depend(x, dependencies).outputs[0]


class SoftDepend(Depend):
  """A Depend that degrades to identity on backends without control dependencies (an optimisation hint)."""

  requires_control_dependencies = False


class PrintOperation(Operation):
  """Identity that prints `data` (mtf Tensors) with `message` when its output is computed."""

  has_side_effects = True  # Graph.drop_unneeded keeps it

  def __init__(self, x: Tensor, data: Sequence[Tensor], message: str, name: Optional[str] = None,
               **kwargs):
    super().__init__([x], name=name or "Print")
    self._outputs = [Tensor(self, x.shape, x.dtype)]
    self._data = list(data)
    self._message = message
    self._kwargs = kwargs
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def gradient(self, grad_ys):
    return grad_ys

  def lower(self, lowering):
    data = [lowering.tensors[d].to_laid_out_tensor() for d in self._data]
    lowering.set_tensor_lowering(
        self.outputs[0],
        lowering.mesh_impl(self).Print(lowering.tensors[self.inputs[0]], data, self._message,
                                       **self._kwargs))


def Print(x: Tensor, data: Sequence[Tensor], message: str, **kwargs) -> Tensor:
  """x, printing `data` when computed; the message is followed by the names of `data`."""
  message += " %s" % data
  return PrintOperation(x, data, message, **kwargs).outputs[0]


class ScalarSummaryOperation(Operation):
  """Identity of a scalar that records (op name, value) in the "mtf_scalar_summaries" collection."""

  has_side_effects = True  # Graph.drop_unneeded keeps it

  def __init__(self, name: str, x: Tensor):
    super().__init__([x], x.mesh, name=name)
    if x.shape.ndims:
      raise ValueError(
          f"scalar_summary {self.name!r}: {x.name!r} has shape {x.shape}, but a summary needs a "
          f"scalar; reduce it first (e.g. mtf.reduce_mean(x)).")
    self._outputs = [Tensor(self, x.shape, x.dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def gradient(self, grad_ys):
    return grad_ys

  def lower(self, lowering):
    value = lowering.tensors[self.inputs[0]].to_laid_out_tensor()
    tf.add_to_collection(utils.SCALAR_SUMMARIES_COLLECTION_KEY,
                         (self.name, lowering.mesh_impl(self).replicated_value(value)))
    lowering.set_tensor_lowering(self.outputs[0], value)


def scalar_summary(name: str, x: Tensor) -> ScalarSummaryOperation:
  """Records scalar x for summaries under `name`; returns the Operation."""
  return ScalarSummaryOperation(name, x)


class WhileLoopOperation(Operation):
  """A loop over mtf sub-graphs: while cond_fn(*vars): vars = body_fn(*vars).

  The ops built by cond_fn and body_fn belong to this op, not to the graph (they are lowered
  inside tf.while_loop), except Variables, which are moved to the graph before this op.
  With has_accumulators, body outputs beyond the loop variables are summed over the iterations
  (starting from zeros); partial sums pending an allreduce are reduced once, after the loop.
  """

  def __init__(self, cond_fn: Callable, body_fn: Callable, inputs: Sequence[Tensor],
               tf_kwargs: Optional[dict] = None, has_accumulators: bool = False,
               name: str = "while_loop"):
    inputs = list(inputs)
    if not inputs:
      raise ValueError("while_loop needs at least one loop variable.")
    super().__init__(inputs, mesh=inputs[0].mesh, name=name)
    self._tf_kwargs = dict(tf_kwargs or {})
    if self._tf_kwargs.get("back_prop", False):
      raise ValueError(f"while_loop {self.name!r}: back_prop is not supported (mtf loops have no "
                       f"gradient); drop back_prop=True.")
    self._tf_kwargs.pop("back_prop", None)
    self._has_accumulators = has_accumulators
    ops = self.graph.operations
    ops.pop()  # this op; it is appended again after the ops of cond_fn and body_fn
    self._cond_inputs = self._placeholders("cond_input")
    self._cond_output, self._cond_ops = self._capture(lambda: cond_fn(*self._cond_inputs))
    self._check_cond_output()
    self._body_inputs = self._placeholders("body_input")
    body_outputs, self._body_ops = self._capture(lambda: body_fn(*self._body_inputs))
    self._body_outputs = list(body_outputs)
    self._check_body_outputs()
    ops.append(self)
    self._outputs = [Tensor(self, t.shape, t.dtype, index=i) for i, t in enumerate(self._body_outputs)]
    # The loop can split whatever the ops inside it can.
    self._splittable_dims, self._unsplittable_dims = self._initialize_splittable_and_unsplittable_dims(
        "splittable", set().union(*(op.unsplittable_dims for op in self.nested_operations())))

  def _placeholders(self, kind: str) -> list:
    return [Tensor(self, t.shape, t.dtype, name="%s/%s:%d" % (self.name, kind, i))
            for i, t in enumerate(self._inputs)]

  def _capture(self, fn: Callable):
    """Runs fn, keeps the ops it created except Variables, which stay in the graph."""
    ops = self.graph.operations
    before = len(ops)
    result = fn()
    added = ops[before:]
    del ops[before:]
    ops.extend(op for op in added if isinstance(op, variable_ops.Variable))
    return result, [op for op in added if not isinstance(op, variable_ops.Variable)]

  def _check_cond_output(self):
    c = self._cond_output
    if not isinstance(c, Tensor) or c.dtype != tf.bool or c.shape.ndims:
      raise ValueError(f"while_loop {self.name!r}: cond_fn must return a scalar bool mtf Tensor, "
                       f"got {c!r}.")

  def _check_body_outputs(self):
    n, outs = len(self._inputs), self._body_outputs
    if len(outs) < n or (len(outs) > n and not self._has_accumulators):
      raise ValueError(
          f"while_loop {self.name!r}: body_fn returned {len(outs)} tensors for {n} loop variables; "
          f"it must return one per loop variable (more only with has_accumulators=True).")
    for i, (inp, out) in enumerate(zip(self._inputs, outs)):
      if not isinstance(out, Tensor) or out.shape != inp.shape or out.dtype != inp.dtype:
        raise ValueError(
            f"while_loop {self.name!r}: loop variable {i} ({inp.name!r}) enters as {inp.shape} "
            f"{inp.dtype.name} but body_fn returns {out!r}; shapes and dtypes must be loop-invariant.")
    for i, out in enumerate(outs[n:], n):
      if not isinstance(out, Tensor):
        raise ValueError(f"while_loop {self.name!r}: accumulator {i} must be an mtf Tensor, got {out!r}.")

  def gradient(self, grad_ys):
    raise NotImplementedError(f"while_loop {self.name!r} has no gradient; compute gradients inside "
                              f"body_fn (see serialize_training_step).")

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    n = len(self._inputs)
    self._force_external_values(lowering)
    # Accumulator outputs whose body value is a pending allreduce: sum partial sums, reduce after.
    lazy_accumulators = {}
    traces = {"cond": 0, "body": 0}  # eager runs cond/body per iteration; events are recorded once
    # Random ops inside draw per iteration: the iteration number rides along as a last loop variable.
    counts_iterations = self._draws_random_numbers()
    num_vars = n + len(self._body_outputs[n:])

    def lower_ops(kind, placeholders, loop_vars, ops):
      for t, v in zip(placeholders, loop_vars[:n]):
        lowering.tensors[t] = mesh_impl.from_loop_vars(v)
      iteration = loop_vars[num_vars] if counts_iterations else None
      with lowering.in_while_loop(self.name, record=traces[kind] == 0, iteration=iteration):
        for op in ops:
          lowering.lower_operation(op)
      traces[kind] += 1

    def tf_cond_fn(*loop_vars):
      lower_ops("cond", self._cond_inputs, loop_vars, self._cond_ops)
      return mesh_impl.replicated_value(lowering.tensors[self._cond_output])

    def tf_body_fn(*loop_vars):
      lower_ops("body", self._body_inputs, loop_vars, self._body_ops)
      ret = []
      for i, out in enumerate(self._body_outputs):
        value = lowering.tensors[out]
        if i >= n and isinstance(value, LazyAllreduceSum):
          lazy_accumulators[i] = value
          value = value.laid_out_input
        if i >= n:
          value = mesh_impl.slicewise(tf.add, value, mesh_impl.from_loop_vars(loop_vars[i]))
        ret.append(mesh_impl.loop_vars(value))
      if counts_iterations:
        ret.append(loop_vars[num_vars] + 1)
      return ret

    initial = [mesh_impl.loop_vars(lowering.tensors[t]) for t in self._inputs]
    for t in self._body_outputs[n:]:
      zeros = mesh_impl.slicewise(
          lambda t=t: tf.zeros(mesh_impl.slice_shape(t.shape), dtype=t.dtype))
      initial.append(mesh_impl.loop_vars(zeros))
    if counts_iterations:
      initial.append(tf.constant(0, tf.int32))
    results = tf.while_loop(tf_cond_fn, tf_body_fn, initial, back_prop=False, **self._tf_kwargs)
    for i, (slices, out) in enumerate(zip(results, self._outputs)):
      value = mesh_impl.from_loop_vars(slices)
      if i in lazy_accumulators:
        value = lazy_accumulators[i].with_input(value)
      lowering.set_tensor_lowering(out, value)

  def _draws_random_numbers(self) -> bool:
    return any(isinstance(op, random_ops.RandomOperation) for op in self.nested_operations())

  def nested_operations(self) -> list:
    """The ops lowered inside this loop, those of nested loops included."""
    ret = []
    for op in self._cond_ops + self._body_ops:
      ret.append(op)
      if isinstance(op, WhileLoopOperation):
        ret.extend(op.nested_operations())
    return ret

  def _force_external_values(self, lowering):
    """Forces lazy values the loop reads from outside, so they are not first computed (and cached) inside."""
    inner = self.nested_operations()
    internal = set(self._cond_inputs + self._body_inputs)
    for op in inner:
      internal.update(op.outputs)
      if isinstance(op, WhileLoopOperation):
        internal.update(op._cond_inputs + op._body_inputs)
    for op in inner:
      for t in op.inputs:
        if t not in internal and t in lowering.tensors:
          lowering.tensors[t].to_laid_out_tensor()


def while_loop(cond_fn: Callable, body_fn: Callable, inputs: Sequence[Tensor],
               num_loop_vars: Optional[int] = None, has_accumulators: bool = False, **kwargs) -> list:
  """Runs body_fn while cond_fn holds; returns the final loop variables (then the accumulators).

  Args:
    cond_fn: (*loop_vars) -> scalar bool mtf Tensor.
    body_fn: (*loop_vars) -> list of mtf Tensors, one per loop variable with the same shape and
      dtype, followed (with has_accumulators) by tensors summed over the iterations.
    inputs: initial loop variables.
    num_loop_vars: if set, only the first num_loop_vars inputs are tf.while_loop variables; the
      others are kept in mtf variables updated with control dependencies (a multi-GPU speed-up;
      do not use it on TPU, where control dependencies are ignored). Only those outputs are returned.
    has_accumulators: see body_fn.
    **kwargs: passed to tf.while_loop (e.g. parallel_iterations).
  """
  inputs = list(inputs)
  if num_loop_vars is None:
    return WhileLoopOperation(cond_fn, body_fn, inputs, tf_kwargs=kwargs,
                              has_accumulators=has_accumulators).outputs
  if not 0 < num_loop_vars <= len(inputs):
    raise ValueError(f"while_loop: num_loop_vars={num_loop_vars} must be in [1, {len(inputs)}] "
                     f"(the number of inputs).")
  extra_inputs = inputs[num_loop_vars:]
  loop_vars = [_local_loop_variable(x, i) for i, x in enumerate(extra_inputs)]
  first_input = depend(
      inputs[0], [variable_ops.assign(v, x) for v, x in zip(loop_vars, extra_inputs)])

  def read_loop_vars():
    return tuple(variable_ops.read_variable(v) for v in loop_vars)

  def my_cond_fn(*xs):
    return cond_fn(*(xs + read_loop_vars()))

  def my_body_fn(*xs):
    outputs = tuple(body_fn(*(xs + read_loop_vars())))
    updates = [variable_ops.assign(v, x)
               for v, x in zip(loop_vars, outputs[num_loop_vars:len(inputs)])]
    return (depend(outputs[0], updates),) + outputs[1:num_loop_vars] + outputs[len(inputs):]

  return WhileLoopOperation(my_cond_fn, my_body_fn, [first_input] + inputs[1:num_loop_vars],
                            tf_kwargs=kwargs, has_accumulators=has_accumulators).outputs


def _local_loop_variable(x: Tensor, i: int):
  """A fresh, untrainable, uncheckpointed mtf Variable shaped like x."""
  graph = x.graph
  scope_name = tf.get_variable_scope().name
  name = graph.unique_name("loop_var_%d" % i)
  if scope_name:
    name = name[len(scope_name) + 1:]
  return variable_ops.get_variable(
      x.mesh, name, x.shape, dtype=x.dtype, initializer=tf.zeros_initializer(), trainable=False,
      collections=[tf.GraphKeys.LOCAL_VARIABLES]).operation
