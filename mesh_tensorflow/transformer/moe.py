"""Mixture-of-experts feed-forward layers (arXiv:1701.06538, Switch Transformer arXiv:2101.03961).

Tokens are cut into groups; within a group a learned gate sends each token to its top-1,
top-2 or top-n experts (or each expert picks its tokens: "expert_selection"), each expert taking
at most `expert_capacity` tokens of the group (the rest are dropped: their output is zero and
the residual carries them). Routing is expressed as two
mostly-zero tensors over [group, experts, expert_capacity]: `dispatch` gathers expert inputs and
`combine` weights the expert outputs back. The `experts` dimension of the expert weights can be
split over a mesh dimension (layout `experts:batch`); reshapes between "groups split" and
"experts split" become all-to-alls. A load-balancing loss (scaled by loss_coef) is returned
alongside the output and appended to `context.losses`.
"""

from __future__ import annotations

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer

GIN_MODULE = "mesh_tensorflow.transformer.moe"

_GATINGS = ("top_2", "top_n", "switch", "ntlb", "switch_max", "expert_selection")
_SECOND_POLICIES = ("all", "none", "threshold", "random")
_SWITCH_POLICIES = ("argmax", "sample", "input_dropout", "input_jitter")
_WORD_EMBED_MODES = ("concat", "concat_stop_grad", "add", "add_stop_grad", "embed_only")


class HParams:
  """A bag of `moe_*` hyperparameters (stands in for tensor2tensor's HParams)."""

  def __init__(self, **kwargs):
    for k, v in kwargs.items():
      setattr(self, k, v)

  def add_hparam(self, k: str, v) -> None:
    """Sets (or overrides) hyperparameter k to v, as 0.1.21's HParams.add_hparam does."""
    setattr(self, k, v)


def hparams_from_layer_arguments(arguments: dict) -> HParams:
  """A layer's constructor arguments as checked `moe_*` hparams: x becomes moe_x.

  `self` and `activation` (a call argument, not an hparam) are left out; names already starting
  with `moe_` (moe_gating, moe_num_layers) keep theirs.
  """
  hparams = HParams(**{name if name.startswith("moe_") else "moe_" + name: value
                       for name, value in arguments.items() if name not in ("self", "activation")})
  _check_hparams(hparams)
  return hparams


def set_default_moe_hparams(hparams) -> None:
  """Adds 0.1.21's mixture-of-experts defaults to an HParams-like object (GPT-Neo's entry point).

  Sets `moe_num_experts` = 16 and `moe_loss_coef` = 1e-2 as attributes and adds, through
  `hparams.add_hparam`, moe_gating "top_2", moe_capacity_factor_train 1.25 / _eval 2.0 /
  _second_level 1.0, moe_hidden_size 4096, moe_group_size 1024, moe_use_second_place_loss 0,
  moe_second_policy_train/_eval "random" and moe_second_threshold_train/_eval 0.2. Callers add
  the rest transformer_moe_layer_v1 reads (e.g. moe_min_expert_capacity) themselves.

  Args:
    hparams: an object with `add_hparam(name, value)` (e.g. moe.HParams()).
  """
  hparams.moe_num_experts = 16
  hparams.moe_loss_coef = 1e-2
  for name, value in _DEFAULT_MOE_HPARAMS:
    hparams.add_hparam(name, value)


_DEFAULT_MOE_HPARAMS = (
    ("moe_gating", "top_2"),
    # Experts have a fixed capacity per group; the factors (>= 1) leave room for imbalance.
    ("moe_capacity_factor_train", 1.25),
    ("moe_capacity_factor_eval", 2.0),
    ("moe_capacity_factor_second_level", 1.0),
    ("moe_hidden_size", 4096),
    ("moe_group_size", 1024),
    ("moe_use_second_place_loss", 0),
    # When top-2 gating uses the second expert: "all", "none", "threshold" or "random".
    ("moe_second_policy_train", "random"),
    ("moe_second_policy_eval", "random"),
    ("moe_second_threshold_train", 0.2),
    ("moe_second_threshold_eval", 0.2),
)


def _check_choice(what: str, value, choices: tuple) -> None:
  if value not in choices:
    raise ValueError(f"MoE: {what}={value!r} is not one of {choices}.")


def _check_hparams(hparams: HParams) -> None:
  """Construction-time checks of the gating choices (so a bad gin binding fails early)."""
  _check_choice("moe_gating", hparams.moe_gating, _GATINGS)
  for key in ("moe_second_policy_train", "moe_second_policy_eval"):
    _check_choice(key, getattr(hparams, key), _SECOND_POLICIES)
  for key in ("moe_switch_policy_train", "moe_switch_policy_eval"):
    if hasattr(hparams, key):
      _check_choice(key, getattr(hparams, key), _SWITCH_POLICIES)
  if getattr(hparams, "moe_word_embed_mode", None) is not None:
    _check_choice("moe_word_embed_mode", hparams.moe_word_embed_mode, _WORD_EMBED_MODES)


