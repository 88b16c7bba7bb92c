"""Heterogeneous mixture of experts: experts of different effective depth and width.

Each expert is a stack of `moe_num_layers` dense-relu-dense blocks (residual, RMS-normed from the
second on); a mask of 0/1 over [expert_hidden, num_expert_layers, experts] switches parts of
each expert off, so that some experts are narrower or shallower than others. Grouping, gating and
dispatch are moe.py's (0.1.21's `transformer.heterogeneous_moe`).
"""

from __future__ import annotations

from typing import Sequence

import gin
import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import moe, transformer

GIN_MODULE = "mesh_tensorflow.transformer.heterogeneous_moe"


@gin.configurable(module=GIN_MODULE)
class HeterogeneousMoE1D(transformer.TransformerLayer):
  """A mixture of experts of (optionally) heterogeneous depth and width, in place of a feed-forward layer.

  Parameters as moe.MoE1D's, plus moe_num_layers (blocks per expert) and
  heterogeneous_mask_info, e.g. [{"percent_number": .5, "layers": 1, "width": 1},
  {"percent_number": .5, "layers": 2, "width": 2}] (see generate_heterogeneous_expert_masks).
  Variables: the gating's, and `expert_layer_<i>/wi/kernel` [experts, d_model, expert_hidden],
  `expert_layer_<i>/wo/kernel` [experts, expert_hidden, output] (and `expert_layer_<i>/rms_norm/scale`
  for i > 0) per block.
  """

  def __init__(self, num_experts=16, loss_coef=1e-2, hidden_size=4096, group_size=1024,
               capacity_factor_train=1.25, capacity_factor_eval=2.0, use_second_place_loss=False,
               second_policy_train="random", second_policy_eval="random", second_threshold_train=0.2,
               second_threshold_eval=0.2, dropout_rate=0.0, activation="relu", moe_gating="top_2",
               min_expert_capacity=4, switch_policy_train="input_jitter", switch_policy_eval="input_jitter",
               switch_dropout=0.1, switch_temperature=1.0, switch_jitter=1e-2, ntlb_top_k=4,
               output_dim=None, z_loss=None, word_embed_mode=None, use_second_place_expert_prob=None,
               use_second_place_expert_prob_temp=None, moe_num_layers=1, heterogeneous_mask_info=None,
               top_n_num_experts_per_token=3):
    self._hparams = moe.hparams_from_layer_arguments(locals())
    self._activation = activation

  def call(self, context, x, losses=None):
    """x: [batch..., length, d_model] (or [batch..., d_model] when decoding one position)."""
    del losses
    if context.model.ensemble_dims:
      raise NotImplementedError("HeterogeneousMoE1D: ensembles (Unitransformer ensemble=...) are not "
                                "supported.")
    x_shape = x.shape
    has_length_dim = context.length_dim in x_shape.dims
    if not has_length_dim:  # incremental decoding: one position, a length-1 dim for the grouping
      x = mtf.reshape(x, mtf.Shape(x_shape.dims[:-1] + [mtf.Dimension("length", 1)] + x_shape.dims[-1:]))
    y, loss = transformer_moe_layer_v1(
        x, self._hparams.moe_output_dim or context.model.model_dim, self._hparams, context.train,
        context.variable_dtype, layout=context.model.layout, mesh_shape=context.model.mesh_shape,
        nonpadding=context.nonpadding, activation=self._activation, num_microbatches=context.num_microbatches,
        token_embeddings=getattr(context, "input_embeddings", None), context=context)
    if context.losses is not None:
      context.losses.append(loss)
    if not has_length_dim:
      y = mtf.reshape(y, mtf.Shape(x_shape.dims[:-1] + y.shape.dims[-1:]))
    return y


