"""transformer.py: Context, LayerStack and sublayers, make_layer_stack, Unitransformer, Bitransformer,
StudentTeacher, embeddings and target helpers; tiny models overfit on a 2x4 mesh."""

from __future__ import annotations

from types import SimpleNamespace

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer, transformer_layers
from tests.harness import assert_allclose, lower_and_evaluate
from tests.transformer import model_check
from tests.transformer.model_check import LAYOUT_2X4, MESH_2X4, gin_config, import_ids

BATCH, LENGTH, VOCAB = 4, 8, 12
F32 = mtf.VariableDType(tf.float32)


def _ids(seed=0, batch=BATCH, length=LENGTH, low=2):
  return np.random.RandomState(seed).randint(low, VOCAB, size=(batch, length)).astype(np.int32)


def _rms_norm_np(x, eps=1e-6):
  return x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)


# ---- Context ----

def _context(mesh, **kwargs):
  length = mtf.Dimension("length", 4)
  return transformer.Context(model=None, mesh=mesh, batch_dims=[mtf.Dimension("batch", 2)], length_dim=length,
                             variable_dtype=F32, **kwargs)


def test_context_stores_arguments_and_defaults():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  context = _context(mesh, mode="infer")
  assert context.mode == transformer.ModeKeys.PREDICT == "infer"
  assert not context.train and _context(mesh).train
  assert context.layer_outputs == [] and context.shared_params == {} and context.cache == {}
  assert context.next_constant_state == 0 and context.layer_index == 0
  assert context.activation_dtype == tf.float32
  assert context.nonpadding is None
  assert _context(mesh, sequence_id=1).nonpadding == 1


def test_context_states_are_read_in_recording_order():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  context = _context(mesh, states=["k0", "v0", "k1", "v1"], new_states=[], constant_states=["c0", "c1"])
  assert context.get_states(2) == ["k0", "v0"]
  context.record_new_states(["K0", "V0"])
  assert context.get_states(2) == ["k1", "v1"]
  context.record_new_states(["K1", "V1"])
  with pytest.raises(ValueError, match="only 0 of 4 states are left"):
    context.get_states(1)
  assert [context.get_constant_state(), context.get_constant_state()] == ["c0", "c1"]
  context.record_constant_state("c2")
  assert context.get_constant_state() == "c2"


def test_context_nonpadding_position_and_encoder_length():
  def build(mesh):
    seq = import_ids(mesh, np.array([[1, 1, 2, 0], [1, 0, 0, 0]]))
    encoder_output = mtf.zeros(mesh, [mtf.Dimension("batch", 2), mtf.Dimension("memory_length", 3)])
    context = _context(mesh, sequence_id=seq, position_is_default=True, encoder_output=encoder_output)
    assert context.encoder_length_dim == mtf.Dimension("memory_length", 3)
    return [context.nonpadding, context.get_position()]
  nonpadding, position = lower_and_evaluate(build)
  assert_allclose(nonpadding, [[1, 1, 1, 0], [1, 0, 0, 0]])
  assert_allclose(position, [0, 1, 2, 3])


# ---- make_layer_stack and LayerStack ----

def test_make_layer_stack_names_layers_by_block_and_entry():
  attention, ffn = transformer_layers.SelfAttention, transformer_layers.DenseReluDense
  stack = transformer.make_layer_stack([attention, (ffn, "ffn"), [ffn, {"hidden_size": 8}]], num_layers=2)
  assert [layer.name for layer in stack.layers] == [
      "block_000/layer_000", "block_000/ffn", "block_000/layer_002",
      "block_001/layer_000", "block_001/ffn", "block_001/layer_002"]
  assert stack.num_layers == 6 and isinstance(stack, transformer.LayerStack)
  assert stack.layers[2].hidden_size == 8 and stack.layers[1].hidden_size == 4096
  flat = transformer.make_layer_stack([attention, ffn], num_layers=2, block_scope=False)
  assert [layer.name for layer in flat.layers] == ["layer_000", "layer_001", "layer_002", "layer_003"]


def test_make_layer_stack_passes_kwargs_and_rejects_bad_entries():
  class Scaled(transformer.TransformerLayer):
    def __init__(self, factor=1.0):
      self.factor = factor
  stack = transformer.make_layer_stack([(Scaled, "s", {"factor": 3.0})], num_layers=1)
  assert stack.layers[0].factor == 3.0 and stack.layers[0].name == "block_000/s"
  assert '"factor": 3.0' in stack.layers[0].to_json()
  with pytest.raises(ValueError, match="name string and a kwargs dict"):
    transformer.make_layer_stack([(Scaled, 3)], num_layers=1)


