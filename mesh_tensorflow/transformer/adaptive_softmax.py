"""Adaptive softmax (arXiv:1609.04309) with adaptive-width cluster embeddings (arXiv:1809.10853).

p(token) = p(token's cluster) * p(token | cluster): the head cluster scores its own tokens plus
one placeholder per tail cluster, each tail cluster scores its tokens. In training the loss only
evaluates each tail cluster on the positions whose target is in it (optionally compressed to a
shorter length), never the full-vocabulary softmax. Use it as the shared embedding of a
decoder-only Unitransformer with `loss_fn=adaptive_softmax_loss_fn`.
"""

from __future__ import annotations

from typing import Dict, Sequence, Union

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer, vocab_embeddings

GIN_MODULE = "mesh_tensorflow.transformer.adaptive_softmax"
_CLUSTER_LENGTH = "_cluster_length"


class _Cluster(vocab_embeddings._Cluster):
  """A softmax cluster: the embedding plus what the loss needs (masks, length compression)."""

  def __init__(self, embedding, start_token_id: int, end_token_id: int, length_projection_factor: float,
               vocab_dim: mtf.Dimension):
    super().__init__(embedding, start_token_id, end_token_id, vocab_size=vocab_dim.size)
    self._length_projection_factor = length_projection_factor
    self._vocab_dim = vocab_dim

  @property
  def length_projection_factor(self) -> float:
    return self._length_projection_factor

  def get_cluster_mask(self, targets: mtf.Tensor) -> mtf.Tensor:
    """True where the target is in the cluster."""
    return mtf.logical_and(mtf.greater_equal(targets, self._start_token_id),
                           mtf.less(targets, self._end_token_id))

  def get_cluster_length_dim(self, length_dim: mtf.Dimension) -> mtf.Dimension:
    """The shorter length dimension the cluster's positions are packed into."""
    return mtf.Dimension(length_dim.name, int(self._length_projection_factor * length_dim.size))

  def get_project_to_cluster_length(self, cluster_mask: mtf.Tensor, dtype) -> mtf.Tensor:
    """[..., length, _cluster_length] 0/1: the k-th in-cluster position goes to slot k.

    Positions past the cluster length are dropped (not scored). The cluster length dim is named
    _CLUSTER_LENGTH until project_to_cluster_length has reduced the original length.
    """
    seq_length_dim = cluster_mask.shape.get_dim_by_name("length")
    cluster_length_dim = mtf.Dimension(_CLUSTER_LENGTH, self.get_cluster_length_dim(seq_length_dim).size)
    slot = mtf.cumsum(mtf.cast(cluster_mask, tf.int32), seq_length_dim) - 1
    return mtf.cast(cluster_mask, dtype) * mtf.one_hot(slot, cluster_length_dim, dtype=dtype)

  def project_to_cluster_length(self, cluster_mask: mtf.Tensor, t: mtf.Tensor) -> mtf.Tensor:
    """t [..., length, ...] with its in-cluster positions packed into the cluster length dim."""
    length_dim = t.shape.get_dim_by_name("length")
    projection = mtf.cast(self.get_project_to_cluster_length(cluster_mask, dtype=t.dtype), t.dtype)
    packed = mtf.einsum([projection, t], reduced_dims=[length_dim])
    return mtf.rename_dimension(packed, _CLUSTER_LENGTH, length_dim.name)

  def compute_loss(self, decoder, hidden: mtf.Tensor, targets: mtf.Tensor, context) -> mtf.Tensor:
    """Cross-entropy of the cluster's softmax over its nonzero targets, / the decoder's denominator.

    Targets outside the cluster must have been zeroed (they become out-of-range one-hots).
    """
    logits = self._embedding.hidden_to_logits(hidden, context=context)
    soft_targets = mtf.one_hot(targets - self._start_token_id, self._vocab_dim,
                               dtype=context.activation_dtype)
    loss = mtf.layers.softmax_cross_entropy_with_logits(logits, soft_targets, self._vocab_dim,
                                                        z_loss=decoder.z_loss)
    padding_mask = mtf.layers.weights_nonzero(targets, dtype=context.activation_dtype)
    return mtf.reduce_sum(loss * padding_mask) / decoder.loss_denominator(targets, context.num_microbatches)

  def compute_log_softmax(self, hidden: mtf.Tensor, context) -> mtf.Tensor:
    logits = self._embedding.hidden_to_logits(hidden, context=context)
    return mtf.log_softmax(logits, reduced_dim=self._vocab_dim)

  def get_log_softmax_prefix(self, log_softmax: mtf.Tensor, end_index: int) -> mtf.Tensor:
    """The first end_index entries along the vocab dim."""
    return mtf.slice(log_softmax, 0, end_index, self._vocab_dim.name)

  def get_log_softmax_value(self, log_softmax: mtf.Tensor, index: int) -> mtf.Tensor:
    """The entry at index along the vocab dim (the dim disappears)."""
    return mtf.gather(log_softmax, index, dim=self._vocab_dim)


