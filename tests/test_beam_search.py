"""mtf.beam_search: beam search against exhaustive search over a fixed transition table, greedy decoding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import MODES, lower_and_evaluate

EOS = mtf.beam_search.EOS_ID


def make_table(batch: int, length: int, vocab: int, seed: int = 0, scale: float = 2.0) -> np.ndarray:
  """Logits table[batch, step, previous id, next id] (previous id is 0 at step 0)."""
  return (np.random.RandomState(seed).randn(batch, length, vocab, vocab) * scale).astype(np.float32)


def table_logits_fn(table: np.ndarray, batch_dim: mtf.Dimension, length_dim: mtf.Dimension,
                    vocab_dim: mtf.Dimension):
  """logits_fn(step, ids[..., length], states) looking up table[batch, step, ids[step - 1]]."""
  step_dim = mtf.Dimension("step", table.shape[1])
  prev_dim = mtf.Dimension("prev", table.shape[2])

  def logits_fn(step_num, ids, states):
    table_t = mtf.import_tf_tensor(ids.mesh, tf.constant(table),
                                   shape=[batch_dim, step_dim, prev_dim, vocab_dim])
    prev = mtf.gather(ids, step_num - 1, length_dim)  # one_hot(-1) is all zeros: id 0 at step 0
    at_step = mtf.gather(table_t, step_num, step_dim)
    return mtf.gather(at_step, prev, prev_dim, output_shape=prev.shape + vocab_dim), states
  return logits_fn


def log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  return x - np.log(np.sum(np.exp(x - x.max())) ) - x.max()


def exhaustive_finished(table, b, length, alpha, prompt=(), eos_id=EOS):
  """Every eos-terminated sequence (zero padded) with its length-penalised score, best first."""
  vocab = table.shape[-1]
  results = {}
  for seq in itertools.product(range(vocab), repeat=length):
    if any(seq[j] != p for j, p in enumerate(prompt) if p):
      continue
    if eos_id not in seq:
      continue
    end = seq.index(eos_id) + 1
    log_prob, prev = 0.0, 0
    for j in range(end):
      if not (j < len(prompt) and prompt[j]):
        log_prob += log_softmax(table[b, j, prev])[seq[j]]
      prev = seq[j]
    padded = tuple(seq[:end]) + (0,) * (length - end)
    results[padded] = log_prob / ((5.0 + end) / 6.0) ** alpha
  return sorted(results.items(), key=lambda kv: -kv[1])


def run_beam_search(table, beam, length, alpha, mode="graph", mesh_shape="all:1", layout="",
                    prompt=None, **kwargs):
  batch, vocab = table.shape[0], table.shape[-1]
  batch_dim, beam_dim = mtf.Dimension("batch", batch), mtf.Dimension("beam", beam)
  length_dim, vocab_dim = mtf.Dimension("length", length), mtf.Dimension("vocab", vocab)
  initial = np.zeros([batch, beam, length], np.int32) if prompt is None else prompt

  def build(mesh):
    initial_ids = mtf.import_tf_tensor(mesh, tf.constant(initial), shape=[batch_dim, beam_dim, length_dim])
    decode_length = kwargs.pop("decode_length", None)
    if decode_length is not None:
      decode_length = mtf.constant(mesh, decode_length, dtype=tf.int32)
    ids, scores = mtf.beam_search.beam_search(
        table_logits_fn(table, batch_dim, length_dim, vocab_dim), initial_ids, alpha,
        decode_length=decode_length, **kwargs)
    return [ids, scores]
  return lower_and_evaluate(build, mesh_shape, layout, mode)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 3.0])
def test_beam_search_returns_exhaustive_top_k_when_the_beam_holds_every_prefix(alpha):
  # vocab 3, length 3, beam 6: no prefix is ever pruned, so the search is exact.
  table = make_table(batch=2, length=3, vocab=3, seed=1)
  ids, scores = run_beam_search(table, beam=6, length=3, alpha=alpha, stop_early=False,
                                num_prefilter=None)
  for b in range(2):
    expected = exhaustive_finished(table, b, 3, alpha)[:6]
    assert [tuple(s) for s in ids[b]] == [seq for seq, _ in expected]
    np.testing.assert_allclose(scores[b], [score for _, score in expected], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_beam_search_with_stop_early_finds_the_best_sequence_and_sorts_scores(mode):
  table = make_table(batch=2, length=3, vocab=3, seed=2)
  ids, scores = run_beam_search(table, beam=6, length=3, alpha=0.6, mode=mode, num_prefilter=None)
  for b in range(2):
    best_seq, best_score = exhaustive_finished(table, b, 3, 0.6)[0]
    assert tuple(ids[b, 0]) == best_seq
    np.testing.assert_allclose(scores[b, 0], best_score, rtol=1e-5)
    assert np.all(np.diff(scores[b]) <= 0)


def test_length_penalty_alpha_decides_between_a_short_and_a_long_sequence():
  # [eos] has probability ~0.6, [2, 2, eos] ~0.4: alpha 0 prefers the first, alpha 5 the longer one.
  vocab, length = 3, 3
  table = np.full([1, length, vocab, vocab], -10.0, np.float32)
  table[0, 0, 0, EOS], table[0, 0, 0, 2] = np.log(0.6), np.log(0.4)
  table[0, 1, 2, 2] = table[0, 2, 2, EOS] = 0.0
  table[0, 1, 2, EOS] = table[0, 2, 2, 2] = -5.0
  short = run_beam_search(table, beam=2, length=length, alpha=0.0)[0][0, 0]
  long = run_beam_search(table, beam=2, length=length, alpha=5.0)[0][0, 0]
  assert list(short) == [EOS, 0, 0]
  assert list(long) == [2, 2, EOS]


LAYOUT_TABLE = make_table(batch=2, length=4, vocab=4, seed=3)


@pytest.fixture(scope="module")
def single_processor_result():
  return run_beam_search(LAYOUT_TABLE, beam=2, length=4, alpha=0.6)


@pytest.mark.parametrize("mesh_shape,layout", [
    ("all:2", "batch:all"),
    ("rows:2;cols:2", "batch:rows;vocab:cols"),
    ("rows:2;cols:2", "batch:rows;length:cols"),
])
def test_beam_search_result_does_not_depend_on_the_layout(mesh_shape, layout, single_processor_result):
  ref_ids, ref_scores = single_processor_result
  ids, scores = run_beam_search(LAYOUT_TABLE, beam=2, length=4, alpha=0.6, mesh_shape=mesh_shape,
                                layout=layout)
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_allclose(scores, ref_scores, rtol=1e-5)


def test_prefilter_keeps_the_best_sequence():
  table = make_table(batch=2, length=4, vocab=6, seed=4)
  exact_ids, exact_scores = run_beam_search(table, beam=3, length=4, alpha=0.6, num_prefilter=None)
  ids, scores = run_beam_search(table, beam=3, length=4, alpha=0.6)  # default num_prefilter=2
  np.testing.assert_array_equal(ids[:, 0], exact_ids[:, 0])
  np.testing.assert_allclose(scores[:, 0], exact_scores[:, 0], rtol=1e-5)


def test_prompt_ids_are_forced_and_cost_no_probability():
  table = make_table(batch=2, length=3, vocab=3, seed=5)
  prompt = np.zeros([2, 3, 3], np.int32)
  prompt[0, :, 0] = 2  # batch item 0 must start with id 2; item 1 is free
  ids, scores = run_beam_search(table, beam=3, length=3, alpha=0.6, stop_early=False,
                                num_prefilter=None, prompt=prompt)
  for b, item_prompt in [(0, (2,)), (1, ())]:
    expected = exhaustive_finished(table, b, 3, 0.6, prompt=item_prompt)[:3]
    assert [tuple(s) for s in ids[b]] == [seq for seq, _ in expected]
    np.testing.assert_allclose(scores[b], [score for _, score in expected], rtol=1e-5, atol=1e-5)


def test_decode_length_leaves_later_positions_empty():
  table = make_table(batch=2, length=4, vocab=3, seed=6)
  ids, _ = run_beam_search(table, beam=2, length=4, alpha=0.6, decode_length=2, num_prefilter=None)
  assert np.all(ids[:, :, 2:] == 0)
  for b in range(2):
    assert tuple(ids[b, 0]) == exhaustive_finished(table[:, :2], b, 2, 0.6)[0][0] + (0, 0)


def test_without_any_finished_beam_the_alive_beams_and_log_probs_are_returned():
  table = make_table(batch=2, length=2, vocab=3, seed=7)
  ids, scores = run_beam_search(table, beam=6, length=2, alpha=0.6, eos_id=7, num_prefilter=None)
  for b in range(2):
    log_probs = {
        seq: log_softmax(table[b, 0, 0])[seq[0]] + log_softmax(table[b, 1, seq[0]])[seq[1]]
        for seq in itertools.product(range(3), repeat=2)}
    expected = sorted(log_probs.items(), key=lambda kv: -kv[1])[:6]
    assert [tuple(s) for s in ids[b]] == [seq for seq, _ in expected]
    np.testing.assert_allclose(scores[b], [lp for _, lp in expected], rtol=1e-5)


@pytest.mark.parametrize("blocked,use_tpu", [(False, True), (True, True), (False, False)])
def test_states_are_reordered_with_their_beams(blocked, use_tpu):
  """The state records each beam's ids; logits are spoiled wherever it disagrees with the ids."""
  batch, beam, length, vocab = 4, 2, 3, 3
  table = make_table(batch, length, vocab, seed=8)
  dims = [mtf.Dimension("batch", batch), mtf.Dimension("beam", beam), mtf.Dimension("length", length)]
  vocab_dim = mtf.Dimension("vocab", vocab)

  def build(mesh):
    table_fn = table_logits_fn(table, dims[0], dims[2], vocab_dim)

    def logits_fn(step_num, ids, states):
      logits, _ = table_fn(step_num, ids, states)
      # After reordering, the state (ids of the previous step) is ids without position step - 1.
      expected_state = ids * (1 - mtf.one_hot(step_num - 1, dims[2], dtype=tf.int32))
      diff = states[0] - expected_state
      mismatch = mtf.to_float(mtf.reduce_sum(diff * diff, reduced_dim=dims[2]))
      spoil = mtf.one_hot(mtf.constant(mesh, 0, dtype=tf.int32), vocab_dim) * 100.0
      return logits + mismatch * spoil, [ids]
    initial_ids = mtf.zeros(mesh, dims, dtype=tf.int32)
    ids, scores = mtf.beam_search.beam_search(
        logits_fn, initial_ids, 0.6, states=[initial_ids], num_prefilter=None, use_tpu=use_tpu,
        layout="batch:all" if blocked else None, mesh_shape="all:2" if blocked else None)
    return [ids, scores]
  ids, scores = lower_and_evaluate(build, "all:2", "batch:all")
  for b in range(batch):  # beam 2 over 3 ids and 3 positions finds the exhaustive best here
    best_seq, best_score = exhaustive_finished(table, b, length, 0.6)[0]
    assert tuple(ids[b, 0]) == best_seq
    np.testing.assert_allclose(scores[b, 0], best_score, rtol=1e-5)


