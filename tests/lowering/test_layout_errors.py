"""Bad layouts fail while lowering, with messages naming the tensor, dimensions and mesh dimension."""

import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import cpu_devices


def _lower(build, mesh_shape, layout):
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    build(mesh)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(
        mesh_shape, layout, cpu_devices(mtf.convert_to_shape(mesh_shape).size))
    return mtf.Lowering(graph, {mesh: impl})


def test_indivisible_split_raises_at_lowering_naming_dimension_and_fix():
  with pytest.raises(ValueError, match=r"'hidden' \(size 6\).*'cols' \(size 4\).*hidden:cols"):
    _lower(lambda mesh: mtf.ones(mesh, "batch:4;hidden:6"), "rows:2;cols:4", "hidden:cols")


def test_two_dims_of_one_tensor_on_one_mesh_dim_raises_at_lowering():
  with pytest.raises(ValueError, match="'batch' and 'hidden'.*'cols'"):
    _lower(lambda mesh: mtf.ones(mesh, "batch:4;hidden:8"), "cols:4", "batch:cols;hidden:cols")


def test_tensor_dim_on_two_mesh_dims_raises_at_lowering():
  with pytest.raises(ValueError, match="'batch'.*several mesh dimensions"):
    _lower(lambda mesh: mtf.ones(mesh, "batch:4"), "rows:2;cols:2", "batch:rows;batch:cols")


def test_layouts_naming_absent_dims_are_harmless():
  lowering = _lower(lambda mesh: mtf.ones(mesh, "batch:4"), "rows:2;cols:2", "nothing:rows")
  assert lowering.counters
