"""Alternative vocab embeddings for Unitransformer (pick one with gin `get_vocab_embedding_cls.cls`).

Each class has VocabEmbedding's interface: the constructor `(mesh, vocab_dim, output_dim,
variable_dtype, name, ensemble_dim, ...)`, `ids_to_embedding(ids, context)` and
`hidden_to_logits(hidden, context)`. Variable names derive from `name` and are checkpoint-visible.
"""

from __future__ import annotations

from typing import Optional, Sequence

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer

GIN_MODULE = "mesh_tensorflow.transformer.vocab_embeddings"


def _ensemble_dims(ensemble_dim) -> list:
  return [ensemble_dim] if ensemble_dim else []


@gin.configurable(module=GIN_MODULE)
class FactorizedVocabEmbedding:
  """The [vocab, d_model] table factorised through a small inner dimension (as in ALBERT).

  Variables `<name>1` [vocab, inner_vocab] and `<name>2` [inner_vocab, d_model], both with
  stddev inner_dimension_size^-0.25 (so their product has unit variance).
  """

  def __init__(self, mesh, vocab_dim, output_dim, variable_dtype, name, ensemble_dim,
               inner_dimension_size=gin.REQUIRED):
    self._vocab_dim = vocab_dim
    self._output_dim = output_dim
    self._inner_dim = mtf.Dimension("inner_vocab", inner_dimension_size)
    stddev = inner_dimension_size ** -0.25
    self._factor1 = mtf.layers.embedding_weights(
        mesh=mesh, vocab_dim=vocab_dim, output_dim=self._inner_dim, variable_dtype=variable_dtype,
        name=f"{name}1", ensemble_dim=ensemble_dim,
        initializer=tf.random_normal_initializer(stddev=stddev))
    self._factor2 = mtf.layers.embedding_weights(
        mesh=mesh, vocab_dim=self._inner_dim, output_dim=output_dim, variable_dtype=variable_dtype,
        name=f"{name}2", ensemble_dim=ensemble_dim,
        initializer=tf.random_normal_initializer(stddev=stddev))

  def ids_to_embedding(self, ids: mtf.Tensor, context) -> mtf.Tensor:
    del context
    inner = mtf.gather(self._factor1, ids, self._vocab_dim)
    return mtf.einsum([inner, self._factor2], reduced_dims=[self._inner_dim])

  def hidden_to_logits(self, hidden: mtf.Tensor, context) -> mtf.Tensor:
    del context
    hidden *= self._output_dim.size ** -0.5
    inner = mtf.einsum([hidden, self._factor2], reduced_dims=[self._output_dim])
    return mtf.einsum([inner, self._factor1], reduced_dims=[self._inner_dim])


class _Cluster:
  """One cluster of consecutive token ids [start, end) with its own embedding (cluster-local ids).

  The embedding's vocabulary has vocab_size >= end - start entries (more when it also holds
  placeholders, as the adaptive softmax head does).
  """

  def __init__(self, embedding, start_token_id: int, end_token_id: int, vocab_size: Optional[int] = None):
    self._embedding = embedding
    self._start_token_id = start_token_id
    self._end_token_id = end_token_id
    self._vocab_size = end_token_id - start_token_id if vocab_size is None else vocab_size

  @property
  def end_token_id(self) -> int:
    return self._end_token_id

  def ids_to_embedding(self, ids: mtf.Tensor, context) -> mtf.Tensor:
    """Embeddings of the ids in the cluster; other ids get the zero vector."""
    ids -= self._start_token_id
    count = self._end_token_id - self._start_token_id
    inside = mtf.logical_and(mtf.greater_equal(ids, 0), mtf.less(ids, count))
    # Outside ids become vocab_size: gather (a one-hot einsum) gives zeros for it.
    ids = mtf.where(inside, ids, self._vocab_size)
    return self._embedding.ids_to_embedding(ids, context)

  def hidden_to_logits(self, hidden: mtf.Tensor, context) -> mtf.Tensor:
    """Logits of the cluster's tokens only."""
    return self._embedding.hidden_to_logits(hidden, context)


def _check_token_counts(owner: str, clusters: Sequence[dict], vocab_dim) -> None:
  token_counts = [cluster["token_count"] for cluster in clusters]
  if sum(token_counts) != vocab_dim.size:
    raise ValueError(f"{owner}: the cluster token counts {token_counts} sum to {sum(token_counts)}, not "
                     f"to the vocab size {vocab_dim.size}; make the clusters cover the vocabulary exactly.")


