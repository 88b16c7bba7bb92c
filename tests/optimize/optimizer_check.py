"""Optimizer-test helpers: run optimizers for a few steps on given gradients, read back every variable.

Gradients are fed per step (placeholders), so updates can be compared with a NumPy re-implementation
step by step. Values are read from the checkpoint-visible masters (after copy_slices_to_masters),
slots included, keyed by their full variable name.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import cpu_devices, session_config


class VariableSpec(NamedTuple):
  """A variable to train: its name, mtf shape string, initial value and optimizer factory."""
  name: str
  shape: str
  init: np.ndarray
  make_optimizer: Callable


def mesh_impl(mesh_shape, layout, **impl_kwargs):
  mesh_shape = mtf.convert_to_shape(mesh_shape)
  return mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, cpu_devices(mesh_shape.size),
                                                   **impl_kwargs)


def train(specs: Sequence[VariableSpec], grads: Sequence[dict], mesh_shape="all:1", layout="",
          dtype=tf.float32, autostack: bool = True) -> dict:
  """Graph mode: len(grads) steps, step k feeding grads[k][spec.name] to spec's optimizer.

  The global step starts at 0 and is incremented after each step's updates.
  Returns {full variable name: numpy value} for every variable (slots included).
  """
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    placeholders, update_ops = {}, []
    for spec in specs:
      shape = mtf.convert_to_shape(spec.shape)
      var = mtf.get_variable(mesh, spec.name, shape, dtype=dtype,
                             initializer=tf.constant_initializer(spec.init))
      placeholders[spec.name] = tf.placeholder(tf.float32, shape.to_integer_list)
      grad = mtf.cast(mtf.import_tf_tensor(mesh, placeholders[spec.name], shape), var.dtype)
      update_ops += spec.make_optimizer().apply_grads([grad], [var.operation])
    lowering = mtf.Lowering(graph, {mesh: mesh_impl(mesh_shape, layout)}, autostack=autostack)
    global_step = tf.train.get_or_create_global_step()
    with tf.control_dependencies([lowering.lowered_operation(op) for op in update_ops]):
      train_op = tf.assign_add(global_step, 1)
    # All ops exist before the first run (adding control inputs to run ops is deprecated).
    init_ops = [tf.global_variables_initializer(), lowering.copy_masters_to_slices()]
    save_op = lowering.copy_slices_to_masters()
    masters = {name: v.get_master() for name, v in graph.name_to_variable.items()}
    with tf.Session(config=session_config()) as sess:
      for op in init_ops:
        sess.run(op)
      for step_grads in grads:
        sess.run(train_op, {placeholders[name]: g for name, g in step_grads.items()})
      sess.run(save_op)
      return sess.run(masters)


def eager_single_step(spec: VariableSpec, grad: np.ndarray, mesh_shape="all:1", layout="") -> dict:
  """Eager mode: the values one apply_grad step assigns, {full variable name: new value}.

  Eager lowering runs the assignments at once; their results are computed from the Assign
  ops' inputs (new value, or the amount subtracted) and the initial values (slots start at 0).
  """
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  shape = mtf.convert_to_shape(spec.shape)
  var = mtf.get_variable(mesh, spec.name, shape, initializer=tf.constant_initializer(spec.init))
  grad_t = mtf.import_tf_tensor(mesh, tf.constant(grad), shape)
  assigns = spec.make_optimizer().apply_grad(grad_t, var.operation)
  lowering = mtf.Lowering(graph, {mesh: mesh_impl(mesh_shape, layout)}, autostack=False)
  new_values = {}
  for assign in assigns:
    (variable,), (value,) = assign.variables, assign.inputs
    value = lowering.export_to_tf_tensor(value).numpy()
    if assign.assign_fn is mtf.assign_sub_slice:
      old = spec.init if variable is var.operation else np.zeros(variable.shape.to_integer_list)
      value = old - value
    new_values[variable.name] = value
  return new_values


def assert_values_close(actual: dict, expected: dict, rtol=1e-5, atol=1e-6) -> None:
  """Every expected name is present in actual with a close value; no unexpected variables."""
  assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
  for name, value in expected.items():
    np.testing.assert_allclose(actual[name], value, rtol=rtol, atol=atol, err_msg=name)
