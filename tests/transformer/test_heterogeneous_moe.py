"""transformer.heterogeneous_moe: experts of different depth and width (0.1.21's math)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import heterogeneous_moe, moe, transformer
from tests.harness import lower_and_evaluate
from tests.layers.layer_check import check_layer, run_layer, shape_keyed_initializer
from tests.transformer.test_moe import D_MODEL, D_MODEL_DIM, HIDDEN, NUM_EXPERTS, VDTYPE, X, X_SHAPE
from tests.transformer.test_moe import _hparams, _moe_reference

# Two experts of width 1 and depth 1, two of width 2 and depth 2 (0.1.21's docstring example).
MASK_INFO = [{"percent_number": .5, "layers": 1, "width": 1}, {"percent_number": .5, "layers": 2, "width": 2}]


def _mask(mask_info, num_experts, expert_width):
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "m")
  experts = mtf.Dimension("experts", num_experts)
  mask = heterogeneous_moe.generate_heterogeneous_expert_masks(mask_info, num_experts, experts, mesh,
                                                               expert_width)
  lowering = mtf.Lowering(graph, {mesh: mtf.placement_mesh_impl.PlacementMeshImpl("", {}, [""])})
  with tf.Session() as sess:
    return mask.shape, sess.run(lowering.export_to_tf_tensor(mask))


def test_masks_give_each_share_of_experts_its_layers_and_width():
  with tf.Graph().as_default():
    shape, mask = _mask(MASK_INFO, 4, expert_width=1)
  assert shape == mtf.convert_to_shape("expert_hidden:2;num_expert_layers:2;experts:4")
  expected = np.zeros([2, 2, 4])
  expected[:1, :1, :2] = 1   # experts 0, 1: one layer, one hidden unit
  expected[:2, :2, 2:] = 1   # experts 2, 3: two layers, two hidden units
  np.testing.assert_array_equal(mask, expected)


def test_masks_counts_and_the_last_entry_takes_the_remaining_experts():
  info = [{"percent_number": 1, "layers": 3, "width": 1}, {"percent_number": .1, "layers": 1, "width": 1}]
  with tf.Graph().as_default():
    _, mask = _mask(info, 5, expert_width=1)
  assert mask.shape == (1, 3, 5)
  np.testing.assert_array_equal(mask[0].T, [[1, 1, 1]] + [[1, 0, 0]] * 4)


def test_one_homogeneous_layer_equals_moe_transformer_moe_layer_v1():
  hparams = _hparams("top_2", moe_num_layers=1, moe_heterogeneous_mask_info=None)

  def layer(x):
    return heterogeneous_moe.transformer_moe_layer_v1(x, D_MODEL_DIM, hparams, False, VDTYPE)[0]

  moe_reference = _moe_reference("top_2", hparams)

  def reference(x, variables):
    renamed = {name.replace("expert_layer_0/", ""): value for name, value in variables.items()}
    return moe_reference(x, renamed)

  result = check_layer(layer, reference, [(X, X_SHAPE)])
  assert set(result.shapes) == {"top_2_gating/kernel", "expert_layer_0/wi/kernel", "expert_layer_0/wo/kernel"}


def _context(mesh):
  stack = transformer.LayerStack([], sublayers_initial=[], sublayers_per_layer=[], sublayers_final=[])
  model = transformer.Unitransformer(layer_stack=stack, d_model=D_MODEL, input_vocab_size=8,
                                     output_vocab_size=8, autoregressive=True, max_length=4)
  return transformer.Context(model=model, mesh=mesh, batch_dims=[mtf.Dimension("batch", 4)],
                             length_dim=mtf.Dimension("length", 4), variable_dtype=VDTYPE, mode="eval")


def test_expert_layers_are_masked_residual_blocks_as_in_the_original():
  """Two blocks per expert: y0 = wo0(relu(wi0 x) * m0); y = y0 + wo1(relu(wi1 rms(y0)) * m1)."""
  x_shape = "outer_batch:1;experts:4;batch_unsplit:2;expert_capacity:3;d_model:4"
  x_value = np.random.RandomState(1).randn(1, 4, 2, 3, D_MODEL).astype(np.float32)
  mask_value = np.zeros([2, 2, 4], np.float32)
  mask_value[:1, :1, :2] = 1
  mask_value[:2, :2, 2:] = 1
  hparams = _hparams("top_2")

  def layer(x):
    mask = mtf.import_tf_tensor(x.mesh, tf.constant(mask_value),
                                "expert_hidden:2;num_expert_layers:2;experts:4")
    return heterogeneous_moe._expert_layers(
        x, D_MODEL_DIM, x.shape.dims[1], mtf.Dimension("expert_hidden", 2), 2, mask, hparams, False, VDTYPE,
        "relu", _context(x.mesh))

  def reference(x, variables):
    def block(inputs, i):
      h = tf.nn.relu(tf.einsum("oebcm,emh->oebch", inputs, variables[f"expert_layer_{i}/wi/kernel"]))
      h *= tf.transpose(tf.constant(mask_value[:, i, :]))[None, :, None, None, :]
      return tf.einsum("oebch,ehm->oebcm", h, variables[f"expert_layer_{i}/wo/kernel"])
    y0 = block(x, 0)
    normed = y0 * tf.math.rsqrt(tf.reduce_mean(tf.square(y0), -1, keepdims=True) + 1e-6)
    return y0 + block(normed * variables["expert_layer_1/rms_norm/scale"], 1)

  result = check_layer(layer, reference, [(x_value, x_shape)])
  expected_shape = mtf.convert_to_shape("experts:4;d_model:4;expert_hidden:2")
  assert result.shapes["expert_layer_1/wi/kernel"] == expected_shape


def test_heterogeneous_moe1d_call_is_the_layer_function_and_adds_its_loss():
  layer = heterogeneous_moe.HeterogeneousMoE1D(num_experts=NUM_EXPERTS, hidden_size=HIDDEN, group_size=4,
                                               min_expert_capacity=1, second_policy_eval="all")
  losses = []

  def run(x):
    context = _context(x.mesh)
    context.losses = losses
    with tf.variable_scope("moe"):
      return layer.call(context, x)

  moe_reference = _moe_reference("top_2", _hparams("top_2"))

  def reference(x, variables):
    return moe_reference(x, {name.replace("moe/", "").replace("expert_layer_0/", ""): value
                             for name, value in variables.items()})

  result = check_layer(run, reference, [(X, X_SHAPE)])
  assert set(result.shapes) == {"moe/top_2_gating/kernel", "moe/expert_layer_0/wi/kernel",
                                "moe/expert_layer_0/wo/kernel"}
  assert len(losses) == 1 and losses[0].shape == mtf.Shape([])


def test_bad_gating_and_bad_mask_info_raise():
  with pytest.raises(ValueError, match="moe_gating"):
    heterogeneous_moe.HeterogeneousMoE1D(moe_gating="top_7")
  with tf.Graph().as_default(), pytest.raises(ValueError, match="assigns more than the 2 experts"):
    too_many = {"percent_number": 3, "layers": 1, "width": 1}
    _mask([too_many, {"percent_number": 1, "layers": 1, "width": 1}], 2, 1)
  with pytest.raises(ValueError, match="mask_info is empty"):
    _mask([], 2, 1)


def test_heterogeneous_moe1d_incremental_positions_equal_the_full_sequence_call():
  layer = heterogeneous_moe.HeterogeneousMoE1D(
      num_experts=NUM_EXPERTS, hidden_size=1, group_size=4, capacity_factor_eval=4.0,
      second_policy_eval="all",
      min_expert_capacity=4, heterogeneous_mask_info=MASK_INFO)

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(X), X_SHAPE)
    context = _context(mesh)
    full = layer.call(context, x)
    steps = [layer.call(context, mtf.gather(x, i, context.length_dim)) for i in range(X.shape[1])]
    return [full, mtf.stack(steps, "length", axis=1)]

  full, incremental = lower_and_evaluate(build)
  assert full.shape == X.shape and np.abs(full).sum() > 0
  np.testing.assert_allclose(incremental, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gating", ["top_n", "switch_max", "expert_selection"])
def test_one_homogeneous_layer_equals_moe_for_every_gating(gating):
  """Same weights, same routing: the heterogeneous layer shares moe.py's gate (expert selection included)."""
  rng = np.random.RandomState(3)
  shapes = [(D_MODEL, NUM_EXPERTS), (NUM_EXPERTS, D_MODEL, HIDDEN), (NUM_EXPERTS, HIDDEN, D_MODEL)]
  weights = {shape: rng.randn(*shape).astype(np.float32) * 0.5 for shape in shapes}
  hparams = _hparams(gating, moe_group_size=4, moe_top_n_num_experts_per_token=3, moe_num_layers=1,
                     moe_heterogeneous_mask_info=None, moe_use_second_place_expert_prob=0.5)

  def outputs(layer_fn):
    initializer = shape_keyed_initializer(weights)
    with mock.patch.object(tf, "truncated_normal_initializer", return_value=initializer), \
        mock.patch.object(tf, "random_uniform_initializer", return_value=initializer):
      return run_layer(lambda x: layer_fn(x, D_MODEL_DIM, hparams, False, VDTYPE)[0], [(X, X_SHAPE)],
                       grads=False).y

  expected = outputs(moe.transformer_moe_layer_v1)
  assert np.abs(expected).max() > 0
  heterogeneous = outputs(heterogeneous_moe.transformer_moe_layer_v1)
  np.testing.assert_allclose(heterogeneous, expected, rtol=1e-5, atol=1e-6)
