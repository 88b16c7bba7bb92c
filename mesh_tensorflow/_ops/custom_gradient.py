"""Custom gradients, recomputation on the backward pass, and microbatched training steps."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import tensorflow.compat.v1 as tf

from mesh_tensorflow import _autodiff
from mesh_tensorflow._core.dims import Dimension, convert_to_dimension
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._ops import binary as binary_ops
from mesh_tensorflow._ops import control as control_ops
from mesh_tensorflow._ops import einsum as einsum_ops
from mesh_tensorflow._ops import indexing as indexing_ops
from mesh_tensorflow._ops import io as io_ops
from mesh_tensorflow._ops import reshape as reshape_ops
from mesh_tensorflow._ops import variables as variable_ops

__all__ = ["CustomGradientOperation", "custom_gradient", "recompute_grad", "serialize_training_step"]


class CustomGradientOperation(Operation):
  """Identity of fn_outputs whose gradient w.r.t. all_inputs comes from grad_fn.

  Its inputs are all_inputs + fn_outputs (so it is lowered after the forward ops); fn_outputs
  get no gradient through it.
  """

  def __init__(self, explicit_inputs: Sequence[Tensor], all_inputs: Sequence[Tensor],
               fn_outputs: Sequence[Tensor], grad_fn: Callable, forward_operations: Sequence[Operation],
               name: Optional[str] = None):
    super().__init__(list(all_inputs) + list(fn_outputs), name=name or "custom_gradient")
    self._explicit_inputs = list(explicit_inputs)
    self._all_inputs = list(all_inputs)
    self._fn_outputs = list(fn_outputs)
    self._grad_fn = grad_fn
    self._forward_operations = list(forward_operations)
    self._outputs = [Tensor(self, t.shape, t.dtype, index=i) for i, t in enumerate(self._fn_outputs)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def lower(self, lowering):
    for fn_output, output in zip(self._fn_outputs, self._outputs):
      lowering.set_tensor_lowering(output, lowering.tensors[fn_output])

  def gradient(self, grad_ys):
    num_variables = len(self.graph.all_variables)
    grads = list(self._grad_fn(
        explicit_inputs=self._explicit_inputs, all_inputs=self._all_inputs,
        forward_operations=self._forward_operations, outputs=self._fn_outputs,
        output_grads=list(grad_ys)))
    if len(self.graph.all_variables) != num_variables:
      new = [v.name for v in self.graph.all_variables[num_variables:]]
      raise ValueError(f"custom_gradient {self.name!r}: grad_fn created variables {new}; a gradient "
                       f"function must only compute, create variables in the forward fn instead.")
    if len(grads) != len(self._all_inputs):
      raise ValueError(f"custom_gradient {self.name!r}: grad_fn returned {len(grads)} gradients for "
                       f"{len(self._all_inputs)} inputs {[t.name for t in self._all_inputs]}; return "
                       f"one per element of all_inputs (None where there is none).")
    return grads + [None] * len(self._fn_outputs)


def custom_gradient(fn: Callable, grad_fn: Callable, explicit_inputs: Sequence[Tensor]):
  """fn(*explicit_inputs), differentiated by grad_fn instead of through fn's ops.

  Args:
    fn: (*explicit_inputs) -> Tensor or tuple/list of Tensors.
    grad_fn: called with keywords explicit_inputs, all_inputs, forward_operations, outputs,
      output_grads; returns a gradient (or None) per element of all_inputs, which is
      explicit_inputs followed by the float tensors from outside fn that fn's ops read
      (including variables fn created).
    explicit_inputs: non-empty list of Tensors.

  Returns:
    fn's result, structured as fn returned it. Tensors computed inside fn other than its outputs
    are marked unusable: a gradient through them would bypass grad_fn.
  """
  explicit_inputs = list(explicit_inputs)
  if not explicit_inputs:
    raise ValueError("custom_gradient needs at least one explicit input (to find the graph).")
  graph = explicit_inputs[0].graph
  outputs, forward_operations = graph.capture_operations(lambda: fn(*explicit_inputs))
  returns_sequence = isinstance(outputs, (tuple, list))
  fn_outputs = list(outputs) if returns_sequence else [outputs]
  internal = set()
  for op in forward_operations:
    if not isinstance(op, variable_ops.Variable):
      internal.update(op.outputs)
  all_inputs = list(explicit_inputs)
  seen = set(all_inputs)
  for op in forward_operations:
    for t in op.inputs:
      if t not in internal and t not in seen and t.dtype.is_floating:
        all_inputs.append(t)
        seen.add(t)
  ret = CustomGradientOperation(explicit_inputs, all_inputs, fn_outputs, grad_fn,
                                forward_operations).outputs
  # Values shared with a recomputation (variables, random draws) stay usable: gradient ops of the
  # recomputed ops may read them.
  for op in forward_operations:
    if not getattr(op, "is_not_cloned", False):
      for t in op.outputs:
        if t not in fn_outputs:
          t.usable = False
  if not returns_sequence:
    return ret[0]
  return type(outputs)(ret)


def recompute_grad(fn: Callable, explicit_inputs: Sequence[Tensor], control_dependencies: bool = True):
  """fn(*explicit_inputs), whose activations are recomputed on the backward pass instead of kept.

  Args:
    fn: (*explicit_inputs) -> Tensor or tuple of Tensors.
    explicit_inputs: list of Tensors.
    control_dependencies: make the recomputation wait for the output gradients (so it happens
      late and its activations do not live long); ignored on backends without control dependencies.
  """
  def grad_fn(explicit_inputs, all_inputs, forward_operations, outputs, output_grads):
    del explicit_inputs
    graph = all_inputs[0].graph
    mapping = {}
    if control_dependencies:
      ready = [g for g in output_grads if g is not None]
      mapping = {x: control_ops.SoftDepend(x, ready).outputs[0] for x in all_inputs}
    new_ops, mapping = graph.clone_operations(forward_operations, mapping)
    input_grads = _autodiff.gradients(
        ys=[mapping.get(t, t) for t in outputs], xs=[mapping.get(x, x) for x in all_inputs],
        grad_ys=list(output_grads), operations=new_ops)
    for x, g in zip(all_inputs, input_grads):
      if x.dtype.is_floating and g is None:
        raise ValueError(f"recompute_grad: the gradient for input {x.name!r} is None; every float "
                         f"input of fn must influence its outputs (drop unused inputs).")
    return input_grads

  return custom_gradient(fn, grad_fn, explicit_inputs)


def serialize_training_step(features: dict, model_fn: Callable, batch_dim: Dimension, num_splits: int):
  """Runs model_fn and its gradients on num_splits microbatches in sequence, summing the gradients.

  Args:
    features: dict of Tensors, each with batch_dim.
    model_fn: features dict -> outputs dict of Tensors, which must contain "loss".
    batch_dim: the batch Dimension; num_splits must divide its size.
    num_splits: number of microbatches.

  Returns:
    (grads, outputs): grads is a list of gradients aligned with graph.trainable_variables, summed
    over microbatches; outputs has model_fn's keys, each value summed over microbatches, or
    concatenated back along batch_dim if it has the (microbatch-sized) batch dimension.
  """
  batch_dim = convert_to_dimension(batch_dim)
  if not features:
    raise ValueError("serialize_training_step needs at least one feature.")
  if batch_dim.size % num_splits:
    raise ValueError(f"serialize_training_step: num_splits={num_splits} does not divide {batch_dim}.")
  for k, v in features.items():
    if batch_dim not in v.shape.dims:
      raise ValueError(f"serialize_training_step: feature {k!r} {v.shape} lacks the batch dimension "
                       f"{batch_dim}.")
  some_feature = next(iter(features.values()))
  mesh, graph = some_feature.mesh, some_feature.graph
  microbatch_dim = Dimension("microbatch", num_splits)
  small_batch_dim = Dimension(batch_dim.name, batch_dim.size // num_splits)
  output_keys = []

  def select(t, microbatch_num):
    t = reshape_ops.replace_dimensions(t, batch_dim, [small_batch_dim, microbatch_dim])
    return indexing_ops.gather(t, microbatch_num, microbatch_dim)

  def cond_fn(microbatch_num):
    return binary_ops.less(microbatch_num, num_splits)

  def body_fn(microbatch_num):
    outputs = model_fn({k: select(v, microbatch_num) for k, v in features.items()})
    if "loss" not in outputs:
      raise ValueError(f"serialize_training_step: model_fn must return a dict with a 'loss', got "
                       f"keys {sorted(outputs)}.")
    variables = graph.trainable_variables
    grads = _autodiff.gradients([outputs["loss"]], [v.outputs[0] for v in variables])
    missing = [v.name for v, g in zip(variables, grads) if g is None]
    if missing:
      raise ValueError(f"serialize_training_step: trainable variables {missing} get no gradient from "
                       f"the loss; they are disconnected from the graph (make them untrainable).")
    output_keys.extend(outputs)
    ret = [microbatch_num + 1]
    for t in outputs.values():
      if small_batch_dim in t.shape.dims:
        # Place this microbatch's rows at their position in the full batch; the sum over
        # microbatches then concatenates them.
        spread_shape = reshape_ops.replace_dimensions(t.shape, small_batch_dim,
                                                      [small_batch_dim, microbatch_dim])
        t = einsum_ops.einsum(
            [t, indexing_ops.one_hot(microbatch_num, microbatch_dim, dtype=t.dtype)],
            output_shape=spread_shape)
        t = reshape_ops.replace_dimensions(t, [small_batch_dim, microbatch_dim], batch_dim)
      ret.append(t)
    return ret + grads

  loop_outputs = control_ops.while_loop(
      cond_fn, body_fn, [io_ops.constant(mesh, 0, dtype=tf.int32)], has_accumulators=True)
  num_outputs = len(output_keys)
  outputs = dict(zip(output_keys, loop_outputs[1:1 + num_outputs]))
  return loop_outputs[1 + num_outputs:], outputs