def test_layer_stack_needs_both_or_neither_legacy_argument():
  with pytest.raises(ValueError, match="both dropout_rate and norm_epsilon"):
    transformer.LayerStack([], dropout_rate=0.1)
  with pytest.raises(NotImplementedError, match="must implement call"):
    transformer.TransformerLayer().call(None, None)


class _Widen(transformer.TransformerLayer):
  def call(self, context, x):
    return mtf.concat([x, x], "d_model")


def test_layer_that_changes_the_shape_is_named_in_the_error():
  def build(mesh):
    model = _tiny_model(transformer.LayerStack([_named(_Widen(), "block_000/widen")]))
    return [model.call_simple(import_ids(mesh, _ids()), None, compute_loss=False)[0]]
  with pytest.raises(ValueError, match=r"layer 'block_000/widen' \(_Widen\) returned shape"):
    lower_and_evaluate(build)


def _named(layer, name):
  layer.set_name(name)
  return layer


def _tiny_model(stack, **kwargs):
  kwargs = {"d_model": 8, "input_vocab_size": VOCAB, "output_vocab_size": VOCAB, "autoregressive": False,
            "max_length": LENGTH, "vocab_divisor": 4, **kwargs}
  return transformer.Unitransformer(layer_stack=stack, **kwargs)


def _activations_and_context(mesh, model):
  """Random x [batch=2, length=3, d_model] and an eval-mode Context for it."""
  x = mtf.random_normal(mesh, [mtf.Dimension("batch", 2), mtf.Dimension("length", 3), model.model_dim])
  context = transformer.Context(model=model, mesh=mesh, batch_dims=x.shape.dims[:1],
                                length_dim=x.shape.dims[1], variable_dtype=F32, mode="eval")
  return x, context


class _Double(transformer.TransformerLayer):
  def call(self, context, x):
    return x * 2.0


def test_layer_stack_default_sublayers_compute_a_pre_norm_residual_block():
  """Default sublayers: y = x + 2 * rms_norm(x) per layer, then a final rms_norm; scales start at 1."""
  holder = {}

  def build(mesh):
    stack = transformer.LayerStack([_named(_Double(), "a"), _named(_Double(), "b")])
    model = _tiny_model(stack, positional_embedding=False)
    x, context = _activations_and_context(mesh, model)
    y = stack.call(context, x)
    holder["names"] = [v.name for v in mesh.graph.all_variables]
    holder["outputs"] = len(context.layer_outputs)
    return [x, y]
  x, y = lower_and_evaluate(build)
  expected = x
  for _ in range(2):
    expected = expected + 2 * _rms_norm_np(expected)
  assert_allclose(y, _rms_norm_np(expected), rtol=1e-4, atol=1e-5)
  assert holder["names"] == ["a/rms_norm/scale", "b/rms_norm/scale", "rms_norm/scale"]
  assert holder["outputs"] == 3  # after the initial sublayers, between the layers, at the end


def test_layer_stack_legacy_mode_uses_its_own_scopes_and_epsilon():
  holder = {}

  def build(mesh):
    stack = transformer.LayerStack([_named(_Double(), "a")], dropout_rate=0.5, norm_epsilon=1.0)
    model = _tiny_model(stack, positional_embedding=False)
    x, context = _activations_and_context(mesh, model)
    holder["y"] = stack.call(context, x)
    holder["names"] = [v.name for v in mesh.graph.all_variables]
    return [x, holder["y"]]
  x, y = lower_and_evaluate(build)
  expected = x + 2 * _rms_norm_np(x, eps=1.0)
  assert_allclose(y, _rms_norm_np(expected, eps=1.0), rtol=1e-4, atol=1e-5)
  assert holder["names"] == ["a/layer_norm/scale", "final_layer_norm/scale"]


