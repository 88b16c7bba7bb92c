"""Operation classes constructed directly, as upstream's splittability tests do, with the §9 sets."""

import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf


class UpstreamStyleSplittabilityTest(tf.test.TestCase):

  def setUp(self):
    super().setUp()
    self.graph = mtf.Graph()
    self.mesh = mtf.Mesh(self.graph, "my_mesh")
    self.a_dim, self.b_dim, self.c_dim = (mtf.Dimension("a", 5), mtf.Dimension("b", 10),
                                          mtf.Dimension("c", 15))
    self.ab_shape = mtf.Shape([self.a_dim, self.b_dim])
    self.x = mtf.zeros(self.mesh, self.ab_shape)
    self.batch_dim = mtf.Dimension("batch", 100)
    self.grid_h_dim = mtf.Dimension("grid_h", 10)
    self.grid_w_dim = mtf.Dimension("grid_w", 10)
    self.filter_h_dim = mtf.Dimension("filter_h", 5)
    self.filter_w_dim = mtf.Dimension("filter_w", 5)
    self.in_dim = mtf.Dimension("in", 10)
    self.out_dim = mtf.Dimension("out", 10)
    self.image = mtf.zeros(self.mesh, [self.batch_dim, self.grid_h_dim, self.grid_w_dim, self.in_dim])

  def assert_sets(self, op, splittable, unsplittable):
    self.assertEqual(op.splittable_dims, frozenset(splittable))
    self.assertEqual(op.unsplittable_dims, frozenset(unsplittable))

  def test_generic_ops(self):
    operation = mtf.Operation([self.x], name="operation")
    self.assertEqual(operation._initialize_all_dimensions_as_splittable(),
                     (frozenset(["a", "b"]), frozenset()))
    slicewise = mtf.SlicewiseOperation(tf.exp, [self.x], [self.x.shape], [self.x.dtype],
                                       splittable_dims=[self.a_dim],
                                       grad_function=lambda op, dy: [dy * op.outputs[0]], name="simple_exp")
    self.assert_sets(slicewise, ["a"], ["b"])
    self.assert_sets(mtf.GenericGradOperation(slicewise, [self.x]), ["a", "b"], [])
    self.assert_sets(mtf.ScalarMultiplyOperation(self.x, 2.0), ["a", "b"], [])
    self.assert_sets(mtf.ScalarAddOperation(self.x, 2.0), ["a", "b"], [])
    x2 = mtf.zeros(self.mesh, mtf.Shape([self.b_dim]))
    self.assert_sets(mtf.BinaryOpWithBroadcasting(tf.less, self.x, x2, self.ab_shape, tf.bool, name="less"),
                     ["a", "b"], [])
    self.assert_sets(mtf.BroadcastOperation(self.x, mtf.Shape([self.a_dim, self.b_dim, self.c_dim])),
                     ["a", "b", "c"], [])
    self.assert_sets(mtf.ReduceOperation(self.x, mtf.Shape([self.b_dim]), "sum"), ["a", "b"], [])
    self.assert_sets(mtf.PoolOperation(self.image, [2, 2], [2, 2], "AVG_2D"), ["batch", "in"],
                     ["grid_h", "grid_w"])

  def test_joining_ops_forbid_their_dim(self):
    x1 = mtf.zeros(self.mesh, mtf.Shape([self.a_dim, self.b_dim, mtf.Dimension("concat", 5)]))
    x2 = mtf.zeros(self.mesh, mtf.Shape([self.a_dim, self.b_dim, mtf.Dimension("concat", 7)]))
    self.assert_sets(mtf.ConcatOperation([x1, x2], "concat"), ["a", "b"], ["concat"])
    self.assert_sets(mtf.SplitOperation(self.x, self.b_dim, [3, 7]), ["a"], ["b"])
    self.assert_sets(mtf.StackOperation([self.x, self.x], "stack", axis=0), ["a", "b"], ["stack"])
    self.assert_sets(mtf.UnstackOperation(self.x, self.b_dim), ["a"], ["b"])
    self.assert_sets(mtf.SliceOperation(self.x, begin=3, size=4, slice_dim_name="b"), ["a"], ["b"])
    self.assert_sets(mtf.PadOperation(self.x, [7, 2], "a"), ["b"], ["a"])

  def test_ops_with_all_dims_splittable(self):
    y = mtf.zeros(self.mesh, mtf.Shape([self.b_dim, self.c_dim]))
    self.assert_sets(mtf.EinsumOperation([self.x, y], mtf.Shape([self.a_dim, self.c_dim])),
                     ["a", "b", "c"], [])
    self.assert_sets(mtf.ShiftOperation(self.x, -5, self.b_dim, wrap=True), ["a", "b"], [])
    indices = mtf.zeros(self.mesh, self.ab_shape, dtype=tf.int32)
    self.assert_sets(mtf.OneHotOperation(indices, self.c_dim, 1, 0, dtype=tf.bool), ["a", "b", "c"], [])
    self.assert_sets(mtf.ImportOperation(self.mesh, tf.zeros([5, 10]), self.ab_shape), ["a", "b"], [])
    laid_out = mtf.placement_mesh_impl.PlacementMeshImpl.LaidOutTensor([self.x])
    self.assert_sets(mtf.ImportLaidOutTensorOperation(self.mesh, laid_out, self.ab_shape), [], ["a", "b"])
    self.assert_sets(mtf.Constant(self.mesh, 0, self.ab_shape, dtype=tf.int32), ["a", "b"], [])
    self.assert_sets(mtf.StopGradient(self.x), ["a", "b"], [])
    self.assert_sets(mtf.PrintOperation(self.x, [self.x], "Tensor x: "), ["a", "b"], [])
    self.assert_sets(mtf.ReshapeOperation(self.x, mtf.Shape([mtf.Dimension("ab", 50)])), ["a", "b", "ab"], [])
    self.assert_sets(mtf.RandomOperation(self.mesh, self.ab_shape, tf.random_uniform), ["a", "b"], [])

  def test_variable_ops(self):
    var = mtf.Variable(self.mesh, "test_variable", self.ab_shape,
                       mtf.VariableDType(tf.int32, tf.int32, tf.int32),
                       initializer=tf.zeros_initializer(), trainable=True)
    self.assert_sets(var, ["a", "b"], [])
    read = mtf.ReadVariable(var)
    self.assert_sets(read, ["a", "b"], [])
    assign = mtf.Assign([var], [mtf.zeros(self.mesh, self.ab_shape, dtype=tf.int32)])
    self.assert_sets(assign, ["a", "b"], [])
    self.assert_sets(mtf.Depend(read.outputs[0], [assign]), ["a", "b"], [])

  def test_while_loop(self):
    i = mtf.constant(self.mesh, 0, mtf.Shape([]))
    op = mtf.WhileLoopOperation(lambda i, x: mtf.less(i, 10),
                                lambda i, x: [mtf.add(i, 1), mtf.multiply(x, 2)], [i, self.x])
    self.assert_sets(op, ["a", "b"], [])

  def test_conv_ops(self):
    conv_filter = mtf.zeros(self.mesh, [self.filter_h_dim, self.filter_w_dim, self.in_dim, self.out_dim])
    strides, padding = [1, 1, 1, 1], "SAME"
    conv = mtf.Conv2dOperation(self.image, conv_filter, strides, padding)
    self.assert_sets(conv, ["batch", "in", "out"], ["filter_h", "filter_w", "grid_h", "grid_w"])
    d_output = mtf.zeros(self.mesh, conv.outputs[0].shape)
    every = ["batch", "filter_h", "filter_w", "grid_h", "grid_w", "in", "out"]
    self.assert_sets(mtf.Conv2or3dBackpropInputOperation(2, False, self.image.shape, conv_filter, d_output,
                                                         strides, padding), every, [])
    self.assert_sets(mtf.Conv2or3dBackpropFilterOperation(2, False, self.image, conv_filter.shape, d_output,
                                                          strides, padding), every, [])
