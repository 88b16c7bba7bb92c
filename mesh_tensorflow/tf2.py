"""TF2-native Mesh TensorFlow: train with TF functions, checkpoint with tf.train.Checkpoint, use Keras.

`MeshModule` owns an mtf model's variables as tf.Variables; `MeshModule.function` and
`TrainStep` lower an mtf computation once into a TF function called at graph speed;
`MtfLayer` puts an mtf computation into a Keras model. docs/tf2.md shows a complete program.
"""
# ruff: noqa: F401
from mesh_tensorflow._tf2.module import MeshFunction, MeshModule, TrainStep


def __getattr__(name: str):
  # MtfLayer imports Keras, which `import mesh_tensorflow` should not pay for.
  if name == "MtfLayer":
    from mesh_tensorflow._tf2.keras_layer import MtfLayer
    return MtfLayer
  raise AttributeError(f"module 'mesh_tensorflow.tf2' has no attribute {name!r}")
