"""Attention for the Transformer package: dot-product, hybrid, synthetic and local 1-D attention,
and `AttentionParams` (the q/k/v/o projection variables).

All functions work with named dimensions: q has [other dims..., key_dim], k has [memory dims...,
memory_length_dim, key_dim], v has [memory dims..., memory_length_dim, value_dim]; the output has
q's dims with key_dim replaced by value_dim.
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf


def _is_training(context) -> bool:
  """Dropout applies in training; with no context (0.1.18 callers), always."""
  return True if context is None else context.train


def _dropout(weights: mtf.Tensor, context, dropout_rate: float, dropout_broadcast_dims) -> mtf.Tensor:
  if not dropout_rate:
    return weights
  noise_shape = weights.shape - (dropout_broadcast_dims or [])
  return mtf.dropout(weights, _is_training(context), rate=dropout_rate, noise_shape=noise_shape)


def attention(q: mtf.Tensor, k: mtf.Tensor, v: mtf.Tensor, memory_length_dim, key_dim, value_dim, bias=None,
              dropout_rate: float = 0.0, dropout_broadcast_dims=None, extra_logit=None, context=None,
              float32_logits: bool = True, z_loss_coeff: Optional[float] = None) -> mtf.Tensor:
  """softmax(q.k + bias over memory_length_dim) . v.

  Args:
    q, k, v: see the module docstring.
    memory_length_dim: the softmax dimension.
    key_dim, value_dim: channels of q/k and of v.
    bias: optional Tensor added to the logits (e.g. -1e9 where not visible).
    dropout_rate: dropout on the attention weights; applied when context.train, or always when
      context is None (as in release 0.1.18, whose callers pass no context).
    dropout_broadcast_dims: dims along which the dropout mask is shared.
    extra_logit: an optional scalar: an extra always-present logit (attend to nothing).
    context: optional transformer Context (training mode, 2-D sharding of the attention).
    float32_logits: compute logits and softmax in float32.
    z_loss_coeff: if set (and context.train), appends to context.losses z_loss_coeff times the
      mean over non-padding positions of logsumexp(logits)**2, pulling the logits toward zero.
  Returns:
    a Tensor with q's shape, key_dim replaced by value_dim.
  """
  orig_q_shape = q.shape
  q, k, v, bias = maybe_reshape_attention_input_for_2d_sharding(context, q, k, v, bias, [key_dim, value_dim])
  if float32_logits:
    k = mtf.cast(k, tf.float32)
    q = mtf.cast(q, tf.float32)
  logits = mtf.layers.us_einsum([q, k], reduced_dims=[key_dim])
  if bias is not None:
    logits += mtf.cast(bias, logits.dtype)
  if z_loss_coeff is not None and context is not None and context.train:
    _add_z_loss(logits, memory_length_dim, context, z_loss_coeff, v.dtype)
  weights = mtf.cast(mtf.softmax(logits, memory_length_dim, extra_logit=extra_logit), v.dtype)
  weights = _dropout(weights, context, dropout_rate, dropout_broadcast_dims)
  outputs = mtf.einsum([weights, v], q.shape - key_dim + value_dim)
  return _undo_2d_reshape(outputs, orig_q_shape - key_dim + value_dim)


def _add_z_loss(logits: mtf.Tensor, memory_length_dim, context, z_loss_coeff: float, dtype) -> None:
  """Appends z_loss_coeff * mean(logsumexp(logits)**2 * nonpadding) to context.losses."""
  log_z = mtf.reduce_logsumexp(logits, memory_length_dim)
  z_loss = mtf.square(log_z)
  nonpadding = context.nonpadding  # None or 1 when nothing is padding
  if isinstance(nonpadding, mtf.Tensor):
    z_loss *= mtf.cast(nonpadding, log_z.dtype)
  z_loss = mtf.reduce_mean(z_loss)
  if context.num_microbatches and context.num_microbatches > 1:
    z_loss /= context.num_microbatches
  mtf.scalar_summary("attention_z_loss", z_loss)
  context.losses.append(mtf.cast(z_loss * z_loss_coeff, dtype))


def hybrid_attention(q: mtf.Tensor, k: mtf.Tensor, v: mtf.Tensor, context, memory_length_dim, key_dim,
                     value_dim, bias=None, dropout_rate: float = 0.0, dropout_broadcast_dims=None,
                     extra_logit=None) -> mtf.Tensor:
  """A learned mix of softmax attention and doubly-normalised attention (self-attention only).

  The doubly-normalised weights are softmax over memory of log_softmax over queries; the mix
  coefficient is the variable `doubly_coeff` (initially 0.5, clipped to [0, 1]). Queries are
  along `length`, which must have memory_length_dim's size.
  """
  logits = mtf.layers.us_einsum([q, k], reduced_dims=[key_dim])
  if bias is not None:
    logits += bias
  query_length_dim = mtf.Dimension("length", memory_length_dim.size)
  if query_length_dim not in logits.shape.dims:
    raise ValueError(f"hybrid_attention: the logits {logits.shape} need a query dimension {query_length_dim} "
                     f"(self-attention, queries and memory of the same length).")
  doubly_coeff = mtf.get_variable(context.mesh, "doubly_coeff", [], initializer=tf.constant_initializer(0.5),
                                  dtype=context.variable_dtype)
  doubly_coeff = mtf.maximum(mtf.minimum(doubly_coeff, 1.), 0.)
  upper_weights = mtf.softmax(logits, memory_length_dim, extra_logit=extra_logit)
  lower_log_weights = mtf.log_softmax(logits, query_length_dim, extra_logit=extra_logit)
  doubly_weights = mtf.softmax(lower_log_weights, memory_length_dim, extra_logit=extra_logit)
  weights = doubly_coeff * doubly_weights + (1. - doubly_coeff) * upper_weights
  weights = _dropout(weights, context, dropout_rate, dropout_broadcast_dims)
  return mtf.einsum([weights, v], q.shape - key_dim + value_dim)


_SYNTHESIZE_MODES = ("random", "factorized", "dense_minus", "random_plus_alpha", "random_plus",
                     "dense_plus_alpha", "dense_plus")
_SYNTHESIZER_TABLE_LENGTH = 512  # 0.1.21's fixed table length outside "random" and "dense_minus"


def _query_positions(table: mtf.Tensor, q: mtf.Tensor, memory_length_dim, context) -> mtf.Tensor:
  """A [..., length, ..., memory_length] table cut to the memory and to the queries' positions.

  "incremental": the row of context.position (the query has no length dim); otherwise the
  first rows, as many as q's length (a table without a length dim is only cut along memory).
  """
  table = mtf.slice(table, 0, memory_length_dim.size, memory_length_dim.name)
  if "length" not in table.shape.dimension_names:
    return table
  if context.mode == "incremental":
    return mtf.gather(table, context.position, table.shape.get_dim_by_name("length"))
  return mtf.slice(table, 0, q.shape.get_dim_by_name("length").size, "length")


def _random_table(q: mtf.Tensor, v: mtf.Tensor, memory_length_dim, context, synthesize_mode: str,
                  factorized_dim: int, max_length: int) -> mtf.Tensor:
  """The learned [length, heads, memory_length] logits: variable `R`, or the product of `R1` and `R2`.

  "factorized" (as 0.1.21): R1, R2 are [tmp=factorized_dim, heads, memory_length=512] and the table
  is sum_tmp R1 * R2, the same for every query position. Initializer: glorot-uniform (TF's default).
  """
  heads = v.shape.get_dim_by_name("heads")
  table_length = max_length if synthesize_mode == "random" else _SYNTHESIZER_TABLE_LENGTH
  table_shape = mtf.Shape([mtf.Dimension("length", table_length), heads,
                           mtf.Dimension("memory_length", table_length)])
  if synthesize_mode == "factorized":
    factor_shape = mtf.Shape([mtf.Dimension("tmp", factorized_dim), heads,
                              mtf.Dimension("memory_length", _SYNTHESIZER_TABLE_LENGTH)])
    r1, r2 = [mtf.get_variable(context.mesh, name, factor_shape, initializer=None,
                               dtype=context.variable_dtype) for name in ("R1", "R2")]
    table = mtf.broadcast(mtf.reduce_sum(r1 * r2, reduced_dim=factor_shape.dims[0]), table_shape)
  else:
    table = mtf.get_variable(context.mesh, "R", table_shape, initializer=None, dtype=context.variable_dtype)
  return _query_positions(table, q, memory_length_dim, context)


def _dense_table(q: mtf.Tensor, key_dim, memory_length_dim, context, table_length: int) -> mtf.Tensor:
  """Logits predicted from each query: relu(q) times the variable `pi/kernel` [key, memory_length]."""
  logits = mtf.layers.dense(mtf.relu(q), [mtf.Dimension("memory_length", table_length)], use_bias=False,
                            name="pi", reduced_dims=[key_dim], variable_dtype=None)
  return _query_positions(logits, q, memory_length_dim, context)


def synthetic_attention(q: mtf.Tensor, k: mtf.Tensor, v: mtf.Tensor, memory_length_dim, key_dim, value_dim,
                        bias=None, dropout_rate: float = 0.0, dropout_broadcast_dims=None, extra_logit=None,
                        synthesize: bool = True, synthesize_mode: str = "random_plus_alpha",
                        factorized_dim: int = 16, max_length: int = 512, context=None) -> mtf.Tensor:
  """Synthesizer attention (arXiv:2005.00743): logits learned per position pair or predicted from q.

  synthesize_mode (0.1.21's):
    "random": a learned table `R` [length=max_length, heads, memory_length=max_length];
    "factorized": `R1`, `R2` [tmp=factorized_dim, heads, memory_length=512] (see _random_table);
    "dense_minus": relu(q) times `pi/kernel` [key_dim, memory_length=max_length];
    "random_plus" / "dense_plus": q.k plus the "random" (512 long) or dense table;
    "..._plus_alpha": (1 - a) * q.k + a * table with a = sigmoid(`alpha` [alpha=1], zeros at start).
  "random", "factorized" and "dense_minus" ignore k; the first two take q only for its length
  (the Synthesizer layer passes x). Their output is [q's dims but the last, heads, value_dim]
  ("dense_minus": q's dims but the last, value_dim). The bias (masks) is added to the logits.
  synthesize=False is plain dot-product attention. "incremental" mode (context.mode) reads the
  table row of context.position.
  """
  if synthesize_mode not in _SYNTHESIZE_MODES:
    raise ValueError(f"synthetic_attention: synthesize_mode={synthesize_mode!r} is not one of "
                     f"{_SYNTHESIZE_MODES}.")
  if not synthesize:
    logits = mtf.layers.us_einsum([q, k], reduced_dims=[key_dim])
    outputs_shape = q.shape - key_dim + value_dim
  elif synthesize_mode in ("random", "factorized"):
    logits = _random_table(q, v, memory_length_dim, context, synthesize_mode, factorized_dim, max_length)
    outputs_shape = mtf.Shape(q.shape.dims[:-1] + [v.shape.get_dim_by_name("heads"), value_dim])
  elif synthesize_mode == "dense_minus":
    logits = _dense_table(q, key_dim, memory_length_dim, context, max_length)
    outputs_shape = mtf.Shape(q.shape.dims[:-1] + [value_dim])
  else:
    logits = mtf.einsum([q, k], reduced_dims=[key_dim])
    outputs_shape = q.shape - key_dim + value_dim
    if synthesize_mode.startswith("random"):
      table = _random_table(q, v, memory_length_dim, context, synthesize_mode, factorized_dim, max_length)
    else:
      table = _dense_table(q, key_dim, memory_length_dim, context, _SYNTHESIZER_TABLE_LENGTH)
    if synthesize_mode.endswith("alpha"):
      alpha = mtf.sigmoid(mtf.get_variable(context.mesh, "alpha", mtf.Shape([mtf.Dimension("alpha", 1)]),
                                           initializer=tf.zeros_initializer(), dtype=context.variable_dtype))
      logits = (1. - alpha) * logits + alpha * table
    else:
      logits += table
  if bias is not None:
    logits += bias
  weights = mtf.softmax(logits, memory_length_dim, extra_logit=extra_logit)
  weights = _dropout(weights, context, dropout_rate, dropout_broadcast_dims)
  return mtf.einsum([weights, v], outputs_shape)


def visibility_mask_to_attention_bias(visible: mtf.Tensor, dtype) -> mtf.Tensor:
  """0 where visible, -1e9 elsewhere."""
  return mtf.cast(mtf.logical_not(visible), dtype) * -1e9


def local_attention_1d(q: mtf.Tensor, k: mtf.Tensor, v: Optional[mtf.Tensor], length_dim, key_dim, value_dim,
                       fully_autoregressive: bool = True, length_dim_num_splits: int = 1, radius: int = 128,
                       sequence_id=1, write_priority=None, read_priority=None,
                       attention_kwargs: Optional[dict] = None) -> mtf.Tensor:
  """Attention of each position p to a window of positions around it along length_dim.

  Query p sees memory positions m with p - radius < m <= p (fully_autoregressive) or
  p - radius < m <= p + radius, in the same segment (equal sequence_id), and with
  read_priority[p] >= write_priority[m] when priorities are given. The length is cut into
  blocks, each of which sees its neighbours through a halo exchange, so the work is linear in
  the length and length_dim may be split over a mesh dimension.

  Args:
    q, k: Tensors with length_dim and key_dim; v: with length_dim and value_dim, or None (v = k).
    length_dim: the sequence Dimension (the same in q, k and v).
    length_dim_num_splits: how many ways length_dim is split (blocks must not straddle splits).
    radius: window radius.
    sequence_id: an int32 Tensor with length_dim, or an integer (one segment).
    write_priority, read_priority: optional int Tensors with length_dim.
    attention_kwargs: keyword arguments for attention() (dropout_rate, context, ...).
  Returns:
    a Tensor shaped like q with key_dim replaced by value_dim.
  """
  if length_dim.size % length_dim_num_splits:
    raise ValueError(f"local_attention_1d: {length_dim} does not divide into length_dim_num_splits="
                     f"{length_dim_num_splits} parts.")
  length_per_split = length_dim.size // length_dim_num_splits
  block_length = max(radius, 128)
  while length_per_split % block_length:
    block_length -= 1
  query_block_length = mtf.Dimension("query_block_length", block_length)
  memory_block_length = mtf.Dimension("memory_block_length", block_length)
  # The blocks dimension keeps the name of length_dim, so it is split like length_dim.
  num_blocks = mtf.Dimension(length_dim.name, length_dim.size // block_length)
  halo = mtf.left_halo_exchange if fully_autoregressive else mtf.halo_exchange

  def reshape_query(x):
    return mtf.replace_dimensions(x, length_dim, [num_blocks, query_block_length])

  def reshape_memory(x):
    x = mtf.replace_dimensions(x, length_dim, [num_blocks, memory_block_length])
    return halo(x, num_blocks, memory_block_length, radius)

  q = reshape_query(q)
  k = reshape_memory(k)
  v = k if v is None else reshape_memory(v)
  if not isinstance(sequence_id, mtf.Tensor) or length_dim not in sequence_id.shape.dims:
    sequence_id = sequence_id + mtf.zeros(q.mesh, [length_dim], tf.int32)
  # Memory segment ids are shifted by 1, so the zeros of the halo padding match no query.
  pos = mtf.range(q.mesh, length_dim, dtype=tf.int32)
  visible = mtf.equal(reshape_query(sequence_id) + 1, reshape_memory(sequence_id + 1))
  relative_position = reshape_memory(pos) - reshape_query(pos)
  visible = mtf.logical_and(visible, mtf.greater(relative_position, -radius))
  visible = mtf.logical_and(visible, mtf.less_equal(relative_position, 0 if fully_autoregressive else radius))
  if read_priority is not None:
    visible = mtf.logical_and(visible, mtf.greater_equal(reshape_query(read_priority),
                                                         reshape_memory(write_priority)))
  bias = visibility_mask_to_attention_bias(visible, q.dtype)
  padded_memory_block_length = k.shape.get_dim_by_name(memory_block_length.name)
  o = attention(q, k, v, padded_memory_block_length, key_dim, value_dim, bias, **(attention_kwargs or {}))
  return mtf.replace_dimensions(o, [num_blocks, query_block_length], length_dim)


def _mesh_axis(layout_rules, mesh_shape, dim) -> Optional[int]:
  return layout_rules.tensor_dimension_to_mesh_axis(dim, mesh_shape)


_UNSPLIT_INNER = "_attention_2d_inner"


def maybe_reshape_attention_input_for_2d_sharding(context, q: mtf.Tensor, k: mtf.Tensor, v: mtf.Tensor, bias,
                                                   unsplittable_dims) -> tuple:
  """Splits replicated attention work over an otherwise idle mesh dimension (2-D sharding).

  With a 2-D mesh where, say, d_model is split over one mesh dimension and heads over the other,
  q/k/v/logits do not contain d_model, so the attention would be computed redundantly over the
  first mesh dimension. This cuts a dimension of q (not in unsplittable_dims) into an outer part
  (same name) and an inner part that takes the name of a tensor dimension the layout maps to the
  idle mesh dimension, so the inner part is split over it. q, k, v and bias are reshaped alike;
  callers reshape the output back. Without a 2-D layout (context.model.layout/mesh_shape) the
  inputs are returned unchanged.
  """
  model = getattr(context, "model", None) if context is not None else None
  layout, mesh_shape = getattr(model, "layout", None), getattr(model, "mesh_shape", None)
  if not (isinstance(layout, (str, list, tuple, mtf.LayoutRules))
          and isinstance(mesh_shape, (str, list, mtf.Shape))):  # no layout given (or a mock context)
    return q, k, v, bias
  layout_rules = mtf.convert_to_layout_rules(layout)
  mesh_shape = mtf.convert_to_shape(mesh_shape)
  if mesh_shape.ndims != 2:
    return q, k, v, bias
  tensors = [t for t in (q, k, v, bias) if t is not None]
  all_names = {d.name for t in tensors for d in t.shape.dims}
  used_axes = {_mesh_axis(layout_rules, mesh_shape, d) for t in tensors for d in t.shape.dims}
  idle = [i for i in range(2) if i not in used_axes]
  if len(idle) != 1:
    return q, k, v, bias
  idle_dim = mesh_shape.dims[idle[0]]
  proxies = sorted(name for name in layout_rules.mesh_dimension_name_to_tensor_dimension_names(idle_dim.name)
                   if name not in all_names)
  if not proxies:
    return q, k, v, bias
  for d in q.shape.dims:
    if d in unsplittable_dims or any(d.name == u.name for u in unsplittable_dims):
      continue
    axis = _mesh_axis(layout_rules, mesh_shape, d)
    already = 1 if axis is None else mesh_shape.dims[axis].size
    if d.size % (idle_dim.size * already) == 0:
      outer = mtf.Dimension(d.name, d.size // idle_dim.size)
      # Two steps, so each reshape is a plain layout move: split off a replicated inner part,
      # then rename it to the proxy name (which slices it over the idle mesh dimension).
      unsplit_inner = mtf.Dimension(_UNSPLIT_INNER, idle_dim.size)

      def split(t, d=d, outer=outer, unsplit_inner=unsplit_inner):
        if t is None or d not in t.shape.dims:
          return t
        t = mtf.replace_dimensions(t, d, [outer, unsplit_inner])
        return mtf.rename_dimension(t, unsplit_inner.name, proxies[0])
      return split(q), split(k), split(v), split(bias)
  return q, k, v, bias


def _undo_2d_reshape(x: mtf.Tensor, shape: mtf.Shape) -> mtf.Tensor:
  """Inverse of the 2-D sharding reshape: gather the proxy dim back, then merge it into its dim."""
  for d in x.shape.dims:
    if d.name not in shape.dimension_names:
      x = mtf.rename_dimension(x, d.name, _UNSPLIT_INNER)
  return x if x.shape == shape else mtf.reshape(x, shape)


def _combined_dim(dims: Sequence[mtf.Dimension]) -> mtf.Dimension:
  """One dimension of the product size, named after the first: [heads:8, d_kv:64] -> heads:512."""
  return mtf.Dimension(dims[0].name, mtf.Shape(dims).size)


class AttentionParams:
  """The q, k, v (or shared kv) and o projection variables of an attention layer.

  With combine_dims, the variables are 2-D: q/k/v [d_model, heads*d_kv] and o
  [heads*d_kv, d_model], the combined dimension named like the first heads dim (so `heads:model`
  splits them by whole heads). Initial stddevs: q d_model^-0.5 (times d_kv^-0.5 if the 1/sqrt(d_kv)
  logit scaling is folded into it), k/v d_model^-0.5, o (heads*d_kv)^-0.5.
  """

  def __init__(self, mesh, query_input_dim, memory_input_dim, output_dim, key_dim, value_dim,
               query_heads_dims, memory_heads_dims, variable_dtype, shared_kv=False, no_query=False,
               combine_dims=True, ensemble_dim=None, keep_query_heads_dims=False,
               fold_scaling_into_initializer=True, make_attention_vars=True):
    if shared_kv and key_dim != value_dim:
      raise ValueError(f"AttentionParams: shared_kv needs key_dim == value_dim, "
                       f"got {key_dim} and {value_dim}.")
    self.mesh = mesh
    self.query_input_dim = query_input_dim
    self.memory_input_dim = memory_input_dim
    self.output_dim = output_dim
    self.key_dim = key_dim
    self.value_dim = value_dim
    self.query_heads_dims = list(query_heads_dims or [])
    self.memory_heads_dims = list(memory_heads_dims or [])
    self.variable_dtype = variable_dtype
    self.shared_kv = shared_kv
    self.no_query = no_query
    self.combine_dims = combine_dims
    self.keep_query_heads_dims = keep_query_heads_dims
    self.fold_scaling_into_initializer = fold_scaling_into_initializer
    self.make_attention_vars = make_attention_vars
    ensemble = [ensemble_dim] if ensemble_dim else []
    if combine_dims:
      self.q_shape = ensemble + [query_input_dim, _combined_dim(self.q_dims)]
      self.k_shape = ensemble + [memory_input_dim, _combined_dim(self.k_dims)]
      self.v_shape = ensemble + [memory_input_dim, _combined_dim(self.v_dims)]
      self.o_shape = ensemble + [_combined_dim(self.o_dims), output_dim]
    else:
      self.q_shape = ensemble + [query_input_dim] + self.q_dims
      self.k_shape = ensemble + [memory_input_dim] + self.k_dims
      self.v_shape = ensemble + [memory_input_dim] + self.v_dims
      self.o_shape = ensemble + self.o_dims + [output_dim]
    self.init_weights()

  def _initializers(self):
    if mtf.layers.unit_scaling_convention():
      init = tf.random_normal_initializer(stddev=1.0)
      return init, init, init
    q_stddev = self.query_input_dim.size ** -0.5
    if self.fold_scaling_into_initializer:
      q_stddev *= self.key_dim.size ** -0.5
    return (tf.random_normal_initializer(stddev=q_stddev),
            tf.random_normal_initializer(stddev=self.memory_input_dim.size ** -0.5),
            tf.random_normal_initializer(stddev=mtf.Shape(self.o_dims).size ** -0.5))

  def init_weights(self):
    """Creates the variables q, k, v (or kv) and o."""
    q_init, kv_init, o_init = self._initializers()

    def variable(name, shape, init):
      return mtf.get_variable(self.mesh, name, mtf.Shape(shape), initializer=init, dtype=self.variable_dtype)
    if self.make_attention_vars:
      if not self.no_query:
        self.wq = variable("q", self.q_shape, q_init)
      if self.shared_kv:
        self.wkv = variable("kv", self.k_shape, kv_init)
      else:
        self.wk = variable("k", self.k_shape, kv_init)
        self.wv = variable("v", self.v_shape, kv_init)
    self.wo = variable("o", self.o_shape, o_init)

  def _project(self, antecedent, weights, input_dim, dims):
    ret = mtf.layers.us_einsum([antecedent, weights], reduced_dims=[input_dim])
    if self.combine_dims:
      ret = mtf.replace_dimensions(ret, ret.shape.dims[-1], dims)
    return ret

  def compute_q(self, query_antecedent):
    ret = self._project(query_antecedent, self.wq, self.query_input_dim, self.q_dims)
    if not self.fold_scaling_into_initializer:
      ret *= self.key_dim.size ** -0.5
    return ret

  def compute_kv(self, memory_antecedent):
    if not self.shared_kv:
      raise ValueError("AttentionParams.compute_kv needs shared_kv=True; use compute_k and compute_v.")
    return self._project(memory_antecedent, self.wkv, self.memory_input_dim, self.k_dims)

  def compute_k(self, memory_antecedent):
    if self.shared_kv:
      raise ValueError("AttentionParams.compute_k: with shared_kv=True use compute_kv.")
    return self._project(memory_antecedent, self.wk, self.memory_input_dim, self.k_dims)

  def compute_v(self, memory_antecedent):
    if self.shared_kv:
      raise ValueError("AttentionParams.compute_v: with shared_kv=True use compute_kv.")
    return self._project(memory_antecedent, self.wv, self.memory_input_dim, self.v_dims)

  def compute_output(self, o, output_shape=None):
    """Projects the attention output o (with o_dims) back to output_dim."""
    if self.combine_dims:
      o = mtf.transpose(o, o.shape - self.o_dims + self.o_dims)
      combined = self.wo.shape.dims[-2]
      o = mtf.replace_dimensions(o, self.o_dims, combined)
      reduced_dims = [combined]
    else:
      reduced_dims = self.o_dims
    return mtf.layers.us_einsum([o, self.wo], output_shape=output_shape, reduced_dims=reduced_dims)

  @property
  def q_dims(self):
    return self.query_heads_dims + [self.key_dim]

  @property
  def k_dims(self):
    return self.memory_heads_dims + [self.key_dim]

  @property
  def v_dims(self):
    return self.memory_heads_dims + [self.value_dim]

  @property
  def o_dims(self):
    """Dims of the attention output that wo reduces (query heads stay when keep_query_heads_dims)."""
    if self.keep_query_heads_dims:
      return [self.value_dim]
    return self.query_heads_dims + [self.value_dim]


def attention_params_simple(mesh, io_dim, kv_dim, heads_dim, variable_dtype) -> AttentionParams:
  """AttentionParams for plain multi-head self-attention: d_model in and out, heads x d_kv inside."""
  return AttentionParams(mesh, query_input_dim=io_dim, memory_input_dim=io_dim, output_dim=io_dim,
                         key_dim=kv_dim, value_dim=kv_dim, query_heads_dims=[heads_dim],
                         memory_heads_dims=[heads_dim], variable_dtype=variable_dtype)


class ExpertsAttentionParams(AttentionParams):
  """AttentionParams whose q and/or shared k=v come from a MoE layer.

  expert_computation: "qkv" (one MoE call on the query antecedent gives q and k=v; keys then come
  from the queries' positions, so only self-attention can use it), "q" (MoE queries; k=v = the
  memory antecedent times the variable `kv`) or "kv" (queries = the query antecedent times the
  variable `q`, initializer stddev d_model**-0.5; k=v = a MoE call on the memory antecedent). The
  queries are scaled by d_kv**-0.5 at run time in every mode. Needs combine_dims and shared_kv.
  experts_hparams carries the MoE1D settings (moe_gating, num_experts, loss_coef, group_size,
  min_expert_capacity, capacity_factor_train/eval, hidden_size, activation, ...). The MoE output
  is the combined heads*d_kv projection.
  """

  def __init__(self, mesh, query_input_dim, memory_input_dim, output_dim, key_dim, value_dim,
               query_heads_dims, memory_heads_dims, variable_dtype, shared_kv=False, no_query=False,
               combine_dims=True, ensemble_dim=None, keep_query_heads_dims=False,
               fold_scaling_into_initializer=True, context=None, experts_hparams=None,
               expert_computation="qkv"):
    if not combine_dims:
      raise ValueError("ExpertsAttentionParams needs combine_dims=True.")
    if not shared_kv:
      raise ValueError("ExpertsAttentionParams needs shared_kv=True (keys and values are one projection).")
    if expert_computation not in ("qkv", "q", "kv"):
      raise ValueError(f"ExpertsAttentionParams: expert_computation={expert_computation!r} "
                       f"is not 'qkv', 'q' or 'kv'.")
    if mtf.layers.unit_scaling_convention():
      raise NotImplementedError("ExpertsAttentionParams does not support the unit-scaling convention.")
    self.context = context
    self.expert_computation = expert_computation
    super().__init__(mesh, query_input_dim, memory_input_dim, output_dim, key_dim, value_dim,
                     query_heads_dims, memory_heads_dims, variable_dtype, shared_kv=shared_kv,
                     no_query=no_query, combine_dims=combine_dims, ensemble_dim=ensemble_dim,
                     keep_query_heads_dims=keep_query_heads_dims,
                     fold_scaling_into_initializer=fold_scaling_into_initializer, make_attention_vars=False)
    if expert_computation == "q":
      _, kv_init, _ = self._initializers()
      self.wkv = mtf.get_variable(self.mesh, "kv", mtf.Shape(self.k_shape), initializer=kv_init,
                                  dtype=self.variable_dtype)
    elif expert_computation == "kv":  # 0.1.21 does not fold the d_kv scaling into this initializer
      self.wq = mtf.get_variable(
          self.mesh, "q", mtf.Shape(self.q_shape),
          initializer=tf.random_normal_initializer(stddev=self.query_input_dim.size ** -0.5),
          dtype=self.variable_dtype)
    from mesh_tensorflow.transformer import moe  # lazily: moe builds on attention users
    # The MoE output is named d_model, so "experts_hidden" and "heads" can be split independently.
    hp = experts_hparams
    self.moe_layer = moe.MoE1D(
        moe_gating=hp.moe_gating, num_experts=hp.num_experts, loss_coef=hp.loss_coef,
        group_size=hp.group_size, min_expert_capacity=hp.min_expert_capacity,
        capacity_factor_train=hp.capacity_factor_train, capacity_factor_eval=hp.capacity_factor_eval,
        switch_policy_train=hp.switch_policy_train, switch_policy_eval=hp.switch_policy_eval,
        switch_dropout=hp.switch_dropout, switch_temperature=hp.switch_temperature,
        switch_jitter=hp.switch_jitter, ntlb_top_k=hp.ntlb_top_k, hidden_size=hp.hidden_size,
        output_dim=mtf.Dimension("d_model", self.q_shape[-1].size),
        use_experts_attention=expert_computation == "qkv", activation=hp.activation, z_loss=hp.z_loss)

  def _rename_to_heads(self, t):
    last = t.shape.dims[-1]
    return mtf.reshape(t, t.shape - last + [mtf.Dimension(self.q_shape[-1].name, last.size)])

  def _compute_merge_qkv(self, antecedent):
    """q (and, for "qkv", the shared k) from the query antecedent: one MoE call, or `q` for "kv"."""
    if self.expert_computation == "qkv":
      q, k = self.moe_layer.call(self.context, antecedent)
      q, k = self._rename_to_heads(q), self._rename_to_heads(k)
      self._k = mtf.replace_dimensions(k, k.shape.dims[-1], self.k_dims)
    elif self.expert_computation == "kv":
      q = mtf.layers.us_einsum([antecedent, self.wq], reduced_dims=[self.query_input_dim])
    else:
      q = self._rename_to_heads(self.moe_layer.call(self.context, antecedent))
    q *= self.key_dim.size ** -0.5
    self._q = mtf.replace_dimensions(q, q.shape.dims[-1], self.q_dims)

  def compute_q(self, query_antecedent):
    self._compute_merge_qkv(query_antecedent)
    return self._q

  def compute_k(self, memory_antecedent):
    return self.compute_kv(memory_antecedent)

  def compute_kv(self, memory_antecedent):
    """"qkv": the k computed with q; "q": the memory antecedent times `kv`; "kv": a MoE call on it."""
    if self.expert_computation == "q":
      return self._project(memory_antecedent, self.wkv, self.memory_input_dim, self.k_dims)
    if self.expert_computation == "kv":
      k = self._rename_to_heads(self.moe_layer.call(self.context, memory_antecedent))
      return mtf.replace_dimensions(k, k.shape.dims[-1], self.k_dims)
    return self._k

  def compute_v(self, memory_antecedent):
    raise NotImplementedError("ExpertsAttentionParams shares keys and values: use compute_kv.")


def _batch_task_ids(context) -> mtf.Tensor:
  """context.cache["task-id"] [batch, n] (0.1.21 reshapes it, so n = 1; else its first column) -> [batch]."""
  task_id = context.cache.get("task-id") if isinstance(context.cache, dict) else None
  if task_id is None:
    raise ValueError("Hyper-prompts need the examples' task ids: set context.cache['task-id'] to an int32 "
                     "[batch, length] Tensor before calling the layer stack.")
  return mtf.gather(task_id, 0, task_id.shape.dims[-1])


def _prompt_dims(task_num: int, num_heads: int, prefix_hidden_dim: int, kv_dim, prompt_length: int):
  return (mtf.Dimension("task_num", task_num), mtf.Dimension("memory_length", prompt_length),
          mtf.Dimension("heads", num_heads), mtf.Dimension("prefix_hidden", prefix_hidden_dim), kv_dim)


def _shared_prompts(context, dropout_rate: float) -> mtf.Tensor:
  """context.shared_params[<encoder|decoder>]["prompts"], layer-normalised over d_model (+ dropout)."""
  scope = tf.get_variable_scope().name.split("/")[0]
  prompts = mtf.layers.layer_norm(context.shared_params[scope]["prompts"], dim=context.model.model_dim,
                                  name="prompts_layernorm")
  return _train_dropout(prompts, context, dropout_rate)


def _train_dropout(x: mtf.Tensor, context, dropout_rate: float) -> mtf.Tensor:
  if context.train and dropout_rate != 0.0:
    return mtf.dropout(x, context.train, rate=dropout_rate)
  return x


def _batch_prompts(prompts, w_up, w_down, task_id, dims, context, dropout_rate: float) -> mtf.Tensor:
  """Each example's task prompt keys (or values): relu(prompts w_up) w_down, gathered by task id.

  prompts [task_num, memory_length=prompt_length, d_model]; w_up [(task_num,) d_model,
  prefix_hidden]; w_down [(task_num,) prefix_hidden, heads, d_kv]. Returns [batch,
  memory_length=prompt_length, heads, d_kv].
  """
  task_num_dim, prompt_length_dim, heads_dim, prefix_hidden_dim, kv_dim = dims
  hidden = mtf.relu(mtf.matmul(prompts, w_up,
                               output_shape=[task_num_dim, prompt_length_dim, prefix_hidden_dim],
                               reduced_dims=[context.model.model_dim]))
  hidden = _train_dropout(hidden, context, dropout_rate)
  projected = mtf.matmul(hidden, w_down, output_shape=[task_num_dim, prompt_length_dim, heads_dim, kv_dim],
                         reduced_dims=[prefix_hidden_dim])
  batch_dim = task_id.shape.get_dim_by_name("batch")
  return mtf.gather(projected, task_id, task_num_dim,
                    output_shape=[batch_dim, prompt_length_dim, heads_dim, kv_dim])


def make_params_mtlprompt(task_num: int, num_heads: int, prefix_hidden_dim: int, kv_dim, context,
                          mtlprompt_share: bool, dropout_rate: float, prompt_length=None) -> tuple:
  """MTL-Prompt keys and values [batch, memory_length=prompt_length, heads, d_kv] for each example's task.

  Variables in scope `prompt`: w_k_up, w_v_up [d_model, prefix_hidden] and w_k_down, w_v_down
  [prefix_hidden, heads, d_kv], each with a leading task_num dim unless mtlprompt_share.
  """
  task_id = _batch_task_ids(context)
  dims = _prompt_dims(task_num, num_heads, prefix_hidden_dim, kv_dim, prompt_length)
  task_num_dim, _, heads_dim, prefix_dim, _ = dims
  task_dims = [] if mtlprompt_share else [task_num_dim]
  up_shape = mtf.Shape(task_dims + [context.model.model_dim, prefix_dim])
  down_shape = mtf.Shape(task_dims + [prefix_dim, heads_dim, kv_dim])
  with tf.variable_scope("prompt"):
    w_k_up, w_k_down, w_v_up, w_v_down = [
        mtf.get_variable(context.mesh, name, shape, dtype=context.variable_dtype)
        for name, shape in (("w_k_up", up_shape), ("w_k_down", down_shape), ("w_v_up", up_shape),
                            ("w_v_down", down_shape))]
  prompts = _shared_prompts(context, dropout_rate)
  return (_batch_prompts(prompts, w_k_up, w_k_down, task_id, dims, context, dropout_rate),
          _batch_prompts(prompts, w_v_up, w_v_down, task_id, dims, context, dropout_rate))


def make_params_hyperprompt(task_num: int, num_heads: int, prefix_hidden_dim: int, kv_dim, context,
                            mtlprompt_share: bool, dropout_rate: float, prompt_length: int,
                            scope=None) -> tuple:
  """HyperPrompt keys and values: the prompt projections generated by a hypernetwork per task and layer.

  Reads context.shared_params[scope] ("prompts", "task_raw_embedding" [task_num, e],
  "layer_embedding" [layers, l], "task_projector_layer_one" [e + l, h],
  "task_projector_layer_two" [h, t] and "hypernet_w_{k,v}_{up,down}" [t, d_model, prefix_hidden]
  / [t, prefix_hidden, heads, d_kv]). The layer index comes from the variable scope
  (`<scope>/layer_<i>/...`). mtlprompt_share is not used.
  """
  del mtlprompt_share
  task_id = _batch_task_ids(context)
  dims = _prompt_dims(task_num, num_heads, prefix_hidden_dim, kv_dim, prompt_length)
  task_num_dim, _, heads_dim, prefix_dim, _ = dims
  prompts = _shared_prompts(context, dropout_rate)
  scope_name = tf.get_variable_scope().name
  params = context.shared_params[scope_name.split("/")[0]]
  layer_id = int(scope_name.split("/")[1].split("_")[1])
  raw_embeddings, layer_embeddings = params["task_raw_embedding"], params["layer_embedding"]
  projector_one, projector_two = params["task_projector_layer_one"], params["task_projector_layer_two"]
  layer_num_dim, layer_embedding_dim = layer_embeddings.shape.dims
  if not 0 <= layer_id < layer_num_dim.size:
    raise ValueError(f"make_params_hyperprompt: layer {layer_id} (from the scope {scope_name!r}) has no row "
                     f"in the layer embedding {layer_embeddings.shape}.")
  layer_ids = mtf.constant(raw_embeddings.mesh, layer_id, mtf.Shape([task_num_dim]), dtype=tf.int32)
  layer_rows = mtf.gather(layer_embeddings, layer_ids, layer_num_dim,
                          output_shape=[task_num_dim, layer_embedding_dim])
  task_embeddings = mtf.concat([raw_embeddings, layer_rows], raw_embeddings.shape.dims[1].name)
  hidden_dim, final_dim = projector_one.shape.dims[1], projector_two.shape.dims[1]
  hidden = mtf.relu(mtf.matmul(task_embeddings, projector_one, output_shape=[task_num_dim, hidden_dim],
                               reduced_dims=[projector_one.shape.dims[0]]))
  hidden = _train_dropout(hidden, context, dropout_rate)
  task_embeddings = mtf.layers.layer_norm(
      mtf.matmul(hidden, projector_two, output_shape=[task_num_dim, final_dim], reduced_dims=[hidden_dim]),
      dim=final_dim, name="prompt_task_embed_layernorm")

  def generated(name, shape):
    return mtf.matmul(task_embeddings, params[name], output_shape=[task_num_dim] + shape,
                      reduced_dims=[final_dim])
  up_shape, down_shape = [context.model.model_dim, prefix_dim], [prefix_dim, heads_dim, kv_dim]
  return (_batch_prompts(prompts, generated("hypernet_w_k_up", up_shape),
                         generated("hypernet_w_k_down", down_shape), task_id, dims, context, dropout_rate),
          _batch_prompts(prompts, generated("hypernet_w_v_up", up_shape),
                         generated("hypernet_w_v_down", down_shape), task_id, dims, context, dropout_rate))


def concat_hyper_prompts_kv(k: mtf.Tensor, v: mtf.Tensor, scope_encoder_or_decoder: str,
                            use_hyperprompt: bool, memory_length, task_num: int, num_heads: int,
                            prefix_hidden_dim: int, kv_dim, context, mtlprompt_share: bool,
                            dropout_rate: float, prompt_length: int) -> tuple:
  """Prepends each example's task prompts to the keys and values along memory_length.

  HyperPrompt (use_hyperprompt) or MTL-Prompt projections (see make_params_hyperprompt /
  make_params_mtlprompt). Returns (k, v, memory_position, memory_length), the memory
  prompt_length longer, its positions counted from the first prompt.
  """
  make_prompts = make_params_hyperprompt if use_hyperprompt else make_params_mtlprompt
  kwargs = {"scope": scope_encoder_or_decoder} if use_hyperprompt else {}
  prompts_k, prompts_v = make_prompts(task_num, num_heads, prefix_hidden_dim, kv_dim, context,
                                      mtlprompt_share, dropout_rate, prompt_length=prompt_length, **kwargs)
  k = mtf.concat([prompts_k, k], concat_dim_name="memory_length")
  v = mtf.concat([prompts_v, v], concat_dim_name="memory_length")
  memory_length = mtf.Dimension("memory_length", memory_length.size + prompt_length)
  return k, v, mtf.range(context.mesh, memory_length, tf.int32), memory_length