@gin.configurable(module=GIN_MODULE)
class MoE1D(transformer.TransformerLayer):
  """A mixture of `num_experts` dense-relu-dense experts in place of one feed-forward layer.

  Variables: `gating/kernel` [d_model, expert_unsplit] (or `switch_gating` / `ntlb_gating`),
  `wi/kernel` [experts, d_model, expert_hidden] and `wo/kernel` [experts, expert_hidden, output]
  (with use_experts_attention: `q_wo` and `k_wo` instead of `wo`, and call returns [q, k]).
  moe_gating is "top_2", "top_n" (top_n_num_experts_per_token choices), "switch" (top-1),
  "ntlb" (top-1, overflow goes to the next choices), "switch_max" (top-1, each expert keeps its
  highest-gate tokens) or "expert_selection" (each expert picks its tokens).
  use_second_place_expert_prob (switch, ntlb, switch_max; training only): the probability that
  a token is routed past its top expert, to its second (or, with use_second_place_expert_prob_temp,
  to one sampled at that temperature from the others).
  Example (gin): `decoder/make_layer_stack.layers = [@SelfAttention, @EncDecAttention, @moe.MoE1D]`.
  """

  def __init__(self, num_experts=16, loss_coef=1e-2, hidden_size=4096, group_size=1024,
               capacity_factor_train=1.25, capacity_factor_eval=2.0, use_second_place_loss=False,
               second_policy_train="random", second_policy_eval="random", second_threshold_train=0.2,
               second_threshold_eval=0.2, dropout_rate=0.0, activation="relu", moe_gating="top_2",
               min_expert_capacity=4, switch_policy_train="input_jitter", switch_policy_eval="input_jitter",
               switch_dropout=0.1, switch_temperature=1.0, switch_jitter=1e-2, ntlb_top_k=4,
               output_dim=None, use_experts_attention=False, z_loss=None, word_embed_mode=None,
               use_second_place_expert_prob=None, use_second_place_expert_prob_temp=None,
               top_n_num_experts_per_token=3):
    self._hparams = hparams_from_layer_arguments(locals())
    self._activation = activation

  def call(self, context, x, losses=None):
    """x: [batch..., length, d_model] (or [batch..., d_model] when decoding one position)."""
    del losses
    if context.model.ensemble_dims:
      raise NotImplementedError("MoE1D: ensembles (Unitransformer ensemble=...) are not supported.")
    x_shape = x.shape
    has_length_dim = context.length_dim in x_shape.dims
    token_embeddings = None
    if self._hparams.moe_word_embed_mode is not None:
      token_embeddings = getattr(context, "input_embeddings", None)
      if token_embeddings is None:
        raise ValueError("MoE1D: word_embed_mode routes on the token embeddings, but "
                         "context.input_embeddings is None; set it to the embedded input tokens.")
    if not has_length_dim:  # incremental decoding: one position, a length-1 dim for the grouping
      with_length = lambda t: mtf.reshape(t, mtf.Shape(t.shape.dims[:-1] + [mtf.Dimension("length", 1)]
                                                       + t.shape.dims[-1:]))
      x = with_length(x)
      token_embeddings = None if token_embeddings is None else with_length(token_embeddings)
    output_dim = self._hparams.moe_output_dim or context.model.model_dim
    y, loss = transformer_moe_layer_v1(
        x, output_dim, self._hparams, context.train, context.variable_dtype, layout=context.model.layout,
        mesh_shape=context.model.mesh_shape, nonpadding=context.nonpadding, activation=self._activation,
        num_microbatches=context.num_microbatches, token_embeddings=token_embeddings)
    if context.losses is not None:
      context.losses.append(loss)
    if not has_length_dim:
      out_shape = lambda t: mtf.Shape(x_shape.dims[:-1] + t.shape.dims[-1:])
      y = [mtf.reshape(t, out_shape(t)) for t in y] if isinstance(y, list) else mtf.reshape(y, out_shape(y))
    return y


@gin.configurable(module=GIN_MODULE)
class MoE2D(transformer.TransformerLayer):
  """A two-level (hierarchical) mixture of expert_x * expert_y experts, top-2 gated at each level.

  Variables: `outer_gating/kernel` [d_model, expert_x_unsplit], `inner_gating/kernel`
  [expert_x, d_model, expert_y_unsplit], `wi/kernel` [expert_y, expert_x, d_model, expert_hidden],
  `wo/kernel` [expert_y, expert_x, expert_hidden, d_model].
  """

  def __init__(self, expert_x=8, expert_y=8, loss_coef=1e-2, hidden_size=4096, group_size=1024,
               capacity_factor_train=1.25, capacity_factor_eval=2.0, capacity_factor_second_level=1.0,
               use_second_place_loss=False, second_policy_train="random", second_policy_eval="random",
               second_threshold_train=0.2, second_threshold_eval=0.2, min_expert_capacity=4):
    self._hparams = HParams(
        moe_gating="top_2", moe_num_experts=[expert_x, expert_y], moe_loss_coef=loss_coef,
        moe_hidden_size=hidden_size, moe_group_size=group_size, moe_min_expert_capacity=min_expert_capacity,
        moe_capacity_factor_train=capacity_factor_train, moe_capacity_factor_eval=capacity_factor_eval,
        moe_capacity_factor_second_level=capacity_factor_second_level,
        moe_use_second_place_loss=use_second_place_loss, moe_second_policy_train=second_policy_train,
        moe_second_policy_eval=second_policy_eval, moe_second_threshold_train=second_threshold_train,
        moe_second_threshold_eval=second_threshold_eval, moe_z_loss=None)
    _check_hparams(self._hparams)

  def call(self, context, x, losses=None):
    """x: [batch..., length, d_model]."""
    del losses
    if context.model.ensemble_dims:
      raise NotImplementedError("MoE2D: ensembles (Unitransformer ensemble=...) are not supported.")
    if context.length_dim not in x.shape.dims:
      raise ValueError(f"MoE2D: input {x.shape} has no length dimension {context.length_dim}; MoE2D "
                       f"does not support incremental decoding, use MoE1D.")
    y, loss = transformer_moe_layer_v2(
        x, context.model.model_dim, self._hparams, context.train, context.variable_dtype,
        layout=context.model.layout, mesh_shape=context.model.mesh_shape, nonpadding=context.nonpadding,
        num_microbatches=context.num_microbatches)
    if context.losses is not None:
      context.losses.append(loss)
    return y


