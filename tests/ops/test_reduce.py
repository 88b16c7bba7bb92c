"""Reductions and softmax: results and gradients under any layout, allreduce over split dims, errors."""

import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from mesh_tensorflow._lowering.lazy import LazyAllreduceSum
from tests.harness import (
    MAX_EXAMPLES, MODES, assert_allclose, assert_op_matches_tf, cpu_devices, lower_and_evaluate,
    lowering_counters, mesh_and_layout)

DIMS = {"a": 2, "b": 4, "c": 8}
REDUCTIONS = {
    "sum": (mtf.reduce_sum, tf.reduce_sum), "mean": (mtf.reduce_mean, tf.reduce_mean),
    "max": (mtf.reduce_max, tf.reduce_max), "min": (mtf.reduce_min, tf.reduce_min),
}


def _shape(names):
  return mtf.Shape([mtf.Dimension(n, DIMS[n]) for n in names])


def _shape_string(names):
  return ";".join(f"{n}:{DIMS[n]}" for n in names)


def _random_input(names, seed=0, scale=1.0):
  rng = np.random.RandomState(seed)
  return (scale * rng.uniform(-1, 1, [DIMS[n] for n in names])).astype(np.float32), _shape_string(names)


def _tf_reduce(tf_fn, x_names, out_names):
  """tf_fn over the axes not in out_names, then transposed into out_names order."""
  def fn(x):
    kept = [n for n in x_names if n in out_names]
    y = tf_fn(x, axis=[i for i, n in enumerate(x_names) if n not in out_names])
    return tf.transpose(y, [kept.index(n) for n in out_names]) if out_names else y
  return fn


@st.composite
def reduce_cases(draw):
  """(reduction, x dim names, mtf kwargs, output dim names)."""
  x_names = draw(st.lists(st.sampled_from(sorted(DIMS)), min_size=1, max_size=3, unique=True))
  kind = draw(st.sampled_from(["reduced_dim", "output_shape", "scalar"]))
  if kind == "reduced_dim":
    reduced = draw(st.sampled_from(x_names))
    kwargs = {"reduced_dim": _shape(reduced)[0]}
    out_names = [n for n in x_names if n != reduced]
  elif kind == "output_shape":
    out_names = draw(st.lists(st.sampled_from(x_names), max_size=len(x_names) - 1, unique=True))
    kwargs = {"output_shape": _shape(out_names)}
  else:
    out_names, kwargs = [], {}
  return draw(st.sampled_from(sorted(REDUCTIONS))), x_names, kwargs, out_names


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(reduce_cases(), mesh_and_layout(DIMS), st.sampled_from(MODES))
def test_reductions_match_tf_and_their_gradients_under_any_layout(case, mesh_layout, mode):
  reduction, x_names, kwargs, out_names = case
  mtf_fn, tf_fn = REDUCTIONS[reduction]
  assert_op_matches_tf(lambda x: mtf_fn(x, **kwargs), _tf_reduce(tf_fn, x_names, out_names),
                       [_random_input(x_names)], *mesh_layout, mode=mode)


def _tf_logsumexp(x, axis, extra):
  if extra is None:
    return tf.reduce_logsumexp(x, axis=axis)
  extra = tf.broadcast_to(tf.expand_dims(extra, axis), tf.shape(tf.gather(x, [0], axis=axis)))
  return tf.reduce_logsumexp(tf.concat([x, extra], axis), axis=axis)


SOFTMAX_FNS = {
    "reduce_logsumexp": (mtf.reduce_logsumexp, _tf_logsumexp),
    "log_softmax": (mtf.log_softmax,
                    lambda x, axis, extra: x - tf.expand_dims(_tf_logsumexp(x, axis, extra), axis)),
    "softmax": (mtf.softmax,
                lambda x, axis, extra: tf.exp(x - tf.expand_dims(_tf_logsumexp(x, axis, extra), axis))),
}


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(st.sampled_from(sorted(SOFTMAX_FNS)), st.sampled_from(sorted(DIMS)),
       st.sampled_from(["none", "scalar", "tensor"]), mesh_and_layout(DIMS), st.sampled_from(MODES))
