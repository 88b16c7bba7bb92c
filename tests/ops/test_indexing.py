"""one_hot, gather, top_k family, reduce_first, sampling and cumsum against NumPy / plain TF.

Layouts are drawn so that the indexed, gathered or reduced dimension is split in some
examples and replicated in others, on 1-D, 2-D and 3-D meshes, in graph and eager mode.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import (
    MAX_EXAMPLES, MODES, assert_allclose, assert_op_matches_tf, lower_and_evaluate, mesh_and_layout)

BATCH = mtf.Dimension("batch", 4)
SEQ = mtf.Dimension("seq", 2)
VOCAB = mtf.Dimension("vocab", 8)
D = mtf.Dimension("d", 2)

SIZES = {"batch": 4, "seq": 2, "vocab": 8, "d": 2}
BATCH_VOCAB = "batch:4;vocab:8"
SEQ_VOCAB_BATCH = "seq:2;vocab:8;batch:4"

settings_ = settings(max_examples=MAX_EXAMPLES, deadline=None)


def _import(mesh, array, shape):
  return mtf.import_tf_tensor(mesh, tf.constant(array), shape=shape)


def _distinct(shape, seed=0):
  """Float32 values without ties, so top-k orders (and gradients) are unique."""
  rng = np.random.RandomState(seed)
  return (rng.permutation(int(np.prod(shape))).reshape(shape) - 10.0).astype(np.float32) / 4


def _numpy_top_k(x, axis, k):
  order = np.argsort(-np.moveaxis(x, axis, -1), axis=-1, kind="stable")[..., :k]
  return np.take_along_axis(np.moveaxis(x, axis, -1), order, -1), order


# ---- one_hot ----

@settings_
@given(mesh_and_layout(SIZES), st.sampled_from(MODES), st.sampled_from([tf.int32, tf.int64]))
def test_one_hot_matches_numpy_under_any_layout(mesh_layout, mode, index_dtype):
  indices = np.random.RandomState(1).randint(-1, VOCAB.size + 1, size=(4, 2))  # some out of range

  def build(mesh):
    ids = _import(mesh, indices.astype(index_dtype.as_numpy_dtype), [BATCH, SEQ])
    return [mtf.one_hot(ids, VOCAB, on_value=3.0, off_value=-1.0)]
  got, = lower_and_evaluate(build, *mesh_layout, mode=mode)
  expected = np.where(indices[..., None] == np.arange(VOCAB.size), 3.0, -1.0)
  assert got.shape == (4, 2, 8)
  assert_allclose(got, expected)


@pytest.mark.parametrize("mode", MODES)
def test_one_hot_bool_dtype_with_split_output_dim(mode):
  indices = np.array([0, 7, 3, 4], np.int32)

  def build(mesh):
    op = mtf.OneHotOperation(_import(mesh, indices, [BATCH]), VOCAB, 1, 0, dtype=tf.bool)
    return [op.outputs[0]]
  got, = lower_and_evaluate(build, "rows:2;cols:4", "vocab:cols", mode=mode)
  assert got.dtype == bool
  np.testing.assert_array_equal(got, indices[:, None] == np.arange(8))


def test_one_hot_shape_name_and_splittability():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  ids = mtf.zeros(mesh, [BATCH], dtype=tf.int32)
  op = mtf.OneHotOperation(ids, VOCAB, 1, 0, dtype=tf.float32)
  assert op.name == "one_hot"
  assert op.outputs[0].shape == mtf.Shape([BATCH, VOCAB])
  assert op.splittable_dims == frozenset(["batch", "vocab"])
  assert op.unsplittable_dims == frozenset()
  assert not op.has_gradient


def test_one_hot_of_float_indices_raises_and_adds_no_op():
  graph = mtf.Graph()
  floats = mtf.zeros(mtf.Mesh(graph, "m"), [BATCH])
  with pytest.raises(ValueError, match=r"one_hot 'one_hot': indices .* float32; they must be integers"):
    mtf.one_hot(floats, VOCAB)
  assert len(graph.operations) == 1


# ---- gather ----

def _gather_within_range(w, ids):
  found = tf.logical_and(ids >= 0, ids < 8)
  return tf.gather(w, tf.where(found, ids, tf.zeros_like(ids))) * tf.cast(found, w.dtype)[..., None]


_RNG = np.random.RandomState(2)
# name -> (mtf gather, the same in TF, (weights, dims), (indices, dims))
GATHERS = {
    "rows": (lambda w, ids: mtf.gather(w, ids, VOCAB), lambda w, ids: tf.gather(w, ids),
             (_RNG.randn(8, 2), [VOCAB, D]), (_RNG.randint(0, 8, size=(4, 2)), [BATCH, SEQ])),
    # the one-hot semantics: an index out of range selects zeros and gets no gradient
    "out of range": (lambda w, ids: mtf.gather(w, ids, VOCAB), _gather_within_range,
                     (_RNG.randn(8, 2), [VOCAB, D]),
                     (np.array([[-1, 0], [7, 8], [3, 100], [-5, 7]]), [BATCH, SEQ])),
    "middle dim, reordered output": (
        lambda w, ids: mtf.gather(w, ids, VOCAB, output_shape=[BATCH, SEQ, D]),
        lambda w, ids: tf.transpose(tf.gather(w, ids, axis=1), [2, 1, 0]),
        (_RNG.randn(2, 8, 4), [D, VOCAB, BATCH]), (_RNG.randint(0, 8, size=(2,)), [SEQ])),
    # indices sharing a dim with weights take the one-hot einsum: a row per batch entry
    "batched": (lambda w, ids: mtf.gather(w, ids, VOCAB), lambda w, ids: tf.gather(w, ids, batch_dims=1),
                (_RNG.randn(4, 8), [BATCH, VOCAB]), (_RNG.randint(0, 8, size=(4, 2)), [BATCH, SEQ])),
}


@settings_
@given(st.sampled_from(sorted(GATHERS)), mesh_and_layout(SIZES), st.sampled_from(MODES))
def test_gather_matches_tf_with_gradient_under_any_layout(case, mesh_layout, mode):
  mtf_fn, tf_fn, (weights, weight_dims), (indices, index_dims) = GATHERS[case]
  assert_op_matches_tf(mtf_fn, tf_fn, [(weights.astype(np.float32), weight_dims),
                                       (indices.astype(np.int32), index_dims)], *mesh_layout, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_gather_python_int_bool_weights_and_output_shape(mode):
  weights = _distinct([4, 8])
  flags = weights > 0

  def build(mesh):
    w = _import(mesh, weights, [BATCH, VOCAB])
    ids = _import(mesh, np.array([1, 0], np.int32), [SEQ])
    return [mtf.gather(w, 5, VOCAB),
            mtf.gather(_import(mesh, flags, [BATCH, VOCAB]), ids, BATCH),
            mtf.gather(w, ids, BATCH, output_shape=[VOCAB, SEQ])]
  by_int, by_bool, reordered = lower_and_evaluate(build, "all:4", "vocab:all", mode=mode)
  assert_allclose(by_int, weights[:, 5])
  assert by_bool.dtype == bool
  np.testing.assert_array_equal(by_bool, flags[[1, 0]])
  assert_allclose(reordered, weights[[1, 0]].T)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_of_the_gather_gradient_is_a_gather(mode):
  """ScatterAddOperation (the gather's gradient) is linear in its rows; its gradient gathers."""
  weights = np.random.RandomState(9).randn(8, 2).astype(np.float32)
  indices = np.array([[1, 1], [0, 7], [9, 3], [2, 2]], np.int32)
  v = np.random.RandomState(10).randn(8, 2).astype(np.float32)

  def build(mesh):
    w, ids = _import(mesh, weights, [VOCAB, D]), _import(mesh, indices, [BATCH, SEQ])
    u = mtf.zeros(mesh, [BATCH, SEQ, D])
    dw, = mtf.gradients([mtf.reduce_sum(mtf.gather(w, ids, VOCAB) * u)], [w])
    du, = mtf.gradients([mtf.reduce_sum(dw * _import(mesh, v, [VOCAB, D]))], [u])
    return [du]
  du, = lower_and_evaluate(build, "rows:2;cols:4", "vocab:cols;batch:rows", mode=mode)
  found = (indices >= 0) & (indices < 8)
  assert_allclose(du, np.where(found[..., None], v[np.clip(indices, 0, 7)], 0))


def test_embedding_lookup_lowers_to_a_row_gather_not_a_one_hot_matmul():
  """On one device the lookup and its gradient are GatherV2 and UnsortedSegmentSum kernels."""
  with tf.Graph().as_default() as tf_graph:
    mesh = mtf.Mesh(mtf.Graph(), "m")
    w = mtf.get_variable(mesh, "w", [VOCAB, D])
    ids = mtf.zeros(mesh, [BATCH, SEQ], dtype=tf.int32)
    loss = mtf.reduce_sum(mtf.gather(w, ids, VOCAB))
    dw, = mtf.gradients([loss], [w])
    kinds = {type(op).__name__ for op in mesh.graph.operations}
    assert {"GatherOperation", "ScatterAddOperation"} <= kinds
    assert not kinds & {"OneHotOperation", "EinsumOperation"}
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:1", "", ["/cpu:0"], fuse_slicewise=False)
    lowering = mtf.Lowering(mesh.graph, {mesh: impl})
    lowering.export_to_tf_tensor(dw)
  tf_kinds = {op.type for op in tf_graph.get_operations()}
  assert {"GatherV2", "UnsortedSegmentSum"} <= tf_kinds
  assert not tf_kinds & {"OneHot", "Einsum", "MatMul", "BatchMatMulV2"}


def test_gather_along_missing_dim_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  with pytest.raises(ValueError, match=r"gather: dim .*'seq'.* is not a dimension of"):
    mtf.gather(mtf.zeros(mesh, [BATCH, VOCAB]), 0, SEQ)


# ---- top_k ----

@settings_
@given(mesh_and_layout(SIZES), st.sampled_from(MODES), st.sampled_from([1, 2, 5, 8]))
def test_top_k_values_and_gradient_match_tf_under_any_layout(mesh_layout, mode, k):
  """k == 2 takes the iterative top_1 path, the others TopKOperation."""
  x = _distinct([2, 8, 4])
  k_dim = mtf.Dimension("k", k)
  assert_op_matches_tf(
      lambda t: mtf.top_k(t, reduced_dim=VOCAB, k_dim=k_dim)[0],
      lambda t: tf.math.top_k(tf.transpose(t, [0, 2, 1]), k).values,
      [(x, SEQ_VOCAB_BATCH)], *mesh_layout, mode=mode)


@settings_
@given(mesh_and_layout(SIZES), st.sampled_from(MODES), st.sampled_from([2, 3, 6, 8]))
def test_top_k_indices_are_global_and_break_ties_by_lower_index(mesh_layout, mode, k):
  x = np.random.RandomState(4).randint(0, 3, size=(4, 8)).astype(np.float32)  # many ties
  k_dim = mtf.Dimension("k", k)

  def build(mesh):
    values, indices = mtf.top_k(_import(mesh, x, BATCH_VOCAB), VOCAB, k_dim)
    assert values.shape == indices.shape == mtf.Shape([BATCH, k_dim])
    return [values, indices]
  values, indices = lower_and_evaluate(build, *mesh_layout, mode=mode)
  expected_values, expected_indices = _numpy_top_k(x, 1, k)
  assert indices.dtype == np.int32
  assert_allclose(values, expected_values)
  np.testing.assert_array_equal(indices, expected_indices)


@pytest.mark.parametrize("k,num_top_k_ops,num_stacks", [(1, 1, 0), (4, 4, 2), (5, 1, 0), (8, 1, 0)])
def test_top_k_iterates_top_1_only_for_k_from_2_to_4(k, num_top_k_ops, num_stacks):
  graph = mtf.Graph()
  values, indices = mtf.top_k(mtf.zeros(mtf.Mesh(graph, "m"), BATCH_VOCAB), VOCAB, mtf.Dimension("k", k))
  assert values.shape == indices.shape == mtf.Shape([BATCH, mtf.Dimension("k", k)])
  assert (values.dtype, indices.dtype) == (tf.float32, tf.int32)
  op_types = [type(op).__name__ for op in graph.operations]
  assert op_types.count("TopKOperation") == num_top_k_ops
  assert op_types.count("StackOperation") == num_stacks


def test_top_k_operation_shape_name_and_splittability():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  k_dim = mtf.Dimension("k", 5)
  op = mtf.TopKOperation(mtf.zeros(mesh, SEQ_VOCAB_BATCH), VOCAB, k_dim)
  assert op.name == "top_k"
  assert [t.shape for t in op.outputs] == [mtf.Shape([SEQ, BATCH, k_dim])] * 2
  assert [t.dtype for t in op.outputs] == [tf.float32, tf.int32]
  assert op.unsplittable_dims == frozenset(["k"])
  assert op.splittable_dims == frozenset(["seq", "vocab", "batch"])


@pytest.mark.parametrize("k", [3, 6])
def test_top_k_with_missing_reduced_dim_raises(k):
  mesh = mtf.Mesh(mtf.Graph(), "m")
  with pytest.raises(ValueError, match=r"top_k.*reduced_dim .*'seq'.* is not a dimension of"):
    mtf.top_k(mtf.zeros(mesh, BATCH_VOCAB), SEQ, mtf.Dimension("k", k))


@pytest.mark.parametrize("k", [3, 9])
def test_top_k_with_k_larger_than_reduced_dim_raises(k):
  mesh = mtf.Mesh(mtf.Graph(), "m")
  with pytest.raises(ValueError, match=r"top_k.*k_dim .* more values than reduced_dim"):
    mtf.top_k(mtf.zeros(mesh, "batch:2;vocab:8"), mtf.Dimension("batch", 2), mtf.Dimension("k", k))


def test_top_k_operation_validates_like_top_k_and_adds_no_op():
  graph = mtf.Graph()
  x = mtf.zeros(mtf.Mesh(graph, "m"), BATCH_VOCAB)
  with pytest.raises(ValueError, match=r"top_k 'top_k'.*k_dim .* more values than reduced_dim"):
    mtf.TopKOperation(x, VOCAB, mtf.Dimension("k", 9))
  with pytest.raises(ValueError, match=r"k_dim name 'batch' is already a dimension"):
    mtf.TopKOperation(x, VOCAB, mtf.Dimension("batch", 2))
  assert len(graph.operations) == 1


def test_top_k_with_split_k_dim_raises_before_lowering():
  def build(mesh):
    return [mtf.top_k(mtf.zeros(mesh, BATCH_VOCAB), VOCAB, mtf.Dimension("k", 6))[0]]
  with pytest.raises(ValueError, match=r"can't split dimension 'k'.*top_k builds its k_dim.*Remove the "
                                       r"layout rule k:all"):
    lower_and_evaluate(build, "all:2", "k:all", mode="eager")


# ---- reductions built on top_k ----

@settings_
@given(mesh_and_layout(SIZES), st.sampled_from(MODES))
def test_top_1_argmax_nth_elements_and_reduce_first_match_numpy(mesh_layout, mode):
  x = _distinct([4, 8], seed=5)

  def build(mesh):
    t = _import(mesh, x, BATCH_VOCAB)
    max_value, max_index = mtf.top_1(t, VOCAB)
    return [max_value, max_index, mtf.argmax(t, BATCH, dtype=tf.int64),
            mtf.nth_smallest_element(t, 1, VOCAB), mtf.nth_largest_element(t, 6, VOCAB),
            mtf.reduce_first(t, VOCAB), mtf.reduce_first(t, BATCH)]
  got = lower_and_evaluate(build, *mesh_layout, mode=mode)
  ordered = np.sort(x, axis=1)
  expected = [x.max(1), x.argmax(1), x.argmax(0), ordered[:, 1], ordered[:, -7], x[:, 0], x[0]]
  for g, e in zip(got, expected):
    assert_allclose(g, e)
  assert got[1].dtype == np.int32 and got[2].dtype == np.int64


@pytest.mark.parametrize("mode", MODES)
def test_nth_largest_element_gradient_matches_tf(mode):
  assert_op_matches_tf(
      lambda t: mtf.nth_largest_element(t, 5, VOCAB),
      lambda t: tf.math.top_k(t, 6).values[:, 5],
      [(_distinct([4, 8], seed=6), BATCH_VOCAB)], "rows:2;cols:4", "batch:rows;vocab:cols",
      mode=mode)


def test_reduce_first_along_missing_dim_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  with pytest.raises(ValueError, match=r"reduce_first: reduced_dim .*'seq'.* is not a dimension"):
    mtf.reduce_first(mtf.zeros(mesh, BATCH_VOCAB), SEQ)


# ---- sample_with_temperature ----

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_shape,layout", [("all:1", ""), ("rows:2;cols:4", "batch:rows;vocab:cols")])
def test_sample_with_temperature_zero_is_argmax_and_samples_follow_softmax(mode, mesh_shape, layout):
  num_samples = 4000
  probs = np.array([0.05, 0.1, 0.15, 0.2, 0.0, 0.3, 0.1, 0.1])
  logits = np.tile(np.log(np.maximum(probs, 1e-30)), (num_samples, 1)).astype(np.float32)
  samples_dim = mtf.Dimension("batch", num_samples)

  def build(mesh):
    t = _import(mesh, logits, [samples_dim, VOCAB])
    return [mtf.sample_with_temperature(t, VOCAB, temperature=0.0),
            mtf.sample_with_temperature(t, VOCAB),
            mtf.sample_with_temperature(t * 1e3, VOCAB, temperature=1.0)]
  greedy, sampled, sharp = lower_and_evaluate(build, mesh_shape, layout, mode=mode)
  assert greedy.dtype == sampled.dtype == np.int32
  np.testing.assert_array_equal(greedy, np.full([num_samples], 5))
  np.testing.assert_array_equal(sharp, np.full([num_samples], 5))
  frequencies = np.bincount(sampled, minlength=8) / num_samples
  np.testing.assert_allclose(frequencies, probs, atol=0.03)


# ---- cumsum ----

@settings_
@given(mesh_and_layout(SIZES), st.sampled_from(MODES), st.booleans(), st.sampled_from(["vocab", "batch"]))
def test_cumsum_and_gradient_match_tf_under_any_layout(mesh_layout, mode, exclusive, dim_name):
  x = np.random.RandomState(7).randn(4, 8).astype(np.float32)
  dim = {"vocab": VOCAB, "batch": BATCH}[dim_name]
  axis = 1 if dim_name == "vocab" else 0
  assert_op_matches_tf(
      lambda t: mtf.cumsum(t, dim, exclusive=exclusive),
      lambda t: tf.cumsum(t, axis=axis, exclusive=exclusive),
      [(x, BATCH_VOCAB)], *mesh_layout, mode=mode)


def test_cumsum_of_integers_matches_numpy():
  x = np.arange(32, dtype=np.int32).reshape(4, 8)

  def build(mesh):
    return [mtf.cumsum(_import(mesh, x, BATCH_VOCAB), VOCAB)]
  got, = lower_and_evaluate(build, "all:2", "vocab:all", mode="eager")
  np.testing.assert_array_equal(got, np.cumsum(x, axis=1))


def test_cumsum_along_missing_dim_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  with pytest.raises(ValueError, match=r"cumsum: dim .*'seq'.* is not a dimension of"):
    mtf.cumsum(mtf.zeros(mesh, BATCH_VOCAB), SEQ)
