"""End to end: a small MLP regression trained with each optimizer converges, identically under
data parallelism (all:8, batch:all) and 2-D model+data parallelism (rows:2;cols:4, batch:rows;hidden:cols)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import session_config
from tests.optimize.optimizer_check import mesh_impl

STEPS = 300
BATCH, INPUT, HIDDEN, OUTPUT = 32, 8, 16, 4


def make_data():
  rng = np.random.RandomState(0)
  x = rng.randn(BATCH, INPUT).astype(np.float32)
  y = np.tanh(x @ rng.randn(INPUT, HIDDEN)) @ rng.randn(HIDDEN, OUTPUT) * 0.5
  w1 = rng.randn(INPUT, HIDDEN).astype(np.float32) * 0.3
  w2 = rng.randn(HIDDEN, OUTPUT).astype(np.float32) * 0.3
  return x, y.astype(np.float32), w1, w2


def train_mlp(make_optimizer, mesh_shape: str, layout: str) -> np.ndarray:
  """Full-batch training of relu(x w1) w2 on a fixed regression task; returns the loss per step."""
  x_np, y_np, w1_np, w2_np = make_data()
  batch, inp = mtf.Dimension("batch", BATCH), mtf.Dimension("input", INPUT)
  hidden, out = mtf.Dimension("hidden", HIDDEN), mtf.Dimension("output", OUTPUT)
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    x = mtf.import_tf_tensor(mesh, tf.constant(x_np), [batch, inp])
    y = mtf.import_tf_tensor(mesh, tf.constant(y_np), [batch, out])
    w1 = mtf.get_variable(mesh, "w1", [inp, hidden], initializer=tf.constant_initializer(w1_np))
    w2 = mtf.get_variable(mesh, "w2", [hidden, out], initializer=tf.constant_initializer(w2_np))
    h = mtf.relu(mtf.einsum([x, w1], output_shape=[batch, hidden]))
    prediction = mtf.einsum([h, w2], output_shape=[batch, out])
    loss = mtf.reduce_mean(mtf.square(prediction - y))
    variables = graph.trainable_variables
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    update_ops = make_optimizer().apply_grads(grads, variables)
    lowering = mtf.Lowering(graph, {mesh: mesh_impl(mesh_shape, layout)})
    tf_loss = lowering.export_to_tf_tensor(loss)
    global_step = tf.train.get_or_create_global_step()
    with tf.control_dependencies([lowering.lowered_operation(op) for op in update_ops]):
      train_op = tf.assign_add(global_step, 1)
    init_ops = [tf.global_variables_initializer(), lowering.copy_masters_to_slices()]
    with tf.Session(config=session_config()) as sess:
      for op in init_ops:
        sess.run(op)
      return np.array([sess.run([tf_loss, train_op])[0] for _ in range(STEPS)])


@pytest.mark.parametrize("make_optimizer", [
    lambda: mtf.optimize.SgdOptimizer(0.1),
    lambda: mtf.optimize.MomentumOptimizer(0.02, 0.9),
    lambda: mtf.optimize.AdamWeightDecayOptimizer(0.01),
    lambda: mtf.optimize.AdafactorOptimizer(learning_rate=0.05, min_dim_size_to_factor=8),
], ids=["sgd", "momentum", "adam", "adafactor"])
def test_training_converges_to_the_same_loss_under_data_and_model_parallelism(make_optimizer):
  data_parallel = train_mlp(make_optimizer, "all:8", "batch:all")
  two_d = train_mlp(make_optimizer, "rows:2;cols:4", "batch:rows;hidden:cols")
  assert data_parallel[-1] < 0.1 * data_parallel[0], (data_parallel[0], data_parallel[-1])
  # Same computation, different summation order: identical at first, within float noise later
  # (Adam's m / sqrt(v) amplifies last-bit differences once gradients are small).
  np.testing.assert_allclose(two_d[:50], data_parallel[:50], rtol=1e-4)
  np.testing.assert_allclose(two_d, data_parallel, rtol=1e-2, atol=1e-4)