def test_beam_search_rejects_initial_ids_without_three_dims_or_float_ids():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  with pytest.raises(ValueError, match=r"exactly \[batch, beam, length\]"):
    mtf.beam_search.beam_search(None, mtf.zeros(mesh, "batch:2;length:3", dtype=tf.int32), 0.6)
  with pytest.raises(ValueError, match="must be int32 ids, got dtype float32"):
    mtf.beam_search.beam_search(None, mtf.zeros(mesh, "batch:2;beam:2;length:3"), 0.6)
  with pytest.raises(ValueError, match="must be int32 ids, got dtype float32"):
    mtf.beam_search.greedy_decode(None, mtf.zeros(mesh, "batch:2;length:3"))


def test_beam_search_rejects_states_without_batch_and_beam_dims():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  ids = mtf.zeros(mesh, "batch:2;beam:2;length:3", dtype=tf.int32)
  with pytest.raises(ValueError, match="state .* must contain the batch .* and beam"):
    mtf.beam_search.beam_search(None, ids, 0.6, states=[mtf.zeros(mesh, "batch:2;d:4")])


# ---- greedy decoding ----

def numpy_greedy(table, length, eos_id=EOS):
  ids = np.zeros([table.shape[0], length], np.int32)
  for step in range(length):
    if np.all(np.any(ids == eos_id, axis=1)):
      break
    prev = ids[:, step - 1] if step else np.zeros(table.shape[0], np.int32)
    ids[:, step] = np.argmax(table[np.arange(table.shape[0]), step, prev], axis=-1)
  return ids


