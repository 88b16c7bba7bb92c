"""Attention variants built on SelfAttention: mixture-of-experts projections, Synthesizer,
transparent (encoder-layer-mixing) and branched (weighted-heads) attention.

Re-exported (and gin-registered) as `mesh_tensorflow.transformer.transformer_layers.<Name>`.
"""

from __future__ import annotations

from typing import Optional

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import attention
from mesh_tensorflow.transformer._attention_layers import (
    GIN_MODULE, EncDecAttention, SelfAttention, attention_params, enc_dec_attention)
from mesh_tensorflow.transformer._feed_forward import DenseReluDense


def _experts_hparams(**kwargs):
  from mesh_tensorflow.transformer import moe  # lazily: the layers import without the MoE module
  return moe.HParams(**kwargs)


class _ExpertsAttentionMixin:
  """Builds attention.ExpertsAttentionParams: q and/or the shared k=v from a MoE layer."""

  def _init_experts(self, expert_computation, num_experts, loss_coef, group_size, capacity_factor_train,
                    capacity_factor_eval, moe_gating, min_expert_capacity, switch_policy_train,
                    switch_policy_eval, switch_dropout, switch_temperature, switch_jitter, ntlb_top_k,
                    hidden_size, activation, z_loss):
    if expert_computation not in ("qkv", "q", "kv"):
      raise ValueError(f"{type(self).__name__}: expert_computation={expert_computation!r} is not 'qkv' "
                       f"(queries and keys from one expert layer), 'q' or 'kv' (only those from experts).")
    self.expert_computation = expert_computation
    self.experts_hparams_kwargs = dict(
        num_experts=num_experts, loss_coef=loss_coef, group_size=group_size,
        capacity_factor_train=capacity_factor_train, capacity_factor_eval=capacity_factor_eval,
        moe_gating=moe_gating, min_expert_capacity=min_expert_capacity,
        switch_policy_train=switch_policy_train, switch_policy_eval=switch_policy_eval,
        switch_dropout=switch_dropout, switch_temperature=switch_temperature, switch_jitter=switch_jitter,
        ntlb_top_k=ntlb_top_k, hidden_size=hidden_size, activation=activation, z_loss=z_loss,
        use_experts_attention=True)

  def make_params(self, context) -> attention.AttentionParams:
    heads = [mtf.Dimension("heads", self.num_heads)] if self.num_heads > 1 else None
    return attention.ExpertsAttentionParams(
        context.mesh, query_input_dim=context.model.model_dim, memory_input_dim=context.model.model_dim,
        output_dim=context.model.model_dim, key_dim=self.kv_dim, value_dim=self.kv_dim,
        query_heads_dims=heads, memory_heads_dims=heads, variable_dtype=context.variable_dtype,
        shared_kv=True, ensemble_dim=context.model.ensemble_dim, combine_dims=True,
        fold_scaling_into_initializer=self.fold_scaling_into_initializer, context=context,
        experts_hparams=_experts_hparams(**self.experts_hparams_kwargs),
        expert_computation=self.expert_computation)


_EXPERTS_DEFAULTS = dict(
    expert_computation="qkv", num_experts=16, loss_coef=1e-2, group_size=1024, capacity_factor_train=1.25,
    capacity_factor_eval=2.0,
    moe_gating="switch", min_expert_capacity=4, switch_policy_train="input_jitter",
    switch_policy_eval="input_jitter", switch_dropout=0.0, switch_temperature=1.0, switch_jitter=1e-2,
    ntlb_top_k=4, hidden_size=3072, activation="relu", z_loss=None)


def _split_experts_kwargs(kwargs: dict) -> dict:
  """Pops the MoE settings (with their defaults) out of a layer's kwargs."""
  return {name: kwargs.pop(name, default) for name, default in _EXPERTS_DEFAULTS.items()}


@gin.configurable(module=GIN_MODULE)
class ExpertsSelfAttention(_ExpertsAttentionMixin, SelfAttention):
  """Self-attention whose q and shared k=v projections are a mixture-of-experts layer.

  Takes the SelfAttention arguments plus the MoE1D ones (num_experts, loss_coef, group_size,
  capacity factors, moe_gating, switch_*, ntlb_top_k, hidden_size, activation, z_loss) and
  expert_computation: "qkv" (default: q and k=v from one expert layer), "q" (k=v from the
  variable `kv`) or "kv" (q from the variable `q`).
  """

  def __init__(self, **kwargs):
    experts = _split_experts_kwargs(kwargs)
    kwargs["shared_kv"] = True
    super().__init__(**kwargs)
    self._init_experts(**experts)


