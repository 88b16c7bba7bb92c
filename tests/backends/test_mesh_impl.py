"""MeshImpl layout arithmetic and the placement backend's construction errors."""

import pytest

import mesh_tensorflow as mtf


def test_mesh_impl_properties_and_layout_queries():
  impl = mtf.MeshImpl(shape="rows:2;cols:4", layout_rules="batch:rows;d_ff:cols")
  assert impl.ndims == 2 and impl.size == 8 and impl.supports_control_dependencies
  shape = mtf.convert_to_shape("batch:8;d_model:3;d_ff:16")
  assert impl.tensor_dimension_to_mesh_axis(mtf.Dimension("d_ff", 16)) == 1
  assert impl.tensor_layout(shape) == mtf.TensorLayout([0, None, 1])
  assert impl.slice_shape(shape) == [4, 3, 4]
  assert impl.slice_begin(shape, 6) == [4, 0, 8]
  assert impl.slice_size(shape) == 48 and impl.laid_out_size(shape) == 384
  assert impl.mesh_axis_to_cumprod(shape) == [1, 24]


def test_uneven_split_raises_naming_dimension_and_mesh_dimension():
  impl = mtf.MeshImpl(shape="rows:2;cols:4", layout_rules="d_ff:cols")
  with pytest.raises(ValueError, match="'d_ff'.*'cols'.*multiple of 4"):
    impl.slice_shape(mtf.convert_to_shape("d_ff:6"))


def test_device_list_length_must_match_mesh_size():
  with pytest.raises(ValueError, match="8 processors but 3 devices"):
    mtf.placement_mesh_impl.PlacementMeshImpl("rows:2;cols:4", "", ["cpu:0"] * 3)


@pytest.mark.parametrize("shape,layout,devices", [
    ([], {}, [""]), ("all:2", "a:all", ["", ""]), ("rows:2,cols:2", "a:rows,b:cols", [""] * 4),
    ("processors:2", "two:processors", ["", ""]),
])
def test_placement_mesh_impl_accepts_spec_argument_forms(shape, layout, devices):
  impl = mtf.placement_mesh_impl.PlacementMeshImpl(shape=shape, layout=layout, devices=devices)
  assert impl.size == len(devices) and impl.devices == devices
