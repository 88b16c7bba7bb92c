"""Talking-heads attention (arXiv:2003.02436) and general bilinear attention.

Re-exported (and gin-registered) as `mesh_tensorflow.transformer.transformer_layers.<Name>`.
Heads play three roles, each with its own dims given as (name, size) pairs: key heads (the
q.k logits), softmax heads (the softmax) and value heads (weights . v). Learned linear maps mix
the heads between roles: variable `logits` before the softmax and `weights` after it, skipped
where two roles have the same dims.
"""

from __future__ import annotations

from typing import Optional, Sequence

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer._attention_layers import GIN_MODULE, SelfAttention, enc_dec_attention_bias

DYNAMIC_PROJECTIONS = ("x2l", "m2l", "x2w", "m2w")


def _dims(pairs) -> list:
  return [mtf.Dimension(name, size) for name, size in pairs]


def _attend(layer, context, weights: mtf.Tensor, v: mtf.Tensor, memory_length: mtf.Dimension) -> mtf.Tensor:
  """Dropout on the attention weights (shared along length), u = weights . v, then layer.compute_y(u)."""
  if context.train and layer.dropout_rate:
    weights = mtf.dropout(weights, context.train, rate=layer.dropout_rate,
                          noise_shape=weights.shape - context.length_dim)
  return layer.compute_y(context, mtf.einsum([weights, v], reduced_dims=[memory_length]))


def _enc_dec_memory(layer, context) -> tuple:
  """(m, memory tensors of m, memory_length) for m = context.encoder_output; the tensors are kept
  as a constant decoding state ("first_part" records, "incremental" reads them)."""
  m = context.encoder_output
  if context.mode == "incremental":
    memory = context.get_constant_state()
  else:
    memory = layer.memory_tensors(context, m)
    if context.mode == "first_part":
      context.record_constant_state(memory)
  return m, memory, m.shape.get_dim_by_name("memory_length")