def _sublayer_output(sublayer, x_np, mode="train", sequence_id=None, **kwargs):
  """Runs one sublayer function on x [batch=2, length, d_model] with model d_model."""
  def build(mesh):
    model = _tiny_model(transformer.LayerStack([]), d_model=x_np.shape[-1])
    dims = [mtf.Dimension("batch", x_np.shape[0]), mtf.Dimension("length", x_np.shape[1]), model.model_dim]
    x = mtf.import_tf_tensor(mesh, tf.constant(x_np), dims)
    context = transformer.Context(
        model=model, mesh=mesh, batch_dims=dims[:1], length_dim=dims[1], variable_dtype=F32, mode=mode,
        sequence_id=None if sequence_id is None else import_ids(mesh, sequence_id))
    context.current_layer_input = x * 10.0
    return [sublayer(x, None, context, **kwargs)]
  return lower_and_evaluate(build)[0]


def test_sublayers_match_their_formulas():
  x = np.random.RandomState(1).randn(2, 3, 8).astype(np.float32)
  assert_allclose(_sublayer_output(transformer.sublayer_rms_norm, x, epsilon=0.5), _rms_norm_np(x, 0.5))
  assert_allclose(_sublayer_output(transformer.sublayer_scale_norm, x), _rms_norm_np(x))
  assert_allclose(_sublayer_output(transformer.sublayer_residual, x), 11 * x)
  assert_allclose(_sublayer_output(transformer.sublayer_rezero, x, initial_value=0.25), 0.25 * x)
  centred = x - x.mean(-1, keepdims=True)
  assert_allclose(_sublayer_output(transformer.sublayer_true_layer_norm, x),
                  centred / np.sqrt(np.mean(centred ** 2, -1, keepdims=True) + 1e-6), rtol=1e-4, atol=1e-4)
  sub = x[..., :4]
  assert_allclose(_sublayer_output(transformer.sublayer_rms_norm_subsampled, x, percentage=50.),
                  x / np.sqrt(np.mean(sub ** 2, -1, keepdims=True) + 1e-6), rtol=1e-5)
  assert_allclose(_sublayer_output(transformer.sublayer_clip_activation_gradient, x), x)
  sequence_id = np.array([[1, 1, 0], [1, 2, 2]], np.int32)
  assert_allclose(_sublayer_output(transformer.sublayer_mask_padding, x, sequence_id=sequence_id),
                  x * (sequence_id > 0)[..., None])


def test_sublayer_dropout_applies_in_training_only_with_one_mask_per_sequence():
  x = np.ones((2, 5, 8), np.float32)
  assert_allclose(_sublayer_output(transformer.sublayer_dropout, x, mode="eval", dropout_rate=0.5), x)
  y = _sublayer_output(transformer.sublayer_dropout, x, dropout_rate=0.5)
  assert set(np.unique(y)) <= {0.0, 2.0} and 0 < np.count_nonzero(y) < y.size
  assert (y == y[:, :1, :]).all()  # broadcast along length
  y = _sublayer_output(transformer.sublayer_annealed_dropout, x, init_dropout_rate=0.5, start_step=10,
                       end_step=20)
  assert set(np.unique(y)) <= {0.0, 2.0} and 0 < np.count_nonzero(y) < y.size
  legacy_stack = SimpleNamespace(dropout_rate=0.5)
  y = _sublayer_output(lambda x, _, context: transformer.sublayer_legacy_dropout(x, legacy_stack, context), x)
  assert set(np.unique(y)) <= {0.0, 2.0} and 0 < np.count_nonzero(y) < y.size


def test_layer_stack_recompute_grads_gives_the_same_gradients():
  ids = _ids(11)
  results = []
  for recompute in (False, True):
    def build(mesh, recompute=recompute):
      layers = transformer.make_layer_stack([model_check.SELF_ATTENTION, model_check.FEED_FORWARD],
                                            num_layers=1).layers
      model = _tiny_model(transformer.LayerStack(layers, recompute_grads=recompute), autoregressive=True)
      targets = import_ids(mesh, ids)
      _, loss = model.call_simple(transformer.autoregressive_inputs(targets), targets, compute_loss=True)
      return [loss] + mtf.gradients([loss], [v.outputs[0] for v in mesh.graph.trainable_variables])
    results.append(lower_and_evaluate(build))
  for a, b in zip(*results):
    assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_reversible_layer_stack_matches_its_revnet_formula_with_and_without_recompute():
  results = []
  for recompute in (False, True):
    def build(mesh, recompute=recompute):
      stack = transformer.ReversibleLayerStack([_named(_Double(), "a"), _named(_Double(), "b")],
                                               sublayers_initial=[], sublayers_final=[],
                                               recompute_grads=recompute)
      model = _tiny_model(stack, positional_embedding=False)
      x, context = _activations_and_context(mesh, model)
      y = stack.call(context, x)
      return [x, y, mtf.gradients([mtf.reduce_sum(mtf.square(y))], [x])[0]]
    results.append(lower_and_evaluate(build))
  x, y, _ = results[0]
  f = lambda t: 2 * _rms_norm_np(t)
  x1, x2 = x, x
  for _ in range(2):
    x1, x2 = x2, x1 + f(x2)
  assert_allclose(y, x1 + x2, rtol=1e-4, atol=1e-5)
  assert_allclose(results[1][1], y, rtol=1e-5)
  assert_allclose(results[1][2], results[0][2], rtol=1e-4, atol=1e-4)


