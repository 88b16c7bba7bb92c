"""Getting values into a mesh: imports of TF tensors, constants and ranges."""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Shape, convert_to_dimension, convert_to_shape
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering.laid_out import dtype_of

__all__ = [
    "ImportOperation", "import_tf_tensor", "ImportLaidOutTensorOperation",
    "import_laid_out_tensor", "Constant", "constant", "zeros", "zeros_like", "ones", "ones_like",
    "RangeOperation", "mtf_range",
]


class ImportOperation(Operation):
  """Brings a whole TF tensor into the mesh, sliced by the layout."""

  lowering_cache_inputs = ("_tf_tensor",)  # a cached eager lowering takes it as an input

  def __init__(self, mesh, tf_tensor, shape: Shape, name: Optional[str] = None):
    super().__init__([], mesh=mesh, name=name or "import")
    tf_tensor = tf.convert_to_tensor(tf_tensor)
    if not tf_tensor.shape.is_compatible_with(shape.to_integer_list):
      raise ValueError(
          f"import_tf_tensor {self.name!r}: TF tensor {_tf_name(tf_tensor)}of shape {tf_tensor.shape} "
          f"does not match {shape}; give an mtf shape with the same sizes in the same order.")
    self._outputs = [Tensor(self, shape, tf_tensor.dtype)]
    self._tf_tensor = tf_tensor
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    lowering.set_tensor_lowering(
        self.outputs[0], mesh_impl.import_tf_tensor(self.outputs[0], self._tf_tensor))


def _tf_name(tf_tensor) -> str:
  """"'x:0' " for a graph tensor; "" for an eager one (it has no name)."""
  return "" if tf.executing_eagerly() else f"{tf_tensor.name!r} "


def import_tf_tensor(mesh, tf_tensor, shape=None, name: Optional[str] = None) -> Tensor:
  """Imports a TF tensor into the mtf graph, naming its dimensions.

  Each processor gets its slice of the value, as the layout splits `shape`.

  Args:
    mesh: the mtf.Mesh to import onto.
    tf_tensor: a tf.Tensor (or anything tf.convert_to_tensor takes).
    shape: the mtf shape, one Dimension per axis of tf_tensor (sizes must agree); None for a scalar.
    name: an optional op name.

  Returns:
    An mtf Tensor.

  Example:
    x = mtf.import_tf_tensor(mesh, tf_images, shape=[batch, pixels])
  """
  tf_tensor = tf.convert_to_tensor(tf_tensor)
  if shape is None:
    if tf_tensor.shape.ndims != 0:
      raise ValueError(f"import_tf_tensor: a shape is needed for the non-scalar {tf_tensor}.")
    shape = Shape([])
  return ImportOperation(mesh, tf_tensor, convert_to_shape(shape), name=name).outputs[0]


class ImportLaidOutTensorOperation(Operation):
  """Wraps an already laid-out value (e.g. computed by the backend) as an mtf Tensor."""

  def __init__(self, mesh, laid_out_tensor, shape: Shape, name: Optional[str] = None):
    super().__init__([], mesh=mesh, name=name or "import")
    dtype = dtype_of(laid_out_tensor)
    self._laid_out_tensor = laid_out_tensor
    self._outputs = [Tensor(self, shape, dtype)]
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_splittable_and_unsplittable_dims("unsplittable"))

  def lower(self, lowering):
    lowering.set_tensor_lowering(self.outputs[0], self._laid_out_tensor)


def import_laid_out_tensor(mesh, laid_out_tensor, shape, name: Optional[str] = None) -> Tensor:
  return ImportLaidOutTensorOperation(mesh, laid_out_tensor, convert_to_shape(shape),
                                      name=name).outputs[0]


class Constant(Operation):
  """A constant; scalars are filled per slice, arrays are sliced by the layout."""

  def __init__(self, mesh, value, shape: Shape, dtype: tf.DType, name: Optional[str] = None):
    super().__init__([], mesh, name=name or "constant")
    self._outputs = [Tensor(self, shape, dtype)]
    self._value = value
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    out = self.outputs[0]
    value = self._value
    if np.ndim(value) == 0 or mesh_impl.tensor_layout(out.shape).is_fully_replicated:
      slice_shape = mesh_impl.slice_shape(out.shape)
      laid_out = mesh_impl.slicewise(
          lambda: tf.constant(value=value, dtype=out.dtype, shape=slice_shape))
    else:
      whole = tf.constant(value=value, dtype=out.dtype, shape=out.shape.to_integer_list)
      laid_out = mesh_impl.import_tf_tensor(out, whole)
    lowering.set_tensor_lowering(out, laid_out)


def constant(mesh, value, shape=None, dtype=tf.float32, name: Optional[str] = None) -> Tensor:
  shape = convert_to_shape(shape) or Shape([])
  return Constant(mesh, value, shape, dtype, name=name).outputs[0]


def zeros(mesh, shape, dtype=tf.float32) -> Tensor:
  return constant(mesh, 0, shape=convert_to_shape(shape), dtype=dtype)


def zeros_like(t: Tensor) -> Tensor:
  return zeros(t.mesh, t.shape, dtype=t.dtype)


def ones(mesh, shape, dtype=tf.float32) -> Tensor:
  return constant(mesh, 1, shape=convert_to_shape(shape), dtype=dtype)


def ones_like(t: Tensor) -> Tensor:
  return ones(t.mesh, t.shape, dtype=t.dtype)


class RangeOperation(Operation):
  """The 1-D tensor [0, 1, ..., dim.size - 1] along `dim`."""

  def __init__(self, mesh, dim, dtype, name: Optional[str] = None):
    super().__init__([], mesh, name=name or "range")
    self._dim = convert_to_dimension(dim)
    self._dtype = dtype
    self._outputs = [Tensor(self, Shape([self._dim]), dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    if self._dtype == tf.bfloat16:
      tf_range = tf.cast(tf.range(self._dim.size), tf.bfloat16)
    else:
      tf_range = tf.range(self._dim.size, dtype=self._dtype)
    lowering.set_tensor_lowering(self.outputs[0],
                                 mesh_impl.import_tf_tensor(self.outputs[0], tf_range))


def mtf_range(mesh, dim, dtype, name: Optional[str] = None) -> Tensor:
  return RangeOperation(mesh, dim, dtype, name).outputs[0]
