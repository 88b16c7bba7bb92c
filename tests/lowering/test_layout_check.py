"""check_layout: one pass over the graph rejects a layout some op can't lower, before any TF op exists."""

import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._core.errors import LayoutError, UnsplittableDimensionError
from mesh_tensorflow._lowering.layout_check import check_layout
from tests.harness import cpu_devices

IMAGE, FILTER, DY = "b:2;h:4;w:4;c:3", "fh:3;fw:3;c:3;o:5", "b:2;h:4;w:4;o:5"


def _graph(build):
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  build(mesh)
  return graph, mesh


def _image_and_filter(mesh):
  return mtf.zeros(mesh, IMAGE), mtf.zeros(mesh, FILTER)


def _pool(mesh):
  return mtf.PoolOperation(mtf.zeros(mesh, IMAGE), [2, 2], [2, 2], "MAX_2D").outputs[0]


# (builder, the op class and dim the check must blame, a phrase of that op's reason)
REFUSED_SPLITS = {
    "slice": (lambda m: mtf.slice(mtf.zeros(m, "a:4;b:8"), 0, 4, "b"), "SliceOperation", "b",
              "slice works along 'b'"),
    "concat": (lambda m: mtf.concat([mtf.zeros(m, "a:4;b:8")] * 2, "b"), "ConcatOperation", "b",
               "concat works along 'b'"),
    "stack": (lambda m: mtf.stack([mtf.zeros(m, "a:4")] * 2, "s"), "StackOperation", "s",
              "stack works along 's'"),
    "conv2d": (lambda m: mtf.Conv2dOperation(*_image_and_filter(m), None, "SAME"), "Conv2dOperation", "h",
               "halo_exchange"),
    "conv2d_backprop_input": (
        lambda m: mtf.conv2d_backprop_input(mtf.Shape(IMAGE), mtf.zeros(m, FILTER), mtf.zeros(m, DY),
                                            None, "SAME"),
        "Conv2or3dBackpropInputOperation", "h", "a convolution needs 'h'"),
    "conv2d_backprop_filter": (
        lambda m: mtf.conv2d_backprop_filter(mtf.zeros(m, IMAGE), mtf.Shape(FILTER), mtf.zeros(m, DY),
                                             None, "SAME"),
        "Conv2or3dBackpropFilterOperation", "fh", "a convolution needs 'fh'"),
    "pool": (_pool, "PoolOperation", "w", "pooling needs the pooled dim 'w'"),
    "pool_backprop": (
        lambda m: mtf.pool_backprop(mtf.zeros(m, IMAGE), mtf.zeros(m, "b:2;h:2;w:2;c:3"),
                                    mtf.zeros(m, "b:2;h:2;w:2;c:3"), [2, 2], [2, 2], "MAX_2D"),
        "PoolBackPropOperation", "w", "pooling needs the pooled dim 'w'"),
    "top_k": (lambda m: mtf.top_k(mtf.zeros(m, "a:4;v:16"), mtf.Dimension("v", 16), mtf.Dimension("k", 6)),
              "TopKOperation", "k", "top_k builds its k_dim 'k'"),
    "slicewise": (lambda m: mtf.slicewise(tf.identity, [mtf.zeros(m, "a:4;b:8")], splittable_dims=["a"]),
                  "SlicewiseOperation", "b", "'b' is not declared as splittable"),
}
LAYOUT_FOR_DIM = {"b": "b:all", "s": "s:all", "h": "h:all", "w": "w:all", "fh": "fh:all", "k": "k:all"}


@pytest.mark.parametrize("kind", sorted(REFUSED_SPLITS))
def test_split_of_an_unsplittable_dim_names_op_dim_mesh_dim_and_rule_to_drop(kind):
  build, op_class, dim, reason = REFUSED_SPLITS[kind]
  graph, _ = _graph(build)
  with pytest.raises(UnsplittableDimensionError) as info:
    check_layout(graph, "all:2", LAYOUT_FOR_DIM[dim])
  message = str(info.value)
  assert message.startswith(f"{op_class} '")
  assert (f"can't split dimension '{dim}': the layout rule {dim}:all splits it over mesh dimension "
          f"'all'") in message
  assert reason in message and f"Remove the layout rule {dim}:all" in message
  error = info.value
  assert (type(error.op).__name__, error.dimension, error.mesh_dimension) == (op_class, dim, "all")


