"""Layout rules, tensor layouts and processor numbering (pure arithmetic, no devices)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf


@pytest.mark.parametrize("s", ["d_ff:model;heads:model", "d_ff:model,heads:model",
                               "d_ff:model.heads:model", "d_ff:model heads:model"])
def test_layout_string_separators_are_equivalent(s):
  assert mtf.convert_to_layout_rules(s)._pairs == {("d_ff", "model"), ("heads", "model")}


def test_convert_to_layout_rules_accepts_rules_pairs_and_empty_dict():
  rules = mtf.LayoutRules([("a", "b")])
  assert mtf.convert_to_layout_rules(rules) is rules
  assert mtf.convert_to_layout_rules([("a", "b")])._pairs == {("a", "b")}
  assert mtf.convert_to_layout_rules({})._pairs == set()
  assert repr(mtf.convert_to_layout_rules("")) == "LayoutRulesset()"
  assert repr(mtf.LayoutRules([("batch", "b1")])) == "LayoutRules{('batch', 'b1')}"
  with pytest.raises(ValueError):
    mtf.convert_to_layout_rules("d_ff;heads")


def test_tensor_layout_maps_dims_to_mesh_axes():
  mesh_shape = mtf.convert_to_shape("rows:2;cols:4")
  rules = mtf.convert_to_layout_rules("batch:rows;d_ff:cols")
  layout = rules.tensor_layout(mtf.convert_to_shape("batch:8;d_model:4;d_ff:16"), mesh_shape)
  assert layout == mtf.TensorLayout([0, None, 1])
  assert repr(mtf.TensorLayout([0, None])) == "TensorLayout(0, None)"
  assert layout.mesh_axis_to_tensor_axis(2) == (0, 2)
  assert not layout.is_fully_replicated and mtf.TensorLayout([]).is_fully_replicated
  assert rules.mesh_dimension_name_to_tensor_dimension_names("cols") == ["d_ff"]


def test_two_tensor_dims_on_one_mesh_dim_raises_naming_both():
  rules = mtf.convert_to_layout_rules("a:m;b:m")
  with pytest.raises(ValueError, match="'a' and 'b'.*'m'"):
    rules.tensor_layout(mtf.convert_to_shape("a:4;b:4"), mtf.convert_to_shape("m:2"))


def test_one_tensor_dim_on_two_mesh_dims_raises():
  rules = mtf.convert_to_layout_rules("a:m;a:n")
  with pytest.raises(ValueError, match="'a'.*several mesh"):
    rules.tensor_dimension_to_mesh_axis(mtf.Dimension("a", 4), mtf.convert_to_shape("m:2;n:2"))


def test_split_counts_and_sizes_per_split():
  assert mtf.tensor_dim_to_mesh_dim_size("a:m", "m:4", "a") == 4
  assert mtf.tensor_dim_to_mesh_dim_size("a:m", "m:4", mtf.Dimension("b", 3)) == 1
  assert mtf.tensor_dim_to_size_per_split("a:m", "m:4", mtf.Dimension("a", 8)) == 2
  with pytest.raises(ValueError, match="does not divide"):
    mtf.tensor_dim_to_size_per_split("a:m", "m:4", mtf.Dimension("a", 6))


def test_processor_numbering_is_row_major():
  mesh = mtf.convert_to_shape("a:2;b:3")
  assert mtf.pnum_to_processor_coordinates(mesh, 4) == [1, 1]
  assert mtf.pnum_to_processor_coordinates([2, 3], 5) == [1, 2]
  assert mtf.processor_coordinates_to_pnum([2, 3], [1, 0]) == 3
  assert mtf.processor_groups([2, 3], [1]) == [[0, 1, 2], [3, 4, 5]]
  assert mtf.processor_groups([2, 3], [0]) == [[0, 3], [1, 4], [2, 5]]
  assert mtf.pnum_to_group([2, 3], [0], 4) == 1
  with pytest.raises(ValueError):
    mtf.pnum_to_processor_coordinates("a:2", 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_processor_groups_partition_the_mesh(sizes, data):
  group_dims = data.draw(st.lists(st.integers(0, len(sizes) - 1), unique=True))
  groups = mtf.processor_groups(sizes, group_dims)
  assert sorted(itertools.chain(*groups)) == list(range(mtf.list_product(sizes)))
  for group in groups:
    coords = [mtf.pnum_to_processor_coordinates(sizes, p) for p in group]
    for axis in range(len(sizes)):
      if axis not in group_dims:
        assert len({c[axis] for c in coords}) == 1
  for pnum in range(mtf.list_product(sizes)):
    assert mtf.processor_coordinates_to_pnum(
        sizes, mtf.pnum_to_processor_coordinates(sizes, pnum)) == pnum


def test_mesh_axis_to_tensor_axis_ignores_mesh_axes_beyond_mesh_ndims():
  layout = mtf.TensorLayout([0, 2, 1])
  assert layout.mesh_axis_to_tensor_axis(0) == ()
  assert layout.mesh_axis_to_tensor_axis(1) == (0,)
  assert layout.mesh_axis_to_tensor_axis(2) == (0, 2)
  assert not mtf.TensorLayout([None, 0]).is_fully_replicated
  assert mtf.TensorLayout([None, None, None]).is_fully_replicated
