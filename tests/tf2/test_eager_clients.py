"""GPT-Neo's way of using mtf (eager lowering, both API generations) and the same code as a function.

GPT-Neo builds its model from mtf.layers.* functions and mtf.transformer.attention helpers in
variable scopes, and samples with the transformer package; its callers run that code eagerly.
Here each client computation runs eagerly (built and lowered at the call, as GPT-Neo does) and
as a mtf.tf2 function (lowered once), from the same seed: the values must agree.
"""

import numpy as np
import tensorflow as tf2
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import attention, transformer, transformer_layers
from tests.harness import cpu_devices

BATCH, LENGTH, VOCAB, EMBD, HEADS, HIDDEN = 4, 8, 16, 8, 2, 16
PROMPT = 3
MESH_SHAPE, LAYOUT = "batch:2", "batch:batch"
SEED = 11
batch, length = mtf.Dimension("batch", BATCH), mtf.Dimension("length", LENGTH)
memory, vocab = mtf.Dimension("memory", LENGTH), mtf.Dimension("vocab", VOCAB)
embd, heads = mtf.Dimension("embd", EMBD), mtf.Dimension("heads", HEADS)
kv = mtf.Dimension("features_per_head", EMBD // HEADS)
VARIABLE_DTYPE = mtf.VariableDType(tf.float32, tf.float32, tf.float32)


def _tokens() -> np.ndarray:
  tokens = np.random.RandomState(5).randint(1, VOCAB, size=[BATCH, LENGTH]).astype(np.int32)
  tokens[:, PROMPT:] = 0
  return tokens


def _layer_norm(x, scope):
  """GPT-Neo's layer norm: gain and bias variables in a scope, the statistics in mtf ops."""
  with tf.variable_scope(scope):
    g = mtf.get_variable(x.mesh, "g", [embd], initializer=tf.constant_initializer(1))
    b = mtf.get_variable(x.mesh, "b", [embd], initializer=tf.constant_initializer(0))
    x -= mtf.reduce_mean(x, reduced_dim=embd)
    return x * mtf.rsqrt(mtf.reduce_mean(mtf.square(x), reduced_dim=embd) + 1e-5) * g + b


def neo_logits(mesh, tokens):
  """A one-block GPT-Neo-style LM in the first API generation (mtf.layers, attention helpers)."""
  wte = mtf.get_variable(mesh, "wte", [vocab, embd], initializer=tf.random_normal_initializer(stddev=0.5))
  x = mtf.gather(wte, mtf.import_tf_tensor(mesh, tokens, [batch, length]), vocab)
  with tf.variable_scope("h0"):
    h = _layer_norm(x, "ln_1")
    params = attention.attention_params_simple(mesh, io_dim=embd, kv_dim=kv, heads_dim=heads,
                                               variable_dtype=VARIABLE_DTYPE)
    k = mtf.replace_dimensions(params.compute_k(h), length, memory)
    v = mtf.replace_dimensions(params.compute_v(h), length, memory)
    bias = mtf.cast(mtf.less(mtf.range(mesh, length, tf.int32), mtf.range(mesh, memory, tf.int32)),
                    tf.float32) * -1e9
    a = attention.attention(params.compute_q(h), k, v, memory_length_dim=memory, key_dim=kv,
                            value_dim=kv, bias=bias)
    x += params.compute_output(a, x.shape)
    init = tf.random_normal_initializer(stddev=0.5)
    h = mtf.gelu(mtf.layers.dense(_layer_norm(x, "ln_2"), [mtf.Dimension("hidden", HIDDEN)],
                                  name="c_fc", kernel_initializer=init))
    x += mtf.layers.dense(h, [embd], name="c_proj", kernel_initializer=init)
  return mtf.einsum([_layer_norm(x, "ln_f"), wte], [batch, length, vocab])


def neo_next_tokens(mesh, tokens):
  """The logits, and the token after the prompt sampled greedily and at temperature 1."""
  logits = neo_logits(mesh, tokens)
  last = mtf.gather(logits, PROMPT - 1, length)
  return [logits, mtf.sample_with_temperature(last, vocab, temperature=0.0),
          mtf.sample_with_temperature(last, vocab, temperature=1.0)]


def unitransformer_samples(mesh, tokens):
  """The second API generation: a transformer-layers LM, its loss and autoregressive samples."""
  model = transformer.Unitransformer(
      layer_stack=transformer.LayerStack([transformer_layers.SelfAttention(num_heads=HEADS, key_value_size=4),
                                          transformer_layers.DenseReluDense(hidden_size=HIDDEN)]),
      d_model=EMBD, input_vocab_size=VOCAB, output_vocab_size=VOCAB, autoregressive=True,
      max_length=LENGTH, vocab_divisor=8)
  inputs = mtf.import_tf_tensor(mesh, tokens, [batch, length])
  logits, loss = model.call_simple(inputs, mtf.shift(inputs, -1, length, wrap=False), compute_loss=True,
                                   mode="eval")
  greedy = model.sample_autoregressive(inputs, temperature=0.0, never_end=True)
  sampled = model.sample_autoregressive(inputs, temperature=1.0, never_end=True)
  return [logits, loss, greedy, sampled]


def _mesh_impl():
  return mtf.placement_mesh_impl.PlacementMeshImpl(MESH_SHAPE, LAYOUT, cpu_devices(2))


def run_eagerly(build):
  """As GPT-Neo runs it: the mtf graph built, its variables created and lowered now, eagerly."""
  tf2.random.set_seed(SEED)
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  outputs = build(mesh, tf.constant(_tokens()))
  lowering = mtf.Lowering(graph, {mesh: _mesh_impl()})
  return [lowering.export_to_tf_tensor(x).numpy() for x in outputs]


def run_as_function(build):
  tf2.random.set_seed(SEED)
  module = mtf.tf2.MeshModule(_mesh_impl())
  function = module.function(lambda mesh, tokens: (build(mesh, tokens), []),
                             [tf2.TensorSpec([BATCH, LENGTH], tf.int32)])
  return [x.numpy() for x in function(_tokens())]


def _assert_same(eager, traced):
  for got, want in zip(traced, eager):
    if want.dtype.kind == "f":
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
      np.testing.assert_array_equal(got, want)


def test_the_mtf_layers_model_and_its_sampling_agree_eagerly_and_as_a_function():
  eager = run_eagerly(neo_next_tokens)
  assert eager[0].shape == (BATCH, LENGTH, VOCAB)
  assert np.isfinite(eager[0]).all()
  np.testing.assert_array_equal(eager[1], eager[0][:, PROMPT - 1].argmax(-1))
  _assert_same(eager, run_as_function(neo_next_tokens))


def test_the_transformer_layers_model_and_its_sampling_agree_eagerly_and_as_a_function():
  eager = run_eagerly(unitransformer_samples)
  logits, loss, greedy, sampled = eager
  assert logits.shape == (BATCH, LENGTH, VOCAB) and np.isfinite(loss)
  for samples in (greedy, sampled):
    np.testing.assert_array_equal(samples[:, :PROMPT], _tokens()[:, :PROMPT])  # the prompt kept
    assert (samples[:, PROMPT:] > 0).any()
  _assert_same(eager, run_as_function(unitransformer_samples))
