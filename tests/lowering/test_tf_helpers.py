"""Utility functions of the op namespace: parallel, list transposition, reduction and pool lookups."""

import logging

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf


def test_parallel_calls_fn_per_device_with_indexed_arguments():
  with tf.Graph().as_default():
    outs = mtf.parallel(["cpu:0", "cpu:1"], tf.add, [1, 2], [10, 20])
    assert [o.device.endswith("CPU:%d" % i) for i, o in enumerate(outs)] == [True, True]
    with tf.Session() as sess:
      assert sess.run(outs) == [11, 22]


def test_parallel_rejects_arguments_of_the_wrong_length():
  with pytest.raises(ValueError, match="one entry per device"):
    mtf.parallel(["", ""], tf.identity, [1])
  with pytest.raises(ValueError, match="must be a list"):
    mtf.parallel("cpu:0", tf.identity, [1])


def test_transpose_list_of_lists():
  assert mtf.transpose_list_of_lists([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]
  with pytest.raises(ValueError):
    mtf.transpose_list_of_lists([])


def test_reduction_lookups_and_unknown_names():
  assert mtf.binary_reduction_fn("MAX") is tf.maximum
  assert mtf.reduction_fn("SUM") is tf.reduce_sum
  with pytest.raises(ValueError, match="'PROD'"):
    mtf.reduction_fn("PROD")
  with pytest.raises(ValueError, match="'AVG_1D'"):
    mtf.pool_fn("AVG_1D")


@pytest.mark.parametrize("name,tf_pool", [("AVG_2D", tf.nn.avg_pool2d), ("MAX_2D", tf.nn.max_pool2d)])
def test_pool_fn_flattens_leading_batch_dims(name, tf_pool):
  x = np.random.RandomState(0).randn(2, 3, 4, 6, 5).astype(np.float32)
  got = mtf.pool_fn(name)(tf.constant(x), [2, 2], [2, 2]).numpy()
  want = tf_pool(x.reshape(6, 4, 6, 5), ksize=[2, 2], strides=[2, 2], padding="VALID").numpy()
  np.testing.assert_allclose(got, want.reshape(2, 3, 2, 3, 5))


def test_log_variable_sizes_writes_totals_to_the_log_file(tmp_path, caplog):
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    mtf.get_variable(mesh, "w", "a:4;b:8")
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", "b:all", [""] * 4)
    path = tmp_path / "sizes.txt"
    with open(path, "w") as log_file, caplog.at_level(logging.INFO):
      mtf.log_variable_sizes(graph.all_variables, "Vars", mesh_to_impl={mesh: impl}, log_file=log_file)
  text = path.read_text()
  assert "Variable w" in text and "Total size: 32" in text and "Total slice_size: 8" in text


def test_pretty_print_counters_totals_by_prefix():
  text = mtf.pretty_print_counters([("output/Einsum", 10), ("output/Add", 5), ("allreduce/x", 3)])
  assert text.splitlines() == ["allreduce: 3", "  allreduce/x: 3", "output: 15",
                               "  output/Add: 5", "  output/Einsum: 10"]
