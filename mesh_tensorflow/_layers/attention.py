"""Attention layers (full, incremental, local 1-D/2-D, memory-compressed) and attention masks.

Masks are additive biases: 0 where attention is allowed, -1e9 where it is not. Attention
variables are per-head projections `q`, `k`, `v`, `o` of shape [heads, io_channels, kv_channels]
(or one combined `qkvo` variable with a leading [qkvo=4] dim).
"""

from __future__ import annotations

from typing import Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow import ops_with_redefined_builtins as mtf

__all__ = [
    "dot_product_attention", "multihead_attention_vars", "multihead_attention_params",
    "multihead_attention", "multihead_self_attention_incremental",
    "multihead_encdec_attention_incremental", "masked_local_attention_1d",
    "masked_local_attention_1d_incremental", "local_self_attention_spatial_blocks",
    "local_2d_self_attention_spatial_blocks", "local_1d_halo_exchange", "local_2d_halo_exchange",
    "multihead_self_attention_memory_compressed", "compress_mean", "attention_mask_ignore_padding",
    "attention_mask_autoregressive", "attention_mask_same_segment", "attention_bias_local_block",
    "attention_bias_local_2d_block", "rename_length_to_memory_length",
]

_NEG_INF = -1e9


def dot_product_attention(q: mtf.Tensor, k: mtf.Tensor, v: mtf.Tensor, mask, is_training,
                          dropout: float = 0.0, dropout_broadcast_dims=None,
                          extra_logit=None) -> mtf.Tensor:
  """softmax(q . k + mask) . v over the memory-length dim (no 1/sqrt(depth) scaling here).

  Args:
    q: [..., length_q, depth_k] (length_q may be absent, e.g. when decoding one step).
    k: [..., length_kv, depth_k].
    v: [..., length_kv, depth_v].
    mask: additive bias broadcastable to the logits [..., length_q, length_kv], or None.
    is_training: dropout on the attention weights only applies when training.
    extra_logit: an extra logit, as if attending to an extra all-zero value.

  Returns:
    [..., length_q, depth_v].
  """
  length_kv = k.shape.dims[-2]
  logits = mtf.einsum([q, k], mtf.Shape(q.shape.dims[:-1] + [length_kv]))
  if mask is not None:
    logits += mtf.cast(mask, logits.dtype)
  weights = mtf.softmax(logits, length_kv, extra_logit=extra_logit)
  if dropout != 0.0:
    weights = mtf.dropout(weights, is_training, keep_prob=1.0 - dropout,
                          noise_shape=weights.shape - dropout_broadcast_dims)
  return mtf.einsum([weights, v], mtf.Shape(q.shape.dims[:-1] + [v.shape.dims[-1]]))


def multihead_attention_vars(mesh, heads, io_channels, kv_channels, master_dtype, slice_dtype,
                             activation_dtype) -> list:
  """[wq, wk, wv, wo], unstacked from one combined `qkvo` variable."""
  return multihead_attention_params(
      mesh, heads, io_channels, kv_channels,
      mtf.VariableDType(master_dtype, slice_dtype, activation_dtype), combine=True)


def multihead_attention_params(mesh, heads, io_channels, kv_channels, variable_dtype,
                               combine: bool = False) -> list:
  """Creates [wq, wk, wv, wo], each [heads, io_channels, kv_channels].

  Initial stddevs: q and k io^-0.5 * kv^-0.25, v io^-0.5, o (io * heads)^-0.5. With `combine`,
  one variable `qkvo` [qkvo=4, heads, io, kv] is created and unstacked; else variables q, k, v, o.
  """
  qk_stddev = (io_channels.size ** -0.5) * (kv_channels.size ** -0.25)
  v_stddev = io_channels.size ** -0.5
  o_stddev = (io_channels.size * heads.size) ** -0.5
  stddevs = [qk_stddev, qk_stddev, v_stddev, o_stddev]
  if combine:
    qkvo = mtf.Dimension("qkvo", 4)

    def qkvo_initializer(shape, dtype=None, partition_info=None, verify_shape=None):
      del partition_info, verify_shape
      dtype = dtype or tf.float32
      return tf.random_normal(shape, dtype=dtype) * tf.reshape(tf.cast(stddevs, dtype), [4, 1, 1, 1])

    var = mtf.get_variable(mesh, "qkvo", mtf.Shape([qkvo, heads, io_channels, kv_channels]),
                           initializer=qkvo_initializer, dtype=variable_dtype)
    return mtf.unstack(var, qkvo)
  return [mtf.get_variable(mesh, var_name, mtf.Shape([heads, io_channels, kv_channels]),
                           initializer=tf.random_normal_initializer(stddev=stddev), dtype=variable_dtype)
          for var_name, stddev in zip(["q", "k", "v", "o"], stddevs)]