@gin.configurable(module=GIN_MODULE)
class TalkingHeadsSelfAttention(SelfAttention):
  """Talking-heads self-attention.

  Variables (as 0.1.21's, so its checkpoints restore): `q`, `k` [d_model, key heads, d_k], `v`
  [d_model, value heads, d_v], `y` [value heads, d_v, d_model] (each a dense `kernel`), `logits`
  [key heads, softmax heads] and `weights` [softmax heads, value heads]. The 1/sqrt(d_k) logit
  scaling lives in q's initializer (variance 1 / (d_model * d_k)), not in the computation.
  dynamic_projections adds input-dependent head mixing: "x2l"/"x2w" computed from the query
  position's input, "m2l"/"m2w" from the memory position's, for the logits / weights projection
  (variables `<logits|weights>_dynamic_<i>` [d_model, shared, reduced, new heads], i counting
  the enabled ones in the order x, m; variance dynamic_projections_init_scale / (d_model *
  reduced heads)). Dropout applies to the attention weights after their heads projection.
  """

  def __init__(self, key_heads_dims=(("heads", 12),), softmax_heads_dims=(("heads", 12),),
               value_heads_dims=(("heads", 12),), key_size: int = 64, value_size: int = 64,
               dropout_rate: float = 0.0, relative_attention_type: Optional[str] = None,
               relative_attention_num_buckets: int = 32, dynamic_projections: Sequence[str] = (),
               dynamic_projections_init_scale: float = 1e-2):
    if relative_attention_type == "contextual":
      raise ValueError(f"{type(self).__name__} supports relative_attention_type 'bias' or 'bias_shared', "
                       f"not 'contextual'.")
    unknown = set(dynamic_projections or ()) - set(DYNAMIC_PROJECTIONS)
    if unknown:
      raise ValueError(f"{type(self).__name__}: unknown dynamic_projections {sorted(unknown)}; use some of "
                       f"{DYNAMIC_PROJECTIONS}.")
    self.key_heads_dims = _dims(key_heads_dims)
    self.softmax_heads_dims = _dims(softmax_heads_dims)
    self.value_heads_dims = _dims(value_heads_dims)
    super().__init__(num_heads=mtf.Shape(self.softmax_heads_dims).size, key_value_size=key_size,
                     dropout_rate=dropout_rate, relative_attention_type=relative_attention_type,
                     relative_attention_num_buckets=relative_attention_num_buckets)
    self.key_size = key_size
    self.value_size = value_size
    self.dynamic_projections = list(dynamic_projections or ())
    self.dynamic_projections_init_scale = dynamic_projections_init_scale

  def _dense(self, context, x: mtf.Tensor, reduced_dims, new_dims, name: str, expert_dims=(),
             kernel_initializer=None) -> mtf.Tensor:
    return mtf.layers.dense(x, new_dims=list(new_dims), reduced_dims=list(reduced_dims),
                            expert_dims=context.model.ensemble_dims + list(expert_dims), use_bias=False,
                            variable_dtype=context.variable_dtype, kernel_initializer=kernel_initializer,
                            name=name)

  def key_dim(self, context) -> mtf.Dimension:
    return mtf.Dimension("d_k", self.key_size)

  def value_dim(self, context) -> mtf.Dimension:
    return mtf.Dimension("d_v", self.value_size)

  def compute_q(self, context, x: mtf.Tensor) -> mtf.Tensor:
    key_dim = self.key_dim(context)
    # The 1/sqrt(d_k) logit scaling is folded into the initializer (none under unit scaling).
    init_scale = 1.0 if mtf.layers.unit_scaling_convention() else 1.0 / key_dim.size
    return self._dense(context, x, [context.model.model_dim], self.key_heads_dims + [key_dim], "q",
                       kernel_initializer=mtf.layers.VarianceScalingInitializer(init_scale))

  def compute_k(self, context, x: mtf.Tensor) -> mtf.Tensor:
    """Keys of the memory input x."""
    return self._dense(context, x, [context.model.model_dim], self.key_heads_dims + [self.key_dim(context)],
                       "k")

  def compute_v(self, context, x: mtf.Tensor) -> mtf.Tensor:
    """Values of the memory input x."""
    return self._dense(context, x, [context.model.model_dim],
                       self.value_heads_dims + [self.value_dim(context)], "v")

  def compute_y(self, context, u: mtf.Tensor) -> mtf.Tensor:
    """The output projection of the attended values u (heads and d_v reduced to d_model)."""
    return self._dense(context, u, self.value_heads_dims + [self.value_dim(context)],
                       [context.model.model_dim], "y")

  def memory_tensors(self, context, m: mtf.Tensor) -> list:
    """What the memory keeps per position: [k, v] (decoding states record these)."""
    return [self.compute_k(context, m), self.compute_v(context, m)]

  def talking_heads(self, context, inp: mtf.Tensor, name: str, input_heads_dims, output_heads_dims,
                    dynamic_projections_from: Optional[Sequence[mtf.Tensor]] = None) -> mtf.Tensor:
    """Maps inp's input heads dims to output heads dims (identity where they coincide).

    dynamic_projections_from: tensors with d_model, each adding a dynamic projection computed from it.
    """
    t, sources = inp, dynamic_projections_from
    shared = [d for d in input_heads_dims if d in output_heads_dims]
    reduced = [d for d in input_heads_dims if d not in output_heads_dims]
    new = [d for d in output_heads_dims if d not in input_heads_dims]
    if not (reduced or new):
      return t
    clashes = {d.name for d in reduced} & {d.name for d in new}
    if clashes:
      raise ValueError(f"{type(self).__name__}: heads dims {input_heads_dims} -> {output_heads_dims} reuse "
                       f"the names {sorted(clashes)} with different sizes; give each role distinct names.")
    if not sources:
      return self._dense(context, t, reduced, new, name, expert_dims=shared)
    with tf.variable_scope(name):
      static = mtf.get_variable(
          t.mesh, "kernel", mtf.Shape(context.model.ensemble_dims + shared + reduced + new),
          initializer=mtf.layers.VarianceScalingInitializer()(reduced, new), dtype=context.variable_dtype)
    init_scale = self.dynamic_projections_init_scale
    if not mtf.layers.unit_scaling_convention():
      init_scale /= mtf.Shape(reduced).size
    projections = [
        self._dense(context, source, [context.model.model_dim], shared + reduced + new,
                    "%s_dynamic_%d" % (name, i),
                    kernel_initializer=mtf.layers.VarianceScalingInitializer(init_scale))
        for i, source in enumerate(sources)]
    projections[0] += static  # the static projection folded into the first dynamic one
    return mtf.add_n([mtf.layers.us_einsum([t, p], reduced_dims=reduced) for p in projections])

  def _sources(self, kind: str, x: mtf.Tensor, m: Optional[mtf.Tensor]) -> list:
    """The inputs of the enabled dynamic projections of the `kind` ("l" or "w") projection."""
    sources = []
    for origin, tensor in (("x", x), ("m", m)):
      if origin + "2" + kind in self.dynamic_projections:
        if tensor is None:
          raise ValueError(f"{type(self).__name__}: dynamic projection {origin}2{kind} needs the memory "
                           f"inputs, which incremental decoding does not keep.")
        sources.append(tensor)
    return sources

  def attention_internal(self, context, x: mtf.Tensor, m: Optional[mtf.Tensor], q: mtf.Tensor,
                         k: mtf.Tensor, v: mtf.Tensor, memory_length: mtf.Dimension, bias) -> mtf.Tensor:
    """Talking-heads attention of q over (k, v), as y = compute_y(u) in x's dim order.

    m is the memory input (over memory_length) for the m2* dynamic projections; None where it is
    not kept (incremental self-attention), which those projections then refuse.
    """
    logits = mtf.layers.us_einsum([q, k], reduced_dims=[self.key_dim(context)])
    logits = self.talking_heads(context, logits, "logits", self.key_heads_dims, self.softmax_heads_dims,
                                self._sources("l", x, m))
    if bias is not None:
      logits += mtf.cast(bias, logits.dtype)
    weights = mtf.softmax(logits, memory_length)
    weights = self.talking_heads(context, weights, "weights", self.softmax_heads_dims, self.value_heads_dims,
                                 self._sources("w", x, m))
    return mtf.transpose(_attend(self, context, weights, v, memory_length), x.shape)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    q = self.compute_q(context, x)
    memory, memory_position = self.update_memory(context, self.memory_tensors(context, x))
    k, v = memory * 2 if len(memory) == 1 else memory
    bias = self.compute_bias(context, memory_position, x, self.softmax_heads_dims, q)
    m = None if context.mode == "incremental" else self.rename_length_to_memory_length(x, context)
    return self.attention_internal(context, x, m, q, k, v, self.memory_length(context), bias)


