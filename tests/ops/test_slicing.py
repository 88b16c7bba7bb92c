"""slice/pad, concat/split, stack/unstack against plain TF, values and gradients.

Shapes, meshes (1-D, 2-D, 3-D; 1 to 8 processors) and layouts are drawn by hypothesis; the
dimension being cut or joined is never split (that is an error, tested separately), the others
may be. Outputs of multi-output ops are checked one drawn output at a time, which also checks
that the gradients of the unused outputs are zero-filled.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, assert_op_matches_tf, lower_and_evaluate, mesh_and_layout

settings_ = settings(max_examples=MAX_EXAMPLES, deadline=None)


@st.composite
def cases(draw, min_op_size=1):
  """(sizes dict, op dim name, (mesh, layout), mode); the op dim is left out of the layout."""
  names = ["a", "b", "c"][:draw(st.integers(1, 3))]
  op_dim = draw(st.sampled_from(names))
  sizes = {n: draw(st.integers(min_op_size, 7)) if n == op_dim else draw(st.sampled_from([2, 4, 8]))
           for n in names}
  mesh_layout = draw(mesh_and_layout({n: s for n, s in sizes.items() if n != op_dim}))
  return sizes, op_dim, mesh_layout, draw(st.sampled_from(MODES))


def _shape(sizes: dict) -> str:
  return ";".join(f"{n}:{s}" for n, s in sizes.items())


def _array(sizes: dict, seed=0):
  return np.random.RandomState(seed).standard_normal(list(sizes.values())).astype(np.float32)


def _resized(sizes: dict, name: str, size: int) -> dict:
  return {n: size if n == name else s for n, s in sizes.items()}


@settings_
@given(cases(), st.data())
def test_slice_matches_tf_under_any_layout(case, data):
  sizes, dim, mesh_layout, mode = case
  axis = list(sizes).index(dim)
  begin = data.draw(st.integers(0, sizes[dim] - 1))
  size = data.draw(st.integers(1, sizes[dim] - begin))
  tf_begin = [begin if i == axis else 0 for i in range(len(sizes))]
  tf_size = [size if i == axis else -1 for i in range(len(sizes))]
  assert_op_matches_tf(lambda x: mtf.slice(x, begin, size, dim),
                       lambda x: tf.slice(x, tf_begin, tf_size),
                       [(_array(sizes), _shape(sizes))], *mesh_layout, mode=mode)


@settings_
@given(cases(), st.integers(0, 3), st.integers(0, 3))
def test_pad_matches_tf_under_any_layout(case, before, after):
  sizes, dim, mesh_layout, mode = case
  paddings = [[before, after] if n == dim else [0, 0] for n in sizes]
  assert_op_matches_tf(lambda x: mtf.pad(x, [before, after], dim),
                       lambda x: tf.pad(x, paddings),
                       [(_array(sizes), _shape(sizes))], *mesh_layout, mode=mode)


@settings_
@given(cases(), st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_concat_matches_tf_under_any_layout(case, concat_sizes):
  sizes, dim, mesh_layout, mode = case
  parts = [_resized(sizes, dim, s) for s in concat_sizes]
  inputs = [(_array(p, seed=i), _shape(p)) for i, p in enumerate(parts)]
  assert_op_matches_tf(lambda *xs: mtf.concat(list(xs), dim),
                       lambda *xs: tf.concat(list(xs), axis=list(sizes).index(dim)),
                       inputs, *mesh_layout, mode=mode)


@settings_
@given(cases(), st.data())
def test_split_matches_tf_under_any_layout(case, data):
  sizes, dim, mesh_layout, mode = case
  axis = list(sizes).index(dim)
  if data.draw(st.booleans()):
    num_or_sizes = data.draw(st.sampled_from([n for n in range(1, sizes[dim] + 1) if sizes[dim] % n == 0]))
    num_outputs = num_or_sizes
  else:
    cuts = sorted(data.draw(st.sets(st.integers(1, sizes[dim] - 1), max_size=3)) if sizes[dim] > 1 else [])
    num_or_sizes = [int(s) for s in np.diff([0] + cuts + [sizes[dim]])]
    num_outputs = len(num_or_sizes)
  k = data.draw(st.integers(0, num_outputs - 1))

  def mtf_fn(x):
    return mtf.split(x, x.shape.get_dim_by_name(dim), num_or_sizes)[k]
  assert_op_matches_tf(mtf_fn, lambda x: tf.split(x, num_or_sizes, axis=axis)[k],
                       [(_array(sizes), _shape(sizes))], *mesh_layout, mode=mode)


@settings_
@given(cases(), st.integers(1, 3), st.data())
def test_stack_matches_tf_under_any_layout(case, n, data):
  sizes, dim, mesh_layout, mode = case
  ndims = len(sizes)
  axis = data.draw(st.integers(-ndims - 1, ndims))
  inputs = [(_array(sizes, seed=i), _shape(sizes)) for i in range(n)]
  assert_op_matches_tf(lambda *xs: mtf.stack(list(xs), "stacked_dim", axis=axis),
                       lambda *xs: tf.stack(list(xs), axis=axis),
                       inputs, *mesh_layout, mode=mode)


@settings_
@given(cases(), st.data())
def test_unstack_matches_tf_under_any_layout(case, data):
  sizes, dim, mesh_layout, mode = case
  axis = list(sizes).index(dim)
  k = data.draw(st.integers(0, sizes[dim] - 1))
  assert_op_matches_tf(lambda x: mtf.unstack(x, x.shape.get_dim_by_name(dim))[k],
                       lambda x: tf.unstack(x, axis=axis)[k],
                       [(_array(sizes), _shape(sizes))], *mesh_layout, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_explicit_cases_on_a_3d_mesh(mode):
  x = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)

  def build(mesh):
    t = mtf.import_tf_tensor(mesh, tf.constant(x), "a:4;b:6;c:8")
    b = t.shape.dims[1]
    first, second = mtf.split(t, b, [2, 4])
    return [mtf.slice(t, 1, 3, "b"), mtf.pad(t, [2, 0], "b"), mtf.concat([second, first], "b"),
            mtf.stack([first, first], "s", axis=-1), mtf.unstack(t, b)[5]]
  got = lower_and_evaluate(build, "x:2;y:2;z:2", "a:x;c:z", mode)
  expected = [x[:, 1:4], np.pad(x, [[0, 0], [2, 0], [0, 0]]),
              np.concatenate([x[:, 2:], x[:, :2]], axis=1), np.stack([x[:, :2]] * 2, axis=-1), x[:, 5]]
  for g, e in zip(got, expected):
    np.testing.assert_array_equal(g, e)


# ---- errors ----

X_SHAPE = "a:4;b:8"


def _x(mesh):
  return mtf.import_tf_tensor(mesh, tf.zeros([4, 8]), X_SHAPE)


@pytest.mark.parametrize("verb, build, layout", [
    ("slice", lambda x: mtf.slice(x, 0, 4, "b"), "b:all"),
    ("pad", lambda x: mtf.pad(x, [1, 1], "b"), "b:all"),
    ("concat", lambda x: mtf.concat([x, x], "b"), "b:all"),
    ("split", lambda x: mtf.split(x, x.shape.dims[1], 2)[0], "b:all"),
    ("stack", lambda x: mtf.stack([x, x], "s"), "s:all"),
    ("unstack", lambda x: mtf.unstack(x, x.shape.dims[1])[0], "b:all"),
])
def test_op_along_split_dim_raises_naming_the_layout_rule(verb, build, layout):
  dim = layout.split(":")[0]
  with pytest.raises(ValueError, match=f"can't split dimension '{dim}': the layout rule {layout} splits "
                                       f"it over mesh dimension 'all'.*{verb} works along '{dim}'.*"
                                       f"Remove the layout rule {layout}"):
    lower_and_evaluate(lambda mesh: [build(_x(mesh))], "all:2", layout)


def _graph_x():
  return _x(mtf.Mesh(mtf.Graph(), "m"))


@pytest.mark.parametrize("build, match", [
    (lambda x: mtf.slice(x, 6, 4, "b"), "out of range"),
    (lambda x: mtf.slice(x, -1, 2, "b"), "out of range"),
    (lambda x: mtf.slice(x, 0, 2, "z"), "dimension 'z' is not in"),
    (lambda x: mtf.pad(x, [1], "b"), r"paddings must be \[before, after\]"),
    (lambda x: mtf.pad(x, [1, -1], "b"), "both >= 0"),
    (lambda x: mtf.pad(x, [1, 1], "z"), "dimension 'z' is not in"),
    (lambda x: mtf.concat([], "b"), "at least one tensor"),
    (lambda x: mtf.concat([x, mtf.slice(x, 0, 2, "a")], "b"), "may differ only in the size of 'b'"),
    (lambda x: mtf.concat([x, mtf.stack([x], "s")], "b"), "may differ only"),
    (lambda x: mtf.concat([x, mtf.cast(x, tf.int32)], "b"), "dtype"),
    (lambda x: mtf.split(x, x.shape.dims[1], [3, 4]), "do not add up to 8"),
    (lambda x: mtf.split(x, x.shape.dims[1], 3), "3 parts do not divide 'b'"),
    (lambda x: mtf.split(x, mtf.Dimension("b", 9), 3), "is not a dimension of"),
    (lambda x: mtf.stack([], "s"), "at least one tensor"),
    (lambda x: mtf.stack([x, mtf.slice(x, 0, 2, "a")], "s"), "differs"),
    (lambda x: mtf.stack([x, x], "s", axis=3), "axis 3 is out of range"),
    (lambda x: mtf.stack([x, x], "s", axis=-4), "out of range"),
    (lambda x: mtf.stack([x, x], "a"), "already in"),
    (lambda x: mtf.unstack(x, mtf.Dimension("c", 2)), "is not a dimension of"),
])
def test_bad_arguments_raise_at_construction_and_leave_no_op_behind(build, match):
  x = _graph_x()
  with pytest.raises(ValueError, match=match):
    build(x)
  assert all(op.outputs for op in x.graph.operations)


# ---- names and splittability (core.md §9) ----

def test_default_names_shapes_and_unsplittable_dims():
  x = _graph_x()
  a, b = x.shape.dims
  cases = [
      (mtf.SliceOperation(x, begin=3, size=4, slice_dim_name="b"), "slice", "b", ["a:4;b:4"]),
      (mtf.PadOperation(x, [7, 2], "a"), "pad", "a", ["a:13;b:8"]),
      (mtf.ConcatOperation([x, x], "a"), "concat", "a", ["a:8;b:8"]),
      (mtf.SplitOperation(x, b, [3, 5]), "split", "b", ["a:4;b:3", "a:4;b:5"]),
      (mtf.StackOperation([x, x], "stack", axis=1), "stack", "stack", ["a:4;stack:2;b:8"]),
      (mtf.UnstackOperation(x, a), "unstack", "a", ["b:8"] * 4),
  ]
  for op, name, dim, shapes in cases:
    assert op.name == name
    assert [out.shape for out in op.outputs] == [mtf.convert_to_shape(s) for s in shapes]
    all_dims = {d.name for t in op.inputs + op.outputs for d in t.shape}
    assert op.unsplittable_dims == frozenset([dim])
    assert op.splittable_dims == frozenset(all_dims - {dim})
  split_outputs = mtf.split(x, b, 2)
  assert [t.name for t in split_outputs] == ["split_1:0", "split_1:1"]
