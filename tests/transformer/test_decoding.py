"""Decoding: "first_part" + "incremental" steps reproduce a full forward pass; greedy sampling, top-1
sampling and one-beam beam search agree and are greedy; bos_id, prompts, max_steps, never_end,
encoder-decoder decoding."""

from __future__ import annotations

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer
from tests.harness import assert_allclose, lower_and_evaluate
from tests.transformer import model_check
from tests.transformer.model_check import import_ids

BATCH, LENGTH, VOCAB = 2, 6, 12
F32 = mtf.VariableDType(tf.float32)


def _ids(seed=0):
  return np.random.RandomState(seed).randint(2, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)


def _reusing_variables():
  return tf.variable_scope(tf.get_variable_scope(), reuse=True)


def _clean(ids, eos_id=1):
  """Zero every position after the first eos of each row."""
  ids = np.array(ids)
  for row in ids:
    eos = np.flatnonzero(row == eos_id)
    if eos.size:
      row[eos[0] + 1:] = 0
  return ids


def test_incremental_steps_reproduce_the_full_forward_pass():
  """Step p's logits (teacher-forced inputs) equal position p of one full pass, starting from
  empty states at p = 0 and from first_part states of the whole sequence at p = 3."""
  ids = _ids(1)

  def build(mesh):
    model = model_check.lm(max_length=LENGTH)
    targets = import_ids(mesh, ids)
    batch_dims, length_dim = targets.shape.dims[:-1], targets.shape.dims[-1]
    inputs = transformer.autoregressive_inputs(targets)
    full_logits, _ = model.call_simple(inputs, None, compute_loss=False, mode="infer")
    positions = mtf.range(mesh, length_dim, tf.int32)
    first = transformer.Context(model=model, mesh=mesh, batch_dims=batch_dims, length_dim=length_dim,
                                variable_dtype=F32, mode="first_part", position=positions,
                                position_is_default=True, new_states=[], constant_states=[],
                                read_priority=positions, write_priority=positions, inputs=inputs)
    with tf.variable_scope(model.name, reuse=True):
      model._call_internal(first, inputs)

    def steps(states, start):
      outputs = []
      for p in range(start, LENGTH):
        context = transformer.Context(
            model=model, mesh=mesh, batch_dims=batch_dims, length_dim=length_dim, variable_dtype=F32,
            mode="incremental", position=mtf.constant(mesh, p, dtype=tf.int32), states=states,
            new_states=[], constant_states=first.constant_states,
            read_priority=mtf.constant(mesh, p, dtype=tf.int32), write_priority=positions)
        with tf.variable_scope(model.name, reuse=True):
          outputs.append(model._call_internal(context, mtf.gather(inputs, p, length_dim)))
        states = context.new_states
      return outputs
    assert len(first.new_states) == 4  # k and v of two self-attention layers
    from_empty = steps([mtf.zeros_like(s) for s in first.new_states], 0)
    from_first_part = steps(first.new_states, 3)
    return [full_logits] + from_empty + from_first_part
  values = lower_and_evaluate(build)
  full, from_empty, from_first_part = values[0], values[1:1 + LENGTH], values[1 + LENGTH:]
  for p in range(LENGTH):
    assert_allclose(from_empty[p], full[:, p], rtol=1e-4, atol=1e-5)
  for p in range(3, LENGTH):
    assert_allclose(from_first_part[p - 3], full[:, p], rtol=1e-4, atol=1e-5)


def _greedy_argmax(model, mesh, decoded):
  """argmax of a full forward pass on `decoded` (teacher forcing), reusing the model's variables."""
  with _reusing_variables():
    logits, _ = model.call_simple(transformer.autoregressive_inputs(decoded), None, compute_loss=False,
                                  mode="infer")
  return mtf.argmax(logits, model.output_vocab_dim)


def test_greedy_sampling_top1_sampling_and_one_beam_search_give_the_same_greedy_sequence():
  def build(mesh):
    model = model_check.lm(max_length=LENGTH)
    batch, length = mtf.Dimension("batch", BATCH), mtf.Dimension("length", LENGTH)
    beam = mtf.Dimension("beam", 1)
    zeros = mtf.zeros(mesh, [batch, length], dtype=tf.int32)
    greedy = model.sample_autoregressive(zeros, temperature=0.0, has_partial_sequences=False)
    with _reusing_variables():
      top1 = model.sample_autoregressive(zeros, temperature=1.0, sampling_keep_top_k=1)
      beams = model.beam_search(mtf.zeros(mesh, [batch, beam, length], dtype=tf.int32),
                                mtf.constant(mesh, LENGTH, dtype=tf.int32))
    return [greedy, top1, beams, _greedy_argmax(model, mesh, greedy)]
  greedy, top1, beams, argmax = lower_and_evaluate(build)
  cleaned = _clean(greedy)
  assert (cleaned > 1).sum() > BATCH  # a real sequence, not just eos
  np.testing.assert_array_equal(_clean(top1), cleaned)
  np.testing.assert_array_equal(_clean(beams), cleaned)
  np.testing.assert_array_equal(np.where(cleaned > 0, argmax, 0), cleaned)


