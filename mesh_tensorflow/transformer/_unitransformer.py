"""Unitransformer: embeddings, a LayerStack and a softmax; training loss and autoregressive decoding.

Used alone it is a language model (autoregressive) or an encoder (no output vocabulary); a
Bitransformer pairs an encoder with an autoregressive decoder.
"""

from __future__ import annotations

from typing import Optional

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer._context import Context, ModeKeys
from mesh_tensorflow.transformer._embedding import (
    get_vocab_embedding_cls,
    reduce_ensemble_logits,
    sinusoid_positional_embedding_weights,
)
from mesh_tensorflow.transformer._layer_stack import GIN_MODULE
from mesh_tensorflow.transformer._targets import autoregressive_inputs, delimited_lm_inputs_mask


def _round_up_to_multiple(n: int, divisor: Optional[int]) -> int:
  if not divisor:
    return n
  return n + -n % divisor


def _check_length_fits(context: Context, max_length_dim: mtf.Dimension) -> None:
  if (context.position_is_default and context.length_dim is not None
      and context.length_dim.size > max_length_dim.size):
    raise ValueError(f"Unitransformer: sequence length {context.length_dim} exceeds max_length="
                     f"{max_length_dim.size} of the positional embedding table; raise "
                     f"Unitransformer.max_length or shorten the inputs.")