def test_softmax_family_matches_tf_under_any_layout(fn_name, reduced, extra_kind, mesh_layout, mode):
  mtf_fn, tf_fn = SOFTMAX_FNS[fn_name]
  x_names = "abc"
  axis = x_names.index(reduced)
  rest = [n for n in x_names if n != reduced]
  inputs = [_random_input(x_names, scale=30.0)]  # large logits: exp would overflow without the max
  if extra_kind == "tensor":
    inputs.append(_random_input(rest, seed=1, scale=30.0))
  scalar = 0.5 if extra_kind == "scalar" else None

  def mtf_f(x, extra=scalar):
    return mtf_fn(x, x.shape.get_dim_by_name(reduced), extra_logit=extra)

  def tf_f(x, extra=None):
    if scalar is not None:
      extra = tf.fill([DIMS[n] for n in rest], scalar)
    return tf_fn(x, axis, extra)
  assert_op_matches_tf(mtf_f, tf_f, inputs, *mesh_layout, mode=mode, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mtf_fn,np_fn", [(mtf.reduce_all, np.all), (mtf.reduce_any, np.any)])
def test_reduce_all_and_any_on_booleans_over_split_dims(mtf_fn, np_fn, mode):
  x = np.random.RandomState(4).uniform(size=[2, 4, 8]) > 0.2

  def build(mesh):
    t = mtf.import_tf_tensor(mesh, tf.constant(x), _shape_string("abc"))
    return [mtf_fn(t, reduced_dim=_shape("b")[0]), mtf_fn(t, output_shape=_shape("c")), mtf_fn(t)]
  by_b, to_c, scalar = lower_and_evaluate(build, "rows:2;cols:4", "b:rows;c:cols", mode)
  assert by_b.dtype == bool
  np.testing.assert_array_equal(by_b, np_fn(x, axis=1))
  np.testing.assert_array_equal(to_c, np_fn(x, axis=(0, 1)))
  assert scalar == np_fn(x)


def _reduce_graph(mtf_fn):
  return lambda mesh: [mtf_fn(mtf.ones(mesh, _shape("abc")), output_shape=_shape("a"))]


def test_sum_over_a_split_dim_is_one_lazy_allreduce():
  counters = lowering_counters(_reduce_graph(mtf.reduce_sum), "x:2;y:4", "b:x;c:y")
  # [a=2] partial sums on 8 processors, one group of 8: a ring sends 2 * (8 - 1) slices of 2.
  assert counters["allreduce/[0, 1]/reduce_op"] == 2 * 7 * 2


@pytest.mark.parametrize("mtf_fn", [mtf.reduce_max, mtf.reduce_min])
def test_max_and_min_over_a_split_dim_allreduce(mtf_fn):
  counters = lowering_counters(_reduce_graph(mtf_fn), "x:2;y:4", "c:y")
  # Two groups of 4 along y, each ring sending 2 * (4 - 1) slices of [a=2].
  assert counters["allreduce/[1]/reduce_op"] == 2 * (2 * 3 * 2)


def test_reducing_replicated_dims_needs_no_allreduce():
  counters = lowering_counters(_reduce_graph(mtf.reduce_sum), "x:2;y:4", "a:x")
  assert not [k for k in counters if k.startswith("allreduce")]


def test_sum_stays_lazy_until_used_but_max_does_not():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    x = mtf.ones(mesh, _shape("abc"))
    total, biggest = mtf.reduce_sum(x, output_shape=_shape("a")), mtf.reduce_max(x, output_shape=_shape("a"))
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("x:2", "b:x", cpu_devices(2))
    lowering = mtf.Lowering(graph, {mesh: impl})
    assert isinstance(lowering.tensors[total], LazyAllreduceSum)
    assert not isinstance(lowering.tensors[biggest], LazyAllreduceSum)


@pytest.mark.parametrize("mode", MODES)
def test_reduce_operation_accepts_lower_case_reduction_strings(mode):
  x = np.arange(16, dtype=np.float32).reshape([2, 8])

  def build(mesh):
    t = mtf.import_tf_tensor(mesh, tf.constant(x), _shape_string("ac"))
    op = mtf.ReduceOperation(t, _shape("a"), "max")
    assert op.reduction_fn_string == "MAX"
    return [op.outputs[0]]
  np.testing.assert_array_equal(lower_and_evaluate(build, "all:4", "c:all", mode)[0], x.max(axis=1))


@pytest.fixture
def x():
  return mtf.zeros(mtf.Mesh(mtf.Graph(), "m"), _shape("abc"))


def test_reduce_op_names_and_splittability(x):
  y = mtf.reduce_sum(x, reduced_dim=x.shape[1])
  assert (y.operation.name, y.name) == ("reduce", "reduce:0")
  assert y.operation.splittable_dims == frozenset("abc")
  assert y.operation.unsplittable_dims == frozenset()
  assert re.match(r"reduce_mean(_\d+)?/scalar_mul$", mtf.reduce_mean(x).operation.name)


def test_nothing_to_reduce_returns_the_input(x):
  assert mtf.reduce_sum(x, output_shape=x.shape) is x
  assert mtf.reduce_mean(x, output_shape=x.shape) is x


def test_positional_second_argument_raises(x):
  with pytest.raises(TypeError, match=r"reduce_sum takes its options by keyword only"):
    mtf.reduce_sum(x, x.shape[0])


def test_reduced_dim_missing_from_x_raises(x):
  with pytest.raises(ValueError, match=r"reduce_max: reduced_dim .*'d'.*is not a dimension of"):
    mtf.reduce_max(x, reduced_dim=mtf.Dimension("d", 2))
  with pytest.raises(ValueError, match="reduce_logsumexp: reduced_dim"):
    mtf.reduce_logsumexp(x, mtf.Dimension("a", 3))


def test_reduced_dim_contradicting_output_shape_raises(x):
  with pytest.raises(ValueError, match="contradicts output_shape"):
    mtf.reduce_sum(x, reduced_dim=x.shape[0], output_shape=_shape("c"))


def test_unknown_reduction_raises(x):
  with pytest.raises(ValueError, match=r"unknown reduction 'prod'.*\['SUM', 'MAX', 'MIN'\]"):
    mtf.ReduceOperation(x, _shape("a"), "prod")


def test_output_dims_not_in_the_input_raise(x):
  with pytest.raises(ValueError, match=r"\[Dimension\(name='d', size=3\)\].*can only drop dimensions"):
    mtf.reduce_sum(x, output_shape=[mtf.Dimension("d", 3)])


@pytest.mark.parametrize("fn,kernel", [(mtf.softmax, "Softmax"), (mtf.log_softmax, "LogSoftmax")])
def test_softmax_over_a_whole_dim_is_one_kernel_and_over_a_split_dim_allreduces(fn, kernel):
  def op_types(layout):
    with tf.Graph().as_default() as tf_graph:
      mesh = mtf.Mesh(mtf.Graph(), "m")
      x = mtf.zeros(mesh, _shape_string("abc"))
      y = fn(x, x.shape.get_dim_by_name("c"))
      impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", layout, cpu_devices(4),
                                                       fuse_slicewise=False)
      lowering = mtf.Lowering(mesh.graph, {mesh: impl})
      lowering.export_to_tf_tensor(y)
    return [op.type for op in tf_graph.get_operations()], lowering.communication_events
  whole, no_events = op_types("b:all")
  assert whole.count(kernel) == 4 and "Exp" not in whole and not no_events
  split, events = op_types("c:all")
  assert kernel not in split and "Exp" in split
  assert [e.reason for e in events] == ["softmax_op", "softmax_op"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn,log", [(mtf.softmax, False), (mtf.log_softmax, True)])
@pytest.mark.parametrize("reduced", ["a", "d", "f"])
def test_softmax_of_six_dims_matches_numpy_on_every_cpu_kernel(fn, log, reduced, mode):
  """oneDNN's CPU softmax (TF's default on AVX-512 CPUs) refuses more than 5 dims: mtf reshapes."""
  names = "abcdef"
  x = np.random.RandomState(0).uniform(-5, 5, [2, 3, 2, 4, 2, 5]).astype(np.float32)
  shape = ";".join(f"{n}:{k}" for n, k in zip(names, x.shape))

  def build(mesh):
    t = mtf.import_tf_tensor(mesh, tf.constant(x), shape)
    return [fn(t, t.shape.get_dim_by_name(reduced))]
  [got] = lower_and_evaluate(build, "rows:2;cols:2", "a:rows;c:cols", mode)
  axis = names.index(reduced)
  log_want = x - x.max(axis, keepdims=True)
  log_want -= np.log(np.exp(log_want).sum(axis, keepdims=True))
  assert_allclose(got, log_want if log else np.exp(log_want), rtol=1e-5, atol=1e-5)


def test_softmax_of_integers_raises_naming_the_tensor():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  ints = mtf.import_tf_tensor(mesh, tf.constant([1, 2]), "a:2", name="ints")
  with pytest.raises(ValueError, match=r"softmax: tensor 'ints:0' has dtype int32.*to_float"):
    mtf.softmax(ints, ints.shape.dims[0])
