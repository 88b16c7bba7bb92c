"""mtf.tf2.MtfLayer: an mtf computation in a Keras 3 model, trained by model.fit like plain Keras."""

import numpy as np
import pytest
import tensorflow as tf

import mesh_tensorflow as mtf
from tests.tf2 import mlp

keras = pytest.importorskip("keras")
BATCH, INPUT, HIDDEN, OUTPUT = mlp.BATCH, mlp.INPUT, mlp.HIDDEN, mlp.OUTPUT


@keras.saving.register_keras_serializable(package="mtf_tests")
def mtf_mlp(mesh, inputs, weights):
  """relu(x w1) w2 with named dimensions: the plain-Keras model below, in mtf."""
  batch, inp = mtf.Dimension("batch", BATCH), mtf.Dimension("inp", INPUT)
  hidden, out = mtf.Dimension("hidden", HIDDEN), mtf.Dimension("out", OUTPUT)
  x = mtf.import_tf_tensor(mesh, inputs, [batch, inp])
  h = mtf.relu(mtf.einsum([x, weights["w1"]], [batch, hidden]))
  return mtf.einsum([h, weights["w2"]], [batch, out])


def _mtf_model(mesh_name: str):
  mesh_shape, layout = mlp.MESHES[mesh_name]
  inputs = keras.Input(shape=(INPUT,), batch_size=BATCH)
  layer = mtf.tf2.MtfLayer(mtf_mlp, {"w1": f"inp:{INPUT};hidden:{HIDDEN}",
                                     "w2": f"hidden:{HIDDEN};out:{OUTPUT}"},
                           mesh_shape, layout, name="mtf_mlp")
  model = keras.Model(inputs, layer(inputs))
  layer.mtf_weights["w1"].assign(mlp.W1)
  layer.mtf_weights["w2"].assign(mlp.W2)
  return model


def _plain_model():
  inputs = keras.Input(shape=(INPUT,), batch_size=BATCH)
  hidden = keras.layers.Dense(HIDDEN, activation="relu", use_bias=False)
  out = keras.layers.Dense(OUTPUT, use_bias=False)
  model = keras.Model(inputs, out(hidden(inputs)))
  hidden.kernel.assign(mlp.W1)
  out.kernel.assign(mlp.W2)
  return model


def _data(seed=4):
  rng = np.random.RandomState(seed)
  return (rng.randn(4 * BATCH, INPUT).astype(np.float32),
          rng.randn(4 * BATCH, OUTPUT).astype(np.float32))


@pytest.mark.parametrize("mesh_name", ["one_device", "mesh_2x4"])
def test_gradients_equal_the_plain_keras_models(mesh_name):
  x, y = _data()
  grads = []
  for model in (_mtf_model(mesh_name), _plain_model()):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x[:BATCH]) - y[:BATCH]))
    grads.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
  assert [g.shape for g in grads[0]] == [(INPUT, HIDDEN), (HIDDEN, OUTPUT)]
  for got, want in zip(*grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_model_fit_trains_as_plain_keras_and_the_model_saves(tmp_path):
  x, y = _data()
  histories, weights = [], []
  for model in (_mtf_model("mesh_2x4"), _plain_model()):
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    histories.append(history.history["loss"])
    weights.append([w.numpy() for w in model.trainable_variables])
  np.testing.assert_allclose(histories[0], histories[1], rtol=1e-5)
  assert histories[0][-1] < histories[0][0]
  for got, want in zip(*weights):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  trained = _mtf_model("mesh_2x4")
  trained.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
  trained.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  path = str(tmp_path / "model.keras")
  trained.save(path)
  loaded = keras.models.load_model(path)
  assert isinstance(loaded.get_layer("mtf_mlp"), mtf.tf2.MtfLayer)
  np.testing.assert_allclose(loaded.predict(x, batch_size=BATCH, verbose=0),
                             trained.predict(x, batch_size=BATCH, verbose=0), rtol=1e-6)


def test_an_input_without_a_static_batch_size_is_refused():
  layer = mtf.tf2.MtfLayer(mtf_mlp, {"w1": f"inp:{INPUT};hidden:{HIDDEN}",
                                     "w2": f"hidden:{HIDDEN};out:{OUTPUT}"}, "all:1")
  with pytest.raises(ValueError, match="batch_size"):
    keras.Model(inputs := keras.Input(shape=(INPUT,)), layer(inputs))
  with pytest.raises(ValueError, match="layout must be a string"):
    mtf.tf2.MtfLayer(mtf_mlp, {}, "all:1", mtf.convert_to_layout_rules("batch:all"))