# ---- target helpers, embeddings, ensembles ----

def test_target_helpers_on_hand_computed_examples():
  def build(mesh):
    targets = import_ids(mesh, np.array([[3, 4, 1, 5, 1, 0], [-6, 7, 1, 8, 9, 1]]))
    seq = import_ids(mesh, np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]]))
    return [transformer.autoregressive_inputs(targets, sequence_id=seq),
            transformer.autoregressive_inputs(targets),
            transformer.shift_targets(targets, bos_id=9),
            transformer.delimited_lm_inputs_mask(targets)]
  with_segments, plain, shifted, mask = lower_and_evaluate(build)
  np.testing.assert_array_equal(with_segments, [[0, 3, 4, 0, 5, 0], [0, 6, 7, 1, 8, 9]])
  np.testing.assert_array_equal(plain, [[0, 3, 4, 1, 5, 1], [0, 6, 7, 1, 8, 9]])
  np.testing.assert_array_equal(shifted, [[9, 3, 4, 9, 5, 0], [9, -6, 7, 9, 8, 9]])
  np.testing.assert_array_equal(mask, [[1, 1, 1, 0, 0, 1], [1, 1, 1, 0, 0, 0]])


def test_sinusoid_positional_embedding_matches_numpy():
  length, depth = mtf.Dimension("max_length", 5), mtf.Dimension("d_model", 6)
  (table,) = lower_and_evaluate(
      lambda mesh: [transformer.sinusoid_positional_embedding_weights(mesh, length, depth, tf.float32)])
  inv = np.exp(np.arange(3) * -np.log(1e4) / 2)
  scaled = np.arange(5)[:, None] * inv[None, :]
  assert_allclose(table, np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1), rtol=1e-5)
  with pytest.raises(ValueError, match="must be even"):
    transformer.sinusoid_positional_embedding_weights(None, length, mtf.Dimension("d_model", 5), tf.float32)


def test_vocab_embedding_gathers_rows_and_scales_logits():
  ids = np.array([[1, 3], [2, 0]], np.int32)
  holder = {}

  def build(mesh):
    vocab, d_model = mtf.Dimension("vocab", 4), mtf.Dimension("d_model", 9)
    embedding = transformer.get_vocab_embedding_cls()(mesh, vocab, d_model, F32, name="embedding",
                                                      ensemble_dim=None)
    scaled = transformer.VocabEmbedding(mesh, vocab, d_model, F32, name="scaled", ensemble_dim=None,
                                        scale_variable_like_classifier_weights=True)
    x = embedding.ids_to_embedding(import_ids(mesh, ids), None)
    holder["variables"] = mesh.graph.all_variables
    return [x, embedding.hidden_to_logits(x, None), scaled.ids_to_embedding(import_ids(mesh, ids), None),
            scaled.hidden_to_logits(x, None)] + [v.outputs[0] for v in holder["variables"]]
  x, logits, scaled_x, scaled_logits, table, scaled_table = lower_and_evaluate(build)
  assert [v.name for v in holder["variables"]] == ["embedding", "scaled"]
  assert_allclose(x, table[ids])
  assert_allclose(logits, x @ table.T / 3.0, rtol=1e-5)
  assert_allclose(scaled_x, scaled_table[ids] * 3.0, rtol=1e-5)
  assert_allclose(scaled_logits, x @ scaled_table.T, rtol=1e-5)
  assert 0.1 < scaled_table.std() < 0.6 < table.std()  # stddev d_model^-0.5 = 0.33 vs 1