def rename_length_to_memory_length(x: mtf.Tensor, length_name: str = "length",
                                   memory_length_name: str = "memory_length") -> mtf.Tensor:
  return mtf.rename_dimension(x, length_name, memory_length_name)


def multihead_attention(query_antecedent: mtf.Tensor, memory_antecedent, mask, kv_channels, heads,
                        is_training, dropout: float = 0.0, dropout_broadcast_dims=None,
                        master_dtype=tf.float32, slice_dtype=tf.float32,
                        name: str = "multihead_attention") -> mtf.Tensor:
  """Multi-head attention of query [batch..., length, io] over memory [batch..., memory_length, io].

  memory_antecedent None means self-attention (the query with `length` renamed `memory_length`).
  Variables: combined `<name>/qkvo`. Returns a Tensor of the query's shape.
  """
  batch_dims = query_antecedent.shape.dims[:-2]
  query_length, io_channels = query_antecedent.shape.dims[-2:]
  if memory_antecedent is None:
    memory_antecedent = rename_length_to_memory_length(query_antecedent, query_length.name)
  memory_length = memory_antecedent.shape.dims[-2]
  if memory_antecedent.shape.dims[:-2] != batch_dims:
    raise ValueError(f"multihead_attention: memory batch dims {memory_antecedent.shape.dims[:-2]} "
                     f"differ from query batch dims {batch_dims}; both are [batch..., length, io].")
  if memory_antecedent.shape.dims[-1] != io_channels:
    raise ValueError(f"multihead_attention: memory channels {memory_antecedent.shape.dims[-1]} differ "
                     f"from query channels {io_channels}; project the memory to {io_channels} first.")
  with tf.variable_scope(name, default_name="multihead_attention"):
    wq, wk, wv, wo = multihead_attention_vars(query_antecedent.mesh, heads, io_channels, kv_channels,
                                              master_dtype, slice_dtype, query_antecedent.dtype)
    q = mtf.einsum([query_antecedent, wq], mtf.Shape(batch_dims + [heads, query_length, kv_channels]))
    kv_shape = mtf.Shape(batch_dims + [heads, memory_length, kv_channels])
    k = mtf.einsum([memory_antecedent, wk], kv_shape)
    v = mtf.einsum([memory_antecedent, wv], kv_shape)
    o = dot_product_attention(q, k, v, mask, is_training, dropout, dropout_broadcast_dims)
    return mtf.einsum([o, wo], query_antecedent.shape)


def _write_at_step(new: mtf.Tensor, prev: mtf.Tensor, step_num, length_dim) -> mtf.Tensor:
  """prev with position `step_num` along length_dim replaced by `new` (new lacks length_dim)."""
  at_step = mtf.one_hot(step_num, length_dim, dtype=prev.dtype)
  return prev * (1.0 - at_step) + mtf.multiply(new, at_step, output_shape=prev.shape)


