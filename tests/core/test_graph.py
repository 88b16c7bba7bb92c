"""Graph naming, operations, meshes and the errors raised while building a graph."""

import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf


def test_unique_name_follows_tensorflow_rules():
  g = mtf.Graph()
  assert [g.unique_name(n) for n in ["a", "a", "a_1"]] == ["a", "a_1", "a_1_1"]
  g = mtf.Graph()
  assert [g.unique_name(n) for n in ["a", "a_1", "a"]] == ["a", "a_1", "a_2"]
  g = mtf.Graph()
  assert [g.unique_name(n) for n in ["a", "A"]] == ["a", "A_1"]
  assert g.unique_name("b", mark_as_used=False) == "b"
  assert g.unique_name("b") == "b"


def test_unique_name_is_prefixed_by_variable_scope():
  with tf.Graph().as_default():
    g = mtf.Graph()
    with tf.variable_scope("outer"):
      assert g.unique_name("x") == "outer/x"


def test_operation_registers_itself_and_names_outputs():
  g = mtf.Graph()
  mesh = mtf.Mesh(g, "m")
  x = mtf.zeros(mesh, "a:2")
  y = mtf.zeros(mesh, "a:2")
  assert [op.name for op in g.operations] == ["constant", "constant_1"]
  assert x.name == "constant:0" and y.name == "constant_1:0"
  assert x.operation.to_string == (
      "Constant[Inputs=() Outputs=(Tensor[constant:0, Shape[a=2], <dtype: 'float32'>])]")


def test_operation_without_inputs_or_mesh_raises():
  with pytest.raises(ValueError, match="mesh"):
    mtf.Operation([], name="lonely")


def test_combining_tensors_of_different_meshes_raises_naming_the_tensor():
  g = mtf.Graph()
  x = mtf.zeros(mtf.Mesh(g, "m1"), "a:2")
  y = mtf.zeros(mtf.Mesh(g, "m2"), "a:2")
  with pytest.raises(ValueError, match="different meshes.*constant_1:0"):
    mtf.Operation([x, y], name="mix")


def test_splittability_helpers():
  g = mtf.Graph()
  mesh = mtf.Mesh(g, "m")
  x = mtf.zeros(mesh, "a:2;b:3")
  op = mtf.Operation([x], name="op")
  assert op._initialize_all_dimensions_as_splittable() == (frozenset({"a", "b"}), frozenset())
  assert op.splittable_dims == frozenset({"a", "b"}) and op.unsplittable_dims == frozenset()
  assert op._initialize_splittable_and_unsplittable_dims("splittable", ["a"]) == (
      frozenset({"b"}), frozenset({"a"}))
  assert op._initialize_splittable_and_unsplittable_dims("unsplittable", ["a"]) == (
      frozenset({"a"}), frozenset({"b"}))
  with pytest.raises(ValueError):
    op._initialize_splittable_and_unsplittable_dims("invalid")


def test_capture_and_clone_operations():
  g = mtf.Graph()
  mesh = mtf.Mesh(g, "m")
  x = mtf.zeros(mesh, "a:2")
  result, ops = g.capture_operations(lambda: mtf.ones(mesh, "a:2"))
  assert ops == [result.operation]
  new_ops, mapping = g.clone_operations(ops, {x: x})
  assert new_ops[0].name == ops[0].name and mapping[result] is new_ops[0].outputs[0]
  assert g.operations[-1] is new_ops[0]


def test_lowering_a_mesh_without_implementation_raises():
  g = mtf.Graph()
  mesh = mtf.Mesh(g, "orphan")
  mtf.zeros(mesh, "a:2")
  with pytest.raises(ValueError, match="orphan.*no MeshImpl"):
    mtf.Lowering(g, {})


def test_tensor_constructor_validates_shape_and_dtype():
  g = mtf.Graph()
  op = mtf.zeros(mtf.Mesh(g, "m"), "a:2").operation
  with pytest.raises(ValueError):
    mtf.Tensor(op, [("a", 2)], tf.float32)
  with pytest.raises(ValueError):
    mtf.Tensor(op, mtf.Shape([]), "float32")
