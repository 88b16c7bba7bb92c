"""A tiny two-layer MLP regression, built in mtf for MeshModule tests and in session mode to compare."""

from __future__ import annotations

import numpy as np
import tensorflow as tf2
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import cpu_devices, session_config

BATCH, INPUT, HIDDEN, OUTPUT = 8, 4, 16, 4
LEARNING_RATE = 0.05
INPUT_SIGNATURE = [tf2.TensorSpec([BATCH, INPUT], tf.float32), tf2.TensorSpec([BATCH, OUTPUT], tf.float32)]

# mesh shape, layout: one device, data-parallel 8, and 2x4 (batch over rows, hidden units over cols).
MESHES = {"one_device": ("all:1", ""),
          "data_parallel_8": ("all:8", "batch:all"),
          "mesh_2x4": ("rows:2;cols:4", "batch:rows;hidden:cols")}

_rng = np.random.RandomState(0)
W1 = _rng.randn(INPUT, HIDDEN).astype(np.float32)
W2 = (_rng.randn(HIDDEN, OUTPUT) / 4).astype(np.float32)


def batches(steps: int, seed: int = 1) -> list:
  rng = np.random.RandomState(seed)
  return [(rng.randn(BATCH, INPUT).astype(np.float32), rng.randn(BATCH, OUTPUT).astype(np.float32))
          for _ in range(steps)]


def loss_fn(mesh, x, y, dropout_rate: float = 0.0):
  """Mean squared error of relu(x w1) w2 against y (dropout on the hidden units if asked)."""
  batch, inp = mtf.Dimension("batch", BATCH), mtf.Dimension("inp", INPUT)
  hidden, out = mtf.Dimension("hidden", HIDDEN), mtf.Dimension("out", OUTPUT)
  w1 = mtf.get_variable(mesh, "w1", [inp, hidden], initializer=tf.constant_initializer(W1))
  w2 = mtf.get_variable(mesh, "w2", [hidden, out], initializer=tf.constant_initializer(W2))
  h = mtf.relu(mtf.einsum([mtf.import_tf_tensor(mesh, x, [batch, inp]), w1], [batch, hidden]))
  if dropout_rate:
    h = mtf.dropout(h, rate=dropout_rate)
  prediction = mtf.einsum([h, w2], [batch, out])
  return mtf.reduce_mean(mtf.square(prediction - mtf.import_tf_tensor(mesh, y, [batch, out])))


def mesh_impl(name: str):
  shape, layout = MESHES[name]
  return mtf.placement_mesh_impl.PlacementMeshImpl(
      shape, layout, cpu_devices(mtf.convert_to_shape(shape).size))


def session_mode_losses(name: str, data: list, optimizer_fn=None) -> list:
  """The losses of training on `data` in a tf.compat.v1 graph and session (the reference).

  The global step is incremented after each step's updates, as mtf's Transformer driver does.
  """
  optimizer_fn = optimizer_fn or (lambda: mtf.optimize.SgdOptimizer(LEARNING_RATE))
  with tf.Graph().as_default():
    x = tf.placeholder(tf.float32, [BATCH, INPUT])
    y = tf.placeholder(tf.float32, [BATCH, OUTPUT])
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    loss = loss_fn(mesh, x, y)
    variables = graph.trainable_variables
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    global_step = tf.train.get_or_create_global_step()
    updates = optimizer_fn().apply_grads(grads, variables)
    lowering = mtf.Lowering(graph, {mesh: mesh_impl(name)})
    tf_loss = lowering.export_to_tf_tensor(loss)
    with tf.control_dependencies([lowering.lowered_operation(u) for u in updates]):
      train = tf.assign_add(global_step, 1)
    copy = lowering.copy_masters_to_slices()
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(copy)
      return [sess.run([tf_loss, train], {x: bx, y: by})[0] for bx, by in data]


def train_step(module, dropout_rate: float = 0.0):
  return mtf.tf2.TrainStep(module, lambda mesh, x, y: loss_fn(mesh, x, y, dropout_rate),
                           lambda: mtf.optimize.SgdOptimizer(LEARNING_RATE), INPUT_SIGNATURE)
