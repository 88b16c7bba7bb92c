"""mtf.test_utils.NumpyConverter: numpy -> mtf -> numpy, in graph and eager mode."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import mesh_tensorflow as mtf
from mesh_tensorflow import test_utils
from tests.harness import MAX_EXAMPLES, MODES


def _mode(mode: str):
  """Graph mode: a fresh default graph (the converter's session uses it). Eager: nothing."""
  return tf.Graph().as_default() if mode == "graph" else contextlib.nullcontext()


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(x=hnp.arrays(np.int32, hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
                    elements=st.integers(-1000, 1000)))
def test_numpy_round_trip_keeps_values_and_names_dims_dim0_dim1(mode, x):
  with _mode(mode):
    converter = test_utils.NumpyConverter()
    x_mtf = converter.convert_np_array_to_mtf_tensor(x)
    assert x_mtf.shape.dimension_names == ["dim%d" % i for i in range(x.ndim)]
    assert x_mtf.shape.to_integer_list == list(x.shape)
    assert x_mtf.dtype == tf.int32
    np.testing.assert_array_equal(converter.convert_mtf_tensor_to_np_array(x_mtf), x)


@pytest.mark.parametrize("mode", MODES)
def test_converter_evaluates_mtf_computations_with_given_dims_and_dtype(mode):
  x = np.arange(6, dtype=np.float32).reshape(2, 3)
  with _mode(mode):
    converter = test_utils.NumpyConverter()
    x_mtf = converter.convert_np_array_to_mtf_tensor(x, dim_names=["rows", "cols"], dtype=tf.float32)
    assert x_mtf.shape == mtf.convert_to_shape("rows:2;cols:3")
    col_sums = mtf.reduce_sum(x_mtf * 2.0, reduced_dim=x_mtf.shape.dims[0])
    np.testing.assert_allclose(converter.convert_mtf_tensor_to_np_array(col_sums), 2 * x.sum(0))
    # A second conversion lowers the (grown) graph again.
    np.testing.assert_allclose(converter.convert_mtf_tensor_to_np_array(x_mtf), x)


@pytest.mark.parametrize("mode", MODES)
def test_variables_are_readable_after_global_initialization_alone(mode):
  init = np.array([[1.0, -2.0], [3.0, 0.5]], dtype=np.float32)
  with _mode(mode):
    converter = test_utils.NumpyConverter()
    w = mtf.get_variable(converter.mesh, "w", "a:2;b:2", initializer=tf.constant_initializer(init))
    assert converter.graph.trainable_variables[0].outputs[0] is w
    np.testing.assert_allclose(converter.convert_mtf_tensor_to_np_array(w + 1.0), init + 1.0)


@pytest.mark.parametrize("mode", MODES)
def test_convert_mtf_tensor_to_tf_tensor_returns_the_lowering_and_a_tf_tensor(mode):
  with _mode(mode):
    converter = test_utils.NumpyConverter()
    x_mtf = converter.convert_np_array_to_mtf_tensor(np.array([4, 5], dtype=np.int32))
    lowering, x_tf = converter.convert_mtf_tensor_to_tf_tensor(x_mtf)
    assert isinstance(lowering, mtf.Lowering)
    assert lowering.mesh_impl(converter.mesh).size == 1
    assert x_tf.shape.as_list() == [2] and x_tf.dtype == tf.int32
    assert isinstance(converter.session, tf.Session)
    assert converter.mesh.graph is converter.graph


def test_wrong_number_of_dim_names_raises():
  converter = test_utils.NumpyConverter()
  with pytest.raises(ValueError, match=r"1 dim_names \['a'\] for an array of rank 2"):
    converter.convert_np_array_to_mtf_tensor(np.zeros([2, 2]), dim_names=["a"])
