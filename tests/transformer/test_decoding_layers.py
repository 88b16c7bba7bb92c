"""Incremental decoding of transformer layers equals one full pass.

Each layer runs once over the whole sequence, then as a decoder would: a "first_part" pass over
a prefix (later positions zeroed, as in decoding) records its states, and "incremental" calls
feed one position at a time, each reading the previous step's states. Every step's output must
equal the full pass at that position. The input ids are all non-zero, so the convolutions' padding
mask keeps every position. Conv1DLayer is the exception 0.1.21 makes: its full pass is a centred
("SAME") convolution while a decoding step convolves the window ending at the step, so a step
equals the full pass filter_size // 2 positions earlier.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer, transformer_layers
from tests.harness import lower_and_evaluate
from tests.transformer.layer_context import VARIABLE_DTYPE, call_layer, make_context, model_stub
from tests.transformer.model_check import greedy_decode_and_argmax, named_layer_stack

RNG = np.random.RandomState(1)
BATCH, LENGTH, D_MODEL = 2, 6, 8
X_SHAPE = "batch:2;length:6;d_model:8"
ENCODER_SHAPE = "batch:2;memory_length:5;d_model:8"
INITIAL_POSITION = 3


def _decode(mesh, layer, x_np, encoder_np=None):
  """[full pass, first_part pass, step outputs stacked along length] for the positions decoded."""
  model = model_stub(D_MODEL)
  x = mtf.import_tf_tensor(mesh, tf.constant(x_np), shape=X_SHAPE)
  batch_dim, length_dim = x.shape.dims[:2]
  extra = {}
  if encoder_np is not None:
    extra["encoder_output"] = mtf.import_tf_tensor(mesh, tf.constant(encoder_np), shape=ENCODER_SHAPE)
  extra["inputs"] = mtf.ones(mesh, mtf.Shape([batch_dim, length_dim]), dtype=tf.int32)
  full = call_layer(layer, make_context(x, model, **extra), x)
  prefix = np.where(np.arange(LENGTH)[None, :, None] < INITIAL_POSITION, x_np, 0.0).astype(np.float32)
  prefix = mtf.import_tf_tensor(mesh, tf.constant(prefix), shape=X_SHAPE)
  initial_position = mtf.constant(mesh, INITIAL_POSITION, mtf.Shape([batch_dim]), dtype=tf.int32)
  first_part = make_context(prefix, model, mode="first_part", initial_position=initial_position, **extra)
  first_part_y = call_layer(layer, first_part, prefix)
  states, steps = first_part.new_states, []
  for t in range(INITIAL_POSITION, LENGTH):
    position = mtf.constant(mesh, t, mtf.Shape([batch_dim]), dtype=tf.int32)
    context = transformer.Context(
        model=model, mesh=mesh, batch_dims=[batch_dim], length_dim=length_dim, variable_dtype=VARIABLE_DTYPE,
        mode="incremental", position=position, states=states, new_states=[],
        constant_states=first_part.constant_states, read_priority=position,
        write_priority=mtf.range(mesh, length_dim, tf.int32), initial_position=initial_position,
        encoder_output=extra.get("encoder_output"))
    steps.append(call_layer(layer, context, mtf.gather(x, t, length_dim)))
    assert len(context.new_states) == len(states)
    states = context.new_states
  return [full, first_part_y, mtf.stack(steps, "steps", axis=1)]


DECODING_LAYERS = {
    "self_attention": lambda: transformer_layers.SelfAttention(
        num_heads=4, key_value_size=2, relative_attention_type="bias"),
    "shared_kv_multi_query": lambda: transformer_layers.SelfAttention(
        num_heads=4, num_memory_heads=1, key_value_size=2, shared_kv=True),
    "local_self_attention": lambda: transformer_layers.LocalSelfAttention(
        radius=3, num_heads=4, key_value_size=2),
    "enc_dec_attention": lambda: transformer_layers.EncDecAttention(num_heads=4, key_value_size=2),
    "talking_heads": lambda: transformer_layers.TalkingHeadsSelfAttention(
        key_heads_dims=[("heads", 4)], softmax_heads_dims=[("softmax_heads", 2)],
        value_heads_dims=[("heads", 4)], key_size=2, value_size=2, dynamic_projections=["x2l", "x2w"]),
    "general_bilinear": lambda: transformer_layers.GeneralBilinearSelfAttention(heads_dims=[("heads", 4)]),
    "separable_conv1d": lambda: transformer_layers.SeparableConv1DLayer(
        min_relative_pos=-4, max_relative_pos=0, output_size=D_MODEL),
    "synthesizer_random": lambda: transformer_layers.Synthesizer(
        num_heads=2, key_value_size=2, synthesize_mode="random"),
    "synthesizer_dense_plus_alpha": lambda: transformer_layers.Synthesizer(
        num_heads=2, key_value_size=2, synthesize_mode="dense_plus_alpha"),
    "dynamic_conv_block": lambda: transformer_layers.LocalConvAttnBlock(
        min_relative_pos=-3, max_relative_pos=0, output_size=D_MODEL, attention_type="dynamic_conv"),
}


SHARDED = ("self_attention", "enc_dec_attention")


@pytest.mark.parametrize("name", sorted(DECODING_LAYERS))
def test_incremental_decoding_equals_full_pass(name):
  layer = DECODING_LAYERS[name]()
  x = RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)
  encoder = RNG.randn(BATCH, 5, D_MODEL).astype(np.float32) if name == "enc_dec_attention" else None
  # Layouts are covered by the full-pass tests; the attention layers also decode on a 2-D mesh here.
  mesh_shape, layout = ("batch:2;model:2", "batch:batch;heads:model") if name in SHARDED else ("all:1", "")
  full, first_part, steps = lower_and_evaluate(lambda mesh: _decode(mesh, layer, x, encoder), mesh_shape,
                                               layout)
  prefix = slice(0, INITIAL_POSITION)
  np.testing.assert_allclose(first_part[:, prefix], full[:, prefix], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(steps, full[:, INITIAL_POSITION:], rtol=1e-4, atol=1e-5)


def test_conv1d_layer_decodes_the_window_ending_at_each_step():
  """0.1.21's Conv1DLayer: full pass "SAME" (output t sees t-1..t+1), step t sees t-2..t."""
  layer = transformer_layers.Conv1DLayer(filter_size=3, output_size=D_MODEL, activation="relu")
  x = RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)
  full, first_part, steps = lower_and_evaluate(lambda mesh: _decode(mesh, layer, x))
  # The prefix pass sees zeros after the prefix, so it agrees with the full pass one position short of it.
  prefix = slice(0, INITIAL_POSITION - 1)
  np.testing.assert_allclose(first_part[:, prefix], full[:, prefix], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(steps, full[:, INITIAL_POSITION - 1:LENGTH - 1], rtol=1e-4, atol=1e-5)
  assert not np.allclose(steps, full[:, INITIAL_POSITION:], atol=1e-3)


def test_decoding_a_non_causal_separable_convolution_is_rejected():
  layer = transformer_layers.SeparableConv1DLayer(min_relative_pos=-1, max_relative_pos=1,
                                                  output_size=D_MODEL)
  x = RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)
  with pytest.raises(ValueError, match=r"causal filter .*\[-1, 1\]"):
    lower_and_evaluate(lambda mesh: _decode(mesh, layer, x))


