"""Reverse-mode differentiation of the mtf graph (symbolic: it adds gradient ops to the graph)."""

from __future__ import annotations

import tensorflow.compat.v1 as tf


def gradients(ys, xs, grad_ys=None, operations=None) -> list:
  """d(sum ys)/d xs, aligned with xs (None where x does not reach any y).

  Each op on a path from xs to ys is asked for `op.gradient(grad_outputs)`, in reverse graph
  order; contributions reaching the same tensor are summed.
  """
  from mesh_tensorflow._ops import io
  graph = ys[0].graph
  if not grad_ys:
    grad_ys = [io.Constant(y.mesh, 1.0, y.shape, y.dtype).outputs[0] for y in ys]
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
        input_grads = op.gradient(grad_outputs)
      for inp, grad in zip(op.inputs, input_grads):
        if inp in downstream and grad is not None:
          if inp in tensor_to_gradient:
            tensor_to_gradient[inp] += grad
          else:
            tensor_to_gradient[inp] = grad
  return [tensor_to_gradient.get(x) for x in xs]
