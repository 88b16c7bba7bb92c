"""Funnel Transformer: pooling between blocks, weight sharing, context updates, BitransformerFunnel."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import funnel_transformer, transformer, transformer_layers
from tests.harness import lower_and_evaluate
from tests.layers.layer_check import check_layer
from tests.transformer.model_check import gin_config, named_layer_stack

RNG = np.random.RandomState(0)
BATCH, LENGTH, D_MODEL = 4, 8, 4
X = RNG.randn(BATCH, LENGTH, D_MODEL).astype(np.float32)
X_SHAPE = "batch:%d;length:%d;d_model:%d" % (BATCH, LENGTH, D_MODEL)
VDTYPE = mtf.VariableDType(tf.float32, tf.float32, tf.float32)
LENGTH_DIM = mtf.Dimension("length", LENGTH)


class _Affine(transformer.TransformerLayer):
  """x @ W (a d_model x d_model kernel `affine/kernel`): a layer simple enough to recompute in TF."""

  def call(self, context, x):
    d_model = context.model.model_dim
    return mtf.layers.dense(x, d_model, reduced_dims=[d_model], use_bias=False, variable_dtype=VDTYPE,
                            name="affine")


def _model(layer_stack):
  return transformer.Unitransformer(layer_stack=layer_stack, d_model=D_MODEL, input_vocab_size=16,
                                    output_vocab_size=None, autoregressive=False, max_length=LENGTH)


def _stack(layers, **kwargs):
  kwargs.setdefault("sublayers_initial", [])
  kwargs.setdefault("sublayers_per_layer", [transformer.sublayer_call_layer, transformer.sublayer_residual])
  kwargs.setdefault("sublayers_final", [])
  return funnel_transformer.FunnelTransformerLayerStack(layers, **kwargs)


def _context(model, mesh, sequence_id=None, position=None):
  return transformer.Context(model=model, mesh=mesh, batch_dims=[mtf.Dimension("batch", BATCH)],
                             length_dim=LENGTH_DIM, variable_dtype=VDTYPE, mode="eval",
                             sequence_id=sequence_id, position=position)


def _kernel(variables, block, param, submodule=0):
  return variables["funnel_block_%03d/param_idx_%03d/submodule_%03d/_Affine/affine/kernel"
                   % (block, param, submodule)]


@pytest.mark.parametrize("pooling_type", ["mean", "max"])
@pytest.mark.parametrize("mesh_shape,layout", [("all:1", ""), ("all:4", "batch:all"),
                                               ("batch:2;model:4", "batch:batch;d_model:model")])
def test_funnel_stack_matches_tf_with_pooling_and_shared_repeats(pooling_type, mesh_shape, layout):
  # Block 0: two distinct layers, each applied twice; block 1: one layer; block 2: one layer, repeated 3x.
  sizes = dict(n_blocks=3, block_param_size=[2, 1, 1], block_repeat_size=[2, 1, 3], n_submodules=1)
  stack = _stack([_Affine()], pooling_type=pooling_type, **sizes)
  pool = tf.reduce_mean if pooling_type == "mean" else tf.reduce_max

  def layer(x):
    return stack.call(_context(_model(stack), x.mesh), x)

  def reference(x, variables):
    for block, (params, repeats) in enumerate(zip(sizes["block_param_size"], sizes["block_repeat_size"])):
      for param in range(params):
        for _ in range(repeats):
          x = x + tf.einsum("bld,de->ble", x, _kernel(variables, block, param))
      if block < sizes["n_blocks"] - 1:
        x = pool(tf.reshape(x, [BATCH, x.shape[1] // 2, 2, D_MODEL]), axis=2)
    return x

  result = check_layer(layer, reference, [(X, X_SHAPE)], mesh_shape, layout)
  assert result.y.shape == (BATCH, LENGTH // 4, D_MODEL)
  assert len(result.variables) == 4  # one kernel per distinct layer, shared by its repeats


def test_update_context_pools_sequence_id_and_position_consistently():
  stack = _stack([_Affine()], n_blocks=2, block_param_size=[1, 1], block_repeat_size=[1, 1], n_submodules=1)
  sequence_id = np.array([[1, 1, 1, 1, 2, 2, 0, 0]] * BATCH, np.int32)
  position = np.array([[0, 1, 2, 3, 0, 1, 0, 0]] * BATCH, np.int32)

  def build(mesh):
    seq = mtf.import_tf_tensor(mesh, tf.constant(sequence_id), "batch:%d;length:%d" % (BATCH, LENGTH))
    pos = mtf.import_tf_tensor(mesh, tf.constant(position), "batch:%d;length:%d" % (BATCH, LENGTH))
    context = _context(_model(stack), mesh, seq, pos)
    x = mtf.pool_tensor_1d(mtf.import_tf_tensor(mesh, tf.constant(X), X_SHAPE), LENGTH_DIM)
    stack.update_context(context, x, pool_dim_name="length")
    assert context.length_dim == mtf.Dimension("length", LENGTH // 2)
    return [context.sequence_id, context.position]

  pooled_id, pooled_position = lower_and_evaluate(build)
  np.testing.assert_array_equal(pooled_id, [[1, 1, 2, 0]] * BATCH)
  np.testing.assert_array_equal(pooled_position, [[0, 1, 0, 0]] * BATCH)


def test_default_positions_become_a_range_over_the_pooled_length():
  stack = _stack([_Affine()], n_blocks=3, block_param_size=[1, 1, 1], block_repeat_size=[1, 1, 1],
                 n_submodules=1)

  def build(mesh):
    context = _context(_model(stack), mesh, position=mtf.range(mesh, LENGTH_DIM, tf.int32))
    context.position_is_default = True
    stack.call(context, mtf.import_tf_tensor(mesh, tf.constant(X), X_SHAPE))
    assert stack.context is context and context.length_dim.size == LENGTH // 4
    return [context.position]

  np.testing.assert_array_equal(lower_and_evaluate(build)[0], np.arange(LENGTH // 4))


def test_padding_stays_zero_after_pooling():
  stack = _stack([_Affine()], n_blocks=2, block_param_size=[1, 1], block_repeat_size=[1, 1], n_submodules=1)
  sequence_id = np.ones((BATCH, LENGTH), np.int32)
  sequence_id[:, -2:] = 0

  def build(mesh):
    seq = mtf.import_tf_tensor(mesh, tf.constant(sequence_id), "batch:%d;length:%d" % (BATCH, LENGTH))
    x = mtf.import_tf_tensor(mesh, tf.constant(X), X_SHAPE)
    return [stack.call(_context(_model(stack), mesh, seq), x)]

  (y,) = lower_and_evaluate(build)
  np.testing.assert_array_equal(y[:, -1], 0)
  assert np.abs(y[:, :-1]).min() > 0


def _sa_drd_stack(block_param_size, block_repeat_size):
  submodules = [transformer_layers.SelfAttention(num_heads=2, key_value_size=2),
                transformer_layers.DenseReluDense(hidden_size=8)]
  layers = submodules * int(np.prod(block_param_size))
  return funnel_transformer.FunnelTransformerLayerStack(
      layers, n_blocks=len(block_param_size), block_param_size=block_param_size,
      block_repeat_size=block_repeat_size,
      sublayers_initial=[transformer.sublayer_dropout],
      sublayers_per_layer=[transformer.sublayer_rms_norm, transformer.sublayer_call_layer,
                           transformer.sublayer_dropout, transformer.sublayer_residual],
      sublayers_final=[transformer.sublayer_rms_norm, transformer.sublayer_dropout])


@pytest.mark.parametrize("block_param_size,block_repeat_size", [([2, 2], [1, 1]), ([2, 2], [2, 1])])
def test_each_distinct_self_attention_layer_has_its_own_q_k_v_o(block_param_size, block_repeat_size):
  stack = _sa_drd_stack(block_param_size, block_repeat_size)
  mesh = mtf.Mesh(mtf.Graph(), "my_mesh")
  context = _context(_model(stack), mesh, sequence_id=mtf.ones(mesh, mtf.Shape([LENGTH_DIM]), tf.int32),
                     position=mtf.range(mesh, LENGTH_DIM, tf.int32))
  y = stack.call(context, mtf.zeros(mesh, X_SHAPE))
  assert y.shape.to_integer_list == [BATCH, LENGTH // 2, D_MODEL]
  sa_layers = [layer for layer in stack.layers if isinstance(layer, transformer_layers.SelfAttention)]
  sa_variables = [v for v in mesh.graph.all_variables if "SelfAttention" in v.name]
  assert len(sa_variables) == 4 * len(sa_layers) == 4 * sum(block_param_size)
  calls = 2 * sum(p * r for p, r in zip(block_param_size, block_repeat_size))
  assert len(context.layer_outputs) == calls + 1  # initial, after every layer but the last, final


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_blocks=2, block_param_size=[1], block_repeat_size=[1, 1]), "one entry per block"),
    (dict(n_blocks=1, block_param_size=[1], block_repeat_size=[1], pooling_type="median"), "'median'"),
    (dict(n_blocks=1, block_param_size=[1], block_repeat_size=[1], n_submodules=2), "multiple of"),
])
def test_bad_stack_sizes_raise_value_error(kwargs, message):
  with pytest.raises(ValueError, match=message):
    _stack([_Affine()], **kwargs)


def test_length_not_divisible_by_the_pooling_raises_at_call():
  stack = _stack([_Affine()], n_blocks=4, block_param_size=[1] * 4, block_repeat_size=[1] * 4, n_submodules=1,
                 pooling_size=3)
  mesh = mtf.Mesh(mtf.Graph(), "my_mesh")
  with pytest.raises(ValueError, match=r"multiple of pooling_size \*\* \(n_blocks - 1\) = 27"):
    stack.call(_context(_model(stack), mesh), mtf.zeros(mesh, X_SHAPE))


def _bitransformer_funnel():
  encoder = transformer.Unitransformer(
      layer_stack=_sa_drd_stack([1, 1], [1, 1]), d_model=D_MODEL, input_vocab_size=16, output_vocab_size=None,
      autoregressive=False, max_length=LENGTH, name="encoder")
  decoder_layers = [transformer_layers.SelfAttention(num_heads=2, key_value_size=2),
                    transformer_layers.EncDecAttention(num_heads=2, key_value_size=2),
                    transformer_layers.DenseReluDense(hidden_size=8)]
  decoder = transformer.Unitransformer(
      layer_stack=named_layer_stack(decoder_layers), d_model=D_MODEL, input_vocab_size=16,
      output_vocab_size=16, autoregressive=True, max_length=LENGTH, name="decoder")
  return funnel_transformer.BitransformerFunnel(encoder, decoder)


def test_bitransformer_funnel_decoder_ignores_pooled_encoder_padding():
  inputs = RNG.randint(2, 16, size=(BATCH, LENGTH)).astype(np.int32)
  other = inputs.copy()
  other[:, -4:] = RNG.randint(2, 16, size=(BATCH, 4))  # differs only in padding
  sequence_id = np.ones_like(inputs)
  sequence_id[:, -4:] = 0
  targets = RNG.randint(1, 16, size=(BATCH, LENGTH)).astype(np.int32)
  shape = "batch:%d;length:%d" % (BATCH, LENGTH)

  def build(mesh):
    model = _bitransformer_funnel()
    imp = lambda a: mtf.import_tf_tensor(mesh, tf.constant(a), shape)
    outs = []
    for ids in (inputs, other):
      logits, loss = model.call_simple(imp(ids), imp(targets), True, mode="eval", variable_dtype=VDTYPE,
                                       encoder_sequence_id=imp(sequence_id))
      outs += [logits, loss]
    pooled = model.encoder.layer_stack.context.sequence_id
    assert pooled.shape.to_integer_list == [BATCH, LENGTH // 2]
    decoded = model.decode(imp(inputs), variable_dtype=VDTYPE)
    return outs + [pooled, decoded]

  logits, loss, other_logits, other_loss, pooled, decoded = lower_and_evaluate(build)
  assert logits.shape == (BATCH, LENGTH, 128) and np.isfinite(loss)  # vocab rounded up to 128
  np.testing.assert_allclose(other_logits, logits, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(other_loss, loss, rtol=1e-6)
  np.testing.assert_array_equal(pooled, [[1, 1, 0, 0]] * BATCH)
  assert decoded.shape == (BATCH, LENGTH)


def test_bitransformer_funnel_needs_a_funnel_encoder():
  model = _bitransformer_funnel()
  model.encoder.layer_stack = transformer.LayerStack([transformer_layers.DenseReluDense(hidden_size=8)])
  mesh = mtf.Mesh(mtf.Graph(), "my_mesh")
  ids = mtf.ones(mesh, "batch:%d;length:%d" % (BATCH, LENGTH), tf.int32)
  with pytest.raises(ValueError, match="use a FunnelTransformerLayerStack"):
    model.call_simple(ids, ids, True, variable_dtype=VDTYPE)


def test_gin_builds_a_funnel_encoder_stack_with_make_layer_stack():
  with gin_config("""
      import mesh_tensorflow.transformer.funnel_transformer
      transformer.make_layer_stack.layer_stack_cls = @funnel_transformer.FunnelTransformerLayerStack
      transformer.make_layer_stack.num_layers = 2
      funnel_transformer.FunnelTransformerLayerStack.n_blocks = 2
      funnel_transformer.FunnelTransformerLayerStack.block_param_size = [1, 1]
      funnel_transformer.FunnelTransformerLayerStack.block_repeat_size = [1, 1]
      funnel_transformer.FunnelTransformerLayerStack.n_submodules = 1
  """):
    stack = transformer.make_layer_stack(layers=[_Affine])
  assert isinstance(stack, funnel_transformer.FunnelTransformerLayerStack) and len(stack.layers) == 2
  mesh = mtf.Mesh(mtf.Graph(), "my_mesh")
  y = stack.call(_context(_model(stack), mesh), mtf.zeros(mesh, X_SHAPE))
  assert y.shape.to_integer_list == [BATCH, LENGTH // 2, D_MODEL]