def make_cluster_embedding(mesh, cluster_vocab_dim, output_dim, variable_dtype, name, ensemble_dim,
                           embedding_size: int):
  """A VocabEmbedding when embedding_size is d_model, else a FactorizedVocabEmbedding through it."""
  if embedding_size == output_dim.size:
    return transformer.VocabEmbedding(mesh=mesh, vocab_dim=cluster_vocab_dim, output_dim=output_dim,
                                      variable_dtype=variable_dtype, name=name, ensemble_dim=ensemble_dim)
  return FactorizedVocabEmbedding(mesh=mesh, vocab_dim=cluster_vocab_dim, output_dim=output_dim,
                                  variable_dtype=variable_dtype, name=name, ensemble_dim=ensemble_dim,
                                  inner_dimension_size=embedding_size)


@gin.configurable(module=GIN_MODULE)
class AdaptiveVocabEmbedding:
  """Adaptive input embeddings (arXiv:1809.10853): frequent tokens get wider embeddings.

  `clusters` is a list of {"token_count": n, "embedding_size": k}, covering ids in order: e.g.
  [{"token_count": 50000, "embedding_size": 1024}, {"token_count": 450000, "embedding_size": 64}]
  gives ids [0, 50000) 1024-wide and the rest 64-wide embeddings projected to d_model. Cluster i's
  variables are named `<name>_<i>` (a plain table) or `<name>_<i>1` / `<name>_<i>2` (factorised).
  Raises ValueError when the token counts do not sum to the vocabulary size.
  """

  def __init__(self, mesh, vocab_dim, output_dim, variable_dtype, name, ensemble_dim,
               clusters=gin.REQUIRED):
    self._vocab_dim = vocab_dim
    self._output_dim = output_dim
    _check_token_counts("AdaptiveVocabEmbedding", clusters, vocab_dim)
    self._clusters = []
    start_token_id = 0
    for i, cluster in enumerate(clusters):
      token_count = cluster["token_count"]
      embedding = make_cluster_embedding(
          mesh, mtf.Dimension(vocab_dim.name, token_count), output_dim, variable_dtype,
          f"{name}_{i}", ensemble_dim, cluster["embedding_size"])
      self._clusters.append(_Cluster(embedding, start_token_id, start_token_id + token_count))
      start_token_id += token_count

  def ids_to_embedding(self, ids: mtf.Tensor, context) -> mtf.Tensor:
    # Every cluster embeds the ids outside it as zeros, and the clusters are disjoint.
    return mtf.add_n([cluster.ids_to_embedding(ids, context) for cluster in self._clusters])

  def hidden_to_logits(self, hidden: mtf.Tensor, context) -> mtf.Tensor:
    return mtf.concat([cluster.hidden_to_logits(hidden, context) for cluster in self._clusters],
                      concat_dim_name=self._vocab_dim.name)


@gin.configurable(module=GIN_MODULE)
class MixtureOfSoftmaxes:
  """Token distribution as a mixture of num_softmaxes softmaxes (arXiv:1711.03953).

  Embedding: the plain table `<name>_embedding_weights` [vocab, d_model]. Logits: log of
  sum_k prior_k(h) * softmax(w . tanh(C_k h)), with `<name>_mixture_weights` [softmax_components,
  d_model] giving the priors and `<name>_context_weights` [softmax_components, _d_model_copy,
  d_model] the component contexts (hidden scaled by d_model^-0.5). Use float32 activations: the
  result is a log of a sum of probabilities.
  """

  def __init__(self, mesh, vocab_dim, output_dim, variable_dtype, name, ensemble_dim,
               num_softmaxes=gin.REQUIRED):
    self._vocab_dim = vocab_dim
    self._output_dim = output_dim
    self._copy_output_dim = mtf.Dimension(f"_{output_dim.name}_copy", output_dim.size)
    self._components_dim = mtf.Dimension("softmax_components", num_softmaxes)
    self._embedding_weights = mtf.layers.embedding_weights(
        mesh=mesh, vocab_dim=vocab_dim, output_dim=output_dim, variable_dtype=variable_dtype,
        name=f"{name}_embedding_weights", ensemble_dim=ensemble_dim)
    self._mixture_weights = mtf.layers.embedding_weights(
        mesh=mesh, vocab_dim=self._components_dim, output_dim=output_dim, variable_dtype=variable_dtype,
        name=f"{name}_mixture_weights", ensemble_dim=ensemble_dim)
    self._context_weights = mtf.layers.embedding_weights(
        mesh=mesh, vocab_dim=self._copy_output_dim, output_dim=output_dim, variable_dtype=variable_dtype,
        name=f"{name}_context_weights",
        ensemble_dim=_ensemble_dims(ensemble_dim) + [self._components_dim])

  def ids_to_embedding(self, ids: mtf.Tensor, context) -> mtf.Tensor:
    del context
    return mtf.gather(self._embedding_weights, ids, self._vocab_dim)

  def hidden_to_logits(self, hidden: mtf.Tensor, context) -> mtf.Tensor:
    del context
    hidden *= self._output_dim.size ** -0.5
    component_prior_logits = mtf.einsum([hidden, self._mixture_weights], reduced_dims=[self._output_dim])
    component_contexts = mtf.tanh(mtf.einsum(
        [mtf.rename_dimension(hidden, self._output_dim.name, self._copy_output_dim.name),
         self._context_weights], reduced_dims=[self._copy_output_dim]))
    component_logits = mtf.einsum([component_contexts, self._embedding_weights],
                                  reduced_dims=[self._output_dim])
    component_prior_logits = mtf.log_softmax(component_prior_logits, reduced_dim=self._components_dim)
    component_logits = mtf.log_softmax(component_logits, reduced_dim=self._vocab_dim)
    return mtf.reduce_logsumexp(component_prior_logits + component_logits, reduced_dim=self._components_dim)