def _split_into_groups(n: int, max_group_size: int, mesh_dim_size: int) -> tuple:
  """n = num_groups * group_size, num_groups a multiple of mesh_dim_size (the groups split evenly
  over that mesh dim): the smallest such num_groups >= n // max_group_size dividing n.
  """
  if n % mesh_dim_size != 0:
    raise ValueError(f"MoE: the {n} tokens per outer batch are not divisible by mesh_dim_size="
                     f"{mesh_dim_size} (the split of the batch dimension); change the batch size or layout.")
  num_groups = max(1, n // max_group_size)
  while num_groups % mesh_dim_size != 0 or n % num_groups != 0:
    num_groups += 1
  return num_groups, n // num_groups


def _batch_split(layout, mesh_shape, batch_dim) -> int:
  """How many ways the model's layout splits batch_dim (1 without a layout)."""
  return mtf.tensor_dim_to_mesh_dim_size(layout or "", mesh_shape or "", batch_dim)


def _expert_capacity(group_size: int, capacity_factor: float, num_experts: int, min_capacity: int) -> int:
  capacity = min(group_size, int((group_size * capacity_factor) / num_experts))
  return max(capacity, min_capacity)


def _broadcast_nonpadding(nonpadding, inputs, dims):
  """nonpadding (None, 1 or a tensor over a subset of dims) as a float tensor over dims."""
  if nonpadding is None:
    return None
  return mtf.zeros(inputs.mesh, dims, dtype=inputs.dtype) + nonpadding


def gate(hparams, group_size_dim: mtf.Dimension, **gating_kwargs):
  """(dispatch, combine, loss) of the gating hparams.moe_gating names, on one group of tokens.

  Expert selection normalises over the group, so (as in 0.1.21) it alone is handed the group dim.
  """
  gating_fn = {"top_2": _top_2_gating, "top_n": _top_n_gating, "switch": _switch_gating, "ntlb": _ntlb_gating,
               "switch_max": _switch_max_gating,
               "expert_selection": _expert_selection_gating}.get(hparams.moe_gating)
  if gating_fn is None:
    raise ValueError(f"mixture of experts: unknown hparams.moe_gating={hparams.moe_gating!r}; "
                     f"use one of {_GATINGS}.")
  if hparams.moe_gating == "expert_selection":
    gating_kwargs["group_size_dim"] = group_size_dim
  return gating_fn(hparams=hparams, **gating_kwargs)


def transformer_moe_layer_v1(inputs, output_dim, hparams, train, variable_dtype, layout=None,
                             mesh_shape=None, nonpadding=None, activation=mtf.relu, num_microbatches=None,
                             token_embeddings=None):
  """One-level mixture of experts on inputs [outer_batch?, batch, length, d_model].

  Returns (output [batch dims, length, output_dim], loss * moe_loss_coef); with
  hparams.moe_use_experts_attention the output is [q, k], two projections of the expert hidden layer.
  The tokens of each outer batch are cut into groups of at most moe_group_size, their number a
  multiple of the split of the batch dimension under (layout, mesh_shape); each expert takes at
  most capacity = max(min_expert_capacity, group_size * capacity_factor / num_experts) tokens
  of a group. `nonpadding` (broadcastable to the token dims, 0 at padding) keeps padding unrouted.
  Dims: outer_batch O, groups G (named like the batch dim), group S, experts E, capacity C.
  """
  batch_and_length_dims, input_dim = inputs.shape.dims[:-1], inputs.shape.dims[-1]
  if inputs.shape.dims[0].name == "outer_batch":
    outer_batch_dim, orig_batch_dim = inputs.shape.dims[:2]
  else:
    outer_batch_dim, orig_batch_dim = mtf.Dimension("outer_batch", 1), inputs.shape.dims[0]
  n = mtf.Shape(batch_and_length_dims).size // outer_batch_dim.size
  mesh_dim_size = _batch_split(layout, mesh_shape, orig_batch_dim)
  num_groups, group_size = _split_into_groups(n, hparams.moe_group_size, mesh_dim_size)
  group_size_dim = mtf.Dimension("group", group_size)
  num_groups_dim = mtf.Dimension(orig_batch_dim.name, num_groups)
  experts_dim = mtf.Dimension("experts", hparams.moe_num_experts)
  experts_dim_unsplit = mtf.Dimension("expert_unsplit", experts_dim.size)
  batch_dim_unsplit = mtf.Dimension("batch_unsplit", num_groups)
  moe_input_dims = [outer_batch_dim, num_groups_dim, group_size_dim, input_dim]
  inputs = mtf.reshape(inputs, moe_input_dims)  # [O, G, S, M]
  if getattr(hparams, "moe_word_embed_mode", None) is not None:
    if token_embeddings is None:
      raise ValueError(f"transformer_moe_layer_v1: hparams.moe_word_embed_mode="
                       f"{hparams.moe_word_embed_mode!r} needs token_embeddings shaped like the inputs.")
    token_embeddings = mtf.cast(mtf.reshape(token_embeddings, moe_input_dims), inputs.dtype)

  capacity_factor = hparams.moe_capacity_factor_train if train else hparams.moe_capacity_factor_eval
  expert_capacity_dim = mtf.Dimension("expert_capacity", _expert_capacity(
      group_size, capacity_factor, experts_dim.size, hparams.moe_min_expert_capacity))
  nonpadding = _broadcast_nonpadding(nonpadding, inputs, batch_and_length_dims)
  if nonpadding is not None:
    nonpadding = mtf.reshape(nonpadding, moe_input_dims[:-1])
  dispatch_tensor, combine_tensor, loss = gate(
      hparams, group_size_dim, inputs=inputs, outer_expert_dims=None, experts_dim=experts_dim_unsplit,
      expert_capacity_dim=expert_capacity_dim, train=train, variable_dtype=variable_dtype,
      importance=nonpadding, num_microbatches=num_microbatches, token_embeddings=token_embeddings)

  # [O, E, G, C, M], then regroup so that experts (not groups) are the split dim: an all-to-all.
  expert_inputs = mtf.einsum([inputs, dispatch_tensor], mtf.Shape(
      [outer_batch_dim, experts_dim_unsplit, num_groups_dim, expert_capacity_dim, input_dim]))
  # Renaming d_model first makes the regroup a slice when d_model is split (model parallelism).
  d_model_split_dim = mtf.Dimension("d_model_split", input_dim.size)
  expert_inputs = mtf.reshape(expert_inputs, mtf.Shape(
      [outer_batch_dim, experts_dim, batch_dim_unsplit, expert_capacity_dim, d_model_split_dim]))
  expert_inputs = mtf.reshape(expert_inputs, mtf.Shape(
      [outer_batch_dim, experts_dim, batch_dim_unsplit, expert_capacity_dim, input_dim]))

  hidden_dim = mtf.Dimension("expert_hidden", hparams.moe_hidden_size)
  h = mtf.layers.dense_product(
      expert_inputs, reduced_dims=expert_inputs.shape.dims[-1:], new_dims=[hidden_dim],
      expert_dims=[experts_dim], activation_functions=activation, use_bias=False,
      variable_dtype=variable_dtype, name="wi")
  if hparams.moe_dropout_rate:
    h = mtf.dropout(h, train, rate=hparams.moe_dropout_rate)

  def combine(name):
    expert_output = mtf.layers.dense(
        h, output_dim, expert_dims=[experts_dim], use_bias=False, reduced_dims=h.shape.dims[-1:],
        variable_dtype=variable_dtype, name=name)
    expert_output = mtf.reshape(expert_output, mtf.Shape(
        [outer_batch_dim, experts_dim_unsplit, num_groups_dim, expert_capacity_dim,
         mtf.Dimension("d_model_split", output_dim.size)]))
    expert_output = mtf.reshape(expert_output, mtf.Shape(
        [outer_batch_dim, experts_dim_unsplit, num_groups_dim, expert_capacity_dim, output_dim]))
    output = mtf.einsum([expert_output, combine_tensor], mtf.Shape(moe_input_dims[:-1] + [output_dim]))
    return mtf.reshape(output, batch_and_length_dims + [output_dim])

  if getattr(hparams, "moe_use_experts_attention", False):
    outputs = [combine("q_wo"), combine("k_wo")]  # k is shared with v: no measured loss in quality
  else:
    outputs = combine("wo")
  return outputs, loss * hparams.moe_loss_coef


def transformer_moe_layer_v2(inputs, output_dim, hparams, train, variable_dtype, layout=None,
                             mesh_shape=None, nonpadding=None, num_microbatches=None):
  """Two-level mixture of experts on inputs [a, b, l, m] (or [b, l, m]).

  Level one routes groups of tokens (g groups of s, g split like b) top-2 among expert_x groups
  of experts; each expert-group's inputs (an all-to-all makes x the split dim) are regrouped
  (h groups of t, h split like a) and routed top-2 among expert_y experts, with importance 1
  for first-choice and 0.5 for second-choice tokens (the second choice takes one inner expert).
  The expert weights have dims [expert_y, expert_x, ...]. Returns (output, (loss_outer +
  loss_inner) * moe_loss_coef).
  """
  if len(hparams.moe_num_experts) != 2:
    raise ValueError(f"transformer_moe_layer_v2: hparams.moe_num_experts={hparams.moe_num_experts!r} "
                     f"must be [expert_x, expert_y].")
  nonpadding = _broadcast_nonpadding(nonpadding, inputs, inputs.shape.dims[:-1])
  insert_outer_batch_dim = len(inputs.shape.dims) == 3
  if insert_outer_batch_dim:
    inputs = mtf.reshape(inputs, [mtf.Dimension("outer_batch", 1)] + inputs.shape.dims)
    if nonpadding is not None:
      nonpadding = mtf.reshape(nonpadding, inputs.shape.dims[:-1])
  if len(inputs.shape.dims) != 4:
    raise ValueError(f"transformer_moe_layer_v2: inputs {inputs.shape} must be [outer_batch, batch, "
                     f"length, d_model] or [batch, length, d_model].")
  a0, b1, l, m = inputs.shape.dims
  hidden_dim = mtf.Dimension("expert_hidden", hparams.moe_hidden_size)
  x1 = mtf.Dimension("expert_x", hparams.moe_num_experts[0])
  y0 = mtf.Dimension("expert_y", hparams.moe_num_experts[1])
  x = mtf.Dimension("expert_x_unsplit", x1.size)
  y = mtf.Dimension("expert_y_unsplit", y0.size)
  n = output_dim

  num_groups, group_size = _split_into_groups(
      b1.size * l.size, hparams.moe_group_size, _batch_split(layout, mesh_shape, b1))
  g1 = mtf.Dimension(b1.name, num_groups)
  g = mtf.Dimension(b1.name + "_unsplit", num_groups)
  s = mtf.Dimension("group_size_x", group_size)
  capacity_factor = hparams.moe_capacity_factor_train if train else hparams.moe_capacity_factor_eval
  c = mtf.Dimension("expert_capacity_x", _expert_capacity(
      s.size, capacity_factor, x.size, hparams.moe_min_expert_capacity))
  num_groups, group_size = _split_into_groups(
      a0.size * g.size * c.size, hparams.moe_group_size,
      _batch_split(layout, mesh_shape, a0))
  t = mtf.Dimension("group_size_y", group_size)
  h0 = mtf.Dimension(a0.name, num_groups)
  h = mtf.Dimension(a0.name + "_unsplit", num_groups)
  d = mtf.Dimension("expert_capacity_y", _expert_capacity(
      t.size, hparams.moe_capacity_factor_second_level, y.size, hparams.moe_min_expert_capacity))

  inputs = mtf.reshape(inputs, [a0, g1, s, m])
  if nonpadding is not None:
    nonpadding = mtf.reshape(nonpadding, [a0, g1, s])
  dispatch_x, combine_x, loss_outer = _top_2_gating(
      inputs=inputs, outer_expert_dims=None, experts_dim=x, expert_capacity_dim=c, hparams=hparams,
      train=train, variable_dtype=variable_dtype, name="outer_gating", importance=nonpadding,
      num_microbatches=num_microbatches)
  expert_inputs_x = mtf.einsum([inputs, dispatch_x], mtf.Shape([x, a0, g1, c, m]))
  # Importance for the inner gating: 1 for a first choice, 0.5 for a second choice, 0 for an empty slot.
  importance = mtf.reduce_sum(combine_x, output_shape=[x, a0, g1, c])
  importance = 0.5 * (mtf.to_float(mtf.greater(importance, 0.5)) + mtf.to_float(mtf.greater(importance, 0.0)))
  expert_inputs_x = mtf.reshape(expert_inputs_x, mtf.Shape([x1, a0, g, c, m]))  # all-to-all g1 -> x1
  importance = mtf.reshape(importance, [x1, a0, g, c])
  inputs_y = mtf.reshape(expert_inputs_x, [x1, h0, t, m])
  importance = mtf.reshape(importance, [x1, h0, t])
  dispatch_y, combine_y, loss_inner = _top_2_gating(
      inputs=inputs_y, outer_expert_dims=[x1], experts_dim=y, expert_capacity_dim=d, hparams=hparams,
      train=train, variable_dtype=variable_dtype, importance=importance, name="inner_gating",
      num_microbatches=num_microbatches)
  expert_inputs_y = mtf.einsum([inputs_y, dispatch_y], mtf.Shape([y, x1, h0, d, m]))
  expert_inputs_y = mtf.reshape(expert_inputs_y, mtf.Shape([y0, x1, h, d, m]))  # all-to-all h0 -> y0

  hidden_output = mtf.layers.dense(
      expert_inputs_y, hidden_dim, expert_dims=[y0, x1], reduced_dims=expert_inputs_y.shape.dims[-1:],
      activation=mtf.relu, use_bias=False, variable_dtype=variable_dtype, name="wi")
  expert_output = mtf.layers.dense(
      hidden_output, output_dim, expert_dims=[y0, x1], reduced_dims=hidden_output.shape.dims[-1:],
      use_bias=False, variable_dtype=variable_dtype, name="wo")

  expert_output = mtf.reshape(expert_output, mtf.Shape([y, x1, h0, d, n]))  # all-to-all y0 -> h0
  output_y = mtf.einsum([expert_output, combine_y], mtf.Shape([x1, h0, t, n]))
  output = mtf.reshape(output_y, [x1, a0, g, c, n])
  expert_output_x = mtf.reshape(output, mtf.Shape([x, a0, g1, c, n]))  # all-to-all x1 -> g1
  output_x = mtf.einsum([expert_output_x, combine_x], mtf.Shape([a0, g1, s, n]))
  output = mtf.reshape(output_x, [a0, b1, l, n])
  if insert_outer_batch_dim:
    output = mtf.reshape(output, [b1, l, n])
  return output, (loss_outer + loss_inner) * hparams.moe_loss_coef


def _with_token_embeddings(gate_inputs, token_embeddings, hparams):
  """The router's inputs with the token embeddings mixed in per hparams.moe_word_embed_mode.

  "concat" / "add" (each optionally "_stop_grad": no gradient through the embeddings) or
  "embed_only" (route on the embeddings alone); None leaves the inputs as they are.
  """
  mode = getattr(hparams, "moe_word_embed_mode", None)
  if mode is None:
    return gate_inputs
  gate_inputs, token_embeddings = mtf.to_float(gate_inputs), mtf.to_float(token_embeddings)
  if mode.endswith("_stop_grad"):
    token_embeddings = mtf.stop_gradient(token_embeddings)
  if mode.startswith("concat"):
    return mtf.concat([gate_inputs, token_embeddings], gate_inputs.shape.dims[-1].name)
  if mode.startswith("add"):
    return gate_inputs + token_embeddings
  return token_embeddings


def _gate_logits(inputs, experts_dim, outer_expert_dims, variable_dtype, name):
  return mtf.layers.dense(inputs, experts_dim, use_bias=False, expert_dims=outer_expert_dims,
                          reduced_dims=inputs.shape.dims[-1:], variable_dtype=variable_dtype, name=name)


def _load_balance_loss(mask, gates, group_size_dim, experts_dim):
  """E^2 * mean over groups and experts of (fraction routed to e) * (mean gate of e).

  It is 1 for perfectly balanced routing, up to E when everything goes to one expert.
  """
  density = mtf.reduce_mean(mask, reduced_dim=group_size_dim)
  density_proxy = mtf.reduce_mean(gates, reduced_dim=group_size_dim)
  return mtf.reduce_mean(density_proxy * density) * float(experts_dim.size * experts_dim.size)


def _switch_balance_loss(mask, raw_gates, group_size_dim, experts_dim, importance):
  """The Switch gatings' load-balancing loss, as 0.1.21 computes it.

  Density and gate proxy are averaged over all tokens of the group (padding included); with
  importance, 0.1.21 then multiplies the [<batch>, experts] product by the [<batch>, group]
  routed-token mask, so each group's term is scaled by its fraction of routed tokens.
  """
  density = mtf.reduce_mean(mask, reduced_dim=group_size_dim)
  density_proxy = mtf.reduce_mean(raw_gates, reduced_dim=group_size_dim)
  if importance is not None:
    density_proxy *= mtf.to_float(mtf.equal(importance, 1.0))
  return mtf.reduce_mean(density_proxy * density) * float(experts_dim.size * experts_dim.size)


def _router_z_loss(logits, experts_dim, importance):
  """Mean over routed tokens of logsumexp(gate logits)^2 (keeps the router logits small)."""
  log_z = mtf.reduce_logsumexp(mtf.to_float(logits), experts_dim)
  z_loss = mtf.square(log_z)
  if importance is None:
    return mtf.reduce_mean(z_loss)
  routed = mtf.to_float(mtf.equal(importance, 1.0))
  return mtf.reduce_sum(z_loss * routed) / mtf.maximum(mtf.reduce_sum(routed), 1.0)


def _finish_loss(loss, gate_logits, experts_dim, hparams, importance, num_microbatches, train):
  """Adds the router z-loss (in training only, as 0.1.21) and spreads the loss over microbatches."""
  if train and getattr(hparams, "moe_z_loss", None) is not None:
    loss += hparams.moe_z_loss * _router_z_loss(gate_logits, experts_dim, importance)
  if num_microbatches and num_microbatches > 1:
    loss /= num_microbatches
  return loss


def _slot_one_hot(position, expert_capacity_dim):
  return mtf.one_hot(mtf.to_int32(position), expert_capacity_dim, dtype=tf.float32)


def _finish_routing(combine_tensor, loss, inputs):
  """combine in the inputs' dtype; dispatch = (combine != 0)."""
  combine_tensor = mtf.cast(combine_tensor, inputs.dtype)
  dispatch_tensor = mtf.cast(mtf.cast(combine_tensor, tf.bool), combine_tensor.dtype)
  return dispatch_tensor, combine_tensor, mtf.cast(loss, inputs.dtype)


def _first_choice(gate, index, raw_gates, experts_dim, importance):
  """(gate, one-hot mask, density proxy for the load-balancing loss) of the first choice.

  Tokens whose importance is not 1 take no first choice: their gate, mask and proxy are zero.
  """
  mask = mtf.one_hot(index, experts_dim, dtype=tf.float32)
  density_proxy = raw_gates
  if importance is not None:
    routed = mtf.to_float(mtf.equal(importance, 1.0))
    mask *= routed
    gate *= routed
    density_proxy *= routed
  return gate, mask, density_proxy


def _take_slots(mask, group_size_dim, experts_dim, capacity: float, taken=None):
  """Expert slots in token order, after `taken` slots per expert; tokens past `capacity` drop.

  mask [<batch>, group, experts] (one-hot or zero per token). Returns the mask without the
  dropped tokens, its sum over experts (1 for a placed token) and each token's slot position.
  """
  position = mtf.cumsum(mask, group_size_dim, exclusive=True)
  if taken is not None:
    position += taken
  position *= mask
  mask *= mtf.to_float(mtf.less(position, capacity))
  placed = mtf.reduce_sum(mask, reduced_dim=experts_dim)
  return mask, placed, mtf.reduce_sum(position, reduced_dim=experts_dim)


def _apply_second_policy(mask, gate, hparams, train):
  """mask of a lower-ranked choice, kept per hparams.moe_second_policy_{train,eval}.

  "all" keeps it, "none" drops it, "threshold" keeps it where gate > threshold, "random"
  with probability min(1, gate / threshold).
  """
  policy = hparams.moe_second_policy_train if train else hparams.moe_second_policy_eval
  threshold = hparams.moe_second_threshold_train if train else hparams.moe_second_threshold_eval
  _check_choice("second-place policy", policy, _SECOND_POLICIES)
  if policy == "none":
    return mtf.zeros_like(mask)
  if policy == "threshold":
    return mask * mtf.to_float(mtf.greater(gate, threshold))
  if policy == "random":
    keep = mtf.less(mtf.random_uniform(gate.mesh, gate.shape), gate / max(threshold, 1e-9))
    return mask * mtf.to_float(keep)
  return mask


def _top_2_gating(inputs, outer_expert_dims, experts_dim, expert_capacity_dim, hparams, train, variable_dtype,
                  importance=None, name="top_2_gating", num_microbatches=None, token_embeddings=None):
  """Top-2 gating: every token goes to its best expert and maybe its second best.

  inputs [<batch>, group, d_model]; importance [<batch>, group]: 1 routes a token to up to two
  experts, a value in (0, 1) to one (its best expert, after the first choices), 0 to none.
  The second choice is kept per hparams.moe_second_policy_{train,eval}: "all", "none",
  "threshold" (gate_2 > threshold) or "random" (with probability min(1, gate_2 / threshold)).
  Within a group, first choices take expert slots in token order, then second choices; tokens
  past the capacity are dropped. The two gates are renormalised to sum to 1 before dropping.
  Returns dispatch and combine tensors [<batch>, group, experts, expert_capacity] and the
  load-balancing loss on first choices (plus half the second-place loss if
  moe_use_second_place_loss, plus the optional z-loss).
  """
  group_size_dim = inputs.shape.dims[-2]
  gate_logits = _gate_logits(_with_token_embeddings(inputs, token_embeddings, hparams), experts_dim,
                             outer_expert_dims, variable_dtype, name)
  raw_gates = mtf.to_float(mtf.softmax(gate_logits, experts_dim))  # routing runs in float32
  expert_capacity_f = float(expert_capacity_dim.size)

  gate_1, index_1 = mtf.top_1(raw_gates, experts_dim)
  gate_1, mask_1, density_1_proxy = _first_choice(gate_1, index_1, raw_gates, experts_dim, importance)
  gates_without_top_1 = raw_gates * (1.0 - mask_1)
  gate_2, index_2 = mtf.top_1(gates_without_top_1, experts_dim)
  mask_2 = mtf.one_hot(index_2, experts_dim, dtype=tf.float32)
  if importance is not None:
    mask_2 *= mtf.to_float(mtf.greater(importance, 0.0))
  denom = gate_1 + gate_2 + 1e-9
  gate_1 /= denom
  gate_2 /= denom

  loss = _load_balance_loss(mask_1, density_1_proxy, group_size_dim, experts_dim)
  if hparams.moe_use_second_place_loss:
    normalized = gates_without_top_1 / (mtf.reduce_sum(gates_without_top_1, reduced_dim=experts_dim) + 1e-9)
    loss += 0.5 * _load_balance_loss(mask_2, normalized, group_size_dim, experts_dim)
  loss = _finish_loss(loss, gate_logits, experts_dim, hparams, importance, num_microbatches, train)

  mask_2 = _apply_second_policy(mask_2, gate_2, hparams, train)

  # Slots: first choices in token order, then second choices after them.
  mask_1, mask_1_flat, position_in_expert_1 = _take_slots(mask_1, group_size_dim, experts_dim,
                                                          expert_capacity_f)
  gate_1 *= mask_1_flat
  _, mask_2_flat, position_in_expert_2 = _take_slots(
      mask_2, group_size_dim, experts_dim, expert_capacity_f,
      taken=mtf.reduce_sum(mask_1, reduced_dim=group_size_dim))
  gate_2 *= mask_2_flat

  combine_tensor = (
      gate_1 * mtf.one_hot(index_1, experts_dim, dtype=tf.float32)
      * _slot_one_hot(position_in_expert_1, expert_capacity_dim)
      + gate_2 * mtf.one_hot(index_2, experts_dim, dtype=tf.float32)
      * _slot_one_hot(position_in_expert_2, expert_capacity_dim))
  return _finish_routing(combine_tensor, loss, inputs)


def _switch_inputs_and_policy(inputs, hparams, train):
  """The train/eval switch policy, and the inputs perturbed as it asks (training only)."""
  policy = hparams.moe_switch_policy_train if train else hparams.moe_switch_policy_eval
  _check_choice("switch policy", policy, _SWITCH_POLICIES)
  if train and policy == "input_dropout":
    inputs = mtf.dropout(inputs, train, rate=hparams.moe_switch_dropout)
  elif train and policy == "input_jitter":
    inputs = mtf.layers.multiplicative_jitter(inputs, hparams.moe_switch_jitter)
  return inputs, policy


def _switch_choice(gate_logits, raw_gates, experts_dim, policy, hparams):
  """(gate, index) of the chosen expert: argmax, or sampled at moe_switch_temperature."""
  if policy == "sample":
    index = mtf.sample_with_temperature(gate_logits, experts_dim, temperature=hparams.moe_switch_temperature)
    return mtf.gather(raw_gates, index, experts_dim), index
  return mtf.top_1(raw_gates, experts_dim)


def _switch_gating(inputs, outer_expert_dims, experts_dim, expert_capacity_dim, hparams, train,
                   variable_dtype, importance=None, name="switch_gating", num_microbatches=None,
                   token_embeddings=None):
  """Top-1 (Switch) gating: each token goes to one expert, weighted by that expert's probability.

  hparams.moe_switch_policy_{train,eval}: "argmax", "sample" (from the gate distribution at
  moe_switch_temperature), "input_dropout" / "input_jitter" (perturb the inputs in training,
  then argmax). Tokens past an expert's capacity (in token order) are dropped. Returns dispatch,
  combine [<batch>, group, experts, expert_capacity] and the load-balancing loss.
  """
  return _switch_choices_gating(inputs, outer_expert_dims, experts_dim, expert_capacity_dim, hparams, train,
                                variable_dtype, importance, name, num_microbatches, num_choices=1,
                                token_embeddings=token_embeddings)


def _ntlb_gating(inputs, outer_expert_dims, experts_dim, expert_capacity_dim, hparams, train,
                 variable_dtype, importance=None, name="ntlb_gating", num_microbatches=None,
                 token_embeddings=None):
  """Switch gating with "no token left behind": a token dropped by its first choice's full expert
  tries its next choices (up to moe_ntlb_top_k), each taking the free slots in token order.

  The token's weight is the gate probability of the expert it lands in; the load-balancing loss
  is the Switch loss on first choices.
  """
  return _switch_choices_gating(inputs, outer_expert_dims, experts_dim, expert_capacity_dim, hparams, train,
                                variable_dtype, importance, name, num_microbatches,
                                num_choices=hparams.moe_ntlb_top_k, token_embeddings=token_embeddings)


def _switch_choices_gating(inputs, outer_expert_dims, experts_dim, expert_capacity_dim, hparams, train,
                           variable_dtype, importance, name, num_microbatches, num_choices: int,
                           token_embeddings=None):
  """Switch gating where a token dropped by a full expert tries its next `num_choices - 1` choices.

  The first choice follows the switch policy, later ones the remaining gates in order; each
  choice takes the experts' free slots in token order. num_choices=1 is plain Switch gating.
  """
  group_size_dim = inputs.shape.dims[-2]
  inputs, policy = _switch_inputs_and_policy(inputs, hparams, train)
  gate_logits = _switch_gate_logits(inputs, outer_expert_dims, experts_dim, hparams, train, variable_dtype,
                                    name, token_embeddings)
  raw_gates = mtf.to_float(mtf.softmax(gate_logits, experts_dim))
  first_gate, first_index = _switch_choice(gate_logits, raw_gates, experts_dim, policy, hparams)
  loss = _switch_balance_loss(mtf.one_hot(first_index, experts_dim, dtype=tf.float32), raw_gates,
                              group_size_dim, experts_dim, importance)
  loss = _finish_loss(loss, gate_logits, experts_dim, hparams, importance, num_microbatches, train)

  capacity = float(expert_capacity_dim.size)
  num_choices = min(num_choices, experts_dim.size)
  gate, index = first_gate, first_index
  # State between choices: tokens not placed yet, slots taken per expert, gates not yet chosen.
  unplaced = None if importance is None else mtf.to_float(mtf.equal(importance, 1.0))
  occupancy = None
  remaining = raw_gates
  combine_tensor = None
  for choice in range(num_choices):
    choice_one_hot = mtf.one_hot(index, experts_dim, dtype=tf.float32)
    mask, placed, position = _take_slots(choice_one_hot if unplaced is None else choice_one_hot * unplaced,
                                         group_size_dim, experts_dim, capacity, taken=occupancy)
    term = gate * placed * choice_one_hot * _slot_one_hot(position, expert_capacity_dim)
    combine_tensor = term if combine_tensor is None else combine_tensor + term
    if choice + 1 < num_choices:
      taken = mtf.reduce_sum(mask, reduced_dim=group_size_dim)
      occupancy = taken if occupancy is None else occupancy + taken
      unplaced = 1.0 - placed if unplaced is None else unplaced * (1.0 - placed)
      remaining *= 1.0 - choice_one_hot
      gate, index = mtf.top_1(remaining, experts_dim)
  return _finish_routing(combine_tensor, loss, inputs)



def _switch_gate_logits(inputs, outer_expert_dims, experts_dim, hparams, train, variable_dtype, name,
                        token_embeddings):
  """Router logits of the top-1 gatings; in training maybe steered past the top expert."""
  gate_logits = _gate_logits(_with_token_embeddings(inputs, token_embeddings, hparams), experts_dim,
                             outer_expert_dims, variable_dtype, name)
  if train and getattr(hparams, "moe_use_second_place_expert_prob", None) is not None:
    gate_logits = _stochastically_use_non_top_expert(gate_logits, experts_dim, hparams)
  return gate_logits


def _stochastically_use_non_top_expert(gate_logits, experts_dim, hparams):
  """With probability moe_use_second_place_expert_prob per token, masks out its top logit (-1e9).

  With moe_use_second_place_expert_prob_temp set, only one other expert, sampled from the
  remaining logits at that temperature, keeps its logit; otherwise the second best wins argmax.
  """
  _, top_index = mtf.top_1(gate_logits, experts_dim)
  top_mask = mtf.one_hot(top_index, experts_dim, dtype=gate_logits.dtype)
  token_shape = mtf.Shape([d for d in gate_logits.shape.dims if d != experts_dim])
  use_other = mtf.cast(mtf.less(mtf.random_uniform(gate_logits.mesh, token_shape),
                                hparams.moe_use_second_place_expert_prob), gate_logits.dtype)
  other_logits = gate_logits - 1e9 * top_mask
  temperature = getattr(hparams, "moe_use_second_place_expert_prob_temp", None)
  if temperature is not None:
    sampled = mtf.sample_with_temperature(other_logits, experts_dim, temperature=temperature)
    other_logits += (1.0 - mtf.one_hot(sampled, experts_dim, dtype=gate_logits.dtype)) * -1e9
  return use_other * other_logits + (1.0 - use_other) * gate_logits


def _check_capacity_fits_group(gating: str, group_size_dim, expert_capacity_dim) -> None:
  if expert_capacity_dim.size > group_size_dim.size:
    raise ValueError(f"MoE {gating} gating: expert capacity {expert_capacity_dim.size} exceeds the group "
                     f"size {group_size_dim.size} (each expert picks capacity tokens of a group); lower "
                     f"min_expert_capacity or raise group_size.")


def _switch_max_gating(inputs, outer_expert_dims, experts_dim, expert_capacity_dim, hparams, train,
                       variable_dtype, importance=None, name="switch_max_gating", num_microbatches=None,
                       token_embeddings=None):
  """Top-1 gating where a full expert keeps the tokens with its highest gates (not the first ones).

  Each token picks one expert as in Switch gating; each expert then takes the expert_capacity
  tokens of the group with the largest gate among those that picked it. Returns dispatch and
  combine [<batch>, experts, expert_capacity, group] and the Switch load-balancing loss (its
  density counts padding, its proxy does not, as in 0.1.21).
  """
  group_size_dim = inputs.shape.dims[-2]
  _check_capacity_fits_group("switch_max", group_size_dim, expert_capacity_dim)
  inputs, policy = _switch_inputs_and_policy(inputs, hparams, train)
  gate_logits = _switch_gate_logits(inputs, outer_expert_dims, experts_dim, hparams, train, variable_dtype,
                                    name, token_embeddings)
  raw_gates = mtf.to_float(mtf.softmax(gate_logits, experts_dim))
  gate, index = _switch_choice(gate_logits, raw_gates, experts_dim, policy, hparams)
  mask = mtf.one_hot(index, experts_dim, dtype=tf.float32)
  loss = _switch_balance_loss(mask, raw_gates, group_size_dim, experts_dim, importance)
  if importance is not None:
    mask *= mtf.to_float(mtf.equal(importance, 1.0))
  loss = _finish_loss(loss, gate_logits, experts_dim, hparams, importance, num_microbatches, train)
  kept_gates, token_index = mtf.top_k(mask * gate, reduced_dim=group_size_dim, k_dim=expert_capacity_dim)
  combine_tensor = mtf.one_hot(token_index, group_size_dim, dtype=tf.float32) * kept_gates
  return _finish_routing(combine_tensor, loss, inputs)


def _expert_selection_gating(inputs, outer_expert_dims, experts_dim, group_size_dim, expert_capacity_dim,
                             hparams, train, variable_dtype, importance=None, name="expert_selection_gating",
                             num_microbatches=None, normalize_by_num_experts_routed=True,
                             token_embeddings=None):
  """Expert-choice gating: each expert takes the expert_capacity tokens it scores highest.

  The router's softmax runs over the group (padding masked out), per expert; expert e takes
  its top expert_capacity tokens weighted by those probabilities, and (with
  normalize_by_num_experts_routed) a token's weights are divided by how many experts took it.
  The loss is group_size * mean over tokens of (mean over experts of the probability)^2 *
  (non-padding tokens of the group). Returns dispatch and combine
  [<batch>, experts, expert_capacity, group] and the loss.
  """
  _check_capacity_fits_group("expert_selection", group_size_dim, expert_capacity_dim)
  inputs, _ = _switch_inputs_and_policy(inputs, hparams, train)
  gate_logits = _gate_logits(_with_token_embeddings(inputs, token_embeddings, hparams), experts_dim,
                             outer_expert_dims, variable_dtype, name)
  gate_logits = mtf.to_float(gate_logits)
  if importance is not None:
    gate_logits += mtf.to_float(mtf.equal(importance, 0.0)) * -1e9
  raw_gates = mtf.softmax(gate_logits, group_size_dim)
  token_probs, token_index = mtf.top_k(raw_gates, reduced_dim=group_size_dim, k_dim=expert_capacity_dim)
  dispatch_tensor = mtf.one_hot(token_index, group_size_dim, dtype=tf.float32)
  combine_tensor = dispatch_tensor * token_probs
  if normalize_by_num_experts_routed:
    experts_per_token = mtf.reduce_sum(dispatch_tensor,
                                       output_shape=dispatch_tensor.shape.dims[:-3] + [group_size_dim])
    combine_tensor /= mtf.maximum(experts_per_token, 1.0)

  mean_prob = mtf.reduce_mean(raw_gates, reduced_dim=experts_dim)
  if importance is None:
    true_group_size = float(group_size_dim.size)
  else:
    mean_prob *= mtf.to_float(mtf.equal(importance, 1.0))
    true_group_size = mtf.reduce_sum(mtf.to_float(importance), reduced_dim=group_size_dim)
  loss = mtf.reduce_mean(mean_prob * mean_prob * true_group_size) * float(group_size_dim.size)
  loss = _finish_loss(loss, gate_logits, experts_dim, hparams, importance, num_microbatches, train)
  combine_tensor = mtf.cast(combine_tensor, inputs.dtype)
  dispatch_tensor = mtf.cast(mtf.cast(dispatch_tensor, tf.bool), combine_tensor.dtype)
  return dispatch_tensor, combine_tensor, mtf.cast(loss, inputs.dtype)


def _top_n_gating(inputs, outer_expert_dims, experts_dim, expert_capacity_dim, hparams, train, variable_dtype,
                  importance=None, name="top_n_gating", num_microbatches=None, token_embeddings=None):
  """Top-2 gating generalised to hparams.moe_top_n_num_experts_per_token choices per token.

  The n gates are renormalised to sum to 1; choices after the first are kept per the
  second-place policy; the n-th choices take expert slots after all (n-1)-th ones. Tokens with
  importance 0 are not routed. The load-balancing loss is on first choices; with
  moe_use_second_place_loss 0.1.21 adds half the balance loss of the THIRD choices against the
  gates left after the top two (kept as it is), so that needs at least 3 experts per token.
  Returns dispatch, combine [<batch>, group, experts, expert_capacity] and the loss.
  """
  num_choices = hparams.moe_top_n_num_experts_per_token
  if hparams.moe_use_second_place_loss and num_choices < 3:
    raise ValueError(f"MoE top_n gating: moe_use_second_place_loss uses the third choices, but "
                     f"top_n_num_experts_per_token={num_choices}; set it to 3 or more or drop the loss.")
  group_size_dim = inputs.shape.dims[-2]
  gate_logits = _gate_logits(_with_token_embeddings(inputs, token_embeddings, hparams), experts_dim,
                             outer_expert_dims, variable_dtype, name)
  raw_gates = mtf.to_float(mtf.softmax(gate_logits, experts_dim))
  density_proxy = raw_gates
  routed = None
  if importance is not None:
    density_proxy *= mtf.to_float(mtf.equal(importance, 1.0))
    routed = mtf.to_float(mtf.greater(importance, 0.0))
  gates, masks, indices = [], [], []
  remaining = raw_gates
  without_top_two = None
  for n in range(num_choices):
    gate, index = mtf.top_1(remaining, experts_dim)
    mask = mtf.one_hot(index, experts_dim, dtype=tf.float32)
    if routed is not None:
      mask *= routed
      gate *= routed
    remaining *= 1.0 - mask
    if n == 1:
      without_top_two = remaining
    gates.append(gate)
    masks.append(mask)
    indices.append(index)
  if num_choices > 1:
    denom = mtf.add_n(gates) + 1e-9
    gates = [gate / denom for gate in gates]

  loss = _load_balance_loss(masks[0], density_proxy, group_size_dim, experts_dim)
  if hparams.moe_use_second_place_loss:
    normalized = without_top_two / (mtf.reduce_sum(without_top_two, reduced_dim=experts_dim) + 1e-9)
    loss += 0.5 * _load_balance_loss(masks[2], normalized, group_size_dim, experts_dim)
  loss = _finish_loss(loss, gate_logits, experts_dim, hparams, importance, num_microbatches, train)
  masks = masks[:1] + [_apply_second_policy(mask, gate, hparams, train)
                       for gate, mask in zip(gates[1:], masks[1:])]

  capacity = float(expert_capacity_dim.size)
  occupancy = None
  combine_tensor = None
  for gate, mask, index in zip(gates, masks, indices):
    mask, placed, position = _take_slots(mask, group_size_dim, experts_dim, capacity, taken=occupancy)
    taken = mtf.reduce_sum(mask, reduced_dim=group_size_dim)
    occupancy = taken if occupancy is None else occupancy + taken
    term = (gate * placed * mtf.one_hot(index, experts_dim, dtype=tf.float32)
            * _slot_one_hot(position, expert_capacity_dim))
    combine_tensor = term if combine_tensor is None else combine_tensor + term
  return _finish_routing(combine_tensor, loss, inputs)
