"""mtf.verify_no_new_dims: an output may only use dimensions (name and size) that some input has."""

import pytest

import mesh_tensorflow as mtf


def test_output_made_of_input_dims_in_any_order_passes():
  a, b, c = mtf.Dimension("a", 2), mtf.Dimension("b", 3), mtf.Dimension("c", 4)
  assert mtf.verify_no_new_dims([mtf.Shape([a, b]), mtf.Shape([c])], mtf.Shape([c, a])) is None
  assert mtf.verify_no_new_dims([mtf.Shape([a, b])], mtf.Shape([])) is None
  assert mtf.verify_no_new_dims(["a:2;b:3", "c:4"], "b:3;c:4") is None  # shape strings are accepted


def test_a_dimension_no_input_has_raises_and_is_named():
  message = r"No new dimensions allowed in output.*\[Dimension\(name='d', size=5\)\]"
  with pytest.raises(ValueError, match=message):
    mtf.verify_no_new_dims([mtf.Shape([mtf.Dimension("a", 2)])], "a:2;d:5")


def test_same_name_with_another_size_is_a_new_dimension():
  with pytest.raises(ValueError, match=r"Dimension\(name='a', size=3\).*name and size"):
    mtf.verify_no_new_dims(["a:2;b:3"], "a:3")


def test_reachable_from_the_ops_module_as_upstream():
  from mesh_tensorflow import ops
  assert ops.verify_no_new_dims is mtf.verify_no_new_dims
