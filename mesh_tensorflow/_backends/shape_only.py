"""ShapeOnlyMeshImpl: a backend whose laid-out values carry only one slice's shape and dtype.

It lets `mtf.dry_run` walk every op's normal `lower` code -- the same calls to the communication
layer, in the same order, so the same events -- without devices, sessions or real data. Like the
SIMD backend it holds a single slice (a placeholder standing for every processor's), and
`slicewise` builds fn once on placeholders so TensorFlow's shape functions give the output
slice shapes. Use it only under a throwaway default graph (dry_run makes one).
"""

from __future__ import annotations

import tensorflow.compat.v1 as tf

from mesh_tensorflow._lowering import laid_out
from mesh_tensorflow._lowering.lazy import convert_args_to_laid_out_tensors
from mesh_tensorflow._lowering.mesh_impl import MeshImpl


def _placeholder(shape, dtype):
  return tf.placeholder(tf.as_dtype(dtype).base_dtype, shape=list(shape))


class ShapeOnlyMeshImpl(MeshImpl):
  """A mesh of `shape` laid out by `layout`, with shape-only slices and no-op collectives."""

  class LaidOutTensor(laid_out.LaidOutTensor):
    """One placeholder standing for every processor's slice."""

  class LaidOutVariable(laid_out.LaidOutVariable):
    """A variable's slice as a placeholder; assignments and copies are no-ops."""

    def __init__(self, variable, mesh_impl):
      self._variable = variable
      slice_shape = mesh_impl.slice_shape(variable.outputs[0].shape)
      self._laid_out_tensor = mesh_impl.LaidOutTensor([_placeholder(slice_shape, variable.slice_dtype)])
      self._copy_master_to_slices = mesh_impl.register_copy_master_to_slices(tf.no_op)
      self._copy_slices_to_master = tf.no_op()

    def assign_to_slices(self, assign_fn, values):
      del assign_fn, values
      return tf.no_op()

  @property
  def devices(self) -> list:
    return [""] * self.size

  def slicewise(self, fn, *inputs):
    inputs = convert_args_to_laid_out_tensors(inputs)
    ret = fn(*[x.tensor_list[0] if isinstance(x, self.LaidOutTensor) else x for x in inputs])
    if isinstance(ret, tuple):
      return tuple(self.LaidOutTensor([t]) for t in ret)
    return self.LaidOutTensor([ret])

  def allreduce(self, x, mesh_axes, reduction_fn_string):
    del mesh_axes, reduction_fn_string
    return x.to_laid_out_tensor()

  def allconcat(self, x, mesh_axis, concat_axis):
    n = self.shape[mesh_axis].size
    return self.slicewise(lambda t: tf.concat([t] * n, concat_axis), x)

  def alltoall(self, x, mesh_axis, split_axis, concat_axis):
    n = self.shape[mesh_axis].size
    return self.slicewise(lambda t: tf.concat(tf.split(t, n, split_axis), concat_axis), x)

  def receive(self, x, mesh_axis, source_pcoord):
    del mesh_axis, source_pcoord
    return x.to_laid_out_tensor()

  def laid_out_pnum(self):
    return self.LaidOutTensor([_placeholder([], tf.int32)])

  def import_tf_tensor(self, x, tf_x):
    return self.LaidOutTensor([_placeholder(self.slice_shape(x.shape), tf_x.dtype)])

  def export_to_tf_tensor(self, x, laid_out_x):
    del laid_out_x
    return _placeholder(x.shape.to_integer_list, x.dtype)

  def random(self, shape, tf_fn, kwargs, key=None):
    """A placeholder of the slice: a dry run needs the shape, not the (XLA-compiled) draw."""
    del tf_fn, key
    return self.LaidOutTensor([_placeholder(self.slice_shape(shape), kwargs.get("dtype", tf.float32))])

  def Print(self, x, data, message, **kwargs):  # pylint: disable=invalid-name
    del data, message, kwargs
    return x
