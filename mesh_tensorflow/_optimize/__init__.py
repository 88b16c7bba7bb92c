"""Optimizer implementations behind the public `mesh_tensorflow.optimize` facade."""
