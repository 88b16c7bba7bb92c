"""Per-example losses and loss weights."""

from __future__ import annotations

import tensorflow.compat.v1 as tf

from mesh_tensorflow import ops_with_redefined_builtins as mtf

__all__ = ["softmax_cross_entropy_with_logits", "sigmoid_cross_entropy_with_logits", "weights_nonzero"]


def softmax_cross_entropy_with_logits(logits: mtf.Tensor, targets: mtf.Tensor, vocab_dim,
                                      z_loss: float = 0.0) -> mtf.Tensor:
  """Per-example `-sum_vocab(log_softmax(logits) * targets)`, plus `z_loss * logZ**2`.

  Integer targets are class ids (dims = logits' dims without vocab_dim) and are one-hot encoded;
  float targets are distributions with logits' dims. The result has logits' dims minus vocab_dim.
  """
  vocab_dim = mtf.convert_to_dimension(vocab_dim)
  if vocab_dim not in logits.shape.dims:
    raise ValueError(f"softmax_cross_entropy_with_logits: vocab_dim {vocab_dim} is not a dim of logits "
                     f"{logits.shape}; pass the logits' vocabulary dim.")
  if targets.dtype.is_integer:
    expected = set(logits.shape.dims) - {vocab_dim}
    if set(targets.shape.dims) != expected:
      raise ValueError(
          f"softmax_cross_entropy_with_logits: integer (class id) targets {targets.shape} must have "
          f"the dims of logits {logits.shape} other than vocab_dim {vocab_dim}.")
    targets = mtf.one_hot(targets, vocab_dim, dtype=logits.dtype)
  elif set(targets.shape.dims) != set(logits.shape.dims):
    raise ValueError(
        f"softmax_cross_entropy_with_logits: soft targets {targets.shape} must have the same dims as "
        f"logits {logits.shape}; for class ids pass an integer Tensor.")
  if z_loss == 0:  # one log_softmax kernel per slice where the vocabulary is whole
    return mtf.negative(mtf.reduce_sum(mtf.log_softmax(logits, vocab_dim) * targets,
                                       reduced_dim=vocab_dim))
  log_z = mtf.reduce_logsumexp(logits, vocab_dim)
  loss = mtf.negative(mtf.reduce_sum((logits - log_z) * targets, reduced_dim=vocab_dim))
  return loss + z_loss * mtf.square(log_z)


def sigmoid_cross_entropy_with_logits(logits: mtf.Tensor, targets: mtf.Tensor) -> mtf.Tensor:
  """Elementwise `tf.nn.sigmoid_cross_entropy_with_logits`; logits and targets have equal shapes."""
  if logits.shape != targets.shape:
    raise ValueError(f"sigmoid_cross_entropy_with_logits: logits {logits.shape} and targets "
                     f"{targets.shape} must have the same shape (use mtf.broadcast/transpose).")
  return mtf.cwise(lambda x, z: tf.nn.sigmoid_cross_entropy_with_logits(labels=z, logits=x),
                   [logits, targets], name="sigmoid_cross_entropy_with_logits")


def weights_nonzero(targets: mtf.Tensor, dtype=tf.float32) -> mtf.Tensor:
  """1 where targets != 0, else 0, in `dtype` (e.g. to weight out padding)."""
  return mtf.cwise(lambda x: tf.cast(tf.not_equal(x, 0), dtype), [targets], output_dtype=dtype,
                   name="weights_nonzero")