@pytest.mark.parametrize("kind", sorted(REFUSED_SPLITS))
def test_the_same_graphs_pass_when_only_splittable_dims_are_split(kind):
  graph, _ = _graph(REFUSED_SPLITS[kind][0])
  check_layout(graph, "all:2", "")
  check_layout(graph, "rows:2;cols:1", "nothing:rows")


def test_check_layout_builds_no_tf_op():
  tf_graph = tf.Graph()
  with tf_graph.as_default():
    graph, _ = _graph(REFUSED_SPLITS["concat"][0])
    check_layout(graph, "all:2", "a:all")
    with pytest.raises(UnsplittableDimensionError):
      check_layout(graph, "all:2", "b:all")
  assert not tf_graph.get_operations()


def test_unsplittable_dim_of_an_op_inside_a_while_loop_blames_that_op():
  def build(mesh):
    x = mtf.zeros(mesh, "a:4;b:8")
    mtf.while_loop(lambda i, y: mtf.less(i, 3),
                   lambda i, y: [i + 1, mtf.slice(mtf.concat([y, y], "b"), 0, 8, "b")],
                   [mtf.constant(mesh, 0, dtype=tf.int32), x])
  graph, _ = _graph(build)
  loop = graph.operations[-1]
  assert type(loop).__name__ == "WhileLoopOperation" and loop.unsplittable_dims == {"b"}
  with pytest.raises(UnsplittableDimensionError,
                     match="ConcatOperation 'concat' can't split dimension 'b'") as info:
    check_layout(graph, "all:2", "b:all")
  assert info.value.op in loop.nested_operations()
  check_layout(graph, "all:2", "a:all")


def test_generic_gradient_refuses_what_its_forward_op_refuses_for_the_same_reason():
  def build(mesh):
    x = mtf.get_variable(mesh, "x", "a:4;b:8")
    y = mtf.slicewise(tf.exp, [x], splittable_dims=["a"], name="my_exp")
    mtf.gradients([mtf.reduce_sum(y)], [x])
  graph, _ = _graph(build)
  grad_op = graph.operations[-1]
  assert type(grad_op).__name__ == "GenericGradOperation"
  assert grad_op.layout_unsplittable_dims == {"b"}
  with pytest.raises(UnsplittableDimensionError, match="'my_exp' can't split dimension 'b'"):
    check_layout(graph, "all:2", "b:all")
  assert grad_op.unsplittable_reason("b") == (
      "it differentiates 'my_exp' slice by slice, and for that op 'b' is not declared as splittable "
      "(splittable_dims: ['a']); tf_fn may need it whole")


@pytest.mark.parametrize("layout, match", [
    ("hidden:cols", r"'hidden' \(size 6\).*'cols' \(size 4\).*hidden:cols"),
    ("batch:cols;hidden:cols", "'batch' and 'hidden'.*'cols'"),
    ("batch:rows;batch:cols", "'batch'.*several mesh dimensions"),
])
def test_invalid_tensor_layouts_are_rejected_without_lowering(layout, match):
  graph, _ = _graph(lambda mesh: mtf.ones(mesh, "batch:4;hidden:6"))
  with pytest.raises(ValueError, match=match):
    check_layout(graph, "rows:2;cols:4", layout)


def test_check_layout_considers_only_the_given_mesh():
  graph = mtf.Graph()
  mesh_a, mesh_b = mtf.Mesh(graph, "a"), mtf.Mesh(graph, "b")
  mtf.concat([mtf.zeros(mesh_a, "x:4")] * 2, "x")
  mtf.zeros(mesh_b, "x:4")
  check_layout(graph, "all:2", "x:all", mesh=mesh_b)
  with pytest.raises(UnsplittableDimensionError):
    check_layout(graph, "all:2", "x:all", mesh=mesh_a)


def test_lowering_runs_the_check_before_building_anything():
  tf_graph = tf.Graph()
  with tf_graph.as_default():
    graph, mesh = _graph(lambda m: mtf.concat([mtf.get_variable(m, "v", "a:4;b:8")] * 2, "b"))
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "b:all", cpu_devices(2))
    num_tf_ops = len(tf_graph.get_operations())
    with pytest.raises(LayoutError, match="ConcatOperation 'concat' can't split dimension 'b'"):
      mtf.Lowering(graph, {mesh: impl})
    assert len(tf_graph.get_operations()) == num_tf_ops
