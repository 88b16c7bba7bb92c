"""graph_interface.GraphInterface over tf and mtf graphs: names, sizes, cost graphs, memory contents."""

import tensorflow.compat.v1 as tf
from tensorflow.core.framework import cost_graph_pb2, tensor_shape_pb2, types_pb2

import mesh_tensorflow as mtf
from mesh_tensorflow.auto_mtf import graph_interface


def _mtf_graph():
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  x = mtf.constant(mesh, 0, mtf.convert_to_shape("a:3;b:4"), dtype=tf.int32)
  y = mtf.constant(mesh, 0, mtf.convert_to_shape("b:4;c:5"), dtype=tf.int32)
  z = mtf.einsum([x, y], mtf.convert_to_shape("a:3;c:5"))
  return graph, z


def _shape(*sizes):
  return tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=s) for s in sizes])


class GraphInterfaceTest(tf.test.TestCase):

  def test_rejects_what_is_not_a_graph(self):
    with self.assertRaises(TypeError):
      graph_interface.GraphInterface("hello")

  def test_mtf_graph_names_sizes_and_dimensions(self):
    graph, z = _mtf_graph()
    gi = graph_interface.GraphInterface(graph)
    self.assertEqual(gi.get_all_operation_names(), ["constant", "constant_1", "einsum"])
    self.assertEqual(list(gi.get_operation_input_names("einsum")), ["constant:0", "constant_1:0"])
    self.assertEqual(gi.get_tensor_size("einsum:0"), 3 * 5 * 4)
    self.assertEqual(gi.get_tensor_size("constant:0", {"b": "m"}, {"m": 2}), 3 * 2 * 4)
    self.assertEqual(gi.get_operation_mtf_dimension_names("einsum"), {"a", "b", "c"})
    self.assertIsNone(gi.get_tensor_device("einsum:0"))
    self.assertTrue(gi.is_tensor_on_canonical_device("einsum:0"))
    self.assertFalse(gi.is_tensor_final(z.name))
    gi.set_tensor_final(z.name)
    self.assertTrue(gi.is_tensor_final(z.name))

  def test_mtf_cost_graph_lists_each_op_with_inputs_and_output_sizes(self):
    graph, z = _mtf_graph()
    gi = graph_interface.GraphInterface(graph)
    gi.set_tensor_final(z.name)
    expected = cost_graph_pb2.CostGraphDef()
    for i, (name, shape) in enumerate([("constant", (3, 4)), ("constant_1", (4, 5)), ("einsum", (3, 5))]):
      node = expected.node.add(name=name, device="", id=i)
      if name == "einsum":
        node.input_info.add(preceding_node=0, preceding_port=0)
        node.input_info.add(preceding_node=1, preceding_port=0)
        node.is_final = True
      node.output_info.add(size=4 * shape[0] * shape[1], alias_input_port=-1, dtype=types_pb2.DT_INT32,
                           shape=_shape(*shape))
    self.assertProtoEquals(expected, gi.compute_cost_graph())

  def test_tf_cost_graph_drops_sizes_of_tensors_on_other_devices(self):
    with tf.Graph().as_default() as g:
      with tf.device("cpu:0"):
        a = tf.constant([1, 2], name="a")
      with tf.device("cpu:1"):
        tf.add(a, a, name="b")
    gi = graph_interface.GraphInterface(g, canonical_device="cpu:0")
    cost_graph = gi.compute_cost_graph(devices=[a.device])
    self.assertEqual(cost_graph.node[0].output_info[0].size, 8)
    self.assertEqual(cost_graph.node[1].output_info[0].size, 0)
    self.assertFalse(cost_graph.node[1].output_info[0].HasField("shape"))
    self.assertEqual(list(cost_graph.node[1].input_info), 2 * [cost_graph_pb2.CostGraphDef.Node.InputInfo(
        preceding_node=0, preceding_port=0)])

  def test_memory_contents_free_tensors_after_their_last_use_but_keep_final_ones(self):
    graph, z = _mtf_graph()
    gi = graph_interface.GraphInterface(graph)
    gi.set_tensor_final(z.name)
    self.assertEqual(gi.compute_memory_contents_under_schedule([0, 1, 2]), [
        frozenset({"constant:0"}), frozenset({"constant:0", "constant_1:0"}),
        frozenset({"constant:0", "constant_1:0", "einsum:0"})])
    self.assertEqual(gi.compute_memory_contents_under_schedule([1, 0, 2])[0], frozenset({"constant_1:0"}))
