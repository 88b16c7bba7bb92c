"""Named dimensions and shapes: parsing, algebra and the exact string forms of the spec."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf


@pytest.mark.parametrize("s", ["x:4;y:8", "x:4.y:8", "x:4 y:8", "x:4,y:8"])
def test_shape_string_separators_are_equivalent(s):
  assert mtf.convert_to_shape(s) == mtf.Shape([mtf.Dimension("x", 4), mtf.Dimension("y", 8)])


def test_convert_to_shape_accepts_shapes_pairs_empty_and_none():
  shape = mtf.Shape([("a", 2)])
  assert mtf.convert_to_shape(shape) is shape
  assert mtf.convert_to_shape([("a", 2), mtf.Dimension("b", 3)]).to_integer_list == [2, 3]
  assert mtf.convert_to_shape([]) == mtf.Shape([])
  assert mtf.convert_to_shape("") == mtf.Shape([])
  assert mtf.convert_to_shape(None) is None


@pytest.mark.parametrize("bad", ["x;4", "x:4:5", "x:four"])
def test_malformed_shape_string_raises_value_error_naming_token(bad):
  with pytest.raises(ValueError, match="Cannot parse"):
    mtf.convert_to_shape(bad)


def test_convert_to_dimension_rules():
  assert mtf.convert_to_dimension(None) is None
  assert mtf.convert_to_dimension(("a", 3)) == mtf.Dimension("a", 3)
  with pytest.raises(TypeError):
    mtf.convert_to_dimension(5)
  with pytest.raises(ValueError):
    mtf.convert_to_dimension(("a", "3"))
  with pytest.raises(ValueError):
    mtf.convert_to_dimension(mtf.Dimension(3, "a"))


def test_repeated_dimension_raises_and_names_it():
  with pytest.raises(ValueError, match="'batch'"):
    mtf.Shape([("batch", 2), ("batch", 2)])


def test_one_name_with_two_sizes_is_two_dimensions_as_in_0_1_21():
  """A kernel mapping d_model=6 to d_model=2 (0.1.21's dense keeps both names)."""
  shape = mtf.Shape([("d_model", 6), ("d_model", 2)])
  assert shape.dims == [mtf.Dimension("d_model", 6), mtf.Dimension("d_model", 2)]
  assert shape - mtf.Dimension("d_model", 6) == mtf.Shape([("d_model", 2)])


def test_string_forms_match_spec():
  shape = mtf.Shape([("batch", 8), ("d_model", 512)])
  assert repr(shape) == str(shape) == shape.to_string == "Shape[batch=8, d_model=512]"
  assert str(mtf.Shape([])) == "Shape[]"
  assert str(mtf.Dimension("batch", 8)) == "Dimension(name='batch', size=8)"


def test_shape_algebra():
  a, b, c = mtf.Dimension("a", 2), mtf.Dimension("b", 3), mtf.Dimension("c", 4)
  s = mtf.Shape([a, b])
  assert s + c == mtf.Shape([a, b, c])
  assert s + [c] == mtf.Shape([a, b, c])
  assert s + mtf.Shape([c]) == mtf.Shape([a, b, c])
  assert (s + c) - [a, mtf.Dimension("zz", 1)] == mtf.Shape([b, c])
  assert s - b == mtf.Shape([a])
  assert s - None == s
  with pytest.raises(ValueError):
    s - c  # noqa: B018
  assert s.size == 6 and mtf.Shape([]).size == 1
  assert s[1] == b and s[:1] == [a] and len(s) == 2 and list(s) == [a, b]
  assert s.dimension_names == ["a", "b"]
  assert s.rename_dimension("a", "z").dimension_names == ["z", "b"]
  assert s.resize_dimension("b", 7).to_integer_list == [2, 7]
  assert s.get_dim_by_name("b") == b
  for method, args in [("rename_dimension", ("q", "r")), ("resize_dimension", ("q", 2)),
                       ("get_dim_by_name", ("q",))]:
    with pytest.raises(ValueError, match="'q'"):
      getattr(s, method)(*args)


def test_cumprod_and_cumprod_to_tensor_axis():
  s = mtf.convert_to_shape("a:2;b:1;c:4")
  assert s.cumprod == [1, 2, 2]
  assert s.cumprod_to_tensor_axis(2) == 2
  assert s.cumprod_to_tensor_axis(1) == 0
  assert s.cumprod_to_tensor_axis(3) is None


def test_helpers_combined_anonymous_list_product():
  dims = [mtf.Dimension("a", 2), mtf.Dimension("b", 3)]
  assert mtf.combined_dimension(dims) == mtf.Dimension("a", 6)
  assert mtf.combined_dimension(dims, "ab") == mtf.Dimension("ab", 6)
  assert mtf.anonymous_shape(mtf.Shape(dims)).dimension_names == ["_anonymous_0", "_anonymous_1"]
  assert mtf.list_product([2, 3, 4]) == 24 and mtf.list_product([]) == 1
  assert mtf.is_subsequence([1, 3], [1, 2, 3]) and not mtf.is_subsequence([3, 1], [1, 2, 3])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.text("abcdefgh_", min_size=1, max_size=5), st.integers(1, 9)),
                max_size=5, unique_by=lambda p: p[0]))
def test_shape_string_round_trip(pairs):
  shape = mtf.Shape(pairs)
  as_string = ";".join(f"{d.name}:{d.size}" for d in shape)
  assert mtf.convert_to_shape(as_string) == shape
  assert shape.size == mtf.list_product(shape.to_integer_list)