@gin.configurable(module=GIN_MODULE)
class ExpertsEncDecAttention(_ExpertsAttentionMixin, EncDecAttention):
  """Encoder-decoder attention with a mixture-of-experts projection.

  expert_computation "q": MoE queries, k=v = encoder output times `kv`; "kv": queries from the
  variable `q`, k=v = a MoE call on the encoder output. The default "qkv" (0.1.21's) makes keys
  from the decoder's own positions, which cannot attend over the encoder: 0.1.21 fails building
  it, and this layer raises a ValueError when called with it.
  """

  def __init__(self, relative_attention_type: Optional[str] = None, **kwargs):
    experts = _split_experts_kwargs(kwargs)
    kwargs["shared_kv"] = True
    super().__init__(relative_attention_type=relative_attention_type, **kwargs)
    self._init_experts(**experts)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    if self.expert_computation == "qkv":
      raise ValueError("ExpertsEncDecAttention: expert_computation='qkv' computes the keys from the decoder "
                       "input, not the encoder output; set expert_computation='q' or 'kv'.")
    return super().call(context, x, losses)


@gin.configurable(module=GIN_MODULE)
class Synthesizer(SelfAttention):
  """Multi-head Synthesizer layer (arXiv:2005.00743) with 0.1.21's variables and math.

  synthesize_mode (see attention.synthetic_attention) also decides the projections, as in 0.1.21,
  whatever shared_kv says: "..._plus..." modes project q, k and v (`q`, `k`, `v`, `o`);
  "..._minus" modes q and a shared k=v (`q`, `kv`, `o`); "random" and "factorized" no query
  (the table replaces the logits; `kv`, `o`). The tables are 512 long (max_length for "random"
  and "dense_minus", whose default is 512), so sequences are at most 512 long. Decodes
  incrementally: keys/values are recorded like SelfAttention's and a step reads its table row.
  """

  def __init__(self, num_heads: int = 8, num_memory_heads: int = 0, key_value_size: int = 128,
               shared_kv: bool = False, dropout_rate: float = 0.0, attention_kwargs: Optional[dict] = None,
               relative_attention_type: Optional[str] = None, relative_attention_num_buckets: int = 32,
               attention_func: Optional[str] = None, combine_dims: bool = True,
               keep_query_heads_dims: bool = False, synthesize_mode: str = "random_plus_alpha",
               fold_scaling_into_initializer: bool = True, **kwargs):
    """Creates the layer (SelfAttention's arguments, plus synthesize_mode)."""
    super().__init__(num_heads=num_heads, num_memory_heads=num_memory_heads, key_value_size=key_value_size,
                     shared_kv=shared_kv, dropout_rate=dropout_rate, attention_kwargs=attention_kwargs,
                     relative_attention_type=relative_attention_type,
                     relative_attention_num_buckets=relative_attention_num_buckets,
                     attention_func=attention_func, combine_dims=combine_dims,
                     keep_query_heads_dims=keep_query_heads_dims,
                     fold_scaling_into_initializer=fold_scaling_into_initializer, **kwargs)
    if synthesize_mode not in attention._SYNTHESIZE_MODES:
      raise ValueError(f"Synthesizer: synthesize_mode={synthesize_mode!r} is not one of "
                       f"{attention._SYNTHESIZE_MODES}.")
    self.synthesize_mode = synthesize_mode
    self.shared_kv = "plus" not in synthesize_mode
    self.no_query = "plus" not in synthesize_mode and "minus" not in synthesize_mode

  def make_params(self, context) -> attention.AttentionParams:
    return attention_params(
        context=context, kv_dim=self.kv_dim, num_heads=self.num_heads, num_memory_heads=self.num_memory_heads,
        shared_kv=self.shared_kv, no_query=self.no_query,
        fold_scaling_into_initializer=self.fold_scaling_into_initializer)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    params = self.make_params(context)
    q = x if self.no_query else params.compute_q(x)
    kv_list = [params.compute_kv(x)] if self.shared_kv else [params.compute_k(x), params.compute_v(x)]
    kv_list, memory_position = self.update_memory(context, kv_list)
    k, v = kv_list * 2 if self.shared_kv else kv_list
    bias = self.compute_bias(context, memory_position, x, params.query_heads_dims, q)
    kwargs = self.attention_kwargs_from_context(context)
    kwargs.pop("z_loss_coeff", None)  # synthetic logits have no z-loss (nor in 0.1.21)
    o = attention.synthetic_attention(q, k, v, self.memory_length(context), self.kv_dim, self.kv_dim, bias,
                                      synthesize=True, synthesize_mode=self.synthesize_mode, context=context,
                                      **kwargs)
    attention_output = params.compute_output(o, output_shape=self.expected_attention_output_shape(x, params))
    return self.layer_output_from_attention_output(context, attention_output, losses)