def test_ensemble_reducers_match_numpy():
  logits_np = np.random.RandomState(2).randn(3, 2, 5).astype(np.float32)

  def build(mesh):
    ensemble, vocab = mtf.Dimension("ensemble", 3), mtf.Dimension("vocab", 5)
    logits = mtf.import_tf_tensor(mesh, tf.constant(logits_np), [ensemble, mtf.Dimension("batch", 2), vocab])
    return [transformer.reduce_ensemble_logits_select(logits, ensemble, vocab, model_id=1),
            transformer.reduce_ensemble_logits_mean_logit(logits, ensemble, vocab),
            transformer.reduce_ensemble_logits(logits, ensemble, vocab)]
  select, mean_logit, mean_prob = lower_and_evaluate(build)
  assert_allclose(select, logits_np[1])
  assert_allclose(mean_logit, logits_np.mean(0), rtol=1e-5)
  probs = np.exp(logits_np) / np.exp(logits_np).sum(-1, keepdims=True)
  assert_allclose(mean_prob, np.log(probs.mean(0)), rtol=1e-4, atol=1e-5)


# ---- Unitransformer ----

def test_unitransformer_dims_and_argument_errors():
  model = model_check.lm(vocab=10)
  assert model.input_vocab_dim == mtf.Dimension("vocab", 12)  # rounded up to vocab_divisor 4
  assert model.max_length_dim == mtf.Dimension("max_length", LENGTH)
  assert model.fully_autoregressive and model.ensemble_dims == []
  with pytest.raises(ValueError, match="autoregressive model needs an output vocabulary"):
    _tiny_model(transformer.LayerStack([]), output_vocab_size=None, autoregressive=True)
  with pytest.raises(ValueError, match="input_full_attention needs autoregressive"):
    _tiny_model(transformer.LayerStack([]), input_full_attention=True)


def test_sequence_longer_than_max_length_is_rejected():
  def build(mesh):
    model = model_check.lm(max_length=4)
    return [model.call_simple(import_ids(mesh, _ids()), None, compute_loss=False)[0]]
  with pytest.raises(ValueError, match=r"sequence length .*length.*8.* exceeds max_length=4"):
    lower_and_evaluate(build)


def test_loss_is_label_smoothed_cross_entropy_with_z_loss_over_nonzero_targets():
  targets_np = _ids(3)
  targets_np[:, -2:] = 0  # padding: no loss
  holder = {}

  def build(mesh):
    model = model_check.lm(label_smoothing=0.1, z_loss=0.01)
    targets = import_ids(mesh, targets_np)
    logits, loss = model.call_simple(transformer.autoregressive_inputs(targets), targets, compute_loss=True)
    holder["denominator"] = model.loss_denominator(targets, 1)
    return [logits, loss]
  logits, loss = lower_and_evaluate(build)
  vocab = logits.shape[-1]
  log_z = np.log(np.exp(logits).sum(-1))
  log_probs = logits - log_z[..., None]
  soft = np.full(logits.shape, 0.1 / vocab)
  soft[np.arange(BATCH)[:, None], np.arange(LENGTH)[None, :], targets_np] += 0.9
  per_token = -(soft * log_probs).sum(-1) + 0.01 * log_z ** 2
  assert holder["denominator"] == BATCH * LENGTH
  assert_allclose(loss, (per_token * (targets_np > 0)).sum() / (BATCH * LENGTH), rtol=1e-5)


def test_custom_loss_fn_replaces_the_default_loss():
  ids = _ids(15)
  seen = {}

  def loss_fn(model, context, logits, targets, vocab_dim):
    seen["args"] = (model, context.mode, vocab_dim)
    return mtf.reduce_mean(mtf.square(logits))

  def build(mesh):
    model = model_check.lm(num_layers=1, loss_fn=loss_fn)
    targets = import_ids(mesh, ids)
    seen["model"] = model
    return model.call_simple(transformer.autoregressive_inputs(targets), targets, compute_loss=True)
  logits, loss = lower_and_evaluate(build)
  assert seen["args"] == (seen["model"], "train", seen["model"].output_vocab_dim)
  assert_allclose(loss, np.mean(np.square(logits)), rtol=1e-5)


def test_lm_logits_and_gradients_are_the_same_on_one_processor_and_on_a_2x4_mesh():
  ids = _ids(4)

  def build(mesh):
    model = model_check.lm(vocab=16, num_layers=1)
    targets = import_ids(mesh, ids)
    logits, loss = model.call_simple(transformer.autoregressive_inputs(targets), targets, compute_loss=True)
    variables = mesh.graph.trainable_variables
    return [logits, loss] + mtf.gradients([loss], [v.outputs[0] for v in variables])
  single = lower_and_evaluate(build)
  sharded = lower_and_evaluate(build, MESH_2X4, LAYOUT_2X4)
  for a, b in zip(sharded, single):
    assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _cross_entropy_np(logits, targets, z_loss=1e-4):
  log_z = np.log(np.exp(logits).sum(-1))
  picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return ((log_z - picked + z_loss * log_z ** 2) * (targets > 0)).sum() / targets.size