@gin.configurable(module=GIN_MODULE)
class Unitransformer:
  """A Transformer with one layer stack: ids [batch..., length] -> logits [batch..., length, vocab].

  Args:
    layer_stack: a LayerStack.
    d_model: model width.
    input_vocab_size / output_vocab_size: vocabulary sizes (padded up to vocab_divisor);
      output_vocab_size None makes an encoder that returns the hidden states.
    autoregressive: causal self-attention (position p sees positions <= p).
    max_length: size of the positional embedding table.
    shared_embedding_and_softmax_weights: logits from the input embedding table.
    label_smoothing, z_loss: loss options; loss_fn(model, context, logits, targets, vocab_dim)
      replaces the default loss.
    name: variable scope of the model.
    layout, mesh_shape: the layout the model runs under (optional; enables 2-D attention
      sharding and blocked beam search).
    vocab_divisor: round vocabularies up to a multiple of this.
    ensemble: number of ensemble members (dimension `ensemble`), or None.
    positional_embedding / sinusoid_positional_embedding: learned or fixed position embeddings.
    input_full_attention: (delimited LM) the inputs part attends fully within itself.
    loss_on_targets_only: (delimited LM) no loss on the inputs part.
    loss_denominator: fixed loss denominator (default: number of target positions).
    token_dropout_rate: in training, replace input tokens by 0 with this probability.
  Example:
    model = Unitransformer(layer_stack=make_layer_stack([SelfAttention, DenseReluDense]),
                           input_vocab_size=32000, output_vocab_size=32000,
                           autoregressive=True, max_length=512)
    logits, loss = model.call_simple(inputs, targets, compute_loss=True)
  """

  def __init__(self, layer_stack, d_model: int = 1024, input_vocab_size=gin.REQUIRED,
               output_vocab_size=gin.REQUIRED, autoregressive=gin.REQUIRED, max_length=gin.REQUIRED,
               shared_embedding_and_softmax_weights: bool = False, label_smoothing: float = 0.0,
               z_loss: float = 1e-4, name: str = "transformer", layout=None, mesh_shape=None,
               vocab_divisor: int = 128, ensemble: Optional[int] = None, loss_fn=None,
               positional_embedding: bool = True, sinusoid_positional_embedding: bool = False,
               input_full_attention: bool = False, loss_on_targets_only: bool = False,
               loss_denominator=None, token_dropout_rate: float = 0.0):
    self.layer_stack = layer_stack
    self.model_dim = mtf.Dimension("d_model", d_model)
    self.input_vocab_size_unpadded = input_vocab_size
    self.input_vocab_dim = mtf.Dimension("vocab", _round_up_to_multiple(input_vocab_size, vocab_divisor))
    if output_vocab_size:
      self.output_vocab_dim = mtf.Dimension("vocab", _round_up_to_multiple(output_vocab_size, vocab_divisor))
    else:
      self.output_vocab_dim = None
      if autoregressive:
        raise ValueError(f"Unitransformer {name!r}: an autoregressive model needs an output vocabulary "
                         f"(output_vocab_size={output_vocab_size!r}).")
    if input_full_attention and not autoregressive:
      raise ValueError(f"Unitransformer {name!r}: input_full_attention needs autoregressive=True.")
    self.autoregressive = autoregressive
    self.positional_embedding = positional_embedding or sinusoid_positional_embedding
    self.sinusoid_positional_embedding = sinusoid_positional_embedding
    self.input_full_attention = input_full_attention
    self.loss_on_targets_only = loss_on_targets_only
    self._loss_denominator = loss_denominator
    self.max_length_dim = mtf.Dimension("max_length", max_length)
    self.shared_embedding_and_softmax_weights = shared_embedding_and_softmax_weights
    self.label_smoothing = label_smoothing
    self.z_loss = z_loss
    self.name = name
    self.layout = layout
    self.mesh_shape = mesh_shape
    self.ensemble_dim = mtf.Dimension("ensemble", ensemble) if ensemble else None
    self.loss_fn = loss_fn
    self.token_dropout_rate = token_dropout_rate

  @property
  def fully_autoregressive(self) -> bool:
    return self.autoregressive and not self.input_full_attention

  @property
  def ensemble_dims(self) -> list:
    return [self.ensemble_dim] if self.ensemble_dim else []

  def loss_denominator(self, targets, num_microbatches) -> float:
    """The fixed loss_denominator, else the number of target positions (per ensemble member)."""
    if self._loss_denominator is not None:
      return float(self._loss_denominator)
    ret = float(targets.shape.size) * num_microbatches
    if self.ensemble_dim:
      ret /= self.ensemble_dim.size  # ensembling must not shrink each member's gradient
    return ret

  def _compute_loss(self, context, logits, targets, output_vocab_dim):
    """Label-smoothed cross-entropy (+ z_loss in training) over nonzero targets, / loss_denominator."""
    if self.loss_fn is not None:
      return self.loss_fn(self, context, logits, targets, output_vocab_dim)
    off_value = self.label_smoothing / output_vocab_dim.size
    on_value = 1.0 - self.label_smoothing + off_value
    soft_targets = mtf.one_hot(targets, output_vocab_dim, dtype=context.activation_dtype, on_value=on_value,
                               off_value=off_value)
    loss = mtf.layers.softmax_cross_entropy_with_logits(
        logits, soft_targets, output_vocab_dim, z_loss=self.z_loss if context.train else 0.0)
    weights = mtf.layers.weights_nonzero(targets, dtype=context.activation_dtype)
    if self.loss_on_targets_only:
      weights *= mtf.cast(mtf.logical_not(delimited_lm_inputs_mask(targets)), dtype=context.activation_dtype)
    return mtf.reduce_sum(loss * weights) / self.loss_denominator(targets, context.num_microbatches)

  def _embedding(self, context, mesh):
    if "embedding" in context.shared_params:
      return context.shared_params["embedding"]
    return get_vocab_embedding_cls()(mesh, self.input_vocab_dim, self.model_dim, context.variable_dtype,
                                     name="embedding", ensemble_dim=self.ensemble_dim)

  def _positional_embedding(self, context, mesh, x):
    """The position embedding of each token of x."""
    if self.sinusoid_positional_embedding:
      table = sinusoid_positional_embedding_weights(mesh, self.max_length_dim, self.model_dim,
                                                    context.activation_dtype)
    elif "positional_embedding" in context.shared_params:
      table = context.shared_params["positional_embedding"]
    else:
      table = mtf.layers.embedding_weights(mesh, self.max_length_dim, self.model_dim, context.variable_dtype,
                                           "positional_embedding", ensemble_dim=self.ensemble_dim)
    _check_length_fits(context, self.max_length_dim)
    if context.position_is_default:
      sliced = mtf.slice(table, 0, context.length_dim.size, self.max_length_dim.name)
      return mtf.rename_dimension(sliced, self.max_length_dim.name, context.length_dim.name)
    if context.length_dim is not None and context.length_dim.size > self.max_length_dim.size:
      tf.logging.warning("Unitransformer %s: length %s exceeds max_length %d; positions past it get "
                         "zero embeddings.", self.name, context.length_dim, self.max_length_dim.size)
    return mtf.gather(table, context.position, self.max_length_dim)

  def _call_internal(self, context: Context, inputs: mtf.Tensor, targets=None) -> mtf.Tensor:
    """Embeds inputs, runs the layer stack and (with an output vocabulary) returns logits.

    Appends the loss to context.losses when targets are given and losses are collected.
    """
    mesh = inputs.mesh
    if self.ensemble_dim and self.ensemble_dim not in inputs.shape.dims:
      # Every member trains on the same examples.
      inputs = mtf.broadcast(inputs, [self.ensemble_dim] + inputs.shape.dims)
      if targets is not None:
        targets = mtf.broadcast(targets, [self.ensemble_dim] + targets.shape.dims)
    if self.token_dropout_rate > 0 and context.train:
      keep = mtf.greater_equal(mtf.random_uniform(mesh, inputs.shape), self.token_dropout_rate)
      inputs *= mtf.cast(keep, inputs.dtype)
    vocab_embedding = self._embedding(context, mesh)
    x = vocab_embedding.ids_to_embedding(inputs, context)
    context.input_embeddings = x  # MoE's word_embed_mode routes on the token embeddings.
    if self.positional_embedding:
      x += mtf.cast(self._positional_embedding(context, mesh, x), x.dtype)
    x = self.layer_stack.call(context, x)
    if self.output_vocab_dim is None:
      return x
    if self.shared_embedding_and_softmax_weights:
      logits = vocab_embedding.hidden_to_logits(x, context=context)
    else:
      logits = mtf.layers.dense(x, self.output_vocab_dim, use_bias=False,
                                variable_dtype=context.variable_dtype, reduced_dims=x.shape.dims[-1:],
                                name="logits")
    if targets is not None and context.losses is not None:
      context.losses.append(self._compute_loss(context, logits, targets, self.output_vocab_dim))
    if self.ensemble_dim:
      logits = reduce_ensemble_logits(logits, self.ensemble_dim, self.output_vocab_dim)
    return logits

  def call_simple(self, inputs, targets, compute_loss, mode=ModeKeys.TRAIN,
                  variable_dtype=mtf.VariableDType(tf.float32), sequence_id=None, subsequence_id=None,
                  position=None, encoder_output=None, encoder_sequence_id=None, encoder_inputs=None,
                  shared_params=None, layer_outputs=None, encoder_layer_outputs=None,
                  num_microbatches: int = 1) -> tuple:
    """Runs the model on inputs [batch..., length] (int32 ids): returns (logits, loss or None).

    Args:
      inputs, targets: int32 Tensors with the same shape (targets may be None).
      compute_loss: also return the loss (the sum of context.losses, e.g. plus MoE losses).
      mode: ModeKeys value ("train" enables dropout and z_loss).
      sequence_id / subsequence_id / position: packing information (int32 [batch..., length]).
      encoder_output / encoder_sequence_id / encoder_inputs / encoder_layer_outputs: from an
        encoder, for encoder-decoder attention (length renamed memory_length).
      shared_params: {"embedding": ..., "positional_embedding": ...} shared with another model.
    """
    batch_dims = inputs.shape.dims[:-1]
    length_dim = inputs.shape.dims[-1]
    length_range = mtf.range(inputs.mesh, length_dim, dtype=tf.int32)
    if not self.positional_embedding:
      # Relative attention then assumes positions are tensor indices, still correct within segments.
      position = None
    position_is_default = position is None
    if position_is_default:
      position = length_range
    if self.input_full_attention:
      # The inputs part (plus the position predicting the first target) attends fully.
      full_region = delimited_lm_inputs_mask(targets)
      full_region = mtf.logical_or(full_region, mtf.shift(full_region, offset=1, dim=length_dim, wrap=False))
      read_priority = write_priority = length_range * mtf.cast(mtf.logical_not(full_region), tf.int32)
    elif self.autoregressive:
      read_priority = write_priority = length_range
    else:
      read_priority = write_priority = None
    context = Context(
        model=self, mesh=inputs.mesh, batch_dims=batch_dims, length_dim=length_dim,
        variable_dtype=variable_dtype, mode=mode, losses=[] if compute_loss else None,
        sequence_id=sequence_id, subsequence_id=subsequence_id, position=position,
        position_is_default=position_is_default, encoder_output=encoder_output,
        encoder_sequence_id=encoder_sequence_id, shared_params=shared_params, layer_outputs=layer_outputs,
        encoder_layer_outputs=encoder_layer_outputs, write_priority=write_priority,
        read_priority=read_priority, inputs=inputs, encoder_inputs=encoder_inputs,
        num_microbatches=num_microbatches)
    with tf.variable_scope(self.name):
      logits = self._call_internal(context, inputs, targets)
    loss = mtf.add_n(context.losses) if compute_loss and context.losses else None
    return logits, loss

  def _decoding_contexts(self, inputs, batch_dims, variable_dtype, encoder_output, encoder_sequence_id,
                         encoder_inputs, shared_params, encoder_layer_outputs):
    """The first_part Context over the known prefix, and a factory of incremental Contexts."""
    length_dim = inputs.shape.dims[-1]
    length_range = mtf.range(inputs.mesh, length_dim, tf.int32)
    initial_position = mtf.reduce_sum(mtf.to_int32(mtf.not_equal(inputs, 0)), reduced_dim=length_dim)
    sequence_id = 1 if encoder_sequence_id is not None else None
    if self.input_full_attention:
      after_prompt = mtf.to_int32(mtf.greater(length_range, initial_position))
      read_priority = write_priority = length_range * after_prompt
    else:
      read_priority = write_priority = length_range
    common = dict(model=self, mesh=inputs.mesh, batch_dims=batch_dims, length_dim=length_dim,
                  variable_dtype=variable_dtype, sequence_id=sequence_id, encoder_output=encoder_output,
                  encoder_sequence_id=encoder_sequence_id, shared_params=shared_params,
                  encoder_layer_outputs=encoder_layer_outputs, write_priority=write_priority,
                  encoder_inputs=encoder_inputs)
    first_part = Context(mode=ModeKeys.FIRST_PART, position=length_range, position_is_default=True,
                         new_states=[], initial_position=initial_position, constant_states=[],
                         read_priority=read_priority, inputs=inputs, **common)

    def incremental(position, states, inputs_this_step):
      return Context(mode=ModeKeys.INCREMENTAL, position=position, states=list(states), new_states=[],
                     constant_states=first_part.constant_states, read_priority=position,
                     inputs=inputs_this_step, **common)
    return first_part, incremental, initial_position

  def _run_first_part(self, context, inputs):
    with tf.variable_scope(self.name):
      self._call_internal(context, autoregressive_inputs(inputs))

  def _incremental_logits(self, make_context, ids, position, states, bos_id):
    """Logits for `position` given ids decoded so far; returns (logits, new states)."""
    length_dim = ids.shape.dims[-1]
    inputs_this_step = mtf.gather(ids, position - 1, length_dim)
    if bos_id:
      inputs_this_step += bos_id * mtf.cast(mtf.equal(position, 0), tf.int32)
    context = make_context(position, states, inputs_this_step)
    with tf.variable_scope(self.name, reuse=True):
      logits = self._call_internal(context, inputs_this_step)
    return logits, context.new_states

  def _check_autoregressive(self, fn_name):
    if not self.autoregressive:
      raise ValueError(f"Unitransformer.{fn_name}: model {self.name!r} is not autoregressive.")

  @gin.configurable(module="Unitransformer")
  def sample_autoregressive(self, partial_sequences, stop_at_token=1, max_steps=None, temperature=0.0,
                            variable_dtype=mtf.VariableDType(tf.float32), encoder_output=None,
                            encoder_sequence_id=None, encoder_inputs=None, shared_params=None,
                            has_partial_sequences=True, encoder_layer_outputs=None, never_end=False,
                            remove_partial_sequences=False, sampling_keep_top_k=-1, bos_id=0) -> mtf.Tensor:
    """Continues partial_sequences [batch..., length] (0 = to decode) one token at a time.

    One "first_part" pass over the prefix records each layer's states; then an mtf.while_loop
    runs "incremental" steps (one position each, sampling softmax(logits / temperature);
    temperature 0 is greedy) until every sequence has a new stop_at_token, max_steps, or the end.

    Args:
      sampling_keep_top_k: sample among the k best ids only (-1: all).
      never_end: forbid stop_at_token.
      remove_partial_sequences: shift the outputs left past each prompt.
      has_partial_sequences: False if partial_sequences are all zeros (skips their states).
      bos_id: the input id at position 0.
    Returns:
      int32 ids shaped like partial_sequences.
    """
    self._check_autoregressive("sample_autoregressive")
    if sampling_keep_top_k != -1 and sampling_keep_top_k <= 0:
      raise ValueError(f"sample_autoregressive: sampling_keep_top_k must be -1 or positive, "
                       f"got {sampling_keep_top_k}.")
    inputs = partial_sequences
    length_dim = inputs.shape.dims[-1]
    first_part, make_context, initial_position = self._decoding_contexts(
        inputs, inputs.shape.dims[:-1], variable_dtype, encoder_output, encoder_sequence_id,
        encoder_inputs, shared_params, encoder_layer_outputs)
    self._run_first_part(first_part, inputs)
    if has_partial_sequences:
      initial_states = first_part.new_states
    else:
      initial_states = [mtf.zeros_like(t) for t in first_part.new_states]
    partial_eos_count = 0
    if has_partial_sequences and stop_at_token is not None:
      partial_eos_count = mtf.reduce_sum(mtf.to_int32(mtf.equal(inputs, stop_at_token)),
                                         reduced_dim=length_dim)

    def cond_fn(position, ids, *unused_states):
      is_done = mtf.greater_equal(position, length_dim.size)
      if max_steps:
        is_done = mtf.logical_or(is_done, mtf.greater_equal(position - initial_position, max_steps))
      if stop_at_token is not None:
        eos_count = mtf.reduce_sum(mtf.to_int32(mtf.equal(ids, stop_at_token)), reduced_dim=length_dim)
        is_done = mtf.logical_or(is_done, mtf.greater(eos_count, partial_eos_count))
      return mtf.logical_not(mtf.reduce_all(is_done))

    def body_fn(position, ids, *states):
      logits, new_states = self._incremental_logits(make_context, ids, position, states, bos_id)
      if never_end:
        logits += mtf.one_hot(mtf.constant(logits.mesh, stop_at_token, dtype=tf.int32), self.output_vocab_dim,
                              on_value=-1e9, off_value=0.0, dtype=logits.dtype)
      if sampling_keep_top_k != -1:
        kth_largest = mtf.nth_largest_element(logits, sampling_keep_top_k - 1, self.output_vocab_dim)
        logits = mtf.where(mtf.less(logits, kth_largest), mtf.ones_like(logits) * -1e6, logits)
      ids_this_step = mtf.sample_with_temperature(logits, self.output_vocab_dim, temperature)
      # Positions already given (the prompt) keep their ids.
      write = mtf.one_hot(position, length_dim, dtype=tf.int32) * mtf.to_int32(mtf.equal(ids, 0))
      return [position + 1, ids + ids_this_step * write] + list(new_states)

    outputs = mtf.while_loop(cond_fn, body_fn, [initial_position, inputs] + list(initial_states))[1]
    if has_partial_sequences and remove_partial_sequences:
      outputs = mtf.dynamic_shift(outputs, -initial_position, length_dim, wrap=False)
    return outputs

  def beam_search(self, inputs, decode_length, variable_dtype=mtf.VariableDType(tf.float32),
                  encoder_output=None, encoder_sequence_id=None, encoder_inputs=None, alpha=0.6,
                  shared_params=None, encoder_layer_outputs=None, bos_id=0) -> mtf.Tensor:
    """Beam search from inputs [batch, beam, length] (zeros, or a prompt): the best beam [batch, length].

    Args:
      decode_length: int32 scalar mtf Tensor, the most positions to decode.
      alpha: length penalty exponent (see mtf.beam_search.beam_search).
    """
    self._check_autoregressive("beam_search")
    if inputs.shape.ndims != 3:
      raise ValueError(f"Unitransformer.beam_search: inputs {inputs.shape} must be [batch, beam, length] "
                       f"(exactly one batch dimension).")
    batch_dim, beam_dim, _ = inputs.shape.dims
    first_part, make_context, _ = self._decoding_contexts(
        inputs, [batch_dim, beam_dim], variable_dtype, encoder_output, encoder_sequence_id, encoder_inputs,
        shared_params, encoder_layer_outputs)
    self._run_first_part(first_part, inputs)
    # The prompt (if any) is forced by beam_search step by step; states start empty.
    initial_states = [mtf.zeros_like(t) for t in first_part.new_states]

    def logits_fn(step_num, ids, states):
      logits, new_states = self._incremental_logits(make_context, ids, step_num, states, bos_id)
      return mtf.to_float(logits), new_states

    beams, _ = mtf.beam_search.beam_search(
        logits_fn, inputs, alpha, states=initial_states, decode_length=decode_length, use_tpu=True,
        dtype=tf.float32, mesh_shape=self.mesh_shape, layout=self.layout)
    return mtf.gather(beams, mtf.constant(inputs.mesh, 0, dtype=tf.int32), beam_dim)