@gin.configurable(module=GIN_MODULE)
class TransparentEncDecAttention(EncDecAttention):
  """Encoder-decoder attention over a learned mix of encoder layer outputs (Bapna et al. 2018).

  The encoder's outputs after every `layers_per_encoder_module` layers (plus its embedding
  output: encoder_num_modules + 1 candidates) are mixed with softmax weights, variable `w`
  [encoder_module_outputs, decoder_module_inputs]; decoder module i (layers_per_decoder_module
  layers each, by context.layer_index) attends over mix i. The mixes are cached on the context,
  so all decoder layers share `w`. dropout_rate applies to `w` and to the attention weights.
  """

  def __init__(self, layers_per_encoder_module: int, layers_per_decoder_module: int,
               encoder_num_modules: int, decoder_num_modules: int, dropout_rate: float = 0.0, **kwargs):
    super().__init__(dropout_rate=dropout_rate, **kwargs)
    self.layers_per_encoder_module = layers_per_encoder_module
    self.layers_per_decoder_module = layers_per_decoder_module
    self.encoder_num_modules = encoder_num_modules
    self.decoder_num_modules = decoder_num_modules

  def _get_memory_antecedent(self, context) -> mtf.Tensor:
    module = context.layer_index // self.layers_per_decoder_module
    if module >= self.decoder_num_modules:
      raise ValueError(f"TransparentEncDecAttention: decoder layer {context.layer_index} is in module "
                       f"{module}, but decoder_num_modules={self.decoder_num_modules} with "
                       f"layers_per_decoder_module={self.layers_per_decoder_module}.")
    return self._decoder_inputs(context)[module]

  def _decoder_inputs(self, context) -> list:
    if "transparent_decoder_inputs" in context.cache:
      return context.cache["transparent_decoder_inputs"]
    outputs = context.encoder_layer_outputs
    wanted = [i * self.layers_per_encoder_module for i in range(self.encoder_num_modules + 1)]
    if wanted[-1] >= len(outputs):
      raise ValueError(f"TransparentEncDecAttention: {self.encoder_num_modules} encoder modules of "
                       f"{self.layers_per_encoder_module} layers need {wanted[-1] + 1} encoder layer "
                       f"outputs, context.encoder_layer_outputs has {len(outputs)}.")
    candidates_dim = mtf.Dimension("encoder_module_outputs", len(wanted))
    mixes_dim = mtf.Dimension("decoder_module_inputs", self.decoder_num_modules)
    candidates = mtf.stack([mtf.layers.rename_length_to_memory_length(outputs[i]) for i in wanted],
                           candidates_dim.name)
    stddev = 1.0 if mtf.layers.unit_scaling_convention() else candidates_dim.size ** -0.5
    w = mtf.get_variable(context.mesh, "w", mtf.Shape([candidates_dim, mixes_dim]),
                         initializer=tf.random_normal_initializer(stddev=stddev),
                         dtype=context.variable_dtype)
    if context.train and self.dropout_rate:
      w = mtf.dropout(w, context.train, rate=self.dropout_rate)
    mixes = mtf.layers.us_einsum([mtf.softmax(w, candidates_dim), candidates], reduced_dims=[candidates_dim])
    inputs = mtf.unstack(mixes, mixes_dim)
    context.cache["transparent_decoder_inputs"] = inputs
    return inputs


def _normalized(z: mtf.Tensor) -> mtf.Tensor:
  """Non-negative weights summing to 1 (relu, then divided by the sum)."""
  z = mtf.relu(z)
  return z / mtf.reduce_sum(z + 1e-4)


@gin.configurable(module=GIN_MODULE)
class BranchedSelfAttention(SelfAttention):
  """Weighted Transformer attention (Ahmed et al. 2017): every head is its own branch.

  Each head's output is projected to d_model separately, scaled by `kappa` [heads], passed
  through a DenseReluDense shared by the heads, scaled by `alpha` [heads] and summed over heads.
  kappa and alpha (uniform(0, 1) initialised) are used relu-normalised to sum to 1.
  """

  def __init__(self, **kwargs):
    super().__init__(combine_dims=False, keep_query_heads_dims=True, **kwargs)
    if self.num_memory_heads != 0:
      raise ValueError(f"{type(self).__name__}: set num_memory_heads to 0 (got {self.num_memory_heads}); "
                       f"every branch has its own keys and values.")
    self.dense_layer = DenseReluDense()

  def layer_output_from_attention_output(self, context, attention_output: mtf.Tensor, losses) -> mtf.Tensor:
    heads_dim = mtf.Dimension("heads", self.num_heads)

    def branch_weights(name):
      return _normalized(mtf.get_variable(
          context.mesh, name, mtf.Shape([heads_dim]), dtype=context.variable_dtype,
          initializer=tf.random_uniform_initializer(minval=0.0, maxval=1.0)))
    o = attention_output * branch_weights("kappa")
    o = self.dense_layer.call(context, o, losses) * branch_weights("alpha")
    return mtf.reduce_sum(o, reduced_dim=heads_dim)


@gin.configurable(module=GIN_MODULE)
class BranchedEncDecAttention(BranchedSelfAttention):
  """BranchedSelfAttention over the encoder output."""

  def __init__(self, relative_attention_type: Optional[str] = None, **kwargs):
    super().__init__(relative_attention_type=relative_attention_type, **kwargs)

  def call(self, context, x: mtf.Tensor, losses=None) -> mtf.Tensor:
    return enc_dec_attention(self, context.encoder_output, context, x, losses)