def test_bos_id_is_the_input_at_position_zero():
  def build(mesh):
    model = model_check.lm(max_length=LENGTH, num_layers=1)
    zeros = mtf.zeros(mesh, [mtf.Dimension("batch", BATCH), mtf.Dimension("length", LENGTH)], dtype=tf.int32)
    decoded = model.sample_autoregressive(zeros, has_partial_sequences=False, never_end=True, bos_id=3)
    length_dim = decoded.shape.dims[-1]
    inputs = transformer.autoregressive_inputs(decoded) + 3 * mtf.one_hot(
        mtf.constant(mesh, 0, dtype=tf.int32), length_dim, dtype=tf.int32)
    with _reusing_variables():
      logits, _ = model.call_simple(inputs, None, compute_loss=False, mode="infer")
    return [decoded, logits]
  decoded, logits = lower_and_evaluate(build)
  logits[..., 1] = -np.inf  # never_end
  np.testing.assert_array_equal(decoded, logits.argmax(-1))


def test_prompt_is_kept_and_can_be_removed_and_never_end_forbids_eos():
  prompt = np.zeros((BATCH, LENGTH), np.int32)
  prompt[0, :2] = [5, 6]
  prompt[1, :3] = [7, 8, 9]

  def build(mesh):
    model = model_check.lm(max_length=LENGTH)
    partial = import_ids(mesh, prompt)
    continued = model.sample_autoregressive(partial, never_end=True)
    with _reusing_variables():
      removed = model.sample_autoregressive(partial, never_end=True, remove_partial_sequences=True)
      one_step = model.sample_autoregressive(partial, never_end=True, max_steps=1)
    return [continued, removed, one_step, _greedy_argmax(model, mesh, continued)]
  continued, removed, one_step, argmax = lower_and_evaluate(build)
  np.testing.assert_array_equal(one_step, np.where(np.arange(LENGTH) <= [[2], [3]], continued, 0))
  np.testing.assert_array_equal(continued[0, :2], [5, 6])
  np.testing.assert_array_equal(continued[1, :3], [7, 8, 9])
  assert (continued != 1).all() and (continued[0, 2:] > 0).all()
  np.testing.assert_array_equal(continued[0, 2:], argmax[0, 2:])  # greedy after the prompt
  np.testing.assert_array_equal(removed[0, :4], continued[0, 2:])
  np.testing.assert_array_equal(removed[1, :3], continued[1, 3:])
  assert (removed[0, 4:] == 0).all() and (removed[1, 3:] == 0).all()


def test_prompt_without_a_stop_token_decodes_to_the_end():
  prompt = np.zeros((BATCH, LENGTH), np.int32)
  prompt[:, :2] = [[5, 6], [7, 8]]

  def build(mesh):
    model = model_check.lm(max_length=LENGTH, num_layers=1)
    partial = import_ids(mesh, prompt)
    decoded = model.sample_autoregressive(partial, stop_at_token=None)
    return [decoded, _greedy_argmax(model, mesh, decoded)]
  decoded, argmax = lower_and_evaluate(build)
  np.testing.assert_array_equal(decoded[:, :2], prompt[:, :2])
  np.testing.assert_array_equal(decoded[:, 2:], argmax[:, 2:])  # every position decoded, eos or not


def test_bitransformer_greedy_decode_is_greedy_and_beam_decode_runs():
  inputs_np = _ids(2)
  inputs_np[1, -2:] = 0

  def build(mesh):
    model = model_check.bitransformer(max_length=LENGTH)
    inputs = import_ids(mesh, inputs_np)
    greedy = model.decode(inputs, beam_size=1)
    with _reusing_variables():
      beams = model.decode(inputs, beam_size=2, max_decode_length=LENGTH)
      logits, _ = model.call_simple(inputs, greedy, compute_loss=False, mode="infer")
    return [greedy, beams, mtf.argmax(logits, model.output_vocab_dim)]
  greedy, beams, argmax = lower_and_evaluate(build)
  cleaned = _clean(greedy)
  assert (cleaned > 1).sum() > BATCH
  assert cleaned.shape == beams.shape == (BATCH, LENGTH)
  np.testing.assert_array_equal(np.where(cleaned > 0, argmax, 0), cleaned)
  assert ((beams >= 0) & (beams < VOCAB)).all()


def test_sampling_draws_fresh_noise_at_every_step_and_for_every_sequence():
  """At a temperature where the noise outweighs the logits, each step's token follows that step's
  noise: identical prompts get different continuations, and no sequence repeats one token."""
  rows = 8

  def build(mesh):
    model = model_check.lm(max_length=LENGTH)
    zeros = mtf.zeros(mesh, [mtf.Dimension("batch", rows), mtf.Dimension("length", LENGTH)], dtype=tf.int32)
    return [model.sample_autoregressive(zeros, stop_at_token=None, temperature=1e4,
                                        has_partial_sequences=False)]
  for mesh_shape, layout in [("all:1", ""), ("all:2", "batch:all")]:
    (sampled,) = lower_and_evaluate(build, mesh_shape, layout)
    assert len({tuple(row) for row in sampled}) == rows
    assert all(len(set(row)) > 1 for row in sampled)
