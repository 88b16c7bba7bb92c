"""A constructor that rejects its arguments leaves no half-built op (or variable) in the graph."""

import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import lower_and_evaluate


def _graph_state(graph):
  return (list(graph.operations), list(graph.all_variables), list(graph.trainable_variables),
          dict(graph.name_to_variable))


@pytest.mark.parametrize("build, match", [
    # Each of these raises after Operation.__init__ has registered the op.
    (lambda m: mtf.Conv2dOperation(mtf.zeros(m, "b:2;h:4;w:4;c:3"), mtf.zeros(m, "fh:2;fw:2;k:3;o:5"),
                                   None, "SAME"), "Dimensions do not match"),
    (lambda m: mtf.PoolOperation(mtf.zeros(m, "b:2;h:4;w:4;c:3"), [2, 2], [1, 1], "MAX_2D"),
     "ksize must equal strides"),
    (lambda m: mtf.ScalarSummaryOperation("s", mtf.zeros(m, "a:2")), "needs a scalar"),
    (lambda m: mtf.Depend(mtf.zeros(m, "a:2"), ["not an op"]), "dependencies must be"),
    (lambda m: mtf.Variable(m, "v", mtf.Shape("a:2"), tf.float32, None, True), "VariableDType"),
    (lambda m: mtf.get_variable(m, "w", "a:2;b:3", initializer=tf.constant_initializer([1.0, 2.0])),
     "initializer's value has 2"),
])
def test_rejected_constructor_leaves_the_graph_as_it_was(build, match):
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    mtf.zeros(mesh, "a:2")
    before = _graph_state(graph)
    with pytest.raises(ValueError, match=match):
      build(mesh)
    after = _graph_state(graph)
    assert after[0][:len(before[0])] == before[0]
    # Only the rejected op's own inputs (constants) were added.
    assert {type(op).__name__ for op in after[0][len(before[0]):]} <= {"Constant"}
    assert after[1:] == before[1:]


def test_graph_lowers_after_a_rejected_op():
  def build(mesh):
    x = mtf.zeros(mesh, "b:2;h:4;w:4;c:3")
    with pytest.raises(ValueError):
      mtf.Conv2dOperation(x, mtf.zeros(mesh, "fh:2;fw:2;k:3;o:5"), None, "SAME")
    return [x + 1.0]
  (result,) = lower_and_evaluate(build, "all:2", "b:all")
  assert result.shape == (2, 4, 4, 3) and (result == 1.0).all()


def test_base_operation_reading_an_unusable_tensor_is_not_registered():
  graph = mtf.Graph()
  x = mtf.zeros(mtf.Mesh(graph, "m"), "a:2")
  x.usable = False  # as custom_gradient marks its internal tensors
  before = list(graph.operations)
  with pytest.raises(ValueError, match="'reader' reads tensor 'constant:0', which is internal"):
    mtf.Operation([x], name="reader")
  assert graph.operations == before
