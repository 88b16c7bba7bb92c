"""Layer-test helpers: build a layer on a mesh, read back its output, variables and gradients.

Layers create variables, so references are computed from the variables' actual initial values:
`check_layer` hands them (by full name) to a plain-TensorFlow reference and compares outputs and
the gradients of sum(y * w) (w random) with respect to float inputs and trainable variables.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import lower_and_evaluate


class LayerResult:
  """Numpy values of one layer run: y, variables {name: value}, gradients, and the weights w."""

  def __init__(self, y, variables: dict, shapes: dict, input_grads: list, variable_grads: dict, w):
    self.y = y
    self.variables = variables
    self.shapes = shapes
    self.input_grads = input_grads
    self.variable_grads = variable_grads
    self.w = w


def import_inputs(mesh, inputs: Sequence) -> list:
  return [mtf.import_tf_tensor(mesh, tf.constant(a), shape=s) for a, s in inputs]


def run_layer(layer_fn: Callable, inputs: Sequence, mesh_shape="all:1", layout="", mode: str = "graph",
              grads: bool = True, seed: int = 0) -> LayerResult:
  """Runs `layer_fn(*mtf_inputs) -> mtf Tensor` on a mesh.

  Args:
    inputs: (numpy array, mtf shape string) pairs.
    grads: also return d(sum(y * w))/d(float inputs, trainable variables).
  """
  arrays = [np.asarray(a) for a, _ in inputs]
  rng = np.random.RandomState(seed)
  info = {}

  def build(mesh):
    xs = import_inputs(mesh, [(a, s) for a, (_, s) in zip(arrays, inputs)])
    y = layer_fn(*xs)
    variables = list(mesh.graph.all_variables)
    trainable = [v for v in variables if v.trainable]
    info["names"] = [v.name for v in variables]
    info["shapes"] = {v.name: v.shape for v in variables}
    info["trainable"] = [v.name for v in trainable]
    outs = [y] + [v.outputs[0] for v in variables]
    info["num_grads"] = 0
    if grads:
      w = rng.uniform(-1, 1, size=y.shape.to_integer_list).astype(np.float32)
      info["w"] = w
      loss = mtf.reduce_sum(mtf.cast(y, tf.float32) * mtf.import_tf_tensor(mesh, tf.constant(w), y.shape))
      wrt = [x for x in xs if x.dtype.is_floating] + [v.outputs[0] for v in trainable]
      gs = mtf.gradients([loss], wrt)
      outs += [g if g is not None else mtf.zeros_like(t) for g, t in zip(gs, wrt)]
      info["num_grads"] = len(wrt)
    return outs

  values = lower_and_evaluate(build, mesh_shape, layout, mode)
  n_vars = len(info["names"])
  y, var_values, grad_values = values[0], values[1:1 + n_vars], values[1 + n_vars:]
  n_input_grads = info["num_grads"] - len(info["trainable"]) if grads else 0
  return LayerResult(
      y=y, variables=dict(zip(info["names"], var_values)), shapes=info["shapes"],
      input_grads=grad_values[:n_input_grads],
      variable_grads=dict(zip(info["trainable"], grad_values[n_input_grads:])), w=info.get("w"))


def check_layer(layer_fn: Callable, reference_fn: Callable, inputs: Sequence, mesh_shape="all:1",
                layout="", mode: str = "graph", grads: bool = True, rtol: float = 1e-4,
                atol: float = 1e-4) -> LayerResult:
  """Checks a layer against `reference_fn(*tf_inputs, variables={name: tf value}) -> tf.Tensor`.

  The reference computes y unsharded in plain TF, with axes in the order of the layer's output;
  gradients are checked with tf.gradients of the same weighted sum.
  """
  result = run_layer(layer_fn, inputs, mesh_shape, layout, mode, grads)
  with tf.Graph().as_default():
    xs = [tf.constant(np.asarray(a)) for a, _ in inputs]
    variables = {name: tf.constant(v) for name, v in result.variables.items()}
    y = reference_fn(*xs, variables=variables)
    fetches = [y]
    if grads:
      loss = tf.reduce_sum(tf.cast(y, tf.float32) * result.w)
      wrt = [x for x in xs if x.dtype.is_floating] + [variables[n] for n in result.variable_grads]
      fetches += [tf.convert_to_tensor(g) for g in tf.gradients(loss, wrt, unconnected_gradients="zero")]
    with tf.Session() as sess:
      expected = sess.run(fetches)
  actual = [result.y] + list(result.input_grads) + list(result.variable_grads.values())
  assert np.shape(result.y) == np.shape(expected[0]), (np.shape(result.y), np.shape(expected[0]))
  for a, e in zip(actual, expected):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol)
  return result


def shape_keyed_initializer(shape_to_value: dict) -> Callable:
  """A TF initializer returning fixed values, chosen by the exact requested shape."""
  def initialize(shape, dtype=tf.float32, **unused_kwargs):
    key = tuple(int(s) for s in shape)
    if key not in shape_to_value:
      raise ValueError(f"no value for shape {key}; known: {sorted(shape_to_value)}")
    return tf.reshape(tf.constant(shape_to_value[key], dtype=dtype), key)
  return initialize