def test_greedy_sampling_through_a_unitransformer_of_these_layers_matches_its_full_pass():
  """The layers' state protocol fits Unitransformer.sample_autoregressive (first_part, then a while loop).

  (Not the convolutions: as in 0.1.21 a decoder's full pass zeroes position 0, whose input id is the
  shifted-in 0, and Conv1DLayer's full pass is centred, so their decodes differ from the full pass.)
  """
  layers = [transformer_layers.LocalSelfAttention(radius=2, num_heads=2, key_value_size=4),
            transformer_layers.DenseReluDense(hidden_size=8)]
  model = transformer.Unitransformer(
      layer_stack=named_layer_stack(layers), d_model=D_MODEL, input_vocab_size=8, output_vocab_size=8,
      autoregressive=True, max_length=LENGTH, vocab_divisor=8)

  def build(mesh):
    prompts = tf.constant(np.array([[3, 5, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]], np.int32))
    partial = mtf.import_tf_tensor(mesh, prompts, "batch:2;length:6")
    # stop_at_token 9 is outside the vocabulary: every position gets decoded.
    return greedy_decode_and_argmax(model, partial, VARIABLE_DTYPE, stop_at_token=9)
  decoded, argmax = lower_and_evaluate(build)
  np.testing.assert_array_equal(decoded[:, 0], [3, 4])
  np.testing.assert_array_equal(decoded[0, 1:], [5] + list(argmax[0, 2:]))
  np.testing.assert_array_equal(decoded[1, 1:], argmax[1, 1:])