@gin.configurable(module=GIN_MODULE)
class Mixtape:
  """Mixtape logits (NeurIPS 2019 "Mixtape: Breaking the Softmax Bottleneck Efficiently").

  logit(x) = sum_k pi_k(x) * w_x . tanh(H_k h + b_k) over 4 gates, the gate weights pi from a
  sigmoid tree over 3 gate logits: for the frequent tokens (the first frequent_token_fraction of
  the vocabulary, which is ordered by frequency) v_x . tanh(U_k h + Q_k) + u_k . h + b_{x,k};
  rare tokens share the gate logits u_k . h. The last `extra_ids` ids (sentinels) count as
  frequent. Training adds dropout (dropout_rate) on the context vectors and Gaussian noise
  (noise_std_dev) on the gate logits. The vocab dim is split into frequent and rare parts, so a
  layout must not split `vocab` (lowering raises UnsplittableDimensionError naming the rule).
  Variables (prefix `<name>_`): embedding_weights [vocab, d] (w), context_weights [gates,
  _d_copy, d] (H), context_weights_bias [gates, d] (b), prior_weights [pre_gates, gate_embedding,
  d] (U), prior_weights_bias [pre_gates, gate_embedding] (Q), prior_vocab_vector [frequent
  vocab, gate_embedding] (v), prior_gates_vector [pre_gates, d] (u), prior_bias [frequent vocab,
  pre_gates] (b_x).
  """

  def __init__(self, mesh, vocab_dim, output_dim, variable_dtype, name, ensemble_dim, extra_ids=0,
               dropout_rate=0.0, gate_embedding_size=gin.REQUIRED, frequent_token_fraction=0.1,
               noise_std_dev=0.0):
    if not 0 <= extra_ids <= vocab_dim.size:
      raise ValueError(f"Mixtape: extra_ids={extra_ids} must be in [0, {vocab_dim.size}] (the vocab size).")
    if not 0.0 <= frequent_token_fraction <= 1.0:
      raise ValueError(f"Mixtape: frequent_token_fraction={frequent_token_fraction} must be in [0, 1].")
    self._extra_ids = extra_ids
    self._dropout_rate = dropout_rate
    self._noise_std_dev = noise_std_dev
    self._mesh = mesh
    self._vocab_dim = vocab_dim
    self._frequent_vocab_dim = mtf.Dimension(vocab_dim.name, int(frequent_token_fraction * vocab_dim.size))
    self._rare_vocab_dim = mtf.Dimension(vocab_dim.name, vocab_dim.size - self._frequent_vocab_dim.size)
    self._output_dim = output_dim
    self._copy_output_dim = mtf.Dimension(f"_{output_dim.name}_copy", output_dim.size)
    self._pre_gates_dim = mtf.Dimension("gates", 3)
    self._gates_dim = mtf.Dimension("gates", 4)
    self._gate_embedding_dim = mtf.Dimension("gate_embedding", gate_embedding_size)
    ensemble_dims = _ensemble_dims(ensemble_dim)

    def variable(suffix, dims, initializer):
      return mtf.get_variable(mesh, name=f"{name}_{suffix}", shape=mtf.Shape(ensemble_dims + dims),
                              dtype=variable_dtype, initializer=initializer)

    self._embedding_weights = mtf.layers.embedding_weights(
        mesh=mesh, vocab_dim=vocab_dim, output_dim=output_dim, variable_dtype=variable_dtype,
        name=f"{name}_embedding_weights", ensemble_dim=ensemble_dim)
    self._context_weights = mtf.layers.embedding_weights(
        mesh=mesh, vocab_dim=self._copy_output_dim, output_dim=output_dim, variable_dtype=variable_dtype,
        name=f"{name}_context_weights", ensemble_dim=ensemble_dims + [self._gates_dim])
    self._context_weights_bias = variable("context_weights_bias", [self._gates_dim, output_dim],
                                          tf.zeros_initializer())
    self._prior_weights = mtf.layers.embedding_weights(
        mesh=mesh, vocab_dim=self._gate_embedding_dim, output_dim=output_dim, variable_dtype=variable_dtype,
        name=f"{name}_prior_weights", ensemble_dim=ensemble_dims + [self._pre_gates_dim])
    self._prior_weights_bias = variable("prior_weights_bias", [self._pre_gates_dim, self._gate_embedding_dim],
                                        tf.zeros_initializer())
    self._prior_vocab_vector = variable("prior_vocab_vector", [self._frequent_vocab_dim,
                                                               self._gate_embedding_dim],
                                        tf.random_normal_initializer())
    self._prior_gates_vector = variable("prior_gates_vector", [self._pre_gates_dim, output_dim],
                                        tf.random_normal_initializer())
    self._prior_bias = variable("prior_bias", [self._frequent_vocab_dim, self._pre_gates_dim],
                                tf.random_normal_initializer())

  def ids_to_embedding(self, ids: mtf.Tensor, context) -> mtf.Tensor:
    del context
    return mtf.gather(self._embedding_weights, ids, self._vocab_dim)

  def _sigmoid_tree(self, tensor: mtf.Tensor) -> mtf.Tensor:
    """3 gate logits -> 4 gate probabilities (a two-level binary tree of sigmoids)."""
    gamma = mtf.split(mtf.sigmoid(tensor), self._pre_gates_dim, self._pre_gates_dim.size)
    return mtf.concat([gamma[0] * gamma[1], gamma[0] * (1 - gamma[1]),
                       (1 - gamma[0]) * gamma[2], (1 - gamma[0]) * (1 - gamma[2])], self._gates_dim.name)

  def _dropout(self, tensor: mtf.Tensor, context) -> mtf.Tensor:
    if context is not None and context.train and self._dropout_rate:
      return mtf.dropout(tensor, context.train, rate=self._dropout_rate)
    return tensor

  def _add_noise(self, tensor: mtf.Tensor, context) -> mtf.Tensor:
    if context is not None and context.train and self._noise_std_dev:
      return tensor + mtf.random_normal(self._mesh, tensor.shape, stddev=self._noise_std_dev,
                                        dtype=tensor.dtype)
    return tensor

  def _move_vocab_block(self, logits: mtf.Tensor, first_size: int) -> mtf.Tensor:
    """Swaps the first `first_size` entries of the vocab dim behind the rest."""
    if first_size in (0, self._vocab_dim.size):
      return logits
    head, tail = mtf.split(logits, self._vocab_dim, [first_size, self._vocab_dim.size - first_size])
    return mtf.concat([tail, head], self._vocab_dim.name)

  def hidden_to_logits(self, hidden: mtf.Tensor, context) -> mtf.Tensor:
    hidden = hidden * self._output_dim.size ** -0.5
    context_vectors = mtf.tanh(mtf.einsum(
        [mtf.rename_dimension(hidden, self._output_dim.name, self._copy_output_dim.name),
         self._context_weights], reduced_dims=[self._copy_output_dim]) + self._context_weights_bias)
    context_vectors = self._dropout(context_vectors, context)
    component_logits = mtf.einsum([context_vectors, self._embedding_weights], reduced_dims=[self._output_dim])
    # Sentinels (the last extra_ids ids) first, so that they fall among the frequent tokens.
    component_logits = self._move_vocab_block(component_logits, self._vocab_dim.size - self._extra_ids)

    shared_gate_logits = self._add_noise(
        mtf.einsum([hidden, self._prior_gates_vector], reduced_dims=[self._output_dim]), context)
    parts = []
    if self._frequent_vocab_dim.size:
      prior = mtf.tanh(mtf.einsum([hidden, self._prior_weights], reduced_dims=[self._output_dim])
                       + self._prior_weights_bias)
      frequent_gate_logits = (
          mtf.einsum([prior, self._prior_vocab_vector], reduced_dims=[self._gate_embedding_dim])
          + self._prior_bias + shared_gate_logits)
      parts.append((self._frequent_vocab_dim, self._sigmoid_tree(frequent_gate_logits)))
    if self._rare_vocab_dim.size:
      parts.append((self._rare_vocab_dim, self._sigmoid_tree(shared_gate_logits)))
    if len(parts) == 2:
      blocks = mtf.split(component_logits, self._vocab_dim, [d.size for d, _ in parts])
    else:
      blocks = [component_logits]
    logits = [mtf.einsum([block, gates], reduced_dims=[self._gates_dim])
              for block, (_, gates) in zip(blocks, parts)]
    logits = logits[0] if len(logits) == 1 else mtf.concat(logits, self._vocab_dim.name)
    return self._move_vocab_block(logits, self._extra_ids)

