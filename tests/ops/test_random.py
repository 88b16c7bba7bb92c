"""Random ops and dropout: value ranges, replica agreement per slice, both dropout signatures."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, assert_allclose, lower_and_evaluate, mesh_and_layout

SIZES = {"a": 8, "b": 64}
SHAPE = "a:8;b:64"


@st.composite
def layout_mode_devices(draw):
  """A mesh/layout, a mode, and whether all processors share one device string ("")."""
  mesh_shape, layout = draw(mesh_and_layout(SIZES))
  return mesh_shape, layout, draw(st.sampled_from(MODES)), draw(st.booleans())


def _slices_by_processor(build_fn, mesh_shape, layout, mode, same_device):
  """Per output, the per-processor slices, plus each processor's slice begin (identifies the slice)."""
  size = mtf.convert_to_shape(mesh_shape).size
  devices = [""] * size if same_device else None
  outputs = lower_and_evaluate(build_fn, mesh_shape, layout, mode, devices=devices, per_processor=True)
  impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, [""] * size)
  begins = [tuple(impl.slice_begin(mtf.convert_to_shape(SHAPE), p)) for p in range(size)]
  return outputs, begins


def _assert_equal_exactly_on_same_slices(slices, begins):
  for p in range(len(slices)):
    for q in range(p):
      if begins[p] == begins[q]:
        np.testing.assert_array_equal(slices[p], slices[q])
      else:
        assert not np.array_equal(slices[p], slices[q]), (p, q, begins)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(layout_mode_devices())
def test_random_and_dropout_agree_on_processors_holding_the_same_slice(case):
  mesh_shape, layout, mode, same_device = case

  def build(mesh):
    u = mtf.random_uniform(mesh, SHAPE, minval=-1.0, maxval=1.0)
    return [u, mtf.dropout(mtf.ones(mesh, SHAPE), rate=0.5)]
  (uniform, dropped), begins = _slices_by_processor(build, mesh_shape, layout, mode, same_device)
  _assert_equal_exactly_on_same_slices(uniform, begins)
  _assert_equal_exactly_on_same_slices(dropped, begins)
  for u in uniform:
    assert u.min() >= -1.0 and u.max() < 1.0


@pytest.mark.parametrize("mode", MODES)
def test_random_uniform_and_normal_distributions(mode):
  def build(mesh):
    shape = "a:64;b:64"
    return [mtf.random_uniform(mesh, shape, minval=2.0, maxval=4.0),
            mtf.random_normal(mesh, shape, mean=1.0, stddev=3.0),
            mtf.random_uniform(mesh, shape, maxval=5, dtype=tf.int32),
            mtf.random_normal(mesh, shape, dtype=tf.float64)]
  # A 2-D mesh of 4 processors: each new slice geometry compiles the draw once per device.
  uniform, normal, ints, normal64 = lower_and_evaluate(build, "rows:2;cols:2", "a:rows;b:cols", mode)
  assert uniform.shape == (64, 64) and 2.0 <= uniform.min() and uniform.max() < 4.0
  assert abs(uniform.mean() - 3.0) < 0.05
  assert abs(normal.mean() - 1.0) < 0.15 and abs(normal.std() - 3.0) < 0.15
  assert ints.dtype == np.int32 and set(np.unique(ints)) == {0, 1, 2, 3, 4}
  assert normal64.dtype == np.float64


def test_random_operation_name_dtype_splittability_and_sharing_on_clone():
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "m")
  u = mtf.random_uniform(mesh, SHAPE, dtype=tf.float64, name="noise")
  op = u.operation
  assert isinstance(op, mtf.RandomOperation) and op.name == "noise" and u.dtype == tf.float64
  assert op.splittable_dims == {"a", "b"} and not op.unsplittable_dims
  assert mtf.RandomOperation(mesh, mtf.convert_to_shape(SHAPE), tf.random_uniform).name == "random"
  assert op.is_not_cloned
  y = u * 2.0
  new_ops, mapping = graph.clone_operations([op, y.operation], {})
  assert len(new_ops) == 1 and u not in mapping and new_ops[0].inputs[0] is u


def test_random_with_bad_dtype_raises():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  with pytest.raises(ValueError, match="random_normal.*must be floating, got int32"):
    mtf.random_normal(mesh, SHAPE, dtype=tf.int32)
  with pytest.raises(ValueError, match="random_uniform.*int32 needs an explicit maxval"):
    mtf.random_uniform(mesh, SHAPE, dtype=tf.int32)


# ---- dropout ----

def _x():
  return np.random.RandomState(0).uniform(0.5, 1.5, size=(8, 64)).astype(np.float32)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(st.builds(lambda ml, mode: ml + (mode,), mesh_and_layout(SIZES), st.sampled_from(MODES)),
       st.sampled_from([0.25, 0.5, 0.75]))
def test_dropout_zeroes_or_scales_each_element_and_gradient_follows_the_mask(case, keep_prob):
  mesh_shape, layout, mode = case
  w = np.random.RandomState(1).uniform(-1, 1, size=(8, 64)).astype(np.float32)

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(_x()), SHAPE)
    y = mtf.dropout(x, True, keep_prob=keep_prob)
    loss = mtf.reduce_sum(y * mtf.import_tf_tensor(mesh, tf.constant(w), SHAPE))
    return [y, mtf.gradients([loss], [x])[0]]
  y, dx = lower_and_evaluate(build, mesh_shape, layout, mode)
  kept = y != 0
  assert_allclose(y[kept], _x()[kept] / keep_prob)
  assert abs(kept.mean() - keep_prob) < 0.1
  assert_allclose(dx, w * kept / keep_prob)