def transformer_moe_layer_v1(inputs, output_dim, hparams, train, variable_dtype, layout=None,
                             mesh_shape=None, nonpadding=None, activation=mtf.relu, num_microbatches=None,
                             token_embeddings=None, context=None):
  """Mixture of experts of heterogeneous depth and width on [outer_batch?, batch, length, d_model].

  As moe.transformer_moe_layer_v1 (grouping, capacity, gating, dispatch and combine), but each
  expert is hparams.moe_num_layers blocks x -> wo(act(wi(norm(x)))) + x (no norm and no residual
  for the first block, context's sublayer_dropout after every block but the last) in scopes
  `expert_layer_<i>`. With hparams.moe_heterogeneous_mask_info the hidden units of each block are
  multiplied by that block's slice of generate_heterogeneous_expert_masks(...), whose shape sets
  the number of blocks and the hidden size (as in 0.1.21, in place of moe_num_layers and
  moe_hidden_size); without it all experts are alike.

  Args:
    inputs: [batch dims..., length, input_dim].
    output_dim: the output Dimension (input_dim when moe_num_layers > 1: the blocks are residual).
    hparams: moe hyperparameters (moe.HParams), with moe_num_layers and moe_heterogeneous_mask_info.
    train: whether training (capacity factor, dropout).
    variable_dtype: an mtf.VariableDType.
    layout, mesh_shape: the model's, to split the groups as the batch is split.
    nonpadding: optional [batch dims..., length] 0/1 tensor; padding is not routed.
    activation: the activation of the hidden layer (a function or its name).
    num_microbatches: for the gating's loss.
    token_embeddings: the word embeddings of the inputs, for hparams.moe_word_embed_mode.
    context: the layer's Context (for the norm and dropout between blocks).

  Returns:
    (output [batch dims..., length, output_dim], loss * hparams.moe_loss_coef).
  """
  experts_dim = mtf.Dimension("experts", hparams.moe_num_experts)
  num_layers, hidden_size, mask = hparams.moe_num_layers, hparams.moe_hidden_size, None
  if hparams.moe_heterogeneous_mask_info is not None:
    mask = generate_heterogeneous_expert_masks(hparams.moe_heterogeneous_mask_info, hparams.moe_num_experts,
                                               experts_dim, inputs.mesh, hparams.moe_hidden_size)
    hidden_size, num_layers = mask.shape[0].size, mask.shape[1].size
  if num_layers > 1 and (context is None or output_dim != inputs.shape.dims[-1]):
    raise ValueError(f"heterogeneous_moe: {num_layers} residual expert layers need a context and "
                     f"output_dim == the input dim {inputs.shape.dims[-1]} (got {output_dim}).")
  batch_and_length_dims, input_dim = inputs.shape.dims[:-1], inputs.shape.dims[-1]
  if inputs.shape.dims[0].name == "outer_batch":
    outer_batch_dim, orig_batch_dim = inputs.shape.dims[:2]
  else:
    outer_batch_dim, orig_batch_dim = mtf.Dimension("outer_batch", 1), inputs.shape.dims[0]
  n = mtf.Shape(batch_and_length_dims).size // outer_batch_dim.size
  num_groups, group_size = moe._split_into_groups(  # pylint: disable=protected-access
      n, hparams.moe_group_size, moe._batch_split(layout, mesh_shape, orig_batch_dim))  # pylint: disable=protected-access
  group_size_dim = mtf.Dimension("group", group_size)
  num_groups_dim = mtf.Dimension(orig_batch_dim.name, num_groups)
  experts_dim_unsplit = mtf.Dimension("expert_unsplit", experts_dim.size)
  batch_dim_unsplit = mtf.Dimension("batch_unsplit", num_groups)
  moe_input_dims = [outer_batch_dim, num_groups_dim, group_size_dim, input_dim]
  inputs = mtf.reshape(inputs, moe_input_dims)
  if getattr(hparams, "moe_word_embed_mode", None) is not None:
    if token_embeddings is None:
      raise ValueError(f"heterogeneous_moe: hparams.moe_word_embed_mode={hparams.moe_word_embed_mode!r} "
                       f"needs token_embeddings shaped like the inputs (context.input_embeddings).")
    token_embeddings = mtf.cast(mtf.reshape(token_embeddings, moe_input_dims), inputs.dtype)
  capacity_factor = hparams.moe_capacity_factor_train if train else hparams.moe_capacity_factor_eval
  expert_capacity_dim = mtf.Dimension("expert_capacity", moe._expert_capacity(  # pylint: disable=protected-access
      group_size, capacity_factor, experts_dim.size, hparams.moe_min_expert_capacity))
  nonpadding = moe._broadcast_nonpadding(nonpadding, inputs, batch_and_length_dims)  # pylint: disable=protected-access
  if nonpadding is not None:
    nonpadding = mtf.reshape(nonpadding, moe_input_dims[:-1])
  dispatch_tensor, combine_tensor, loss = moe.gate(
      hparams, group_size_dim, inputs=inputs, outer_expert_dims=None, experts_dim=experts_dim_unsplit,
      expert_capacity_dim=expert_capacity_dim, train=train, variable_dtype=variable_dtype,
      importance=nonpadding, num_microbatches=num_microbatches, token_embeddings=token_embeddings)

  # [O, E, G, C, M], regrouped so that experts are the split dim (d_model renamed first: see moe.py).
  x = mtf.einsum([inputs, dispatch_tensor], mtf.Shape(
      [outer_batch_dim, experts_dim_unsplit, num_groups_dim, expert_capacity_dim, input_dim]))
  x = _regroup(x, [outer_batch_dim, experts_dim, batch_dim_unsplit, expert_capacity_dim], input_dim)
  x = _expert_layers(x, output_dim, experts_dim, mtf.Dimension("expert_hidden", hidden_size), num_layers,
                     mask, hparams, train, variable_dtype, activation, context)
  x = _regroup(x, [outer_batch_dim, experts_dim_unsplit, num_groups_dim, expert_capacity_dim], output_dim)
  output = mtf.einsum([x, combine_tensor], mtf.Shape(moe_input_dims[:-1] + [output_dim]))
  return mtf.reshape(output, batch_and_length_dims + [output_dim]), loss * hparams.moe_loss_coef


