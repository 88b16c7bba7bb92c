"""The layout-change planner (pure: no TensorFlow).

Every plan is checked by simulating its steps with NumPy on per-processor slices: the final slices
must be exactly the slices the new layout prescribes.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from mesh_tensorflow._lowering import plan
from tests.harness import MAX_EXAMPLES, MESH_SHAPES

NAMES = ("a", "b", "c", "d", "e")
MULTI_PROCESSOR_MESHES = tuple(m for m in MESH_SHAPES if mtf.convert_to_shape(m).size > 1) + ("x:3;y:2",)


def _members(mesh_sizes, pnum, mesh_axis):
  """pnums of the processors that differ from `pnum` only along mesh_axis, by coordinate."""
  coord = mtf.pnum_to_processor_coordinates(mesh_sizes, pnum)
  ret = []
  for k in range(mesh_sizes[mesh_axis]):
    c = list(coord)
    c[mesh_axis] = k
    ret.append(mtf.processor_coordinates_to_pnum(mesh_sizes, c))
  return ret


def _expected_slices(array, shape, mesh_shape, rules):
  """Per pnum, the slice of `array` (laid out as `shape`) that processor holds."""
  layout = rules.tensor_layout(shape, mesh_shape)
  mesh_sizes = mesh_shape.to_integer_list
  ret = []
  for pnum in range(mesh_shape.size):
    coord = mtf.pnum_to_processor_coordinates(mesh_sizes, pnum)
    index = []
    for d, m in zip(shape, layout):
      n = 1 if m is None else mesh_sizes[m]
      k = 0 if m is None else coord[m]
      index.append(slice(k * d.size // n, (k + 1) * d.size // n))
    ret.append(array.reshape(shape.to_integer_list)[tuple(index)])
  return ret


def _simulate(steps, slices, mesh_shape):
  """Runs the plan on NumPy slices, checking each step's declared slice shapes."""
  sizes = mesh_shape.to_integer_list
  for step in steps:
    assert all(list(s.shape) == list(step.slice_shape_before) for s in slices), step
    m = step.mesh_axis
    new = []
    for p in range(len(slices)):
      if isinstance(step, plan.LocalReshape):
        new.append(slices[p].reshape(step.slice_shape_after))
        continue
      n = sizes[m]
      mine = mtf.pnum_to_processor_coordinates(sizes, p)[m]
      group = [slices[q] for q in _members(sizes, p, m)]
      if isinstance(step, plan.AllSplit):
        new.append(np.split(slices[p], n, axis=step.tensor_axis)[mine])
      elif isinstance(step, plan.AllToAll):
        new.append(np.concatenate([np.split(s, n, axis=step.split_axis)[mine] for s in group],
                                  axis=step.concat_axis))
      else:
        new.append(np.concatenate(group, axis=step.tensor_axis))
    slices = new
    assert all(list(s.shape) == list(step.slice_shape_after) for s in slices), step
  return slices


def _check_plan(old, new, mesh, layout):
  """Plans old -> new, simulates it, and compares with the new layout's slices; returns the steps."""
  old, new, mesh = mtf.convert_to_shape(old), mtf.convert_to_shape(new), mtf.convert_to_shape(mesh)
  rules = mtf.convert_to_layout_rules(layout)
  steps = plan.plan_reshape(old, new, mesh, rules)
  assert isinstance(steps[-1], plan.LocalReshape)
  assert not any(isinstance(s, plan.LocalReshape) for s in steps[:-1])
  array = np.arange(old.size)
  got = _simulate(steps, _expected_slices(array, old, mesh, rules), mesh)
  for g, e in zip(got, _expected_slices(array, new, mesh, rules)):
    np.testing.assert_array_equal(g, e)
  return steps


def _kinds(steps):
  return [type(s).__name__ for s in steps]


@st.composite
def reshape_cases(draw, rename_only=False):
  """(old shape, new shape, mesh, layout): factorizations of one size, named from NAMES."""
  atoms = draw(st.lists(st.sampled_from([1, 2, 2, 3, 4]), min_size=2, max_size=5))

  def shape_of(atom_list):
    cuts = sorted(draw(st.sets(st.integers(1, len(atom_list) - 1), max_size=3))) if len(atom_list) > 1 else []
    bounds = [0] + cuts + [len(atom_list)]
    sizes = [int(np.prod(atom_list[i:j])) for i, j in zip(bounds, bounds[1:])]
    names = draw(st.permutations(NAMES))[:len(sizes)]
    return mtf.Shape([mtf.Dimension(n, s) for n, s in zip(names, sizes)])

  old = shape_of(atoms)
  if rename_only:
    names = draw(st.permutations(NAMES))[:old.ndims]
    new = mtf.Shape([mtf.Dimension(n, d.size) for n, d in zip(names, old)])
  else:
    new = shape_of(draw(st.permutations(atoms)) if draw(st.booleans()) else atoms)
  mesh = mtf.convert_to_shape(draw(st.sampled_from(MULTI_PROCESSOR_MESHES)))
  sizes = {}
  for d in old.dims + new.dims:
    sizes.setdefault(d.name, []).append(d.size)
  rules, used = [], set()
  for m in mesh:
    candidates = [n for n in sorted(sizes) if n not in used and all(s % m.size == 0 for s in sizes[n])]
    choice = draw(st.sampled_from([None] + candidates))
    if choice is not None:
      used.add(choice)
      rules.append((choice, m.name))
  return old, new, mesh, rules