def _check_length_projection_factor(factor) -> None:
  if factor <= 0 or factor > 1:
    raise ValueError(f"AdaptiveSoftmaxVocabEmbedding: length_projection_factor={factor} must be in (0, 1].")


@gin.configurable(module=GIN_MODULE)
class AdaptiveSoftmaxVocabEmbedding:
  """A vocab embedding computing the adaptive softmax.

  `clusters` lists {"token_count": n, "embedding_size": k (default d_model),
  "length_projection_factor": f (default 1)} covering ids in order; the first is the head. A
  tail cluster with f < 1 scores only the first f * length in-cluster positions of each
  sequence (cheaper; later ones are ignored by the loss). Cluster i's variables are `<name>_<i>`
  (or `<name>_<i>1`, `<name>_<i>2` when factorised); the head's vocabulary has token_count +
  (number of tail clusters) entries. In "train" mode hidden_to_logits returns the hidden state
  unchanged and compute_loss (through adaptive_softmax_loss_fn) does the work; in other modes
  it returns the full log-probabilities.
  Raises ValueError when the token counts do not sum to the vocab size or a
  length_projection_factor is outside (0, 1].
  """

  def __init__(self, mesh: mtf.Mesh, vocab_dim: mtf.Dimension, output_dim: mtf.Dimension,
               variable_dtype: mtf.VariableDType, name: str, ensemble_dim: mtf.Dimension,
               clusters: Sequence[Dict[str, Union[int, float]]] = gin.REQUIRED):
    self._mesh = mesh
    self._variable_dtype = variable_dtype
    self._name = name
    self._ensemble_dim = ensemble_dim
    self._vocab_dim = vocab_dim
    self._output_dim = output_dim
    self._num_clusters = len(clusters)
    vocab_embeddings._check_token_counts("AdaptiveSoftmaxVocabEmbedding", clusters, vocab_dim)
    self._tail_clusters = []
    start_token_id = 0
    for i, cluster_spec in enumerate(clusters):
      cluster = self._create_cluster(cluster_spec, i, start_token_id)
      if i == 0:
        self._head_cluster = cluster
      else:
        self._tail_clusters.append(cluster)
      start_token_id += cluster_spec["token_count"]

  def _create_cluster(self, cluster_spec, index: int, start_token_id: int) -> _Cluster:
    token_count = cluster_spec["token_count"]
    embedding_size = cluster_spec.get("embedding_size", self._output_dim.size)
    length_projection_factor = cluster_spec.get("length_projection_factor", 1)
    _check_length_projection_factor(length_projection_factor)
    if index == 0:  # the head also scores one placeholder per tail cluster
      cluster_vocab_dim = mtf.Dimension(self._vocab_dim.name, token_count + self._num_clusters - 1)
    else:
      cluster_vocab_dim = mtf.Dimension(self._vocab_dim.name, token_count)
    embedding = vocab_embeddings.make_cluster_embedding(
        self._mesh, cluster_vocab_dim, self._output_dim, self._variable_dtype, f"{self._name}_{index}",
        self._ensemble_dim, embedding_size)
    return _Cluster(embedding, start_token_id, start_token_id + token_count, length_projection_factor,
                    cluster_vocab_dim)

  def ids_to_embedding(self, ids: mtf.Tensor, context) -> mtf.Tensor:
    # Each cluster embeds ids outside it as zeros; the clusters are disjoint.
    all_clusters = self._tail_clusters + [self._head_cluster]
    return mtf.add_n([cluster.ids_to_embedding(ids, context) for cluster in all_clusters])

  def hidden_to_logits(self, hidden: mtf.Tensor, context) -> mtf.Tensor:
    """The hidden state itself in training (the loss function scores it), else full log-probabilities."""
    if context.mode == transformer.ModeKeys.TRAIN:
      return hidden
    return self._hidden_to_logits(hidden, context)

  def _hidden_to_logits(self, hidden: mtf.Tensor, context) -> mtf.Tensor:
    """log p(token) over the whole vocabulary (a valid logits tensor: it is already normalised)."""
    head_size = self._head_cluster.end_token_id
    head_log_softmax = self._head_cluster.compute_log_softmax(hidden, context)
    logits = [self._head_cluster.get_log_softmax_prefix(head_log_softmax, head_size)]
    for i, cluster in enumerate(self._tail_clusters):
      tail_log_softmax = cluster.compute_log_softmax(hidden, context)
      cluster_log_prob = self._head_cluster.get_log_softmax_value(head_log_softmax, head_size + i)
      logits.append(cluster_log_prob + tail_log_softmax)
    return mtf.concat(logits, concat_dim_name=self._vocab_dim.name)

  def compute_loss(self, decoder, hidden: mtf.Tensor, targets: mtf.Tensor, context) -> mtf.Tensor:
    """The adaptive-softmax loss without any full-vocabulary softmax.

    Each tail cluster scores the positions whose target it holds; the head scores every position,
    with targets in tail cluster i replaced by the head placeholder head_size + i.
    """
    loss = 0
    tail_cluster_masks = []
    for cluster in self._tail_clusters:
      cluster_mask = cluster.get_cluster_mask(targets)
      tail_cluster_masks.append(cluster_mask)
      if cluster.length_projection_factor == 1:
        targets_in_cluster = mtf.where(cluster_mask, targets, 0)
        hidden_in_cluster = mtf.where(cluster_mask, hidden, 0)
      else:
        targets_in_cluster = cluster.project_to_cluster_length(cluster_mask, targets)
        hidden_in_cluster = cluster.project_to_cluster_length(cluster_mask, hidden)
      loss += cluster.compute_loss(decoder, hidden_in_cluster, targets_in_cluster, context)
    head_targets = targets
    for i, mask in enumerate(tail_cluster_masks):
      head_targets = mtf.where(mask, self._head_cluster.end_token_id + i, head_targets)
    return loss + self._head_cluster.compute_loss(decoder, hidden, head_targets, context)


@gin.configurable(module=GIN_MODULE)
def adaptive_softmax_loss_fn(decoder, context, logits: mtf.Tensor, targets: mtf.Tensor,
                             output_vocab_dim: mtf.Dimension) -> mtf.Tensor:
  """Unitransformer loss_fn for an AdaptiveSoftmaxVocabEmbedding shared embedding.

  `logits` is the hidden state in training (see hidden_to_logits); the embedding must be the
  model's shared one, context.shared_params["embedding"].
  """
  del output_vocab_dim
  vocab_embedding = (context.shared_params or {}).get("embedding")
  if not hasattr(vocab_embedding, "compute_loss"):
    raise ValueError("adaptive_softmax_loss_fn: context.shared_params['embedding'] is "
                     f"{type(vocab_embedding).__name__}, not an AdaptiveSoftmaxVocabEmbedding; pass the "
                     "embedding in shared_params (Bitransformer shares it) with get_vocab_embedding_cls.cls "
                     "= @AdaptiveSoftmaxVocabEmbedding and shared_embedding_and_softmax_weights = True.")
  return vocab_embedding.compute_loss(decoder, hidden=logits, targets=targets, context=context)