def _regroup(x: mtf.Tensor, leading_dims: list, last_dim: mtf.Dimension) -> mtf.Tensor:
  """x reshaped to leading_dims + [last_dim], through a renamed last dim (a slice when it is split)."""
  x = mtf.reshape(x, mtf.Shape(leading_dims + [mtf.Dimension("d_model_split", last_dim.size)]))
  return mtf.reshape(x, mtf.Shape(leading_dims + [last_dim]))


def _expert_layers(x, output_dim, experts_dim, hidden_dim, num_layers, mask, hparams, train, variable_dtype,
                   activation, context):
  """The experts' blocks on x [O, experts, batch_unsplit, capacity, d_model], masked where `mask` says."""
  for layer in range(num_layers):
    with tf.variable_scope(f"expert_layer_{layer}"):
      residual = 0.0
      if layer > 0:
        residual = x
        x = transformer.sublayer_rms_norm(x, None, context)
      h = mtf.layers.dense_product(
          x, reduced_dims=x.shape.dims[-1:], new_dims=[hidden_dim], expert_dims=[experts_dim],
          activation_functions=activation, use_bias=False, variable_dtype=variable_dtype, name="wi")
      if hparams.moe_dropout_rate:
        h = mtf.dropout(h, train, rate=hparams.moe_dropout_rate)
      if mask is not None:
        layer_mask = mtf.reshape(mtf.slice(mask, layer, 1, "num_expert_layers"),
                                 [mask.shape[0], mask.shape[2]])
        h *= mtf.cast(layer_mask, h.dtype)
      y = mtf.layers.dense(h, output_dim, expert_dims=[experts_dim], use_bias=False,
                           reduced_dims=h.shape.dims[-1:], variable_dtype=variable_dtype, name="wo")
      if layer < num_layers - 1:
        y = transformer.sublayer_dropout(y, None, context)
      x = y + residual
  return x


def generate_heterogeneous_expert_masks(mask_info: Sequence[dict], num_experts: int,
                                        experts_dim: mtf.Dimension, mesh: mtf.Mesh,
                                        expert_width: int) -> mtf.Tensor:
  """The 0/1 mask [expert_hidden, num_expert_layers, experts] making experts of different shapes.

  Each entry of mask_info takes the next `percent_number` experts (a fraction of num_experts when
  < 1, else a count; the last entry takes all that remain) and keeps the first `layers` blocks
  and the first width * expert_width hidden units of them. As 0.1.21, the mask's hidden size is
  max(width) and its depth max(layers).

  Args:
    mask_info: e.g. [{"percent_number": .5, "layers": 1, "width": 1},
      {"percent_number": .5, "layers": 2, "width": 2}].
    num_experts: the number of experts.
    experts_dim: the (split) experts Dimension.
    mesh: the Mesh the mask lives on.
    expert_width: the hidden units per unit of "width".

  Returns:
    a float64 Tensor [expert_hidden, num_expert_layers, experts].
  """
  if not mask_info:
    raise ValueError("generate_heterogeneous_expert_masks: mask_info is empty; give at least one "
                     "{'percent_number', 'layers', 'width'} entry.")
  max_layers = max(int(info["layers"]) for info in mask_info)
  max_width = max(int(info["width"]) for info in mask_info)
  blocks = []
  for i, info in enumerate(mask_info):
    percent = info["percent_number"]
    count = int(num_experts * percent) if percent < 1.0 else int(percent)
    if i == len(mask_info) - 1:
      count = num_experts - sum(block.shape[2] for block in blocks)
    if count < 0:
      raise ValueError(f"generate_heterogeneous_expert_masks: mask_info {list(mask_info)} assigns more than "
                       f"the {num_experts} experts.")
    block = np.zeros([max_width, max_layers, count])
    block[:int(info["width"]) * expert_width, :int(info["layers"]), :] = 1
    blocks.append(block)
  mask = np.concatenate(blocks, axis=2)
  tf.logging.info("heterogeneous expert mask (hidden x layers x experts): %s", mask.shape)
  shape = [mtf.Dimension("expert_hidden", max_width), mtf.Dimension("num_expert_layers", max_layers),
           experts_dim]
  return mtf.import_tf_tensor(mesh, tf.convert_to_tensor(mask), shape=shape)
