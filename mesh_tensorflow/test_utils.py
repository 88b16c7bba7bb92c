"""Test helpers: round-trip numpy arrays through mtf Tensors on a one-processor mesh.

Not imported by `mesh_tensorflow/__init__`; use `from mesh_tensorflow import test_utils`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow import placement_mesh_impl


class NumpyConverter:
  """Builds mtf tensors from numpy arrays on its own mesh, and evaluates them back to numpy.

  Works in eager mode (values come from `.numpy()`) and in graph mode (its own `tf.Session`).
  The mesh has one processor, so a variable's slice is its master: initializers alone give it
  its value.

  Example:
    converter = NumpyConverter()
    x = converter.convert_np_array_to_mtf_tensor(np.arange(6).reshape(2, 3))  # dims dim0, dim1
    converter.convert_mtf_tensor_to_np_array(x + 1)
  """

  def __init__(self):
    self._graph = mtf.Graph()
    self._mesh = mtf.Mesh(self._graph, "mtf_mesh")
    self._session = tf.Session()

  @property
  def graph(self):
    return self._graph

  @property
  def mesh(self):
    return self._mesh

  @property
  def session(self):
    return self._session

  def convert_np_array_to_mtf_tensor(self, x: np.ndarray, dim_names: Optional[Sequence[str]] = None,
                                     dtype=tf.int32):
    """A constant mtf Tensor holding x, with dims `dim_names` (default dim0, dim1, ...)."""
    x = np.asarray(x)
    if not dim_names:
      dim_names = ["dim%d" % i for i in range(x.ndim)]
    if len(dim_names) != x.ndim:
      raise ValueError(f"convert_np_array_to_mtf_tensor: {len(dim_names)} dim_names "
                       f"{list(dim_names)} for an array of rank {x.ndim} (shape {x.shape}).")
    shape = mtf.Shape([mtf.Dimension(name, int(size)) for name, size in zip(dim_names, x.shape)])
    return mtf.constant(self._mesh, x, shape=shape, dtype=dtype)

  def convert_mtf_tensor_to_tf_tensor(self, mtf_tensor):
    """Lowers the whole graph on one processor; returns (lowering, mtf_tensor as a tf.Tensor)."""
    mesh_impl = placement_mesh_impl.PlacementMeshImpl(shape=[], layout={}, devices=[""])
    lowering = mtf.Lowering(self._graph, {self._mesh: mesh_impl})
    return lowering, lowering.export_to_tf_tensor(mtf_tensor)

  def convert_mtf_tensor_to_np_array(self, x_mtf) -> np.ndarray:
    """The value of x_mtf (variables initialised by their initializers)."""
    _, x_tf = self.convert_mtf_tensor_to_tf_tensor(x_mtf)
    if tf.executing_eagerly():
      return x_tf.numpy()
    self._session.run(tf.global_variables_initializer())
    return x_tf.eval(session=self._session)