def multihead_self_attention_incremental(query_antecedent: mtf.Tensor, prev_k: mtf.Tensor,
                                         prev_v: mtf.Tensor, step_num, master_dtype, slice_dtype,
                                         name: str = "multihead_attention") -> tuple:
  """One decoding step of self-attention.

  Args:
    query_antecedent: [batch..., io_channels], the current position.
    prev_k, prev_v: [batch..., heads, memory_length, kv_channels] caches.
    step_num: scalar int Tensor, the current position.

  Returns:
    (y [batch..., io_channels], new k cache, new v cache).
  """
  batch_dims = query_antecedent.shape.dims[:-1]
  io_channels = query_antecedent.shape.dims[-1]
  heads, memory_length, kv_channels = prev_k.shape.dims[-3:]
  with tf.variable_scope(name, default_name="multihead_attention"):
    wq, wk, wv, wo = multihead_attention_vars(query_antecedent.mesh, heads, io_channels, kv_channels,
                                              master_dtype, slice_dtype, query_antecedent.dtype)
    step_shape = mtf.Shape(batch_dims + [heads, kv_channels])
    q = mtf.einsum([query_antecedent, wq], step_shape)
    k = _write_at_step(mtf.einsum([query_antecedent, wk], step_shape), prev_k, step_num, memory_length)
    v = _write_at_step(mtf.einsum([query_antecedent, wv], step_shape), prev_v, step_num, memory_length)
    future = mtf.greater(mtf.range(query_antecedent.mesh, memory_length, dtype=tf.int32), step_num)
    mask = mtf.cast(future, q.dtype) * _NEG_INF
    o = dot_product_attention(q, k, v, mask, is_training=False)
    return mtf.einsum([o, wo], query_antecedent.shape), k, v


def multihead_encdec_attention_incremental(query_antecedent: mtf.Tensor, wq, wo, k, v, mask,
                                           name: str = "multihead_attention") -> mtf.Tensor:
  """One decoding step of encoder-decoder attention over precomputed k, v [batch..., heads, len, kv]."""
  heads, _, kv_channels = k.shape.dims[-3:]
  query_dims = query_antecedent.shape.dims[:-1]
  with tf.variable_scope(name, default_name="multihead_attention"):
    q = mtf.einsum([query_antecedent, wq], mtf.Shape(query_dims + [heads, kv_channels]))
    o = dot_product_attention(q, k, v, mask, is_training=False)
    return mtf.einsum([o, wo], query_antecedent.shape)


def _local_block_length(window_size: int, length_per_split: int) -> int:
  """The largest divisor of length_per_split that is at most max(window_size, 128)."""
  block_length = min(max(window_size, 128), length_per_split)
  while length_per_split % block_length:
    block_length -= 1
  return block_length


