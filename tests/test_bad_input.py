"""Mistakes a new user makes get a clear error at graph-construction time, naming the fix."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import cpu_devices


@pytest.fixture(name="mesh")
def fixture_mesh():
  with tf.Graph().as_default():
    yield mtf.Mesh(mtf.Graph(), "mesh")


# ---- names and sizes ----

@pytest.mark.parametrize("build, match", [
    (lambda mesh: mtf.get_variable(mesh, "w", [12, 37]), r"Bare size 12 .*mtf.Dimension\('name', 12\)"),
    (lambda mesh: mtf.Shape(["batch", "length"]), r"'batch' has no size.*mtf.Dimension\('batch', size\)"),
    (lambda mesh: mtf.one_hot(mtf.zeros(mesh, "b:2", dtype=tf.int32), 10), r"Bare size 10"),
    (lambda mesh: mtf.layers.dense(mtf.zeros(mesh, "b:2;c:3"), 64), r"Bare size 64"),
    (lambda mesh: mtf.placement_mesh_impl.PlacementMeshImpl([4], "", cpu_devices(4)), r"Bare size 4"),
    (lambda mesh: mtf.convert_to_dimension(("batch", "8")), "size of type str"),
])
def test_bare_ints_and_names_where_dimensions_are_expected(mesh, build, match):
  with pytest.raises(mtf.DimensionSpecError, match=match) as info:
    build(mesh)
  # Both: upstream raised TypeError for an int and ValueError for a name.
  assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_negative_dimension_size(mesh):
  with pytest.raises(ValueError, match="'a' has negative size -2; sizes must be >= 0"):
    mtf.zeros(mesh, [mtf.Dimension("a", -2)])


def test_shape_accepts_the_string_form():
  shape = mtf.Shape("batch:8;d:4")
  assert shape == mtf.Shape([mtf.Dimension("batch", 8), mtf.Dimension("d", 4)])
  assert repr(shape) == "Shape[batch=8, d=4]" and mtf.Shape("") == mtf.Shape([])
  with pytest.raises(ValueError, match="'batch:eight'.*not an integer"):
    mtf.Shape("batch:eight")


# ---- graphs, meshes, lowering ----

def test_mesh_on_a_tf_graph():
  with pytest.raises(TypeError,
                     match=r"needs an mtf.Graph, got .*Graph; write mtf.Mesh\(mtf.Graph\(\), 'm'\)"):
    mtf.Mesh(tf.Graph(), "m")


@pytest.mark.parametrize("mesh_to_impl, match", [
    ("impl", r"mesh_to_impl, a dict \{mtf.Mesh: MeshImpl\}, got a PlacementMeshImpl"),
    ("reversed", "must map mtf.Mesh objects to MeshImpls, got <.*PlacementMeshImpl object"),
    ("not an impl", r"must map mtf.Mesh objects to MeshImpls, got Mesh\('mesh'\): 'not an impl'"),
])
def test_lowering_without_the_mesh_to_impl_dict(mesh, mesh_to_impl, match):
  mtf.zeros(mesh, "a:2")
  impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "", cpu_devices(2))
  arg = {"impl": impl, "reversed": {impl: mesh}}.get(mesh_to_impl, {mesh: mesh_to_impl})
  with pytest.raises(TypeError, match=match + r".*mtf.Lowering\(graph, \{mesh: mesh_impl\}\)"):
    mtf.Lowering(mesh.graph, arg)


# ---- ops ----

def test_tf_style_nested_paddings(mesh):
  with pytest.raises(ValueError, match=r"paddings must be \[before, after\] for dimension 'c', got the "
                                       r"TF-style nested \[\[0, 0\], \[1, 1\]\].*"
                                       r"mtf.pad\(x, \[1, 2\], 'c'\)"):
    mtf.pad(mtf.zeros(mesh, "b:2;c:3"), [[0, 0], [1, 1]], "c")


# ---- variables ----

def test_get_variable_again_with_another_shape(mesh):
  first = mtf.get_variable(mesh, "w", "a:2")
  assert mtf.get_variable(mesh, "w", "a:2") is first
  with pytest.raises(ValueError, match="'w': a variable of that name already exists with Shape\\[a=2\\], "
                                       "but Shape\\[a=3\\] was asked for"):
    mtf.get_variable(mesh, "w", "a:3")


@pytest.mark.parametrize("value", [[1.0, 2.0, 3.0], np.ones(9)])
def test_initializer_with_the_wrong_number_of_elements(mesh, value):
  with pytest.raises(ValueError, match=rf"Variable 'w' of Shape\[a=2, b=3\] has 6 elements, but its "
                                       rf"initializer's value has {np.size(value)}"):
    mtf.get_variable(mesh, "w", "a:2;b:3", initializer=tf.constant_initializer(value))


@pytest.mark.parametrize("value", [2.0, np.arange(6.0)])
def test_initializers_with_one_or_all_elements_are_accepted(mesh, value):
  w = mtf.get_variable(mesh, "w", "a:2;b:3", initializer=tf.constant_initializer(value))
  assert w.shape == mtf.Shape("a:2;b:3")


# ---- gradients ----

def test_grad_ys_of_another_shape_than_ys(mesh):
  v = mtf.get_variable(mesh, "v", "b:2;c:3")
  y = mtf.reduce_sum(v * v, reduced_dim=mtf.Dimension("c", 3))
  with pytest.raises(ValueError, match=r"grad_y 'constant.*:0' \(Shape\[b=2, c=3\], float32\) does not "
                                       r"match y 'reduce:0' \(Shape\[b=2\], float32\)"):
    mtf.gradients([y], [v], grad_ys=[mtf.ones(mesh, "b:2;c:3")])
  with pytest.raises(ValueError, match="got 2 grad_ys for 1 ys"):
    mtf.gradients([y], [v], grad_ys=[mtf.ones(mesh, "b:2")] * 2)
  (grad,) = mtf.gradients([y], [v], grad_ys=[mtf.ones(mesh, "b:2")])
  assert grad.shape == v.shape