@pytest.mark.parametrize("mode", MODES)
def test_dropout_noise_shape_drops_whole_broadcast_rows(mode):
  def build(mesh):
    x = mtf.ones(mesh, SHAPE)
    return [mtf.dropout(x, rate=0.5, noise_shape=mtf.Shape([mtf.Dimension("a", 8)]))]
  (y,) = lower_and_evaluate(build, "rows:2;cols:4", "a:rows;b:cols", mode)
  for row in y:
    assert np.all(row == 0.0) or np.all(row == 2.0)


@pytest.mark.parametrize("mode", MODES)
def test_dropout_of_integers_is_not_rescaled(mode):
  def build(mesh):
    return [mtf.dropout(mtf.ones(mesh, SHAPE, dtype=tf.int32), keep_prob=0.5)]
  (y,) = lower_and_evaluate(build, "all:4", "b:all", mode)
  assert y.dtype == np.int32 and set(np.unique(y)) == {0, 1}


def _applied(y, x) -> bool:
  """Whether dropout built ops (rather than returning x itself)."""
  return y is not x


def test_dropout_accepts_both_signature_generations():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.ones(mesh, SHAPE)
  noise_shape = "a:8"
  # 0.1.19+: dropout(x, is_training, keep_prob=None, rate=None, noise_shape=None, name=None)
  assert not _applied(mtf.dropout(x, False, rate=0.5), x)
  assert not _applied(mtf.dropout(x, False, 0.5), x)
  assert _applied(mtf.dropout(x, True, 0.5, None, noise_shape, "d"), x)
  assert _applied(mtf.dropout(x, is_training=True, rate=0.5), x)
  assert not _applied(mtf.dropout(x, True, keep_prob=1.0), x)
  assert not _applied(mtf.dropout(x, np.bool_(False), rate=0.1), x)
  assert not _applied(mtf.dropout(x, 0, rate=0.1), x)  # integers are truth values
  assert _applied(mtf.dropout(x, 1, rate=0.1), x)
  # up to 0.1.18: dropout(x, keep_prob=None, rate=None, noise_shape=None, name=None), always applied
  assert _applied(mtf.dropout(x, rate=0.5, name="old"), x)
  assert _applied(mtf.dropout(x, 0.5), x)
  assert _applied(mtf.dropout(x, keep_prob=0.5, noise_shape=noise_shape), x)
  assert not _applied(mtf.dropout(x, 1.0), x)
  y = mtf.dropout(x, 0.9, None, noise_shape, "named")
  assert _applied(y, x) and y.operation.name.startswith("named/")
  random_names = {op.name for op in mesh.graph.operations if isinstance(op, mtf.RandomOperation)}
  assert {"d/random", "old/random", "named/random"} <= random_names
  assert any(name.startswith("dropout") for name in random_names)  # the default scope


def test_dropout_noise_shape_positional_in_both_generations_is_used():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.ones(mesh, SHAPE)
  new_style = lambda: mtf.dropout(x, True, 0.5, None, "a:8")
  old_style = lambda: mtf.dropout(x, 0.5, None, "a:8")
  for dropout_fn in [new_style, old_style]:
    y, ops = mesh.graph.capture_operations(dropout_fn)
    (random_op,) = [op for op in ops if isinstance(op, mtf.RandomOperation)]
    assert random_op.outputs[0].shape == mtf.convert_to_shape("a:8") and y.shape == x.shape


def test_dropout_bad_arguments_raise():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.ones(mesh, SHAPE)
  with pytest.raises(ValueError, match="exactly one of keep_prob and rate"):
    mtf.dropout(x, True, keep_prob=0.5, rate=0.5)
  with pytest.raises(ValueError, match="exactly one of keep_prob and rate"):
    mtf.dropout(x, True)
  with pytest.raises(ValueError, match="exactly one of keep_prob and rate"):
    mtf.dropout(x, False)
  with pytest.raises(ValueError, match="exactly one of keep_prob and rate"):
    mtf.dropout(x, 0.5, 0.5)
  with pytest.raises(ValueError, match="keep_prob must be in \\(0, 1\\].*keep_prob=0.0"):
    mtf.dropout(x, rate=1.0)
  with pytest.raises(ValueError, match="keep_prob must be in"):
    mtf.dropout(x, keep_prob=1.5)
  with pytest.raises(ValueError, match="noise_shape Shape\\[c=2\\].*\\[Dimension\\(name='c', size=2\\)\\].*"
                                       "subset of x's dims"):
    mtf.dropout(x, rate=0.5, noise_shape="c:2")
  with pytest.raises(TypeError, match="multiple values for argument 'keep_prob'"):
    mtf.dropout(x, 0.5, keep_prob=0.5)
  with pytest.raises(TypeError, match="multiple values for argument 'rate'"):
    mtf.dropout(x, True, None, 0.5, rate=0.5)
  with pytest.raises(TypeError, match="7 were given"):
    mtf.dropout(x, True, None, 0.5, None, "n", "extra")
  with pytest.raises(TypeError, match="got 6 positional arguments for \\('x', 'keep_prob'"):
    mtf.dropout(x, 0.5, None, None, "n", "extra")
