"""MeshImpl: the contract between the lowering and a backend.

The concrete methods here are layout arithmetic and TF glue shared by all backends.
A backend supplies only the primitives: slicewise, the collectives (allreduce, allconcat,
alltoall, receive), laid_out_pnum, import/export, random, LaidOutTensor and LaidOutVariable.
"""

from __future__ import annotations

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Shape, convert_to_shape, list_product
from mesh_tensorflow._core.layout import (
    TensorLayout, convert_to_layout_rules, pnum_to_processor_coordinates)
from mesh_tensorflow._lowering.lazy import LazyAllreduceSum, compatible_lazy_allreduce_sums
from mesh_tensorflow._lowering.tf_helpers import parallel


class MeshImpl:
  """A mesh shape plus layout rules; subclasses add devices and communication."""

  def __init__(self, shape, layout_rules):
    self._shape = convert_to_shape(shape)
    self._layout_rules = convert_to_layout_rules(layout_rules)

  @property
  def shape(self) -> Shape:
    return self._shape

  @property
  def ndims(self) -> int:
    return len(self._shape)

  @property
  def layout_rules(self):
    return self._layout_rules

  @property
  def size(self) -> int:
    return self._shape.size

  @property
  def supports_control_dependencies(self) -> bool:
    return True

  # ---- layout arithmetic (pure) ----

  def tensor_dimension_to_mesh_axis(self, tensor_dimension):
    return self._layout_rules.tensor_dimension_to_mesh_axis(tensor_dimension, self._shape)

  def tensor_layout(self, arg) -> TensorLayout:
    """TensorLayout of an mtf Tensor or Shape under this mesh's rules."""
    shape = arg if isinstance(arg, Shape) else arg.shape
    return self._layout_rules.tensor_layout(shape, self._shape)

  def mesh_axis_to_cumprod(self, tensor_shape: Shape) -> list:
    """Per mesh axis: the cumprod of the tensor axis split over it, or None."""
    cumprod = tensor_shape.cumprod
    mesh_to_tensor = self.tensor_layout(tensor_shape).mesh_axis_to_tensor_axis(self.ndims)
    return [None if ta is None else cumprod[ta] for ta in mesh_to_tensor]

  def slice_shape(self, tensor_shape: Shape) -> list:
    """Per-processor shape of a tensor; ValueError naming the dimension if a split is uneven."""
    layout = self.tensor_layout(tensor_shape)
    ret = []
    for dim, mesh_axis in zip(tensor_shape, layout):
      if mesh_axis is None:
        ret.append(dim.size)
        continue
      mesh_dim = self._shape[mesh_axis]
      if dim.size % mesh_dim.size:
        raise ValueError(
            f"Tensor dimension {dim.name!r} (size {dim.size}) of {tensor_shape} is split over mesh "
            f"dimension {mesh_dim.name!r} (size {mesh_dim.size}), which does not divide it. "
            f"Change the layout rule {dim.name}:{mesh_dim.name}, or make {dim.name!r} a "
            f"multiple of {mesh_dim.size}.")
      ret.append(dim.size // mesh_dim.size)
    return ret

  def slice_begin(self, tensor_shape: Shape, pnum: int) -> list:
    layout = self.tensor_layout(tensor_shape)
    coords = pnum_to_processor_coordinates(self._shape, pnum)
    return [0 if mesh_axis is None else dim.size // self._shape[mesh_axis].size * coords[mesh_axis]
            for dim, mesh_axis in zip(tensor_shape, layout)]

  def slice_size(self, tensor_shape: Shape) -> int:
    return list_product(self.slice_shape(tensor_shape))

  def laid_out_size(self, tensor_shape: Shape) -> int:
    return self.slice_size(tensor_shape) * self.size

  # ---- derived communication ----

  def slicewise_delay_allreduce(self, fn, *inputs):
    """slicewise(fn), staying lazy when all inputs are compatible pending allreduce-sums."""
    if compatible_lazy_allreduce_sums(inputs):
      return LazyAllreduceSum(
          self, self.slicewise(fn, *[x.laid_out_input for x in inputs]),
          inputs[0].mesh_axes, add_counter_fn=inputs[0].add_counter_fn)
    return self.slicewise(fn, *inputs)

  def Print(self, x, data, message, **kwargs):  # pylint: disable=invalid-name
    tf.logging.warning("mtf.Print is not implemented for %s; printing nothing.", type(self).__name__)
    return x

  def allsplit(self, x, mesh_axis: int, split_axis: int, which=None):
    """Keeps, on each processor, the `which`-th (default: its own pcoord) piece along split_axis."""
    if which is None:
      which = self.laid_out_pcoord(mesh_axis)
    num_splits = self._shape[mesh_axis].size

    def my_fn(x, which):
      shape = x.shape.as_list()
      begin = [0] * len(shape)
      size = list(shape)
      size[split_axis] = shape[split_axis] // num_splits
      begin[split_axis] = which * size[split_axis]
      return tf.slice(x, begin, size)
    return self.slicewise(my_fn, x, which)

  def shift_by_n_processors(self, x, mesh_axis: int, offset: int, wrap: bool):
    """Processor i along mesh_axis receives the slice of processor i - offset (zeros past the ends)."""
    n = self._shape[mesh_axis].size
    source_pcoord = []
    for i in range(n):
      c = i - offset
      if c != c % n:
        c = c % n if wrap else None
      source_pcoord.append(c)
    return self.receive(x, mesh_axis, source_pcoord)

  def laid_out_pcoord(self, mesh_axis: int):
    """Each processor's coordinate along mesh_axis, as a laid-out int32 scalar."""
    divisor = list_product(self._shape.to_integer_list[mesh_axis + 1:])
    modulus = self._shape[mesh_axis].size

    def my_fn(pnum):
      return tf.cast((tf.cast(pnum, tf.float32) // divisor) % modulus, tf.int32)
    return self.slicewise(my_fn, self.laid_out_pnum())

  def laid_out_slice_num(self, tensor_shape: Shape):
    """An int32 per processor, equal exactly on processors holding the same slice."""
    ret = self.slicewise(lambda: tf.constant(0, tf.int32))
    for mesh_axis in self.tensor_layout(tensor_shape):
      if mesh_axis is not None:
        size = self._shape[mesh_axis].size
        ret = self.slicewise(lambda x, pcoord, size=size: x * size + pcoord,
                             ret, self.laid_out_pcoord(mesh_axis))
    return ret

  def broadcast_impl(self, old_slices, old_shape: Shape, new_shape: Shape):
    """Broadcasts slices of `old_shape` to slices of `new_shape` (a superset of its dims)."""
    new_slice_shape = self.slice_shape(new_shape)

    def tf_fn(x):
      return tf.broadcast_to(expand_dims_to(x, old_shape, new_shape), new_slice_shape)  # any dtype
    return self.slicewise(tf_fn, old_slices)

  def make_slices(self, tf_tensor, tensor_shape: Shape) -> list:
    """Per-processor slices of a whole tf tensor, in pnum order, on the tensor's device."""
    layout = self.tensor_layout(tensor_shape)
    slice_shape = self.slice_shape(tensor_shape)

    def my_fn(pnum):
      if layout.is_fully_replicated:
        return tf_tensor
      return tf.slice(tf_tensor, self.slice_begin(tensor_shape, pnum), slice_shape)
    return parallel([_device_of(tf_tensor)] * self.size, my_fn, list(range(self.size)))

  def combine_slices(self, slices: list, tensor_shape: Shape, device=None):
    """Inverse of make_slices: concatenates slices (pnum order) along split axes."""
    if tensor_shape.ndims == 0:
      return slices[0]
    ret = list(slices)
    mesh_to_tensor = self.tensor_layout(tensor_shape).mesh_axis_to_tensor_axis(self.ndims)
    for mesh_dim, tensor_axis in zip(self._shape, mesh_to_tensor):
      group = len(ret) // mesh_dim.size
      if tensor_axis is None:
        ret = ret[:group]
        continue
      devices = [device] * group if device else [_device_of(ret[i]) for i in range(group)]
      pieces = [[ret[i + group * j] for j in range(mesh_dim.size)] for i in range(group)]
      ret = parallel(devices, tf.concat, pieces, axis=[tensor_axis] * group)
    assert len(ret) == 1
    return ret[0]

  def einsum(self, equation: str, *slices):
    """Per-slice einsum; a hook for backends with a faster contraction."""
    return tf.einsum(equation, *slices)

  # ---- primitives a backend must provide ----

  def slicewise(self, fn, *inputs):
    raise NotImplementedError(f"{type(self).__name__} must implement slicewise")

  def allreduce(self, x, mesh_axes, reduction_fn_string):
    raise NotImplementedError(f"{type(self).__name__} must implement allreduce")

  def allconcat(self, x, mesh_axis, concat_axis):
    raise NotImplementedError(f"{type(self).__name__} must implement allconcat")

  def alltoall(self, x, mesh_axis, split_axis, concat_axis):
    raise NotImplementedError(f"{type(self).__name__} must implement alltoall")

  def receive(self, x, mesh_axis, source_pcoord):
    raise NotImplementedError(f"{type(self).__name__} must implement receive")

  def laid_out_pnum(self):
    raise NotImplementedError(f"{type(self).__name__} must implement laid_out_pnum")

  def export_to_tf_tensor(self, x, laid_out_x):
    raise NotImplementedError(f"{type(self).__name__} must implement export_to_tf_tensor")

  def import_tf_tensor(self, x, tf_x):
    raise NotImplementedError(f"{type(self).__name__} must implement import_tf_tensor")


def _device_of(t) -> str:
  try:
    return t.device
  except AttributeError:  # python constants have no device
    return ""


def expand_dims_to(x, input_shape: Shape, output_shape: Shape):
  """Transposes x (laid out as input_shape) into output_shape's order, with size-1 new dims."""
  missing = [d for d in input_shape if d not in output_shape.dims]
  if missing:
    raise ValueError(f"Cannot broadcast {input_shape} to {output_shape}: {missing} would be dropped.")
  if input_shape == output_shape or input_shape.ndims == 0:
    return x
  perm = [input_shape.dims.index(d) for d in output_shape if d in input_shape.dims]
  x = tf.transpose(x, perm)
  for i, d in enumerate(output_shape):
    if d not in input_shape.dims:
      x = tf.expand_dims(x, i)
  return x
