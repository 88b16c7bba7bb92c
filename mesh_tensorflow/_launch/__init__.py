"""The launcher's internals and the Cluster description (see mesh_tensorflow.launch)."""