def run_greedy(table, length, mode="graph", mesh_shape="all:1", layout="", **kwargs):
  batch, vocab = table.shape[0], table.shape[-1]
  batch_dim, length_dim = mtf.Dimension("batch", batch), mtf.Dimension("length", length)
  vocab_dim = mtf.Dimension("vocab", vocab)

  def build(mesh):
    forced = kwargs.pop("forced_ids", None)
    if forced is not None:
      kwargs["forced_ids"] = mtf.import_tf_tensor(mesh, tf.constant(forced), shape=[batch_dim, length_dim])
    initial_ids = mtf.zeros(mesh, [batch_dim, length_dim], dtype=tf.int32)
    return [mtf.beam_search.greedy_decode(table_logits_fn(table, batch_dim, length_dim, vocab_dim),
                                          initial_ids, **kwargs)]
  return lower_and_evaluate(build, mesh_shape, layout, mode)[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_shape,layout", [("all:1", ""), ("rows:2;cols:2", "batch:rows;vocab:cols")])
def test_greedy_decode_with_zero_temperature_is_argmax_decoding(mode, mesh_shape, layout):
  table = make_table(batch=4, length=5, vocab=4, seed=9)
  ids = run_greedy(table, 5, mode=mode, mesh_shape=mesh_shape, layout=layout)
  np.testing.assert_array_equal(ids, numpy_greedy(table, 5))


def test_greedy_decode_stops_once_every_sequence_has_eos():
  table = np.zeros([2, 4, 3, 3], np.float32)
  table[:, 0, 0, 2] = 5.0   # step 0: id 2
  table[:, 1, 2, EOS] = 5.0  # step 1: eos
  table[:, 2:, :, 2] = 5.0   # would be 2 if decoding went on
  np.testing.assert_array_equal(run_greedy(table, 4), [[2, EOS, 0, 0]] * 2)


def test_greedy_decode_equals_beam_search_with_one_beam():
  # A clear path 2 -> 2 -> eos, small noise elsewhere.
  table = make_table(batch=2, length=4, vocab=4, seed=10, scale=0.5)
  table[:, 0, 0, 2] += 5.0
  table[:, 1, 2, 2] += 5.0
  table[:, 2, 2, EOS] += 5.0
  greedy = run_greedy(table, 4)
  beam_ids, _ = run_beam_search(table, beam=1, length=4, alpha=0.0)
  np.testing.assert_array_equal(greedy, beam_ids[:, 0])
  np.testing.assert_array_equal(greedy, [[2, 2, EOS, 0]] * 2)


def test_greedy_decode_with_temperature_samples_valid_ids():
  table = np.zeros([8, 6, 5, 5], np.float32)  # uniform distribution over 5 ids
  ids = run_greedy(table, 6, temperature=1.0, eos_id=-1)
  assert ids.shape == (8, 6)
  assert np.all((ids >= 0) & (ids < 5))
  assert len(np.unique(ids)) > 1


def test_greedy_decode_emits_forced_ids():
  table = make_table(batch=2, length=4, vocab=4, seed=11)
  forced = np.array([[3, 0, 2, 0], [0, 0, 0, 0]], np.int32)
  ids = run_greedy(table, 4, forced_ids=forced, eos_id=-1)
  assert ids[0, 0] == 3 and ids[0, 2] == 2
  expected_second = np.argmax(table[0, 1, 3])
  assert ids[0, 1] == expected_second
  np.testing.assert_array_equal(ids[1], numpy_greedy(table[1:], 4, eos_id=-1)[0])
