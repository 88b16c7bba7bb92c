"""MeshImpl: the contract between the lowering and a backend.

The concrete methods here are layout arithmetic and the backend-independent part of every
backend: master<->slice copies, deduplicated random draws, processor numbering, broadcasting,
printing. A backend supplies only the primitives in `_lowering/backend.py`'s BACKEND_PRIMITIVES
(listed in docs/architecture.md); that module states the whole contract as Protocols.
Op families never call the collectives directly: they go through `_lowering/comm.py`.
"""

from __future__ import annotations

import contextlib

import os
import random as py_random

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Shape, convert_to_shape, list_product
from mesh_tensorflow._core.layout import (
    TensorLayout, convert_to_layout_rules, pnum_to_processor_coordinates, slice_shape)
from mesh_tensorflow._lowering import random_bits
from mesh_tensorflow._lowering.comm import shift_sources
from mesh_tensorflow._lowering.lazy import compatible_lazy_allreduce_sums
from mesh_tensorflow._lowering.tf_helpers import parallel, transpose_unless_identity


def sequence_mode() -> bool:
  """MTF_SEQUENCE_MODE=1: master->slice copies run one after another (bounds host memory)."""
  return os.environ.get("MTF_SEQUENCE_MODE", "") == "1"


class MeshImpl:
  """A mesh shape plus layout rules; subclasses add devices and communication."""

  def __init__(self, shape, layout_rules):
    self._shape = convert_to_shape(shape)
    self._layout_rules = convert_to_layout_rules(layout_rules)
    self.copy_master_to_slice_ops = []

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

  # The reductions `allreduce` runs as one collective; the communication layer builds the others
  # from allconcats (`_lowering/comm.py`'s allreduce_by_allconcat), so its events say what runs.
  allreduce_reductions = ("SUM", "MAX", "MIN")

  # Whether a variable the layout leaves whole uses its master as a slice (PlacementMeshImpl's
  # option; see `_backends/variable_policy.py`). No other backend does.
  master_as_slice = False

  @property
  def masters(self) -> str:
    """"whole": each variable has a whole master tf.Variable, which checkpoints hold."""
    return "whole"

  @property
  def local_pnums(self) -> list:
    """The processors whose slices this program holds, in pnum order: every one by default.

    (A backend spanning processes, CollectiveMeshImpl, holds a block; SIMD's one program is
    every replica's.)
    """
    return list(range(self.size))

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
    return slice_shape(tensor_shape, self._shape, self._layout_rules)

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
      return inputs[0].with_input(self.slicewise(fn, *[x.laid_out_input for x in inputs]))
    return self.slicewise(fn, *inputs)

  def Print(self, x, data, message, **kwargs):  # pylint: disable=invalid-name
    """x, printing every processor's slices of `data` (tf.Print) when x's slice is computed."""
    def print_fn(x_slice, *data_slices):
      return tf.Print(x_slice, list(data_slices), message, **kwargs)
    return self.slicewise(print_fn, x, *data)

  # ---- shared by every backend: laid-out values as TF tensors, copies, random draws ----

  def control_inputs(self, laid_out) -> list:
    """The TF tensors an op must wait for so that `laid_out` has been computed."""
    return list(laid_out.to_laid_out_tensor().all_slices)

  def replicated_value(self, laid_out):
    """This program's TF tensor of a fully replicated value (e.g. a loop condition, a summary)."""
    return laid_out.to_laid_out_tensor().all_slices[0]

  def loop_vars(self, laid_out) -> list:
    """The TF tensors carrying `laid_out` through a tf.while_loop (inverse: from_loop_vars)."""
    return list(laid_out.to_laid_out_tensor().tensor_list)

  def from_loop_vars(self, tensors):
    return self.LaidOutTensor(list(tensors))

  def master_parts(self, master, master_shape: Shape) -> list:
    """Per logical pnum, its part of the whole tensor `master` (on master's device).

    Processors holding the same part share one tf.slice.
    """
    if self.tensor_layout(master_shape).is_fully_replicated:
      return [master] * self.size
    slice_shape = self.slice_shape(master_shape)
    parts, ret = {}, []
    with tf.device(_device_of(master)):
      for pnum in range(self.size):
        begin = tuple(self.slice_begin(master_shape, pnum))
        if begin not in parts:
          parts[begin] = tf.slice(master, list(begin), slice_shape)
        ret.append(parts[begin])
    return ret

  def register_copy_master_to_slices(self, build_fn):
    """Builds a master->slices copy op with build_fn() and appends it to copy_master_to_slice_ops.

    In MTF_SEQUENCE_MODE the copy waits for the previous one.
    """
    previous = [op for op in self.copy_master_to_slice_ops[-1:] if op is not None]
    with tf.control_dependencies(previous if sequence_mode() else None):
      op = build_fn()
    self.copy_master_to_slice_ops.append(op)
    return op

  def random(self, shape, tf_fn, kwargs, key=None, stagewise=None):
    """Random slices of a tensor of `shape`, the same whatever the layout.

    One algorithm for every backend, with no communication: each processor hashes the global
    indices of its slice's elements with the stream key (see `_lowering/random_bits.py`), so an
    element's value depends only on (key, its index in the whole tensor) and processors holding
    the same slice draw the same values. tf.random.uniform / normal / truncated_normal (and
    their v1 names) are drawn so; any other tf_fn is called per slice as
    tf_fn(slice_shape, seed=[key, slice number], **kwargs), a stateless-style seed.

    Args:
      shape: the whole tensor's mtf Shape.
      tf_fn: the TF random function the values follow.
      kwargs: its keyword arguments (dtype, minval, maxval, mean, stddev, ...), without seed.
      key: the uint64 stream key (RandomOperation passes the op's key for this evaluation);
        None: a fixed random key.
      stagewise: a pipelined op's random_keys.StagewiseKeys; key then holds one key per stage.
    """
    if key is None:
      key = random_bits.stream_key(py_random.getrandbits(64), [])
    kind = random_bits.kind_of(tf_fn)
    if kind is None:
      slice_shape = self.slice_shape(shape)

      def per_slice(slice_num):
        seed = tf.stack([tf.bitcast(key, tf.int64), tf.cast(slice_num, tf.int64)])
        return tf_fn(slice_shape, seed=seed, **kwargs)
      return self.slicewise(per_slice, self.laid_out_slice_num(shape))
    args = (shape.to_integer_list, self.slice_shape(shape),
            [self._pnum_to_pcoord(a) for a in self.tensor_layout(shape)])
    geometry = (random_bits.SliceGeometry(*args) if stagewise is None
                else random_bits.StagewiseGeometry(*args, stagewise))
    return self.slicewise(lambda pnum: random_bits.draw(kind, geometry, pnum, key, **kwargs),
                          self.laid_out_pnum())

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
    return self.receive(x, mesh_axis, shift_sources(self._shape[mesh_axis].size, offset, wrap))

  def _pnum_to_pcoord(self, mesh_axis):
    """(divisor, size) such that a processor's coordinate is (pnum // divisor) % size; None: None."""
    if mesh_axis is None:
      return None
    return (list_product(self._shape.to_integer_list[mesh_axis + 1:]), self._shape[mesh_axis].size)

  def laid_out_pcoord(self, mesh_axis: int):
    """Each processor's coordinate along mesh_axis, as a laid-out int32 scalar."""
    divisor, modulus = self._pnum_to_pcoord(mesh_axis)

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
    """Per-processor slices of a whole tf tensor, in pnum order, on the tensor's device.

    Processors holding the same part of it get the same tensor (sliced once).
    """
    if self.tensor_layout(tensor_shape).is_fully_replicated:
      return [tf_tensor] * self.size
    slice_shape = self.slice_shape(tensor_shape)
    begins = [tuple(self.slice_begin(tensor_shape, pnum)) for pnum in range(self.size)]
    by_begin = {}
    with tf.device(_device_of(tf_tensor)):
      for begin in begins:
        if begin not in by_begin:
          by_begin[begin] = tf.slice(tf_tensor, begin, slice_shape)
    return [by_begin[begin] for begin in begins]

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

  def fusing(self, is_needed=None):
    """A context a Lowering runs in; backends that fuse slicewise computations override it.

    is_needed(laid_out) -> bool: whether a laid-out value may still be read (its mtf tensor has
    consumers not lowered yet, or none at all, so it may be exported).
    """
    return contextlib.nullcontext()

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
  x = transpose_unless_identity(x, perm)
  if input_shape.ndims == output_shape.ndims:
    return x
  sizes = x.shape.as_list() if x.shape.rank is not None else [None]
  if None not in sizes:  # one reshape inserts every size-1 dim (fewer TF ops than expand_dims each)
    sizes = iter(sizes)
    return tf.reshape(x, [next(sizes) if d in input_shape.dims else 1 for d in output_shape])
  for i, d in enumerate(output_shape):
    if d not in input_shape.dims:
      x = tf.expand_dims(x, i)
  return x