@gin.configurable(module=GIN_MODULE)
class TalkingHeadsEncDecAttention(TalkingHeadsSelfAttention):
  """Talking-heads attention over context.encoder_output (k/v kept as a constant decoding state).

  Args: relative_attention_type first, the rest as TalkingHeadsSelfAttention's (by keyword).
  """

  def __init__(self, relative_attention_type: Optional[str] = None, **kwargs):
    super().__init__(relative_attention_type=relative_attention_type, **kwargs)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    q = self.compute_q(context, x)
    m, (k, v), memory_length = _enc_dec_memory(self, context)
    bias = enc_dec_attention_bias(self, context, self.softmax_heads_dims)
    return self.attention_internal(context, x, m, q, k, v, memory_length, bias)


class _GeneralBilinearMixin:
  """General bilinear attention: multi-head attention with d_kv = d_model and no k, v projections.

  Projections on both q and k (or v and o) would be redundant, so k = v = the memory input m and
  only `q` [d_model, heads, d_model] (initial variance 1 / d_model**2: the 1/sqrt(d_model) logit
  scaling) and `y` [heads, d_model, d_model] are learned. One set of heads dims (`heads_dims`)
  serves keys, softmax and values.
  """

  def key_dim(self, context) -> mtf.Dimension:
    return context.model.model_dim

  def value_dim(self, context) -> mtf.Dimension:
    return context.model.model_dim

  def memory_tensors(self, context, m: mtf.Tensor) -> list:
    return [m]

  def attention_internal(self, context, q: mtf.Tensor, m: mtf.Tensor, memory_length: mtf.Dimension,
                         bias) -> mtf.Tensor:
    """Attention of q over m (both keys and values), as y = compute_y(u)."""
    logits = mtf.layers.us_einsum([q, m], reduced_dims=[context.model.model_dim])
    if bias is not None:
      logits += mtf.cast(bias, logits.dtype)
    return _attend(self, context, mtf.softmax(logits, memory_length), m, memory_length)


@gin.configurable(module=GIN_MODULE)
class GeneralBilinearSelfAttention(_GeneralBilinearMixin, TalkingHeadsSelfAttention):
  """General bilinear self-attention (see the talking-heads paper): d_kv = d_model, k = v = x."""

  def __init__(self, heads_dims=(("heads", 12),), dropout_rate: float = 0.0,
               relative_attention_type: Optional[str] = None, relative_attention_num_buckets: int = 32):
    super().__init__(key_heads_dims=heads_dims, softmax_heads_dims=heads_dims, value_heads_dims=heads_dims,
                     dropout_rate=dropout_rate, relative_attention_type=relative_attention_type,
                     relative_attention_num_buckets=relative_attention_num_buckets)
    self.heads_dims = self.key_heads_dims

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    q = self.compute_q(context, x)
    (m,), memory_position = self.update_memory(context, [x])
    bias = self.compute_bias(context, memory_position, x, self.heads_dims, q)
    return mtf.transpose(self.attention_internal(context, q, m, self.memory_length(context), bias), x.shape)


@gin.configurable(module=GIN_MODULE)
class GeneralBilinearEncDecAttention(GeneralBilinearSelfAttention):
  """General bilinear attention over context.encoder_output.

  Args: relative_attention_type first, the rest as GeneralBilinearSelfAttention's (by keyword).
  """

  def __init__(self, relative_attention_type: Optional[str] = None, **kwargs):
    super().__init__(relative_attention_type=relative_attention_type, **kwargs)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    q = self.compute_q(context, x)
    _, (m,), memory_length = _enc_dec_memory(self, context)
    bias = enc_dec_attention_bias(self, context, self.heads_dims)
    return mtf.transpose(self.attention_internal(context, q, m, memory_length, bias), x.shape)
