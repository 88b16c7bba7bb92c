"""Self-attention, encoder-decoder attention and local self-attention layers.

Re-exported (and gin-registered) as `mesh_tensorflow.transformer.transformer_layers.<Name>`.
Variable names (`q`, `k`, `v`/`kv`, `o`, `relative_attention_bias`) are a checkpoint contract.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Optional

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import attention
from mesh_tensorflow.transformer import transformer

GIN_MODULE = "mesh_tensorflow.transformer.transformer_layers"
RELATIVE_ATTENTION_TYPES = ("bias", "bias_shared", "contextual")


def _relative_position_bucket(relative_position, bidirectional: bool = True, num_buckets: int = 32,
                              max_distance: int = 128):
  """T5's bucket of each relative position (memory_position - query_position), an int32 Tensor.

  Distances below `num_buckets // 2` (halved again when bidirectional, where the upper half of
  the buckets holds keys to the right of the query) each get their own bucket; larger distances
  share logarithmically wider buckets up to `max_distance`, and everything beyond falls in the
  last bucket. Unidirectional: keys to the right all map to bucket 0.
  """
  distance = -relative_position  # > 0: the memory position lies before the query
  bucket = 0
  if bidirectional:
    num_buckets //= 2
    bucket = mtf.to_int32(mtf.less(distance, 0)) * num_buckets
    distance = mtf.abs(distance)
  else:
    distance = mtf.maximum(distance, 0)
  num_exact = num_buckets // 2
  # log(0) = -inf for distance 0 is harmless: those distances take the exact bucket below.
  log_ratio = mtf.log(mtf.to_float(distance) / num_exact) / math.log(max_distance / num_exact)
  log_bucket = num_exact + mtf.to_int32(log_ratio * (num_buckets - num_exact))
  log_bucket = mtf.minimum(log_bucket, num_buckets - 1)
  return bucket + mtf.where(mtf.less(distance, num_exact), distance, log_bucket)


def _bias_from_visibility(visible: mtf.Tensor, context) -> mtf.Tensor:
  return attention.visibility_mask_to_attention_bias(visible, context.activation_dtype)


def _check_relative_attention_type(layer: str, relative_attention_type) -> None:
  if relative_attention_type is not None and relative_attention_type not in RELATIVE_ATTENTION_TYPES:
    raise ValueError(f"{layer}: unknown relative_attention_type {relative_attention_type!r}; use one of "
                     f"{RELATIVE_ATTENTION_TYPES} or None.")


def _relative_attention_values(layer, context, heads_dims, buckets_dim: mtf.Dimension, q: mtf.Tensor,
                               cache_key) -> mtf.Tensor:
  """Per-bucket logit biases: a `relative_attention_bias` variable, or for "contextual" a dense of q."""
  if layer.relative_attention_type == "contextual":
    return mtf.layers.dense(q, reduced_dims=[layer.kv_dim], new_dims=[buckets_dim], use_bias=False,
                            variable_dtype=context.variable_dtype, name="relative_attention_ak",
                            expert_dims=context.model.ensemble_dims + list(heads_dims or []))
  shared = layer.relative_attention_type == "bias_shared"
  if shared and cache_key in context.cache:
    return context.cache[cache_key]
  values = mtf.get_variable(context.mesh, "relative_attention_bias",
                            context.model.ensemble_dims + list(heads_dims or []) + [buckets_dim],
                            initializer=tf.glorot_uniform_initializer(), dtype=context.variable_dtype)
  if shared:
    context.cache[cache_key] = values
  return values


def _relative_attention_bias(layer, context, relative_position, bidirectional: bool, heads_dims,
                             q: mtf.Tensor, cache_key) -> mtf.Tensor:
  buckets_dim = mtf.Dimension("buckets", layer.relative_attention_num_buckets)
  buckets = _relative_position_bucket(relative_position, bidirectional=bidirectional,
                                      num_buckets=buckets_dim.size)
  values = _relative_attention_values(layer, context, heads_dims, buckets_dim, q, cache_key)
  return mtf.gather(values, buckets, buckets_dim)


def attention_params(context, kv_dim: mtf.Dimension, num_heads: int, num_memory_heads: int = 0,
                     shared_kv: bool = False, no_query: bool = False, combine_dims: bool = True,
                     keep_query_heads_dims: bool = False,
                     fold_scaling_into_initializer: bool = True, params_cls=attention.AttentionParams,
                     **params_kwargs) -> attention.AttentionParams:
  """AttentionParams (or `params_cls`, given `params_kwargs`) for `num_heads` query heads over d_model.

  num_memory_heads: 0 = as many key/value heads as query heads (`heads`); 1 = multi-query
  attention (one shared key/value head); n > 1 = n key/value heads `heads`, each serving
  num_heads / n query heads (`query_heads`).
  """
  if num_heads == 1:
    query_heads_dims = None
  else:
    query_heads_dims = [mtf.Dimension("heads", num_heads)]
  if num_memory_heads == 0:
    memory_heads_dims = query_heads_dims
  elif num_memory_heads == 1:
    memory_heads_dims = None
  else:
    if num_heads % num_memory_heads:
      raise ValueError(f"attention_params: num_memory_heads={num_memory_heads} must divide "
                       f"num_heads={num_heads}.")
    memory_heads_dims = [mtf.Dimension("heads", num_memory_heads)]
    query_heads_dims = memory_heads_dims + [mtf.Dimension("query_heads", num_heads // num_memory_heads)]
  model_dim = context.model.model_dim
  return params_cls(
      context.mesh, query_input_dim=model_dim, memory_input_dim=model_dim, output_dim=model_dim,
      key_dim=kv_dim, value_dim=kv_dim, query_heads_dims=query_heads_dims,
      memory_heads_dims=memory_heads_dims, variable_dtype=context.variable_dtype, shared_kv=shared_kv,
      no_query=no_query, ensemble_dim=context.model.ensemble_dim, combine_dims=combine_dims,
      keep_query_heads_dims=keep_query_heads_dims,
      fold_scaling_into_initializer=fold_scaling_into_initializer, **params_kwargs)


@gin.configurable(module=GIN_MODULE)
class SelfAttention(transformer.TransformerLayer):
  """Multi-head self-attention over the length dimension.

  Causality comes from the context's read/write priorities (a query sees the memory positions
  whose write priority is at most its read priority); packed sequences are separated by
  sequence_id (or subsequence_id). In "first_part" mode the keys/values are recorded as states;
  in "incremental" mode (x has no length dim) the current step is written into those states at
  `context.position` and the query attends over them.
  """

  def __init__(self, num_heads: int = 8, num_memory_heads: int = 0, key_value_size: int = 128,
               shared_kv: bool = False, dropout_rate: float = 0.0, attention_kwargs: Optional[dict] = None,
               relative_attention_type: Optional[str] = None, relative_attention_num_buckets: int = 32,
               attention_func: Optional[str] = None, combine_dims: bool = True,
               keep_query_heads_dims: bool = False, fold_scaling_into_initializer: bool = True,
               z_loss_coeff: Optional[float] = None, use_hyperprompt: bool = False,
               hyperprompt_mtlshare: bool = False, hyperprompt_length_encoder: Optional[int] = None,
               hyperprompt_length_decoder: Optional[int] = None, hyperprompt_hidden_dim: Optional[int] = None,
               hyperprompt_task_num: int = 8):
    """Creates the layer; the hyperprompt_* arguments are 0.1.21's (see attention.concat_hyper_prompts_kv).

    hyperprompt_length_encoder / _decoder: in a layer under the `encoder` / `decoder` variable
    scope, that many task prompts (MTL-Prompt, or HyperPrompt if use_hyperprompt; projections
    shared across tasks if hyperprompt_mtlshare, hidden size hyperprompt_hidden_dim, for
    hyperprompt_task_num tasks) are prepended to the keys and values; every query sees them.
    They need context.cache["task-id"] and context.shared_params[scope]["prompts"].
    """
    _check_relative_attention_type(type(self).__name__, relative_attention_type)
    if attention_func not in (None, "hybrid"):
      raise ValueError(f"{type(self).__name__}: unknown attention_func {attention_func!r}; use None (softmax "
                       f"attention) or 'hybrid'.")
    self.num_heads = num_heads
    self.num_memory_heads = num_memory_heads
    self.key_value_size = key_value_size
    self.shared_kv = shared_kv
    self.dropout_rate = dropout_rate
    self.attention_kwargs = attention_kwargs or {}
    self.relative_attention_type = relative_attention_type
    self.relative_attention_num_buckets = relative_attention_num_buckets
    self.attention_func = attention_func
    self.combine_dims = combine_dims
    self.keep_query_heads_dims = keep_query_heads_dims
    self.fold_scaling_into_initializer = fold_scaling_into_initializer
    self.z_loss_coeff = z_loss_coeff  # see attention.attention
    self.use_hyperprompt = use_hyperprompt
    self.hyperprompt_mtlshare = hyperprompt_mtlshare
    self.hyperprompt_length_encoder = hyperprompt_length_encoder
    self.hyperprompt_length_decoder = hyperprompt_length_decoder
    self.hyperprompt_hidden_dim = hyperprompt_hidden_dim
    self.hyperprompt_task_num = hyperprompt_task_num

  def make_params(self, context) -> attention.AttentionParams:
    return attention_params(
        context=context, kv_dim=self.kv_dim, num_heads=self.num_heads,
        num_memory_heads=self.num_memory_heads, shared_kv=self.shared_kv, combine_dims=self.combine_dims,
        keep_query_heads_dims=self.keep_query_heads_dims,
        fold_scaling_into_initializer=self.fold_scaling_into_initializer)

  @property
  def kv_dim(self) -> mtf.Dimension:
    return mtf.Dimension("d_kv", self.key_value_size)

  def memory_length(self, context) -> mtf.Dimension:
    return mtf.Dimension("memory_length", context.length_dim.size)

  def rename_length_to_memory_length(self, x: mtf.Tensor, context) -> mtf.Tensor:
    return mtf.replace_dimensions(x, context.length_dim, self.memory_length(context))

  def min_relative_position(self, context) -> Optional[int]:
    """Memory positions more than this far to the left are masked (None: no limit)."""
    return None

  def max_relative_position(self, context) -> Optional[int]:
    """Memory positions more than this far to the right are masked (None: no limit)."""
    return None

  @property
  def attention_fn(self) -> Callable[..., mtf.Tensor]:
    """The attention function this layer calls (a property, as in 0.1.21)."""
    return attention.hybrid_attention if self.attention_func == "hybrid" else attention.attention

  def attention_kwargs_from_context(self, context) -> dict:
    kwargs = copy.copy(self.attention_kwargs)
    if self.z_loss_coeff is not None:
      kwargs["z_loss_coeff"] = self.z_loss_coeff
    kwargs["dropout_rate"] = self.dropout_rate if context.train else 0.0
    kwargs.setdefault("dropout_broadcast_dims", [context.length_dim])
    return kwargs

  def expected_attention_output_shape(self, x: mtf.Tensor, params) -> mtf.Shape:
    if self.keep_query_heads_dims:
      return mtf.Shape(x.shape[:-1] + params.query_heads_dims + x.shape[-1:])
    return x.shape

  def layer_output_from_attention_output(self, context, attention_output: mtf.Tensor, losses) -> mtf.Tensor:
    return attention_output

  def compute_bias(self, context, memory_position: mtf.Tensor, x: mtf.Tensor, heads_dims,
                   q: mtf.Tensor, use_prompt_kv: Optional[str] = None) -> Optional[mtf.Tensor]:
    """The sum of the attention logit biases (masks and relative-position terms), or None.

    use_prompt_kv ("encoder_prompts" / "decoder_prompts"): the memory starts with that many
    prompts (see _prompt_length), which every query sees, as 0.1.21 masks them.
    """
    min_relative_position = self.min_relative_position(context)
    max_relative_position = self.max_relative_position(context)
    relative_position = memory_position - context.position
    prompt_length = self._prompt_length(use_prompt_kv)
    if prompt_length:
      relative_position -= prompt_length
    biases = []
    if min_relative_position is not None:
      biases.append(_bias_from_visibility(
          mtf.greater_equal(relative_position, min_relative_position), context))
    if max_relative_position is not None:
      biases.append(_bias_from_visibility(
          mtf.less_equal(relative_position, max_relative_position), context))
    if context.read_priority is not None:
      if use_prompt_kv == "decoder_prompts":  # the prompts are written before everything
        length_name = context.length_dim.name
        prompts = mtf.constant(x.mesh, -1, mtf.Shape([mtf.Dimension(length_name, prompt_length)]),
                               dtype=tf.int32)
        memory_write_priority = mtf.rename_dimension(
            mtf.concat([prompts, context.write_priority], length_name), length_name, "memory_length")
      else:
        memory_write_priority = self.rename_length_to_memory_length(context.write_priority, context)
      biases.append(_bias_from_visibility(mtf.greater_equal(context.read_priority, memory_write_priority),
                                          context))
    sequence_id = self._sequence_id_for_masking(context)
    if sequence_id is not None:
      if prompt_length:  # 0.1.21 compares with a memory of ones: a query of segment 1 sees it all
        memory_length = mtf.Dimension("memory_length", context.length_dim.size + prompt_length)
        memory_sequence_id = mtf.ones(x.mesh, mtf.Shape([x.shape.dims[0], memory_length]), dtype=tf.int32)
      else:
        memory_sequence_id = self.rename_length_to_memory_length(sequence_id, context)
      biases.append(_bias_from_visibility(mtf.equal(sequence_id, memory_sequence_id), context))
    if self.relative_attention_type is not None:
      cache_key = ("self_attention_bias", min_relative_position, max_relative_position,
                   tuple(heads_dims or []))
      biases.append(_relative_attention_bias(
          self, context, relative_position, not context.model.fully_autoregressive, heads_dims, q,
          cache_key))
    return mtf.add_n(biases) if biases else None

  def _prompt_length(self, use_prompt_kv: Optional[str]) -> Optional[int]:
    return {"encoder_prompts": self.hyperprompt_length_encoder,
            "decoder_prompts": self.hyperprompt_length_decoder}.get(use_prompt_kv)

  def _concat_prompts(self, context, k: mtf.Tensor, v: mtf.Tensor, memory_position: mtf.Tensor):
    """(k, v, memory_position, memory_length, use_prompt_kv), with this scope's task prompts prepended.

    0.1.21 reads the scope (`encoder` or `decoder`) from the variable scope's first part.
    """
    scope = tf.get_variable_scope().name.split("/")[0]
    memory_length = self.memory_length(context)
    prompt_length = {"encoder": self.hyperprompt_length_encoder,
                     "decoder": self.hyperprompt_length_decoder}.get(scope)
    if not prompt_length:
      return k, v, memory_position, memory_length, None
    k, v, memory_position, memory_length = attention.concat_hyper_prompts_kv(
        k, v, scope, self.use_hyperprompt, memory_length, self.hyperprompt_task_num, self.num_heads,
        self.hyperprompt_hidden_dim, self.kv_dim, context, self.hyperprompt_mtlshare, self.dropout_rate,
        prompt_length=prompt_length)
    return k, v, memory_position, memory_length, scope + "_prompts"

  def _sequence_id_for_masking(self, context) -> Optional[mtf.Tensor]:
    """subsequence_id (several targets per input) or sequence_id, when it runs along the length.

    Not in "incremental" mode, whose single query position has no length dim to compare.
    """
    if context.mode == "incremental":
      return None
    for sequence_id in (context.subsequence_id, context.sequence_id):
      if isinstance(sequence_id, mtf.Tensor):
        return sequence_id if context.length_dim in sequence_id.shape.dims else None
    return None

  def update_memory(self, context, kv_list: list) -> tuple:
    """Keys/values over `memory_length` (and the memory positions), recording decoding states.

    Full modes rename length to memory_length; "incremental" writes this step's (length-less)
    keys/values into the recorded states at context.position.
    """
    memory_length = self.memory_length(context)
    if context.mode == "incremental":
      one_hot = mtf.one_hot(context.position, memory_length, dtype=context.activation_dtype)
      old_states = context.get_states(len(kv_list))
      kv_list = [old * (1.0 - one_hot) + new * one_hot for old, new in zip(old_states, kv_list)]
      memory_position = mtf.range(context.mesh, memory_length, tf.int32)
    else:
      kv_list = [self.rename_length_to_memory_length(t, context) for t in kv_list]
      memory_position = self.rename_length_to_memory_length(context.position, context)
    if context.mode in ("incremental", "first_part"):
      context.record_new_states(kv_list)
    return kv_list, memory_position

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    params = self.make_params(context)
    q = params.compute_q(x)
    kv_list = [params.compute_kv(x)] if self.shared_kv else [params.compute_k(x), params.compute_v(x)]
    kv_list, memory_position = self.update_memory(context, kv_list)
    k, v = kv_list * 2 if self.shared_kv else kv_list
    k, v, memory_position, memory_length, use_prompt_kv = self._concat_prompts(context, k, v, memory_position)
    bias = self.compute_bias(context, memory_position, x, params.query_heads_dims, q,
                             use_prompt_kv=use_prompt_kv)
    o = self.attention_fn(
        q, k, v, context=context, memory_length_dim=memory_length, key_dim=self.kv_dim,
        value_dim=self.kv_dim, bias=bias, **self.attention_kwargs_from_context(context))
    attention_output = params.compute_output(o, output_shape=self.expected_attention_output_shape(x, params))
    return self.layer_output_from_attention_output(context, attention_output, losses)


@gin.configurable(module=GIN_MODULE)
def relative_position_spans(context, num_sentinels: int = gin.REQUIRED,
                            vocab_size: Optional[int] = None) -> mtf.Tensor:
  """Encoder-minus-decoder span positions [batch, length, memory_length] for span-corruption models.

  Inputs are text with dropped spans replaced by sentinels; targets are the dropped spans, each
  after its sentinel. Sentinels are the top `num_sentinels` ids below `vocab_size` (default: the
  padded output vocabulary size). With s = "is a sentinel", encoder positions are 2*cumsum(s) - s
  (text between sentinels even, sentinel k at 2k-1) and decoder positions 2*cumsum(s) - 1 (the
  whole k-th target span sits where sentinel k was), so a target token is at relative position 0
  from its sentinel, -1 from the text just before the gap, +1 from the text just after it.
  """
  if vocab_size is None:
    vocab_size = context.model.output_vocab_dim.size
  if context.mode == "incremental" or context.inputs is None or context.encoder_inputs is None:
    raise ValueError("relative_position_spans needs context.inputs and context.encoder_inputs (the "
                     "decoder and encoder token ids along their lengths); it does not support "
                     "incremental decoding.")

  def span_counts(ids):
    is_sentinel = mtf.to_int32(mtf.greater_equal(ids, vocab_size - num_sentinels))
    length_dim = ids.shape.dims[-1]
    return 2 * mtf.cumsum(is_sentinel, length_dim), is_sentinel

  decoder_count, _ = span_counts(context.inputs)
  encoder_count, encoder_is_sentinel = span_counts(context.encoder_inputs)
  return (encoder_count - encoder_is_sentinel) - (decoder_count - 1)


@gin.configurable(module=GIN_MODULE)
def enc_dec_attention_bias(layer, context, heads_dims, relative_position_fn=relative_position_spans,
                           q: Optional[mtf.Tensor] = None) -> Optional[mtf.Tensor]:
  """Encoder-decoder attention bias: segment (or padding) mask plus optional relative-position bias.

  Args:
    layer: the attention layer (its relative_attention_type and bucket count are read).
    context: a Context.
    heads_dims: the query heads dims of the relative-position bias variable.
    relative_position_fn: context -> [batch, length, memory_length] relative positions of the
      encoder tokens to the decoder tokens (default: relative_position_spans).
    q: the queries, for the "contextual" relative attention type only.
  Returns:
    the bias Tensor, or None when nothing is masked.
  """
  biases = []
  if isinstance(context.encoder_sequence_id, mtf.Tensor):
    if isinstance(context.sequence_id, mtf.Tensor):
      visible = mtf.equal(context.sequence_id, context.encoder_sequence_id)
    else:  # decoding: no decoder segments, so only hide the encoder padding
      visible = mtf.not_equal(context.encoder_sequence_id, 0)
    biases.append(_bias_from_visibility(visible, context))
  if layer.relative_attention_type is not None:
    cache_key = ("enc_dec_attention_bias", tuple(heads_dims or []))
    biases.append(_relative_attention_bias(
        layer, context, relative_position_fn(context), True, heads_dims, q, cache_key))
  return mtf.add_n(biases) if biases else None


@gin.configurable(module=GIN_MODULE)
def enc_dec_attention(self_attention_layer: SelfAttention, memory_antecedent: mtf.Tensor, context,
                      x: mtf.Tensor, losses, attention_fn=attention.attention,
                      z_loss_coeff: Optional[float] = None) -> mtf.Tensor:
  """Attention of x over `memory_antecedent` (dims [batch..., memory_length, d_model]).

  The keys/values are computed once: "first_part" records them as a constant state and
  "incremental" reads them back.

  Args:
    self_attention_layer: the layer whose parameters and options are used.
    memory_antecedent: the encoder output.
    context: a Context.
    x: the decoder activations [batch..., length, d_model].
    losses: passed to the layer's layer_output_from_attention_output.
    attention_fn: the attention function (attention.attention, or the layer's own if None).
    z_loss_coeff: see attention.attention.
  Returns:
    a Tensor shaped like x.
  """
  layer = self_attention_layer
  if memory_antecedent.shape.dims[-1] != context.model.model_dim:
    raise ValueError(f"{type(layer).__name__}: the encoder output's last dim "
                     f"{memory_antecedent.shape.dims[-1]} differs from the decoder's d_model "
                     f"{context.model.model_dim}; give encoder and decoder the same d_model.")
  params = layer.make_params(context)
  q = params.compute_q(x)
  if context.mode == "incremental":
    k, v, memory_length = context.get_constant_state()
  else:
    if layer.shared_kv:
      k = v = params.compute_kv(memory_antecedent)
    else:
      k, v = params.compute_k(memory_antecedent), params.compute_v(memory_antecedent)
    memory_length = memory_antecedent.shape.get_dim_by_name("memory_length")
    if context.mode == "first_part":
      context.record_constant_state((k, v, memory_length))
  bias = enc_dec_attention_bias(layer, context, params.query_heads_dims, q=q)
  attention_fn = attention_fn or layer.attention_fn
  kwargs = layer.attention_kwargs_from_context(context)
  kwargs.pop("z_loss_coeff", None)  # the argument (0.1.21 passes the layer's) decides
  if z_loss_coeff is not None:
    kwargs["z_loss_coeff"] = z_loss_coeff
  o = attention_fn(q, k, v, memory_length, layer.kv_dim, layer.kv_dim, bias, context=context, **kwargs)
  attention_output = params.compute_output(o, output_shape=layer.expected_attention_output_shape(x, params))
  return layer.layer_output_from_attention_output(context, attention_output, losses)


@gin.configurable(module=GIN_MODULE)
class EncDecAttention(SelfAttention):
  """Multi-head attention of the decoder over `context.encoder_output` (dim `memory_length`)."""

  def __init__(self, relative_attention_type: Optional[str] = None, **kwargs):
    super().__init__(relative_attention_type=relative_attention_type, **kwargs)

  def _get_memory_antecedent(self, context) -> mtf.Tensor:
    return context.encoder_output

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    return enc_dec_attention(self, self._get_memory_antecedent(context), context, x, losses,
                             z_loss_coeff=self.z_loss_coeff)


@gin.configurable(module=GIN_MODULE)
class LocalSelfAttention(SelfAttention):
  """Self-attention where each position sees only the `radius` positions ending at itself.

  (And, unless the model is fully autoregressive, `radius` positions to its right.) Sequences up
  to max(256, 4 * radius) use masked full attention; longer ones attention.local_attention_1d.
  Decoding keeps a `window` of the last `radius` keys/values, slot = position mod radius.
  """

  def __init__(self, radius: int = 128, num_heads: int = 8, num_memory_heads: int = 0,
               key_value_size: int = 128, shared_kv: bool = False, dropout_rate: float = 0.0,
               attention_kwargs: Optional[dict] = None):
    super().__init__(num_heads=num_heads, num_memory_heads=num_memory_heads, key_value_size=key_value_size,
                     shared_kv=shared_kv, dropout_rate=dropout_rate, attention_kwargs=attention_kwargs)
    self.radius = radius

  @property
  def window_dim(self) -> mtf.Dimension:
    return mtf.Dimension("window", self.radius)

  def min_relative_position(self, context) -> int:
    return 1 - self.radius

  def max_relative_position(self, context) -> Optional[int]:
    return None if context.model.fully_autoregressive else self.radius

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    params = self.make_params(context)
    q = params.compute_q(x)
    kv_list = [params.compute_kv(x)] if self.shared_kv else [params.compute_k(x), params.compute_v(x)]
    kwargs = self.attention_kwargs_from_context(context)
    if context.mode == "incremental":
      o = self._incremental_attention(context, q, kv_list, kwargs)
    elif context.length_dim.size <= max(256, 4 * self.radius):
      memory_length = self.memory_length(context)
      renamed = [self.rename_length_to_memory_length(t, context) for t in kv_list]
      k, v = renamed * 2 if self.shared_kv else renamed
      memory_position = self.rename_length_to_memory_length(context.position, context)
      o = attention.attention(q, k, v, memory_length, self.kv_dim, self.kv_dim,
                              self.compute_bias(context, memory_position, x, params.query_heads_dims, q),
                              context=context, **kwargs)
    else:
      o = attention.local_attention_1d(
          q=q, k=kv_list[0], v=kv_list[-1], length_dim=context.length_dim,
          key_dim=self.kv_dim, value_dim=self.kv_dim,
          fully_autoregressive=context.model.fully_autoregressive, radius=self.radius,
          sequence_id=1 if context.sequence_id is None else context.sequence_id,
          write_priority=context.write_priority,
          read_priority=context.read_priority, attention_kwargs=kwargs)
    if context.mode == "first_part":
      context.record_new_states([self._recent_window(context, t) for t in kv_list])
    return params.compute_output(o, output_shape=x.shape)

  def _incremental_attention(self, context, q, kv_list, kwargs) -> mtf.Tensor:
    window_position = mtf.range(context.mesh, self.window_dim, tf.int32)
    current_slot = mtf.equal(window_position, mtf.mod(context.position, self.radius))
    old_states = context.get_states(len(kv_list))
    kv_list = [mtf.where(current_slot, new, old, output_shape=old.shape)
               for new, old in zip(kv_list, old_states)]
    context.record_new_states(kv_list)
    k, v = kv_list * 2 if self.shared_kv else kv_list
    # Before the window has filled up, its later slots hold nothing yet.
    bias = _bias_from_visibility(mtf.greater_equal(context.position, window_position), context)
    return attention.attention(q, k, v, self.window_dim, self.kv_dim, self.kv_dim, bias, context=context,
                               **kwargs)

  def _recent_window(self, context, t: mtf.Tensor) -> mtf.Tensor:
    """The window state of t (the `radius` positions before initial_position, slot = pos mod radius)."""
    window_position = mtf.range(context.mesh, self.window_dim, tf.int32)
    position = mtf.range(context.mesh, context.length_dim, tf.int32)
    select = mtf.logical_and(
        mtf.equal(mtf.mod(position, self.radius), window_position),
        mtf.logical_and(mtf.less(position, context.initial_position),
                        mtf.greater_equal(position, context.initial_position - self.radius)))
    state_shape = (t.shape - [context.length_dim, self.kv_dim]) + [self.window_dim, self.kv_dim]
    return mtf.einsum([t, mtf.cast(select, t.dtype)], output_shape=state_shape,
                      reduced_dims=[context.length_dim])
