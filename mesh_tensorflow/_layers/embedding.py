"""Embedding tables and lookups."""

from __future__ import annotations

import tensorflow.compat.v1 as tf

from mesh_tensorflow import ops_with_redefined_builtins as mtf

__all__ = ["embedding_weights", "embedding"]


def embedding_weights(mesh, vocab_dim, output_dim, variable_dtype, name: str = "embedding",
                      ensemble_dim=None, initializer=None) -> mtf.Tensor:
  """The embedding variable `name` of shape [ensemble_dim..., vocab_dim, output_dim].

  `ensemble_dim` is None, a Dimension or a list of Dimensions; `initializer` defaults to
  `tf.random_normal_initializer()`.
  """
  if ensemble_dim is None:
    ensemble_dims = []
  elif isinstance(ensemble_dim, mtf.Dimension):
    ensemble_dims = [ensemble_dim]
  else:
    ensemble_dims = list(ensemble_dim)
  shape = mtf.Shape(ensemble_dims + [vocab_dim, output_dim])
  if initializer is None:
    initializer = tf.random_normal_initializer()
  return mtf.get_variable(mesh, name, shape, dtype=variable_dtype, initializer=initializer)


def embedding(indices: mtf.Tensor, vocab_dim, output_dim, variable_dtype,
              name: str = "embedding") -> mtf.Tensor:
  """Looks integer `indices` up in a fresh [vocab_dim, output_dim] table: indices' dims + output_dim."""
  weights = embedding_weights(indices.mesh, vocab_dim, output_dim, variable_dtype, name)
  return mtf.gather(weights, indices, vocab_dim)