@settings(max_examples=MAX_EXAMPLES * 25, deadline=None)
@given(reshape_cases())
def test_every_plan_reproduces_the_new_layout_slices(case):
  try:
    _check_plan(*case)
  except NotImplementedError as e:
    assert "Reshape in two steps" in str(e)


@settings(max_examples=MAX_EXAMPLES * 25, deadline=None)
@given(reshape_cases(rename_only=True))
def test_any_rename_is_planned_and_correct(case):
  _check_plan(*case)


def test_same_layout_needs_only_a_local_reshape():
  steps = _check_plan("a:4;b:6", "c:24", "x:2;y:2", "a:x;c:x")
  assert _kinds(steps) == ["LocalReshape"]
  assert steps[0].slice_shape_before == (2, 6) and steps[0].slice_shape_after == (12,)


def test_replicated_to_split_is_an_allsplit_moving_no_bytes():
  steps = _check_plan("a:4;b:6", "a2:4;b:6", "x:2", "a2:x")
  assert _kinds(steps) == ["AllSplit", "LocalReshape"]
  assert (steps[0].mesh_axis, steps[0].tensor_axis) == (0, 0)
  assert plan.total_bytes_moved(steps, 4) == 0


def test_split_to_replicated_is_an_allconcat_and_counts_bytes():
  steps = _check_plan("a:4;b:6", "a:4;b2:6", "x:2;y:4", "b:x")
  assert _kinds(steps) == ["AllConcat", "LocalReshape"]
  assert (steps[0].mesh_axis, steps[0].tensor_axis) == (0, 1)
  # 8 processors each receive the other half (4*3 floats of 4 bytes).
  assert steps[0].bytes_moved(4) == 8 * 12 * 1 * 4
  assert plan.total_bytes_moved(steps, 4) == 8 * 12 * 4


def test_moving_a_split_between_dims_is_an_alltoall():
  steps = _check_plan("a:4;b:6", "b2:4;a:6", "x:2", "a:x")
  assert _kinds(steps) == ["AllToAll", "LocalReshape"]
  step = steps[0]
  assert (step.mesh_axis, step.split_axis, step.concat_axis) == (0, 1, 0)
  # 2 processors each send/receive half of their 12-element slice.
  assert step.bytes_moved(2) == 2 * 6 * 2
  assert str(step) == "alltoall(mesh_axis=0, split_axis=1, concat_axis=0)"


def test_swapping_two_mesh_axes_between_dims_is_correct():
  steps = _check_plan("a:4;b:8", "b:4;a:8", "x:2;y:4", "a:x;b:y")
  assert "AllToAll" in _kinds(steps)


def test_concat_and_split_on_the_same_dim_are_ordered_correctly():
  # a is split over x; after the reshape the flat dim is split over y instead. Splitting a over y
  # before gathering x would give non-contiguous rows; the plan must gather first.
  steps = _check_plan("a:4;b:6", "c:24", "x:2;y:2", "a:x;c:y")
  assert _kinds(steps)[-1] == "LocalReshape"


def test_nested_splits_of_one_old_dim():
  steps = _check_plan("a:8;b:3", "c:2;d:4;b:3", "x:2;y:4", "c:x;d:y")
  assert _kinds(steps) == ["AllSplit", "AllSplit", "LocalReshape"]
  assert [s.tensor_axis for s in steps[:2]] == [0, 0]


def test_mesh_axes_of_size_one_need_no_steps():
  steps = _check_plan("a:4;b:6", "b:4;a:6", "x:1;y:2;z:4", "a:x")
  assert _kinds(steps) == ["LocalReshape"]


def test_split_inside_an_old_dim_raises_not_implemented():
  with pytest.raises(NotImplementedError, match="mesh dimension 'x'.*'b2'.*Reshape in two steps"):
    plan.plan_reshape("a:4;b:6", "a:4;b1:2;b2:3", "x:3", "b2:x")


def test_nested_splits_that_do_not_divide_the_old_dim_raise_not_implemented():
  with pytest.raises(NotImplementedError, match="does not fall on a whole dimension"):
    plan.plan_reshape("a:4;b:6", "c:2;d:12", "x:2;y:3", "c:x;d:y")


def test_reshape_to_a_different_size_raises():
  with pytest.raises(ValueError, match="total sizes differ"):
    plan.plan_reshape("a:4;b:6", "c:25", "x:2", "")


def test_uneven_split_raises():
  with pytest.raises(ValueError, match="'c'.*mesh dimension 'x' \\(size 4\\)"):
    plan.plan_reshape("a:4;b:6", "c:6;d:4", "x:4", "c:x")


def test_steps_render_short_descriptions():
  steps = plan.plan_reshape("a:4;b:6", "c:4;b:6", "x:2;y:2", "a:x;b:y")
  assert [str(s) for s in steps] == [
      "allconcat(mesh_axis=0, tensor_axis=0)", "local_reshape([4, 3] -> [4, 3])"]
