"""Decoding with mtf.while_loop: beam search with GNMT length penalty, and greedy/sampled decoding.

Both take a `logits_fn(step_num, ids, states) -> (logits, new_states)` that scores the next
position given the ids decoded so far; ids are int32 with 0 meaning "not decoded yet".
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow import ops_with_redefined_builtins as mtf

__all__ = ["EOS_ID", "INF", "beam_search", "greedy_decode", "compute_topk_scores_and_seq"]

EOS_ID = 1
INF = 1. * 1e7

_GIN_MODULE = "mesh_tensorflow.beam_search"


def compute_topk_scores_and_seq(sequences: mtf.Tensor, scores: mtf.Tensor, scores_to_gather: mtf.Tensor,
                                flags: mtf.Tensor, beam_dim: mtf.Dimension, prefix: str = "default"):
  """Keeps the beam_dim.size best (by `scores`) of the candidates along sequences' 2nd dimension.

  Args:
    sequences: [batch, candidates, length] ids.
    scores: [batch, candidates] ranking scores.
    scores_to_gather: [batch, candidates] scores to return for the kept candidates.
    flags: [batch, candidates] bools (finished or not).
    beam_dim: the output beam dimension.
    prefix: name prefix of the gather ops.
  Returns:
    (seq [batch, beam, length], gathered scores [batch, beam], flags [batch, beam],
     selector [batch, beam, candidates] float32 one-hot of each kept candidate), best first.
  """
  old_beam_dim = sequences.shape.dims[1]
  _, topk_indices = mtf.top_k(scores, old_beam_dim, k_dim=beam_dim)
  selector = mtf.one_hot(topk_indices, old_beam_dim, dtype=tf.float32)

  def gather(tensor, name):
    with tf.variable_scope(prefix + name):
      output_shape = mtf.Shape([beam_dim if d == old_beam_dim else d for d in tensor.shape.dims])
      return mtf.gather(tensor, topk_indices, old_beam_dim, output_shape=output_shape)
  return (gather(sequences, "_seq"), gather(scores_to_gather, "_scores"), gather(flags, "_flags"),
          selector)


def _check_initial_ids(initial_ids: mtf.Tensor, ndims: Optional[int], fn_name: str) -> None:
  if not initial_ids.dtype.is_integer:
    raise ValueError(f"{fn_name}: initial_ids {initial_ids.name!r} must be int32 ids, got dtype "
                     f"{initial_ids.dtype.name}; use mtf.to_int32.")
  if ndims is not None and initial_ids.shape.ndims != ndims:
    raise ValueError(f"{fn_name}: initial_ids {initial_ids.name!r} has shape {initial_ids.shape}; "
                     f"it must be exactly [batch, beam, length].")


def _check_state(state: mtf.Tensor, batch_dim: mtf.Dimension, beam_dim: mtf.Dimension) -> None:
  if batch_dim not in state.shape.dims or beam_dim not in state.shape.dims:
    raise ValueError(f"beam_search: state {state.name!r} {state.shape} must contain the batch "
                     f"{batch_dim} and beam {beam_dim} dimensions of initial_ids (beams are "
                     f"reordered every step).")


def _length_penalty(length: mtf.Tensor, alpha, dtype: tf.DType) -> mtf.Tensor:
  """GNMT length penalty ((5 + length) / 6)^alpha."""
  return mtf.pow((5. + mtf.cast(length, dtype)) / 6., alpha)


def _select_beams(state: mtf.Tensor, selector: mtf.Tensor, beam_dim, old_beam_dim) -> mtf.Tensor:
  """state with beam b replaced by beam a of the old state where selector[batch, a, b] == 1."""
  return mtf.einsum(
      [mtf.rename_dimension(state, beam_dim.name, old_beam_dim.name), mtf.cast(selector, state.dtype)],
      reduced_dims=[old_beam_dim], output_shape=state.shape)


def _select_beams_blocked(state, selector, batch_dim, beam_dim, old_beam_dim, layout, mesh_shape):
  """Same as _select_beams, as one [minor_batch*beam, minor_batch*beam] matmul per processor.

  minor_batch is the part of the batch each processor holds; the bigger (block diagonal)
  selector costs more FLOPs but matches TPU matrix units better than [beam, beam] matmuls.
  Needs batch and beam adjacent in state.
  """
  mesh = state.mesh
  major_batch = mtf.Dimension(batch_dim.name, mtf.tensor_dim_to_mesh_dim_size(layout, mesh_shape, batch_dim))
  minor_batch = mtf.Dimension("minor_batch", batch_dim.size // major_batch.size)
  old_minor_batch = mtf.Dimension("old_minor_batch", minor_batch.size)
  old_combined = mtf.Dimension("old_combined", minor_batch.size * beam_dim.size)
  combined = mtf.Dimension("new_combined", old_combined.size)
  same_minor_batch = mtf.to_float(mtf.equal(mtf.range(mesh, old_minor_batch, tf.float32),
                                            mtf.range(mesh, minor_batch, tf.float32)))
  selector = mtf.reshape(selector, [major_batch, minor_batch, old_beam_dim, beam_dim])
  selector = mtf.einsum([selector, same_minor_batch], reduced_dims=[],
                        output_shape=[major_batch, old_minor_batch, old_beam_dim, minor_batch, beam_dim])
  selector = mtf.reshape(selector, [major_batch, old_combined, combined])
  s = mtf.replace_dimensions(state, [batch_dim, beam_dim], [major_batch, old_combined])
  s = mtf.einsum([s, mtf.cast(selector, state.dtype)], reduced_dims=[old_combined],
                 output_shape=mtf.replace_dimensions(s.shape, old_combined, combined))
  return mtf.replace_dimensions(s, [major_batch, combined], [batch_dim, beam_dim])


def _top_candidates(curr_scores, batch_dim, beam_dim, vocab_dim, double_beam, num_prefilter):
  """(scores, beam index, id) of the double_beam best (beam, id) pairs of curr_scores, best first.

  With num_prefilter, only the num_prefilter best ids of each beam compete (cheaper, lossy).
  """
  if num_prefilter and num_prefilter < vocab_dim.size and num_prefilter * beam_dim.size >= double_beam.size:
    prefilter_dim = mtf.Dimension("prefilter", num_prefilter)
    scores, ids = mtf.top_k(curr_scores, vocab_dim, k_dim=prefilter_dim)
    ids += mtf.range(curr_scores.mesh, beam_dim, tf.int32) * vocab_dim.size
    flat_dim = mtf.Dimension("beam_and_prefilter", beam_dim.size * num_prefilter)
    scores = mtf.reshape(scores, [batch_dim, flat_dim])
    flat_ids = mtf.reshape(ids, [batch_dim, flat_dim])
    top_scores, positions = mtf.top_k(scores, flat_dim, k_dim=double_beam)
    top_flat_ids = mtf.gather(flat_ids, positions, flat_dim, output_shape=[batch_dim, double_beam])
  else:
    flat_dim = mtf.Dimension("beam_and_vocab", beam_dim.size * vocab_dim.size)
    flat_scores = mtf.reshape(curr_scores, [batch_dim, flat_dim])
    top_scores, top_flat_ids = mtf.top_k(flat_scores, flat_dim, k_dim=double_beam)
  return top_scores, mtf.floordiv(top_flat_ids, vocab_dim.size), mtf.mod(top_flat_ids, vocab_dim.size)


@gin.configurable(module=_GIN_MODULE)
def beam_search(logits_fn: Callable, initial_ids: mtf.Tensor, alpha, states: Optional[Sequence] = None,
                eos_id: int = EOS_ID, stop_early: bool = True, decode_length: Optional[mtf.Tensor] = None,
                use_tpu: bool = True, dtype=tf.float32, layout=None, mesh_shape=None,
                num_prefilter: Optional[int] = 2) -> tuple:
  """Beam search with the GNMT length penalty ((5 + length) / 6)^alpha (arXiv:1609.08144).

  Alive beams are grown by one position per step: the 2*beam best (beam, id) extensions are
  split into those ending in eos (merged into the finished beams) and the rest (the best beam
  of them stay alive). The loop ends at decode_length, or (stop_early) when no alive beam can
  beat the worst finished one.

  Args:
    logits_fn: (step_num int32 scalar, ids [batch, beam, length], states list) ->
      (logits [batch, beam, vocab] for position step_num, new_states like states).
    initial_ids: int32 [batch, beam, length]; zeros, or a prompt: nonzero entries are forced
      (decoding still starts at position 0, each forced id costing no log-probability).
    alpha: length penalty exponent (0: rank by log-probability).
    states: optional mtf Tensors containing the batch and beam dims, reordered with the beams.
    eos_id: end-of-sequence id.
    stop_early: stop once the best sequences are provably found.
    decode_length: optional int32 scalar mtf Tensor, max number of decoded positions.
    use_tpu: False keeps all but the first 6 loop variables in mtf variables (GPU speed-up).
    dtype: dtype of the scores.
    layout, mesh_shape: with use_tpu, reorder states with block-diagonal matmuls (see
      _select_beams_blocked).
    num_prefilter: if set, each beam contributes only its num_prefilter best ids per step
      (empirically lossless for 2; None for an exact search).
  Returns:
    (decoded ids [batch, beam, length], scores [batch, beam]), best first. Scores are
    length-penalised log-probabilities of finished beams; for a batch item none of whose beams
    finished, its alive beams and their (unpenalised) log-probabilities.
  """
  _check_initial_ids(initial_ids, 3, "beam_search")
  batch_dim, beam_dim, length_dim = initial_ids.shape.dims
  states = list(states or [])
  for state in states:
    _check_state(state, batch_dim, beam_dim)
  mesh = initial_ids.mesh
  batch_by_beam = mtf.Shape([batch_dim, beam_dim])
  double_beam = mtf.Dimension("double_beam", beam_dim.size * 2)
  old_beam_dim = mtf.Dimension("old_beam", beam_dim.size)

  # Only beam 0 is alive at first, so the first step does not pick the same extension k times.
  initial_log_probs = mtf.broadcast(
      mtf.one_hot(mtf.constant(mesh, 0, dtype=tf.int32), beam_dim, on_value=0.0, off_value=-INF,
                  dtype=dtype),
      batch_by_beam)
  length_scalar = mtf.constant(mesh, length_dim.size, dtype=tf.int32)
  if decode_length is None:
    decode_length = length_scalar
  else:
    decode_length = mtf.minimum(decode_length, length_scalar)

  def grow_topk(i, alive_seq, alive_log_probs, states):
    """The 2*beam best one-position extensions of the alive beams.

    Returns (seq [batch, double_beam, length], log_probs, scores (length-penalised), finished
    flags, new_states, selector [batch, double_beam, beam] of the beam each came from).
    """
    logits, new_states = logits_fn(i, alive_seq, states)
    logits = mtf.cast(logits, dtype)
    vocab_dim = logits.shape.dims[-1]
    candidate_log_probs = mtf.log_softmax(logits, vocab_dim)
    prompt_ids = mtf.gather(initial_ids, i, length_dim)
    candidate_log_probs = mtf.where(
        mtf.not_equal(prompt_ids, 0),
        mtf.one_hot(prompt_ids, vocab_dim, on_value=0.0, off_value=-INF, dtype=dtype),
        candidate_log_probs)
    log_probs = candidate_log_probs + alive_log_probs
    length_penalty = _length_penalty(i + 1, alpha, dtype)
    top_scores, top_beam_index, top_ids = _top_candidates(
        log_probs / length_penalty, batch_dim, beam_dim, vocab_dim, double_beam, num_prefilter)
    top_log_probs = top_scores * length_penalty
    top_seq = mtf.gather(alive_seq, top_beam_index, beam_dim,
                         output_shape=[batch_dim, double_beam, length_dim])
    position = mtf.one_hot(i, length_dim, dtype=tf.int32)
    top_seq = top_seq * (1 - position) + top_ids * position
    top_finished = mtf.equal(top_ids, eos_id)
    first_selector = mtf.one_hot(top_beam_index, beam_dim, dtype=tf.float32)
    return top_seq, top_log_probs, top_scores, top_finished, new_states, first_selector

  def grow_alive(curr_seq, curr_scores, curr_log_probs, curr_finished):
    """The beam best unfinished candidates: (seq, log_probs, flags, selector)."""
    # -2*INF ranks finished candidates below even the dead beams (about -INF): at most one in
    # two candidates ends in eos, so none is kept alive and later extended past its eos.
    curr_scores += mtf.cast(curr_finished, curr_scores.dtype) * (-2. * INF)
    return compute_topk_scores_and_seq(curr_seq, curr_scores, curr_log_probs, curr_finished,
                                       beam_dim, "grow_alive")

  def grow_finished(finished_seq, finished_scores, finished_flags, curr_seq, curr_scores,
                    curr_finished):
    """The beam best of the finished beams and the newly finished candidates."""
    curr_scores += (1. - mtf.cast(curr_finished, curr_scores.dtype)) * -INF

    def concat(a, b):
      a = mtf.rename_dimension(a, beam_dim.name, "triple_beam")
      b = mtf.rename_dimension(b, double_beam.name, "triple_beam")
      return mtf.concat([a, b], "triple_beam")
    scores = concat(finished_scores, curr_scores)
    return compute_topk_scores_and_seq(concat(finished_seq, curr_seq), scores, scores,
                                       concat(finished_flags, curr_finished), beam_dim,
                                       "grow_finished")

  def inner_loop(i, alive_seq, alive_log_probs, finished_seq, finished_scores, finished_flags,
                 *states):
    (top2k_seq, top2k_log_probs, top2k_scores, top2k_finished, new_states,
     first_selector) = grow_topk(i, alive_seq, alive_log_probs, list(states))
    with tf.variable_scope("grow_alive"):
      alive_seq, alive_log_probs, _, second_selector = grow_alive(
          top2k_seq, top2k_scores, top2k_log_probs, top2k_finished)
    with tf.variable_scope("grow_finished"):
      finished_seq, finished_scores, finished_flags, _ = grow_finished(
          finished_seq, finished_scores, finished_flags, top2k_seq, top2k_scores, top2k_finished)
    # selector[batch, old_beam, beam]: which old beam each new alive beam extends.
    selector = mtf.einsum(
        [mtf.rename_dimension(first_selector, beam_dim.name, old_beam_dim.name), second_selector],
        output_shape=[batch_dim, old_beam_dim, beam_dim])
    if use_tpu and layout is not None and mesh_shape is not None:
      new_states = [_select_beams_blocked(s, selector, batch_dim, beam_dim, old_beam_dim, layout,
                                          mesh_shape) for s in new_states]
    else:
      new_states = [_select_beams(s, selector, beam_dim, old_beam_dim) for s in new_states]
    return [i + 1, alive_seq, alive_log_probs, finished_seq, finished_scores,
            finished_flags] + new_states

  def is_not_finished(i, unused_alive_seq, alive_log_probs, unused_finished_seq, finished_scores,
                      finished_flags, *unused_states):
    """Continue while i < decode_length and (with stop_early) some alive beam may still win."""
    if not stop_early:
      return mtf.less(i, decode_length)
    max_length_penalty = _length_penalty(decode_length, alpha, finished_scores.dtype)
    # Log-probabilities only decrease, so the best alive beam scores at most this.
    lower_bound_alive_scores = mtf.gather(alive_log_probs, 0, beam_dim) / max_length_penalty
    # Scores are negative: the min over finished beams (others zeroed) is the worst finished one;
    # with no finished beam, -INF, so the bound is never met.
    lowest_score_of_finished = mtf.reduce_min(
        finished_scores * mtf.cast(finished_flags, finished_scores.dtype), reduced_dim=beam_dim)
    lowest_score_of_finished += (1. - mtf.cast(mtf.reduce_any(finished_flags, reduced_dim=beam_dim),
                                               finished_scores.dtype)) * -INF
    bound_is_met = mtf.reduce_all(mtf.greater(lowest_score_of_finished, lower_bound_alive_scores))
    return mtf.logical_and(mtf.less(i, decode_length), mtf.logical_not(bound_is_met))

  while_loop_inputs = [
      mtf.constant(mesh, 0, dtype=tf.int32), initial_ids, initial_log_probs, initial_ids,
      mtf.constant(mesh, -INF, batch_by_beam, dtype=dtype),
      mtf.constant(mesh, False, batch_by_beam, tf.bool)] + states
  (_, alive_seq, alive_log_probs, finished_seq, finished_scores, finished_flags) = mtf.while_loop(
      is_not_finished, inner_loop, while_loop_inputs, num_loop_vars=None if use_tpu else 6)[:6]

  # A batch item none of whose beams reached eos returns its alive beams.
  any_finished = mtf.reduce_any(finished_flags, reduced_dim=beam_dim)
  return (mtf.where(any_finished, finished_seq, alive_seq),
          mtf.where(any_finished, finished_scores, alive_log_probs))


@gin.configurable(module=_GIN_MODULE)
def greedy_decode(logits_fn: Callable, initial_ids: mtf.Tensor, temperature=0.0,
                  initial_states: Optional[Sequence] = None, eos_id: int = EOS_ID,
                  forced_ids: Optional[mtf.Tensor] = None, use_tpu: bool = True) -> mtf.Tensor:
  """Decodes one position per step, by argmax (temperature 0) or sampling softmax(logits / temperature).

  Stops when every sequence contains eos_id, or at the end of the length dimension (positions
  after a sequence's eos hold whatever was decoded while others were unfinished).

  Args:
    logits_fn: (step_num int32 scalar, ids [..., length], states list) ->
      (logits [..., vocab] for position step_num, new_states like states).
    initial_ids: int32 [..., length], zeros.
    temperature: 0.0 (argmax) to 1.0 (sample from the model); a float or an mtf scalar.
    initial_states: optional list of mtf Tensors.
    eos_id: end-of-sequence id.
    forced_ids: optional int32 [..., length]; nonzero entries are emitted instead of sampling.
    use_tpu: False keeps the states in mtf variables (GPU speed-up).
  Returns:
    int32 ids shaped like initial_ids.
  """
  _check_initial_ids(initial_ids, None, "greedy_decode")
  length_dim = initial_ids.shape.dims[-1]
  mesh = initial_ids.mesh
  num_steps = mtf.constant(mesh, length_dim.size, dtype=tf.int32)

  def cond_fn(step_num, prev_ids, *unused_states):
    overflow = mtf.equal(step_num, num_steps)
    has_eos = mtf.reduce_any(mtf.equal(prev_ids, eos_id), reduced_dim=length_dim)
    return mtf.logical_not(mtf.logical_or(overflow, mtf.reduce_all(has_eos)))

  def body_fn(step_num, ids, *states):
    logits, new_states = logits_fn(step_num, ids, list(states))
    vocab_dim = logits.shape.dims[-1]
    new_ids = mtf.sample_with_temperature(logits, vocab_dim, temperature)
    if forced_ids is not None:
      forced = mtf.gather(forced_ids, step_num, length_dim)
      new_ids = forced + new_ids * mtf.to_int32(mtf.equal(forced, 0))
    ids += new_ids * mtf.one_hot(step_num, length_dim, dtype=tf.int32)
    return [step_num + 1, ids] + list(new_states)

  while_loop_inputs = [mtf.constant(mesh, 0, dtype=tf.int32), initial_ids] + list(initial_states or [])
  final_step_num, mtf_samples = mtf.while_loop(
      cond_fn, body_fn, while_loop_inputs, num_loop_vars=None if use_tpu else 2)[:2]
  return mtf.Print(mtf_samples, [final_step_num], "output_length")
