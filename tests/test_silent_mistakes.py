"""Mistakes that used to give a tensor silently now warn or raise, naming the tensor, dim or op.

0.1.21 accepted each of these and built a model that trained wrong or failed later inside TF.
"""

import warnings

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer, transformer_layers
from mesh_tensorflow.transformer._train import eval as eval_lib
from tests.harness import cpu_devices

BATCH, HIDDEN, CLASSES = mtf.Dimension("batch", 4), mtf.Dimension("hidden", 6), mtf.Dimension("classes", 3)


@pytest.fixture(name="mesh")
def fixture_mesh():
  with tf.Graph().as_default():
    yield mtf.Mesh(mtf.Graph(), "mesh")


# ---- an einsum output dim in no input ----

def test_einsum_output_dim_in_no_input_warns_once_naming_the_dim_and_the_op(mesh):
  a = mtf.zeros(mesh, [BATCH, HIDDEN])
  w2 = mtf.zeros(mesh, [HIDDEN, mtf.Dimension("class", 3)])  # the typo that trained a wrong model
  with pytest.warns(mtf.BroadcastWarning) as record:
    logits = mtf.einsum([a, w2], output_shape=[BATCH, CLASSES], name="logits")
  assert len(record) == 1
  message = str(record[0].message)
  assert "einsum 'logits'" in message and "['classes']" in message and "broadcast_dims" in message
  assert record[0].filename == __file__  # points at the user's line, not the package's
  assert logits.shape == mtf.Shape([BATCH, CLASSES])  # 0.1.21's meaning is kept


def test_einsum_broadcast_asked_for_does_not_warn_and_copies_the_input(mesh):
  x = mtf.import_tf_tensor(mesh, tf.constant([1.0, 2.0, 3.0, 4.0]), [BATCH])
  with warnings.catch_warnings():
    warnings.simplefilter("error", mtf.BroadcastWarning)
    y = mtf.einsum([x], output_shape=[BATCH, CLASSES], broadcast_dims=[CLASSES])
  lowering = mtf.Lowering(mesh.graph, {mesh: mtf.placement_mesh_impl.PlacementMeshImpl("", "", [""])})
  with tf.Session() as sess:
    np.testing.assert_array_equal(sess.run(lowering.export_to_tf_tensor(y)),
                                  np.repeat([[1.0], [2.0], [3.0], [4.0]], 3, axis=1))


def test_einsum_broadcast_dims_must_be_new_output_dims(mesh):
  x = mtf.zeros(mesh, [BATCH, HIDDEN])
  with pytest.raises(ValueError, match=r"broadcast_dims lists .*'hidden'.* but an input has it"):
    mtf.einsum([x], output_shape=[BATCH, HIDDEN], broadcast_dims=[HIDDEN])
  with pytest.raises(ValueError, match=r"broadcast_dims lists .*'classes'.* not in the output shape"):
    mtf.einsum([x], output_shape=[BATCH], broadcast_dims=[CLASSES])


def test_the_packages_own_layers_and_transformer_do_not_warn(mesh):
  x = mtf.zeros(mesh, [BATCH, mtf.Dimension("length", 5), HIDDEN])
  ids = mtf.zeros(mesh, [BATCH, mtf.Dimension("length", 5)], dtype=tf.int32)
  with warnings.catch_warnings():
    warnings.simplefilter("error", mtf.BroadcastWarning)
    h = mtf.layers.dense(x, mtf.Dimension("d_ff", 8), activation=mtf.relu, name="ff")
    h = mtf.layers.layer_norm(h, h.shape[-1])
    h = h * mtf.dropout(h, keep_prob=0.9)
    model = transformer.Unitransformer(
        layer_stack=transformer.LayerStack([transformer_layers.SelfAttention(num_heads=2, key_value_size=4),
                                            transformer_layers.DenseReluDense(hidden_size=8)]),
        d_model=8, input_vocab_size=16, output_vocab_size=16, autoregressive=True, max_length=5)
    logits, loss = model.call_simple(inputs=ids, targets=ids, compute_loss=True)
    mtf.gradients([loss], [v.outputs[0] for v in mesh.graph.trainable_variables])
  assert loss.shape == mtf.Shape([]) and logits.shape.dims[:2] == ids.shape.dims


# ---- one name at two sizes ----

def test_shape_string_naming_a_dim_twice_is_refused_with_the_sizes():
  with pytest.raises(ValueError, match=r"'heads:4;heads:8' names \['heads'\] more than once.*\[4, 8\]"):
    mtf.Shape("heads:4;heads:8")
  # A list of Dimensions keeps 0.1.21's kernels that map d_model=6 to d_model=2.
  kernel = mtf.Shape([mtf.Dimension("d_model", 6), mtf.Dimension("d_model", 2)])
  assert kernel.to_integer_list == [6, 2]


def test_rename_dimension_onto_a_name_the_tensor_has_is_refused(mesh):
  x = mtf.zeros(mesh, "heads:4;kv:8")
  with pytest.raises(ValueError, match=r"rename_dimension of '.*': cannot rename 'kv' \(size 8\) to 'heads'.*"
                                       r"already has Dimension\(name='heads', size=4\)"):
    mtf.rename_dimension(x, "kv", "heads")
  with pytest.raises(ValueError, match="cannot rename 'kv'"):
    x.shape.rename_dimension("kv", "heads")
  assert mtf.rename_dimension(x, "kv", "d_kv").shape == mtf.Shape("heads:4;d_kv:8")


# ---- errors that name the tensor ----

def test_layout_that_does_not_divide_a_variable_names_the_variable(mesh):
  w1 = mtf.get_variable(mesh, "w1", [HIDDEN, mtf.Dimension("d_ff", 10)])
  mesh_impl = mtf.placement_mesh_impl.PlacementMeshImpl("model:4", "d_ff:model", cpu_devices(4))
  with pytest.raises(ValueError, match=r"Tensor 'w1.*' \(output of Variable 'w1'\).*'d_ff'.*size 10.*model"):
    mtf.Lowering(mesh.graph, {mesh: mesh_impl})
  del w1


def test_import_shape_mismatch_says_import_tf_tensor(mesh):
  with pytest.raises(ValueError, match=r"import_tf_tensor 'import'.*\(3,\) does not match Shape\[batch=4\]"):
    mtf.import_tf_tensor(mesh, tf.zeros([3]), [BATCH])


def test_perplexity_eval_lengths_without_inputs_name_the_missing_key():
  gin.clear_config()
  with gin.unlock_config():
    gin.parse_config(["make_layer_stack.layers = [@transformer_layers.SelfAttention]",
                      "make_layer_stack.num_layers = 1", "Unitransformer.d_model = 8",
                      "Unitransformer.max_length = 8"])
  try:
    model = transformer.make_bitransformer(input_vocab_size=16, output_vocab_size=16)
  finally:
    gin.clear_config()
  with pytest.raises(ValueError, match=r"sequence_length = \{'targets': 8\} has no 'inputs' key.*Bitransf"):
    eval_lib.model_feature_lengths(model, {"targets": 8})
  assert eval_lib.model_feature_lengths(model, {"inputs": 4, "targets": 8}) == {"inputs": 4, "targets": 8}