def test_lm_with_shared_softmax_and_sinusoids_runs_in_eager_mode():
  ids = _ids(5)
  holder = {}

  def build(mesh):
    targets = import_ids(mesh, ids)
    model = model_check.lm(shared_embedding_and_softmax_weights=True, sinusoid_positional_embedding=True)
    result = model.call_simple(transformer.autoregressive_inputs(targets), targets, True)
    holder["names"] = [v.name for v in mesh.graph.all_variables]
    return result
  logits, loss = lower_and_evaluate(build, mode="eager")
  assert logits.shape == (BATCH, LENGTH, VOCAB)
  assert_allclose(loss, _cross_entropy_np(logits, ids), rtol=1e-5)
  assert "transformer/embedding" in holder["names"]
  assert not any("logits" in n or "positional_embedding" in n for n in holder["names"])


def test_delimited_lm_attends_fully_within_inputs_and_scores_targets_only():
  """[inputs, eos, targets, eos]: with input_full_attention position 0 sees input position 1."""
  ids = np.array([[5, 6, 1, 7, 8, 1, 0, 0]] * BATCH, np.int32)
  changed = ids.copy()
  changed[:, 1] = 9

  def run(model_kwargs, targets_np):
    def build(mesh):
      targets = import_ids(mesh, targets_np)
      model = model_check.lm(num_layers=1, **model_kwargs)
      return model.call_simple(transformer.autoregressive_inputs(targets), targets, compute_loss=True)
    return lower_and_evaluate(build)
  full = {"input_full_attention": True, "loss_on_targets_only": True}
  (logits, loss), (changed_logits, _) = run(full, ids), run(full, changed)
  # Position 1 reads input token 0 (shifted by one); position 2 reads token 1, which changed.
  assert not np.allclose(logits[:, 1], changed_logits[:, 1])
  (causal_logits, _), (causal_changed, _) = run({}, ids), run({}, changed)
  assert_allclose(causal_logits[:, 1], causal_changed[:, 1])
  targets_only = ids * np.array([0, 0, 0, 1, 1, 1, 0, 0])
  assert_allclose(loss, _cross_entropy_np(logits, targets_only), rtol=1e-5)


def test_token_dropout_replaces_training_inputs_by_padding():
  ids = _ids(12)

  def build(mesh):
    targets = import_ids(mesh, ids)
    model = model_check.lm(num_layers=1, token_dropout_rate=0.999)
    dropped, _ = model.call_simple(targets, None, compute_loss=False)
    with tf.variable_scope(tf.get_variable_scope(), reuse=True):
      zeros, _ = model.call_simple(mtf.zeros_like(targets), None, compute_loss=False, mode="eval")
      kept, _ = model.call_simple(targets, None, compute_loss=False, mode="eval")
    return [dropped, zeros, kept]
  dropped, zeros, kept = lower_and_evaluate(build)
  assert_allclose(dropped, zeros, rtol=1e-5)
  assert not np.allclose(kept, zeros)


def test_tiny_lm_overfits_a_fixed_batch_on_a_2x4_mesh():
  ids = _ids(6)

  def build_loss(mesh):
    targets = import_ids(mesh, ids)
    model = model_check.lm(vocab=16, d_model=16, num_layers=1)
    return model.call_simple(transformer.autoregressive_inputs(targets), targets, compute_loss=True)[1]
  losses = model_check.train_losses(build_loss, steps=30)
  assert losses[-1] < 0.3 * losses[0], losses


def test_ensemble_lm_trains_each_member_and_reduces_logits():
  ids = _ids(7)
  holder = {}

  def build(mesh):
    model = model_check.lm(ensemble=2)
    targets = import_ids(mesh, ids)
    logits, loss = model.call_simple(transformer.autoregressive_inputs(targets), targets, compute_loss=True)
    holder["shapes"] = {v.name: v.shape.dimension_names for v in mesh.graph.all_variables}
    holder["logits"] = logits.shape.dimension_names
    return [logits, loss]
  logits, loss = lower_and_evaluate(build)
  assert holder["shapes"]["transformer/embedding"] == ["ensemble", "vocab", "d_model"]
  assert holder["logits"] == ["batch", "length", "vocab"]
  assert np.isfinite(loss) and logits.shape == (BATCH, LENGTH, VOCAB)


