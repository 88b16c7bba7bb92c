"""Reverse-mode differentiation of the mtf graph (symbolic: it adds gradient ops to the graph)."""

from __future__ import annotations

import functools

import tensorflow.compat.v1 as tf

from mesh_tensorflow._ops import io


def gradients(ys, xs, grad_ys=None, operations=None) -> list:
  """d(sum ys)/d xs, aligned with xs (None where x does not reach any y).

  Each op on a path from xs to ys is asked for `op.gradient(grad_outputs)`, in reverse graph
  order; contributions reaching the same tensor are summed. `grad_ys` (default: ones) weights
  each y and must have its shape and dtype. An op without a gradient on the path raises
  GradientNotImplementedError naming it.

  Args:
    ys: mtf Tensors to differentiate (usually [loss]).
    xs: mtf Tensors to differentiate with respect to, e.g. variables' outputs.
    grad_ys: one weight per y, of its shape and dtype (default ones).
    operations: the ops to walk (default all of the graph's).

  Returns:
    A list aligned with xs: mtf Tensors, or None where x does not reach any y.
  """
  graph = ys[0].graph
  if not grad_ys:
    grad_ys = [io.Constant(y.mesh, 1.0, y.shape, y.dtype).outputs[0] for y in ys]
  _check_grad_ys_match_ys(ys, grad_ys)
  if operations is None:
    operations = graph.operations
  downstream = set(xs)
  for op in operations:
    if op.has_gradient and set(op.inputs) & downstream:
      downstream |= set(op.outputs)
  tensor_to_gradient = {y: g for y, g in zip(ys, grad_ys) if g is not None}
  with tf.variable_scope(graph.captured_variable_scope):
    for op in operations[::-1]:
      grad_outputs = [tensor_to_gradient.get(out) for out in op.outputs]
      if not (op.has_gradient and any(g is not None for g in grad_outputs)
              and set(op.inputs) & downstream):
        continue
      with tf.variable_scope(op.name + "/gradients"):
        input_grads, added = graph.capture_operations(functools.partial(op.gradient, grad_outputs))
      graph.drop_unneeded(added, [grad for inp, grad in zip(op.inputs, input_grads)
                                  if inp in downstream and grad is not None])
      for inp, grad in zip(op.inputs, input_grads):
        if inp in downstream and grad is not None:
          if inp in tensor_to_gradient:
            tensor_to_gradient[inp] += grad
          else:
            tensor_to_gradient[inp] = grad
  return [tensor_to_gradient.get(x) for x in xs]


def _check_grad_ys_match_ys(ys, grad_ys) -> None:
  """One grad_y per y, of y's shape and dtype (a different shape would silently broadcast)."""
  if len(grad_ys) != len(ys):
    raise ValueError(f"gradients: got {len(grad_ys)} grad_ys for {len(ys)} ys "
                     f"{[y.name for y in ys]}; give one per y (None for a y to ignore).")
  for y, g in zip(ys, grad_ys):
    if g is not None and (g.shape != y.shape or g.dtype != y.dtype):
      raise ValueError(
          f"gradients: grad_y {g.name!r} ({g.shape}, {g.dtype.name}) does not match y {y.name!r} "
          f"({y.shape}, {y.dtype.name}); a grad_y must have its y's shape and dtype (reduce or "
          f"broadcast it first, e.g. mtf.broadcast(g, y.shape)).")
