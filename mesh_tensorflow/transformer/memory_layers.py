"""Product-key memory layer (Lample et al. 2019, "Large Memory Layers with Product Keys").

A query is split into two halves; each half is scored against its own n_keys sub-keys, and the
top-knn of each half combine into knn^2 candidate keys out of n_keys^2 (the Cartesian product),
of which the best knn select value vectors. Memory size grows as n_keys^2 while scoring costs
about 2 * n_keys per query.
"""

from __future__ import annotations

from typing import Tuple

import gin

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer

GIN_MODULE = "mesh_tensorflow.transformer.memory_layers"


@gin.configurable(module=GIN_MODULE)
class ProductKeyValueMemory(transformer.TransformerLayer):
  """Memory layer with n_keys^2 values addressed by product keys, in n_heads independent heads.

  Variables: `keys` [n_heads, product_key(2), n_keys, key(key_size // 2)], `values` [n_values
  (n_keys^2), d_model], the query projection `query/kernel` [d_model, n_heads, product_key, key]
  and `query/bias`, and the query layer norm (`layer_prepostprocess/layer_norm/...`). The output
  is the softmax(score)-weighted sum of the knn selected values, summed over heads.
  """

  def __init__(self, key_size: int = gin.REQUIRED, n_keys: int = gin.REQUIRED, n_heads: int = gin.REQUIRED,
               knn: int = gin.REQUIRED):
    if not 0 < knn <= n_keys:
      raise ValueError(f"ProductKeyValueMemory: knn={knn} must be in [1, n_keys={n_keys}].")
    self.key_size = key_size
    self.n_keys = n_keys
    self.n_values = n_keys ** 2
    self.n_heads = n_heads
    self.knn = knn

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    """x [batch..., length, d_model] -> the same shape."""
    del losses
    n_key_dim = mtf.Dimension("n_keys", self.n_keys)
    n_value_dim = mtf.Dimension("n_values", self.n_values)
    key_dim = mtf.Dimension("key", self.key_size // 2)
    value_dim = x.shape.dims[-1]
    head_dim = mtf.Dimension("n_heads", self.n_heads)
    product_dim = mtf.Dimension("product_key", 2)
    keys = mtf.get_variable(context.mesh, name="keys",
                            shape=mtf.Shape([head_dim, product_dim, n_key_dim, key_dim]),
                            dtype=context.variable_dtype)
    values = mtf.layers.embedding_weights(context.mesh, vocab_dim=n_value_dim, output_dim=value_dim,
                                          variable_dtype=context.variable_dtype, name="values")
    query = mtf.layers.dense(x, [head_dim, product_dim, key_dim], reduced_dims=x.shape.dims[-1:],
                             use_bias=True, variable_dtype=context.variable_dtype,
                             name="query")  # [b, l, h, 2, k]
    # Layer norm (rather than the paper's batch norm) normalises the queries.
    query = mtf.layers.layer_norm(query, query.shape.dims[-1])
    scores, indices = self.get_indices(keys, query)  # [b, l, h, knn]
    scores = mtf.softmax(scores, reduced_dim=scores.shape.dims[-1])
    top_values = mtf.gather(values, indices, n_value_dim)  # [b, l, h, knn, d_model]
    return mtf.einsum([top_values, scores], reduced_dims=scores.shape.dims[-2:])

  def get_indices(self, keys: mtf.Tensor, query: mtf.Tensor) -> Tuple[mtf.Tensor, mtf.Tensor]:
    """The knn best (score, value index) pairs per query and head.

    keys [h, 2, n_keys, k], query [..., h, 2, k] -> scores and int32 indices [..., h, knn]; the
    index of the product key (i, j) is i * n_keys + j and its score is the sum of the halves'.
    """
    score_shape = mtf.Shape(query.shape.dims[:-1] + keys.shape.dims[2:3])
    scores = mtf.einsum([query, keys], output_shape=score_shape)  # [..., h, 2, n_keys]
    knn_dim = mtf.Dimension("knn", self.knn)
    scores, indices = mtf.top_k(scores, score_shape.dims[-1], knn_dim)  # [..., h, 2, knn]

    knn_square_dim = mtf.Dimension("knn_square_dim", self.knn ** 2)
    scores1, scores2 = mtf.unstack(scores, scores.shape.dims[-2])
    scores2 = mtf.rename_dimension(scores2, "knn", "knn2")
    out_shape = mtf.Shape(scores1.shape.dims + scores2.shape.dims[-1:])
    all_scores = mtf.add(scores1, scores2, output_shape=out_shape)
    all_scores = mtf.replace_dimensions(all_scores, out_shape[-2:], knn_square_dim)

    indices1, indices2 = mtf.unstack(indices, indices.shape.dims[-2])
    indices1 = mtf.multiply(indices1, self.n_keys)
    indices2 = mtf.rename_dimension(indices2, "knn", "knn2")
    all_indices = mtf.add(indices1, indices2, output_shape=out_shape)
    all_indices = mtf.replace_dimensions(all_indices, out_shape[-2:], knn_square_dim)

    scores, best = mtf.top_k(all_scores, all_scores.shape.dims[-1], knn_dim)
    return scores, mtf.gather(all_indices, best, knn_square_dim)