# ---- Bitransformer and StudentTeacher ----

def _bi_batch(seed):
  rng = np.random.RandomState(seed)
  inputs = rng.randint(2, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)
  inputs[:, -2:] = 0  # padding
  return inputs, np.flip(inputs, axis=1).copy()


def test_tiny_bitransformer_overfits_a_fixed_batch_on_a_2x4_mesh():
  inputs_np, targets_np = _bi_batch(8)

  def build_loss(mesh):
    model = model_check.bitransformer(d_model=16)
    return model.call_simple(import_ids(mesh, inputs_np), import_ids(mesh, targets_np), compute_loss=True)[1]
  losses = model_check.train_losses(build_loss, steps=30)
  assert losses[-1] < 0.3 * losses[0], losses


def test_bitransformer_shares_embeddings_under_the_shared_scope():
  inputs_np, targets_np = _bi_batch(9)
  holder = {}

  def build(mesh):
    model = model_check.bitransformer()
    logits, loss = model.call_simple(import_ids(mesh, inputs_np), import_ids(mesh, targets_np), True)
    holder["names"] = [v.name for v in mesh.graph.all_variables]
    assert model.output_vocab_dim == model.decoder.output_vocab_dim and model.z_loss == model.decoder.z_loss
    return [logits, loss]
  logits, loss = lower_and_evaluate(build)
  assert holder["names"][:2] == ["shared/embedding", "shared/positional_embedding"]
  assert not any(n.endswith("/embedding") and not n.startswith("shared") for n in holder["names"])
  assert logits.shape == (BATCH, LENGTH, VOCAB) and np.isfinite(loss)


def test_shared_embedding_needs_equal_d_model_and_vocabulary():
  model = model_check.bitransformer()
  model.decoder.model_dim = mtf.Dimension("d_model", 16)
  mesh = mtf.Mesh(mtf.Graph(), "m")
  ids = import_ids(mesh, _bi_batch(0)[0])
  with pytest.raises(ValueError, match="same d_model and vocabulary.*shared_embedding=False"):
    model.call_simple(ids, ids, compute_loss=False)


def test_student_teacher_mixes_soft_and_hard_losses_and_freezes_the_teacher():
  inputs_np, targets_np = _bi_batch(10)
  holder = {}

  def build(mesh, fraction_soft):
    model = transformer.StudentTeacher(model_check.bitransformer(), model_check.bitransformer(),
                                       temperature=2.0, fraction_soft=fraction_soft)
    inputs, targets = import_ids(mesh, inputs_np), import_ids(mesh, targets_np)
    _, loss = model.call_simple(inputs, targets, compute_loss=True)
    holder["trainable"] = [v.name for v in mesh.graph.trainable_variables]
    return [loss]
  (hard,) = lower_and_evaluate(lambda mesh: build(mesh, 0.0))
  assert all(n.startswith("student/") for n in holder["trainable"])
  (mixed,) = lower_and_evaluate(lambda mesh: build(mesh, 0.5))
  assert holder["trainable"] and all(n.startswith("student/") for n in holder["trainable"])
  (soft,) = lower_and_evaluate(lambda mesh: build(mesh, 1.0))
  assert_allclose(mixed, 0.5 * hard + 0.5 * soft, rtol=1e-5)


def test_student_teacher_initializes_teacher_and_student_from_a_trained_model_checkpoint(tmp_path):
  inputs_np, targets_np = _bi_batch(13)
  path = str(tmp_path / "model.ckpt")

  def run_graph(build_model, save):
    """Builds a model on one processor, initialises it; saves or returns its master values."""
    with tf.Graph().as_default():
      graph = mtf.Graph()
      mesh = mtf.Mesh(graph, "my_mesh")
      model = build_model()
      model.call_simple(import_ids(mesh, inputs_np), import_ids(mesh, targets_np), compute_loss=True)
      if not save:
        model.initialize()
      masters = {v.name: v.get_master() for v in graph.all_variables}
      impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:1", "", [""])
      mtf.Lowering(graph, {mesh: impl})
      with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        if save:
          tf.train.Saver(masters).save(sess, path)
        return sess.run(masters)
  trained = run_graph(model_check.bitransformer, save=True)
  values = run_graph(lambda: transformer.StudentTeacher(
      model_check.bitransformer(), model_check.bitransformer(), temperature=1.0, fraction_soft=0.5,
      teacher_checkpoint=path, initialize_student_weights=True), save=False)
  for name, value in trained.items():
    assert_allclose(values["teacher/" + name], value)
    assert_allclose(values["student/" + name], value)


