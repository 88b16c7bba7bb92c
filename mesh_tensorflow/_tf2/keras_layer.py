"""MtfLayer: an mtf computation as a Keras layer whose weights Keras owns, trains and saves.

Keras 3 keeps a layer's weights as its own variables and trains them with its optimizers through
TF's gradients of `call`. So the layer hands its weights to the mtf computation as inputs
(imported whole, then laid out by the mesh's layout), lowers the mtf graph in `call`, and
returns the output as a TF tensor: TF differentiates the lowered program (slices, einsums,
collectives) like any TF code. `model.fit` traces `call` once into its train function, so the
mtf graph is built and lowered once per trace, not per step.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import keras
import tensorflow.compat.v1 as tf

from mesh_tensorflow._backends.placement import PlacementMeshImpl
from mesh_tensorflow._core.dims import convert_to_shape
from mesh_tensorflow._core.graph import Graph, Mesh
from mesh_tensorflow._lowering.lowering import Lowering
from mesh_tensorflow._ops.reshape import import_fully_replicated


@keras.saving.register_keras_serializable(package="mesh_tensorflow")
class MtfLayer(keras.layers.Layer):
  """A Keras layer computing `fn(mesh, inputs, weights)` in mtf on a mesh of this process.

  Args:
    fn: fn(mesh, inputs, weights) -> an mtf Tensor: `inputs` the layer's input, a TF tensor
      (import it with mtf.import_tf_tensor, naming its dimensions), `weights` a dict of the
      layer's weights as mtf Tensors. A function registered with
      `keras.saving.register_keras_serializable`, so that a saved model can name it.
    weight_shapes: weight name -> mtf shape (an mtf.Shape or a string such as "inp:4;hidden:16").
    mesh_shape: the mesh, an mtf.Shape or a string such as "rows:2;cols:4".
    layout: layout rules, a string such as "batch:rows;hidden:cols" (a string, so that the
      layer's config can hold it).
    devices: one device per processor (default "cpu:0", "cpu:1", ...).
    initializer: a Keras initializer (or its name) for every weight.
    **kwargs: Keras Layer arguments (name, dtype, ...).

  Inputs need a static shape, batch included (`keras.Input(shape, batch_size=...)`): mtf
  shapes are static.
  """

  def __init__(self, fn: Callable, weight_shapes: dict, mesh_shape, layout="",
               devices: Optional[Sequence[str]] = None, initializer="glorot_uniform", **kwargs):
    super().__init__(**kwargs)
    if not callable(fn):
      raise ValueError(f"MtfLayer: fn must be a function fn(mesh, inputs, weights), got {fn!r}.")
    self._fn = fn
    self._weight_shapes = {name: convert_to_shape(shape) for name, shape in weight_shapes.items()}
    self._mesh_shape = convert_to_shape(mesh_shape)
    if not isinstance(layout, str):
      raise ValueError(f"MtfLayer: layout must be a string such as 'batch:rows', got {layout!r}.")
    self._layout = layout
    self._devices = list(devices) if devices is not None else [
        f"cpu:{i}" for i in range(self._mesh_shape.size)]
    self._initializer = keras.initializers.get(initializer)
    self.mtf_weights = {}

  def build(self, input_shape):
    for name, shape in self._weight_shapes.items():
      self.mtf_weights[name] = self.add_weight(
          name=name, shape=tuple(shape.to_integer_list), initializer=self._initializer)

  def call(self, inputs):
    if not inputs.shape.is_fully_defined():
      raise ValueError(
          f"MtfLayer {self.name}: input shape {inputs.shape} is not fully defined; mtf shapes are "
          f"static: give the model's input a batch size (keras.Input(shape, batch_size=...)) and "
          f"fit with that batch size.")
    graph = Graph()
    mesh = Mesh(graph, "mesh")
    weights = {name: import_fully_replicated(mesh, tf.convert_to_tensor(variable),
                                             self._weight_shapes[name], name=name)
               for name, variable in self.mtf_weights.items()}
    output = self._fn(mesh, inputs, weights)
    # fuse_slicewise=False: TF differentiates per-device ops; the fused device program's calls
    # are functions built by hand, which carry no gradient.
    mesh_impl = PlacementMeshImpl(self._mesh_shape, self._layout, self._devices, fuse_slicewise=False)
    return Lowering(graph, {mesh: mesh_impl}).export_to_tf_tensor(output)

  def get_config(self) -> dict:
    config = super().get_config()
    config.update(fn=keras.saving.serialize_keras_object(self._fn),
                  weight_shapes={name: _shape_string(shape)
                                 for name, shape in self._weight_shapes.items()},
                  mesh_shape=_shape_string(self._mesh_shape), layout=self._layout, devices=self._devices,
                  initializer=keras.initializers.serialize(self._initializer))
    return config

  @classmethod
  def from_config(cls, config: dict):
    config = dict(config)
    config["fn"] = keras.saving.deserialize_keras_object(config["fn"])
    return cls(**config)


def _shape_string(shape) -> str:
  """"name:size;..." (what convert_to_shape parses back)."""
  return ";".join(f"{dim.name}:{dim.size}" for dim in shape.dims)
