"""Bodies of mesh_tensorflow.transformer.utils (model-side helpers); utils.py re-exports them."""

# Gin registers these functions under the public module, so bindings read `utils.<name>.<arg>`.
GIN_MODULE = "mesh_tensorflow.transformer.utils"