# ---- gin ----

def test_gin_builds_a_bitransformer_with_scoped_layer_lists():
  config = """
    transformer.make_layer_stack.num_layers = 1
    encoder/transformer.make_layer_stack.layers = [@transformer_layers.SelfAttention]
    decoder/transformer.make_layer_stack.layers = [@transformer_layers.SelfAttention,
                                                   @transformer_layers.EncDecAttention]
    transformer.Unitransformer.d_model = 8
    transformer.Unitransformer.max_length = 8
    decoder/transformer.Unitransformer.label_smoothing = 0.1
    Unitransformer.sample_autoregressive.sampling_keep_top_k = 3
    Bitransformer.decode.beam_size = 4
  """
  with gin_config(config):
    model = transformer.make_bitransformer(input_vocab_size=VOCAB, output_vocab_size=VOCAB)
    assert gin.query_parameter("Unitransformer.sample_autoregressive.sampling_keep_top_k") == 3
    assert gin.query_parameter("Bitransformer.decode.beam_size") == 4
  assert [type(layer).__name__ for layer in model.decoder.layer_stack.layers] == [
      "SelfAttention", "EncDecAttention"]
  assert model.encoder.layer_stack.num_layers == 1 and model.encoder.output_vocab_dim is None
  assert model.decoder.label_smoothing == 0.1 and model.encoder.label_smoothing == 0.0
  assert (model.encoder.name, model.decoder.name) == ("encoder", "decoder")


def test_gin_builds_a_student_teacher_from_student_and_teacher_scopes():
  config = """
    transformer.make_layer_stack.layers = [@transformer_layers.SelfAttention]
    transformer.make_layer_stack.num_layers = 1
    teacher/transformer.make_layer_stack.num_layers = 3
    transformer.Unitransformer.max_length = 8
    student/encoder/transformer.Unitransformer.d_model = 16
  """
  with gin_config(config):
    model = transformer.make_bi_student_teacher(input_vocab_size=VOCAB, output_vocab_size=VOCAB)
  assert isinstance(model, transformer.StudentTeacher)
  assert [m.layer_stack.num_layers for m in (model.student.encoder, model.teacher.decoder)] == [1, 3]
  assert (model.student.encoder.model_dim.size, model.teacher.encoder.model_dim.size) == (16, 1024)


def test_layer_stack_without_sublayers_masks_padding_of_its_output():
  x_np = np.random.RandomState(14).randn(1, 3, 4).astype(np.float32)

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(x_np), "batch:1;length:3;d_model:4")
    context = transformer.Context(model=None, mesh=mesh, batch_dims=x.shape.dims[:1],
                                  length_dim=x.shape.dims[1], variable_dtype=F32,
                                  sequence_id=import_ids(mesh, np.array([[1, 1, 0]])))
    stack = transformer.LayerStack([_named(_Double(), "double")], sublayers_initial=[],
                                   sublayers_per_layer=[transformer.sublayer_call_layer], sublayers_final=[])
    return [stack.call(context, x)]
  assert_allclose(lower_and_evaluate(build)[0], 2 * x_np * np.array([1, 1, 0])[None, :, None])


def test_layout_that_cannot_divide_num_heads_names_the_dimension_and_mesh_dim():
  def build(mesh):
    targets = import_ids(mesh, _ids())
    return [model_check.lm().call_simple(targets, targets, compute_loss=True)[1]]
  with pytest.raises(ValueError, match=r"'heads' \(size 4\).*mesh dimension 'cols' \(size 8\)"):
    lower_and_evaluate(build, "rows:1;cols:8", "heads:cols")


def test_model_attributes_mirror_arguments():
  model = _tiny_model(transformer.LayerStack([]), layout="batch:all", mesh_shape="all:8", z_loss=0.5,
                      loss_denominator=7)
  assert (model.layout, model.mesh_shape, model.z_loss) == ("batch:all", "all:8", 0.5)
  assert model.name == "transformer"
  assert model.loss_denominator(SimpleNamespace(shape=None), 1) == 7.0
