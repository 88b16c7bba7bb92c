"""Token and position embeddings, and the reducers that combine an ensemble's logits."""

from __future__ import annotations

import math

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer._layer_stack import GIN_MODULE


@gin.configurable(module=GIN_MODULE)
class VocabEmbedding:
  """The shared input embedding / softmax weights, variable `<name>` [ensemble..., vocab, d_model].

  With scale_variable_like_classifier_weights the table is initialised with stddev
  d_model^-0.5 and embeddings are scaled up by d_model^0.5; otherwise it has stddev 1 and
  hidden states are scaled down by d_model^-0.5 before the logits einsum.
  """

  def __init__(self, mesh, vocab_dim, output_dim, variable_dtype, name, ensemble_dim,
               scale_variable_like_classifier_weights: bool = False):
    self._vocab_dim = vocab_dim
    self._output_dim = output_dim
    self._scale_variable_like_classifier_weights = scale_variable_like_classifier_weights
    if scale_variable_like_classifier_weights:
      initializer = tf.random_normal_initializer(stddev=output_dim.size ** -0.5)
    else:
      initializer = tf.random_normal_initializer()
    self._embedding_weights = mtf.layers.embedding_weights(
        mesh=mesh, vocab_dim=vocab_dim, output_dim=output_dim, variable_dtype=variable_dtype, name=name,
        ensemble_dim=ensemble_dim, initializer=initializer)

  def ids_to_embedding(self, ids: mtf.Tensor, context) -> mtf.Tensor:
    del context
    ret = mtf.gather(self._embedding_weights, ids, self._vocab_dim)
    if self._scale_variable_like_classifier_weights:
      ret *= self._output_dim.size ** 0.5
    return ret

  def hidden_to_logits(self, hidden: mtf.Tensor, context) -> mtf.Tensor:
    del context
    if not self._scale_variable_like_classifier_weights:
      hidden *= self._output_dim.size ** -0.5
    return mtf.einsum([hidden, self._embedding_weights], reduced_dims=[self._output_dim])


@gin.configurable(module=GIN_MODULE)
def get_vocab_embedding_cls(cls=VocabEmbedding):
  """The embedding class Unitransformer and Bitransformer build (a gin knob)."""
  return cls


def sinusoid_positional_embedding_weights(mesh, max_length_dim, model_dim, dtype, min_timescale=1.0,
                                          max_timescale=1.0e4) -> mtf.Tensor:
  """[max_length, d_model]: sin of the position times geometric timescales, then cos of the same.

  Channel i < d_model/2 holds sin(p * t_i), channel d_model/2 + i holds cos(p * t_i), with
  t_i = min_timescale * (max_timescale / min_timescale) ** (-i / (d_model/2 - 1)).
  """
  if model_dim.size % 2 or model_dim.size < 4:
    raise ValueError(f"sinusoid_positional_embedding_weights: {model_dim} must be even and >= 4 "
                     f"(half sin, half cos channels).")
  num_timescales = model_dim.size // 2
  timescales_dim = mtf.Dimension("timescales", num_timescales)
  log_increment = math.log(float(max_timescale) / float(min_timescale)) / (num_timescales - 1)
  inv_timescales = min_timescale * mtf.exp(mtf.range(mesh, timescales_dim, dtype) * -log_increment)
  scaled_time = mtf.range(mesh, max_length_dim, dtype) * inv_timescales
  signal = mtf.concat([mtf.sin(scaled_time), mtf.cos(scaled_time)], timescales_dim.name)
  return mtf.reshape(signal, mtf.Shape([max_length_dim, model_dim]))


@gin.configurable(module=GIN_MODULE)
def reduce_ensemble_logits_select(logits: mtf.Tensor, ensemble_dim, vocab_dim,
                                  model_id: int = 0) -> mtf.Tensor:
  """The logits of ensemble member model_id."""
  del vocab_dim
  return mtf.gather(logits, model_id, ensemble_dim)


@gin.configurable(module=GIN_MODULE)
def reduce_ensemble_logits_mean_prob(logits: mtf.Tensor, ensemble_dim, vocab_dim) -> mtf.Tensor:
  """log of the members' mean probability."""
  probs = mtf.reduce_mean(mtf.softmax(logits, vocab_dim), reduced_dim=ensemble_dim)
  return mtf.log(mtf.maximum(probs, 1e-20))


@gin.configurable(module=GIN_MODULE)
def reduce_ensemble_logits_mean_logit(logits: mtf.Tensor, ensemble_dim, vocab_dim) -> mtf.Tensor:
  """The members' mean logits."""
  del vocab_dim
  return mtf.reduce_mean(logits, reduced_dim=ensemble_dim)


@gin.configurable(module=GIN_MODULE)
def reduce_ensemble_logits(logits: mtf.Tensor, ensemble_dim, vocab_dim,
                           reduce_fn=reduce_ensemble_logits_mean_prob) -> mtf.Tensor:
  """Combines an ensemble's logits with reduce_fn (a gin knob)."""
  return reduce_fn(logits, ensemble_dim, vocab_dim)