def masked_local_attention_1d(x: mtf.Tensor, kv_channels, heads, is_training, window_size: int = 128,
                              master_dtype=tf.float32, slice_dtype=tf.float32,
                              length_per_split: Optional[int] = None, return_kv: Optional[list] = None,
                              params=None, name: Optional[str] = None) -> mtf.Tensor:
  """Causal local self-attention: position p attends to positions (p - window_size, p].

  The length is cut into blocks (`query_block_length` / `memory_block_length`, the block count
  keeping the length dim's name so it is split like the length); each block's keys and values
  are extended by the previous window_size positions with a left halo exchange. Positions before
  the start see zero keys/values.

  Args:
    x: [batch..., length, io_channels].
    length_per_split: length held by each processor, if the length dim is split (blocks must
      not straddle processors).
    return_kv: if a list, the full-length k and v ([batch..., heads, length, kv]) are appended.
    params: optional (wq, wk, wv, wo), else a `qkvo` variable is created.

  Returns:
    a Tensor of x's shape.
  """
  del is_training  # no dropout in this layer
  batch_dims = x.shape.dims[:-2]
  length, io_channels = x.shape.dims[-2:]
  with tf.variable_scope(name, default_name="masked_local_attention_1d"):
    if params is None:
      params = multihead_attention_vars(x.mesh, heads, io_channels, kv_channels, master_dtype,
                                        slice_dtype, x.dtype)
    wq, wk, wv, wo = params
    qkv_shape = mtf.Shape(batch_dims + [heads, length, kv_channels])
    q = mtf.einsum([x, wq], qkv_shape)
    k = mtf.einsum([x, wk], qkv_shape)
    v = mtf.einsum([x, wv], qkv_shape)
    if return_kv is not None:
      return_kv.extend([k, v])
    block_length = _local_block_length(window_size, length_per_split or length.size)
    num_blocks = mtf.Dimension(length.name, length.size // block_length)
    query_block = mtf.Dimension("query_block_length", block_length)
    memory_block = mtf.Dimension("memory_block_length", block_length)
    q = mtf.reshape(q, mtf.Shape(batch_dims + [heads, num_blocks, query_block, kv_channels]))
    kv_block_shape = mtf.Shape(batch_dims + [heads, num_blocks, memory_block, kv_channels])
    k = mtf.left_halo_exchange(mtf.reshape(k, kv_block_shape), num_blocks, memory_block, window_size)
    v = mtf.left_halo_exchange(mtf.reshape(v, kv_block_shape), num_blocks, memory_block, window_size)
    # Memory position m (0 = window_size steps before the block) is visible from query position
    # q iff q - window_size < m - window_size <= q.
    padded_memory_block = mtf.Dimension(memory_block.name, window_size + block_length)
    mpos = mtf.range(x.mesh, padded_memory_block, tf.int32)
    qpos = mtf.range(x.mesh, query_block, tf.int32) + window_size
    hidden = mtf.logical_or(mtf.greater(mpos, qpos), mtf.less_equal(mpos, qpos - window_size))
    mask = mtf.cast(hidden, x.dtype) * _NEG_INF
    o = dot_product_attention(q, k, v, mask, is_training=False)
    o = mtf.reshape(o, qkv_shape)
    return mtf.einsum([o, wo], x.shape)


def masked_local_attention_1d_incremental(x: mtf.Tensor, prev_k: mtf.Tensor, prev_v: mtf.Tensor,
                                          step_num, master_dtype=None, slice_dtype=None, params=None,
                                          name: Optional[str] = None) -> tuple:
  """One decoding step of masked_local_attention_1d, with ring-buffer k/v caches.

  Args:
    x: [batch..., io_channels].
    prev_k, prev_v: [batch..., heads, window_length, kv_channels]; step t writes slot
      t % window_length.
    step_num: scalar int Tensor.

  Returns:
    (y [batch..., io_channels], new k cache, new v cache).
  """
  batch_dims = x.shape.dims[:-1]
  io_channels = x.shape.dims[-1]
  heads, window_length, kv_channels = prev_k.shape.dims[-3:]
  with tf.variable_scope(name, default_name="masked_local_attention_1d"):
    if params is None:
      params = multihead_attention_vars(x.mesh, heads, io_channels, kv_channels, master_dtype,
                                        slice_dtype, x.dtype)
    wq, wk, wv, wo = params
    step_shape = mtf.Shape(batch_dims + [heads, kv_channels])
    q = mtf.einsum([x, wq], step_shape)
    slot = mtf.mod(step_num, window_length.size)
    k = _write_at_step(mtf.einsum([x, wk], step_shape), prev_k, slot, window_length)
    v = _write_at_step(mtf.einsum([x, wv], step_shape), prev_v, slot, window_length)
    o = dot_product_attention(q, k, v, None, is_training=False)
    return mtf.einsum([o, wo], x.shape), k, v


def _halo_or_pad(x: mtf.Tensor, blocks_dim, block_dim, halo_size: int, left_only: bool) -> mtf.Tensor:
  """Extends each block along block_dim by halo_size from its neighbours (zeros beyond the edge)."""
  if halo_size == 0:
    return x
  if blocks_dim is None:
    return mtf.pad(x, [halo_size, 0 if left_only else halo_size], block_dim.name)
  if left_only:
    return mtf.left_halo_exchange(x, blocks_dim, block_dim, halo_size)
  return mtf.halo_exchange(x, blocks_dim, block_dim, halo_size)


def local_1d_halo_exchange(k: mtf.Tensor, v: mtf.Tensor, num_w_blocks, w_dim, mask_right: bool) -> tuple:
  """Gives each w block of k and v its left (and, unless mask_right, right) neighbour block."""
  return tuple(_halo_or_pad(t, num_w_blocks, w_dim, w_dim.size, mask_right) for t in (k, v))


def local_2d_halo_exchange(k: mtf.Tensor, v: mtf.Tensor, num_h_blocks, h_dim, num_w_blocks, w_dim,
                           mask_right: bool) -> tuple:
  """Like local_1d_halo_exchange along h, then along w (so corner blocks come along too)."""
  for blocks_dim, block_dim in [(num_h_blocks, h_dim), (num_w_blocks, w_dim)]:
    k, v = (_halo_or_pad(t, blocks_dim, block_dim, block_dim.size, mask_right) for t in (k, v))
  return k, v


def _memory_dim(query_dim, memory_dim) -> mtf.Dimension:
  name = memory_dim.name if memory_dim is not None else "memory_" + query_dim.name
  return mtf.Dimension(name, query_dim.size)


def local_self_attention_spatial_blocks(query_antecedent: mtf.Tensor, kv_channels, heads, is_training,
                                        memory_w_dim=None, mask_right: bool = False,
                                        master_dtype=tf.float32, slice_dtype=tf.float32,
                                        name: Optional[str] = None) -> mtf.Tensor:
  """Self-attention within each w block and its neighbour blocks.

  Args:
    query_antecedent: [batch, num_w_blocks, w_dim, io_channels].
    memory_w_dim: the name for the memory width dim (default "memory_" + w_dim.name).
    mask_right: causal: attend to the previous block and earlier positions of the same block.

  Returns:
    a Tensor of query_antecedent's shape.
  """
  del is_training  # no dropout in this layer
  batch, num_w_blocks = query_antecedent.shape.dims[:2]
  w_dim, io_channels = query_antecedent.shape.dims[-2:]
  with tf.variable_scope(name, default_name="multihead_attention"):
    wq, wk, wv, wo = multihead_attention_vars(query_antecedent.mesh, heads, io_channels, kv_channels,
                                              master_dtype, slice_dtype, query_antecedent.dtype)
    memory_w_dim = _memory_dim(w_dim, memory_w_dim)
    memory_antecedent = mtf.rename_dimension(query_antecedent, w_dim.name, memory_w_dim.name)
    q = mtf.einsum([query_antecedent, wq], mtf.Shape([batch, heads, num_w_blocks, w_dim, kv_channels]))
    kv_shape = mtf.Shape([batch, heads, num_w_blocks, memory_w_dim, kv_channels])
    k = mtf.einsum([memory_antecedent, wk], kv_shape)
    v = mtf.einsum([memory_antecedent, wv], kv_shape)
    k, v = local_1d_halo_exchange(k, v, num_w_blocks, memory_w_dim, mask_right)
    mask = None
    if mask_right:
      mask = attention_bias_local_block(query_antecedent.mesh, w_dim, memory_w_dim)
    o = dot_product_attention(q, k, v, mask, is_training=False)
    return mtf.einsum([o, wo], query_antecedent.shape)


def local_2d_self_attention_spatial_blocks(query_antecedent: mtf.Tensor, kv_channels, heads,
                                           is_training, memory_h_dim=None, memory_w_dim=None,
                                           mask_right: bool = False, master_dtype=tf.float32,
                                           slice_dtype=tf.float32, name: Optional[str] = None) -> mtf.Tensor:
  """Self-attention within each (h, w) block and its neighbour blocks.

  Args:
    query_antecedent: [batch, num_h_blocks, num_w_blocks, h_dim, w_dim, io_channels].
    memory_h_dim, memory_w_dim: names for the memory dims (default "memory_" + query dim name).
    mask_right: causal in raster order: attend to the blocks above and to the left, and to
      earlier positions (rows above; same row, columns left) of the same block.

  Returns:
    a Tensor of query_antecedent's shape.
  """
  del is_training  # no dropout in this layer
  batch, num_h_blocks, num_w_blocks = query_antecedent.shape.dims[:3]
  h_dim, w_dim, io_channels = query_antecedent.shape.dims[-3:]
  with tf.variable_scope(name, default_name="multihead_attention"):
    wq, wk, wv, wo = multihead_attention_vars(query_antecedent.mesh, heads, io_channels, kv_channels,
                                              master_dtype, slice_dtype, query_antecedent.dtype)
    memory_h_dim = _memory_dim(h_dim, memory_h_dim)
    memory_w_dim = _memory_dim(w_dim, memory_w_dim)
    memory_antecedent = mtf.rename_dimension(query_antecedent, h_dim.name, memory_h_dim.name)
    memory_antecedent = mtf.rename_dimension(memory_antecedent, w_dim.name, memory_w_dim.name)
    blocks = [batch, heads, num_h_blocks, num_w_blocks]
    q = mtf.einsum([query_antecedent, wq], mtf.Shape(blocks + [h_dim, w_dim, kv_channels]))
    kv_shape = mtf.Shape(blocks + [memory_h_dim, memory_w_dim, kv_channels])
    k = mtf.einsum([memory_antecedent, wk], kv_shape)
    v = mtf.einsum([memory_antecedent, wv], kv_shape)
    k, v = local_2d_halo_exchange(k, v, num_h_blocks, memory_h_dim, num_w_blocks, memory_w_dim,
                                  mask_right)
    # dot_product_attention wants one memory dim: flatten (memory_h, memory_w) per block.
    memory_h_dim, memory_w_dim = k.shape.dims[-3:-1]
    memory = mtf.Dimension("memory_length", memory_h_dim.size * memory_w_dim.size)
    k, v = (mtf.replace_dimensions(t, [memory_h_dim, memory_w_dim], memory) for t in (k, v))
    mask = None
    if mask_right:
      mask = attention_bias_local_2d_block(query_antecedent.mesh, h_dim, w_dim, memory_h_dim,
                                           memory_w_dim)
      mask = mtf.replace_dimensions(mask, [memory_h_dim, memory_w_dim], memory)
    o = dot_product_attention(q, k, v, mask, is_training=False)
    return mtf.einsum([o, wo], query_antecedent.shape)


def compress_mean(x: mtf.Tensor, dim, compression_factor: int) -> mtf.Tensor:
  """Means of consecutive groups of `compression_factor` along dim (which keeps its name)."""
  dims = x.shape.dims
  if dim not in dims or dim.size % compression_factor:
    raise ValueError(f"compress_mean: dim {dim} must be a dim of {x.shape} with a size divisible "
                     f"by compression_factor={compression_factor}.")
  pos = dims.index(dim)
  group_dim = mtf.Dimension("compression_factor", compression_factor)
  grouped = mtf.Shape(dims[:pos] + [mtf.Dimension(dim.name, dim.size // compression_factor), group_dim]
                      + dims[pos + 1:])
  return mtf.reduce_mean(mtf.reshape(x, grouped), reduced_dim=group_dim)


def multihead_self_attention_memory_compressed(x: mtf.Tensor, mask_right: bool, compression_factor: int,
                                               kv_channels, heads, is_training, dropout: float = 0.0,
                                               dropout_broadcast_dims=None, master_dtype=tf.float32,
                                               slice_dtype=tf.float32,
                                               name: str = "multihead_attention") -> mtf.Tensor:
  """Self-attention over a memory made `compression_factor` times shorter by group means.

  Args:
    x: [batch..., length, io_channels].
    mask_right: causal: a compressed position is visible once its whole group is in the past.

  Returns:
    a Tensor of x's shape. There is an extra zero logit, so a query may attend to nothing.
  """
  batch_dims = x.shape.dims[:-2]
  length, io_channels = x.shape.dims[-2:]
  with tf.variable_scope(name, default_name="compressed_attention"):
    wq, wk, wv, wo = multihead_attention_vars(x.mesh, heads, io_channels, kv_channels, master_dtype,
                                              slice_dtype, x.dtype)
    memory_antecedent = rename_length_to_memory_length(
        compress_mean(x, length, compression_factor), length.name)
    memory_length = memory_antecedent.shape.dims[-2]
    q = mtf.einsum([x, wq], mtf.Shape(batch_dims + [heads, length, kv_channels]))
    kv_shape = mtf.Shape(batch_dims + [heads, memory_length, kv_channels])
    k = mtf.einsum([memory_antecedent, wk], kv_shape)
    v = mtf.einsum([memory_antecedent, wv], kv_shape)
    mask = None
    if mask_right:
      query_pos = mtf.range(x.mesh, length, dtype=tf.int32)
      memory_pos = (mtf.range(x.mesh, memory_length, dtype=tf.int32) * compression_factor
                    + (compression_factor - 1))
      mask = mtf.cast(mtf.greater(memory_pos, query_pos), x.dtype) * _NEG_INF
    o = dot_product_attention(q, k, v, mask, is_training, dropout, dropout_broadcast_dims,
                              extra_logit=0.0)
    return mtf.einsum([o, wo], x.shape)


def attention_mask_ignore_padding(inputs: mtf.Tensor, dtype=tf.float32) -> mtf.Tensor:
  """Bias hiding padding (id 0) of `inputs` [..., length], as [..., memory_length]."""
  inputs = rename_length_to_memory_length(inputs)
  return mtf.cast(mtf.equal(inputs, 0), dtype) * _NEG_INF


def attention_mask_autoregressive(query_pos: mtf.Tensor, dtype=tf.float32) -> mtf.Tensor:
  """Bias hiding later positions: from positions [..., length] to [..., length, memory_length]."""
  memory_pos = rename_length_to_memory_length(query_pos)
  return mtf.cast(mtf.less(query_pos, memory_pos), dtype) * _NEG_INF


def attention_mask_same_segment(query_segment: mtf.Tensor, memory_segment=None,
                                dtype=tf.float32) -> mtf.Tensor:
  """Bias hiding other segments: [..., length] (and [..., length] memory) -> [..., length, memory_length]."""
  if memory_segment is None:
    memory_segment = query_segment
  memory_segment = rename_length_to_memory_length(memory_segment)
  return mtf.cast(mtf.not_equal(query_segment, memory_segment), dtype) * _NEG_INF


def attention_bias_local_block(mesh, block_length, memory_length, dtype=tf.int32) -> mtf.Tensor:
  """Causal bias for a block attending to [previous block, itself] (see local_1d_halo_exchange).

  Returns:
    float32 [block_length, memory_length] with memory_length of size 2 * block_length (named
    `memory_length.name`): the previous block is visible, the own block up to the query position.
  """
  memory_length = mtf.Dimension(memory_length.name, 2 * block_length.size)
  qpos = mtf.range(mesh, block_length, dtype=dtype)
  mpos = mtf.range(mesh, memory_length, dtype=dtype) - block_length.size
  return mtf.cast(mtf.less(qpos, mpos), tf.float32) * _NEG_INF


def attention_bias_local_2d_block(mesh, h_dim, w_dim, memory_h_dim, memory_w_dim,
                                  dtype=tf.int32) -> mtf.Tensor:
  """Raster-order causal bias for a 2-D block attending to the blocks above/left and itself.

  Memory dims (named like memory_h_dim / memory_w_dim) have twice the block sizes: the halo
  from the previous block comes first (see local_2d_halo_exchange with mask_right). A memory
  position is hidden iff its row is below the query's, or it is in the query's row to its right.

  Returns:
    float32 [h_dim, w_dim, memory_h, memory_w].
  """
  memory_h = mtf.Dimension(memory_h_dim.name, 2 * h_dim.size)
  memory_w = mtf.Dimension(memory_w_dim.name, 2 * w_dim.size)
  qh = mtf.range(mesh, h_dim, dtype=dtype)
  qw = mtf.range(mesh, w_dim, dtype=dtype)
  mh = mtf.range(mesh, memory_h, dtype=dtype) - h_dim.size
  mw = mtf.range(mesh, memory_w, dtype=dtype) - w_dim.size
  out_shape = mtf.Shape([h_dim, w_dim, memory_h, memory_w])
  row_below = mtf.cast(mtf.less(qh, mh), tf.float32)
  right_in_row = mtf.multiply(mtf.cast(mtf.equal(qh, mh), tf.float32),
                              mtf.cast(mtf.less(qw, mw), tf.float32), output_shape=out_shape)
  return mtf.add(row_below, right_in_row, output_shape=out_shape) * _NEG_INF
