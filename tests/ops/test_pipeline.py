"""mtf.pipeline: a pipelined residual MLP's loss and gradients equal the layer-by-layer model's.

The stacked weights are given as numpy arrays; the reference, in plain TF, applies layer l with
the weights at PipelineSchedule.layer_position(l), so the gradients w.r.t. the stacked weights
compare directly. Meshes split the stages, the batch and the MLP's hidden dimension.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._ops.pipeline import pipeline, pipeline_schedule
from tests.harness import assert_allclose, lower_and_evaluate

BATCH, D_MODEL, D_FF = 16, 4, 8


def _mlp_layer(h, get_variable, initial):
  """A residual MLP layer: h + relu(h w1) w2, the weights from `initial` (stacked arrays)."""
  d_model = h.shape.get_dim_by_name("d_model")
  d_ff = mtf.Dimension("d_ff", D_FF)
  w1 = get_variable("w1", [d_model, d_ff], initializer=tf.constant_initializer(initial["w1"]))
  w2 = get_variable("w2", [d_ff, d_model], initializer=tf.constant_initializer(initial["w2"]))
  hidden = mtf.relu(mtf.einsum([h, w1], output_shape=h.shape - d_model + d_ff))
  return h + mtf.einsum([hidden, w2], output_shape=h.shape)


def _stacked_weights(sched, seed=0):
  """Random stacked weights [stages, (slots,)] + layer shape, as the pipeline's variables hold them."""
  rng = np.random.RandomState(seed)
  lead = [sched.num_stages] + ([sched.slots_per_stage] if sched.slots_per_stage > 1 else [])
  return {"w1": rng.normal(0, 0.25, lead + [D_MODEL, D_FF]).astype(np.float32),
          "w2": rng.normal(0, 0.25, lead + [D_FF, D_MODEL]).astype(np.float32)}


def _inputs(seed=1):
  rng = np.random.RandomState(seed)
  return (rng.normal(size=[BATCH, D_MODEL]).astype(np.float32),
          rng.normal(size=[BATCH, D_MODEL]).astype(np.float32))


def _pipelined(sched, schedule, initial, mesh_shape, layout, recompute=False):
  """[output, loss, d loss / d w1, d loss / d w2] of the pipelined MLP on the mesh."""
  x_value, target = _inputs()
  layers_per_round = sched.layers_per_tick if schedule == "circular" else 1

  def build(mesh):
    batch = mtf.Dimension("batch", BATCH)
    x = mtf.import_tf_tensor(mesh, tf.constant(x_value), shape=f"batch:{BATCH};d_model:{D_MODEL}")
    y = pipeline(lambda h, get: _mlp_layer(h, get, initial), x, sched.num_layers,
                 mtf.Dimension("stages", sched.num_stages), batch, sched.num_microbatches,
                 schedule=schedule, layers_per_round=layers_per_round, recompute=recompute)
    loss = mtf.reduce_sum(y * mtf.import_tf_tensor(mesh, tf.constant(target), shape=y.shape))
    variables = {v.name.split("/")[-1]: v.outputs[0] for v in mesh.graph.trainable_variables}
    grads = mtf.gradients([loss], [variables["w1"], variables["w2"]])
    return [y, loss] + grads

  return lower_and_evaluate(build, mesh_shape, layout)


def _layer_by_layer(sched, initial):
  """The same quantities in plain TF, layer l reading the stacked weights at its (stage, slot)."""
  x_value, target = _inputs()
  with tf.Graph().as_default():
    w1, w2 = tf.constant(initial["w1"]), tf.constant(initial["w2"])
    h = tf.constant(x_value)
    for layer in range(sched.num_layers):
      stage, slot = sched.layer_position(layer)
      at = (stage, slot) if sched.slots_per_stage > 1 else (stage,)
      h = h + tf.matmul(tf.nn.relu(tf.matmul(h, w1[at])), w2[at])
    loss = tf.reduce_sum(h * target)
    with tf.Session() as sess:
      return sess.run([h, loss] + tf.gradients(loss, [w1, w2]))


# (mesh, layout, stages, layers for fill-drain, layers for circular: two rounds)
MESHES = [
    ("stage:8", "stages:stage", 8, 8, 16),
    ("stage:4;batch:2", "stages:stage;batch:batch", 4, 4, 8),
    ("stage:2;batch:2;model:2", "stages:stage;batch:batch;d_ff:model", 2, 4, 4),
]


@pytest.mark.parametrize("mesh_shape, layout, stages, fill_drain_layers, circular_layers", MESHES,
                         ids=[m[0] for m in MESHES])
@pytest.mark.parametrize("schedule", ["fill_drain", "circular"])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
def test_pipelined_mlp_loss_and_gradients_equal_the_layer_by_layer_model(
    mesh_shape, layout, stages, fill_drain_layers, circular_layers, schedule, microbatches):
  layers = fill_drain_layers if schedule == "fill_drain" else circular_layers
  sched = pipeline_schedule(layers, stages, microbatches, schedule)
  initial = _stacked_weights(sched)
  got = _pipelined(sched, schedule, initial, mesh_shape, layout)
  for g, e in zip(got, _layer_by_layer(sched, initial)):
    assert_allclose(g, e, rtol=1e-5, atol=1e-5)
