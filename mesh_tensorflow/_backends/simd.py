"""SimdMeshImpl: one SPMD program on TPU replicas, each replica holding one slice of every tensor.

Lowered code is built once and run by every replica (inside `tf.compat.v1.tpu.replicate`/
`rewrite`), so a LaidOutTensor holds a single tf.Tensor: this replica's slice. Collectives are XLA
cross-replica ops. Replicas are numbered physically (by the device assignment); mesh
coordinates use logical pnums; `logical_to_physical` maps one to the other.
"""

from __future__ import annotations

from typing import Optional, Sequence

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow import _tf_compat, tpu_variables
from mesh_tensorflow._core.layout import (
    pnum_to_processor_coordinates, processor_coordinates_to_pnum, processor_groups)
from mesh_tensorflow._lowering import laid_out
from mesh_tensorflow._lowering.comm import allreduce_by_allconcat
from mesh_tensorflow._lowering.lazy import convert_args_to_laid_out_tensors
from mesh_tensorflow._lowering.mesh_impl import MeshImpl
from mesh_tensorflow._lowering.tf_helpers import outside_all_rewrites


def _tpu_ops():
  """TPU collective ops (tests replace this function with an emulation)."""
  return _tf_compat.tpu_ops


@gin.configurable(module="mesh_tensorflow.simd_mesh_impl")
class SimdMeshImpl(MeshImpl):
  """Mesh implementation for TPU: SIMD computation, XLA collectives.

  Args:
    shape: the mesh shape (anything mtf.convert_to_shape accepts).
    layout: the layout rules (anything mtf.convert_to_layout_rules accepts).
    devices: deprecated and ignored (placement comes from device_assignment).
    device_assignment: a tf.tpu.experimental.DeviceAssignment with one replica per processor.
    logical_to_physical: a permutation of range(mesh size): logical pnum -> replica id (see
      auto_logical_to_physical_tpu / HierarchicalTiling). Default: the identity.
    allreduce_in_bfloat16_max_group_size: bfloat16 sums over larger groups run in float32.
  """

  allreduce_reductions = ("SUM",)  # XLA's cross-replica sum; MAX and MIN are allconcats

  def __init__(self, shape, layout, devices=None, device_assignment=None,
               logical_to_physical: Optional[Sequence[int]] = None,
               allreduce_in_bfloat16_max_group_size: int = 8):
    super().__init__(shape, layout)
    if devices is not None:
      tf.logging.warning("SimdMeshImpl ignores devices=%s; replicas are placed by the "
                         "device_assignment.", devices)
    self._device_assignment = device_assignment
    if logical_to_physical is None:
      logical_to_physical = range(self.size)
    self._logical_to_physical = list(logical_to_physical)
    _check_logical_to_physical(self._logical_to_physical, self.shape)
    self._physical_to_logical = [None] * self.size
    for logical, physical in enumerate(self._logical_to_physical):
      self._physical_to_logical[physical] = logical
    self._pnum_tensor = None
    self.graph_device_function_stacks = []
    self._allreduce_in_bfloat16_max_group_size = allreduce_in_bfloat16_max_group_size

  @property
  def device_assignment(self):
    return self._device_assignment

  @property
  def devices(self) -> list:
    """Per logical pnum, the TPU device of its replica ("" without a device assignment)."""
    return [self._replica_device(self.l2p(pnum)) for pnum in range(self.size)]

  def _replica_device(self, physical_pnum: int) -> str:
    if self._device_assignment is None:
      return ""
    return self._device_assignment.tpu_device(replica=physical_pnum)

  @property
  def supports_control_dependencies(self) -> bool:
    return False  # XLA orders ops itself, so mtf.depend is refused

  @property
  def pnum_tensor(self):
    """This replica's logical pnum: a replicated input fed physical_to_logical[replica]."""
    if self._pnum_tensor is None:
      with outside_all_rewrites():
        self._pnum_tensor = _tpu_ops().tpu_replicated_input(self._physical_to_logical,
                                                            name="pnum_constants")
    return self._pnum_tensor

  def l2p(self, logical_pnum: int) -> int:
    return self._logical_to_physical[logical_pnum]

  def p2l(self, physical_pnum: int) -> int:
    return self._physical_to_logical[physical_pnum]

  class LaidOutTensor(laid_out.LaidOutTensor):
    """This replica's slice (a one-element tensor list)."""

    def __init__(self, tensor_list):
      assert isinstance(tensor_list, list), tensor_list
      super().__init__(tensor_list)

    @property
    def one_slice(self):
      return self.tensor_list[0]

  class LaidOutVariable(laid_out.LaidOutVariable):
    """One slice variable per replica (collection "TPU_VAR"), seen as one ReplicatedVariable.

    The master variable (checkpointed) lives on the host; copy ops move values both ways.
    """

    def __init__(self, variable, mesh_impl):
      self._variable = variable
      self._mesh_impl = mesh_impl
      shape = variable.outputs[0].shape
      slice_shape = mesh_impl.slice_shape(shape)
      with tf.device(variable.master_device), outside_all_rewrites():
        zero_tensor = tf.zeros(slice_shape, dtype=variable.slice_dtype)
      slices = self._create_slices(variable, zero_tensor)
      self._laid_out_tensor = mesh_impl.LaidOutTensor(
          [tpu_variables.ReplicatedVariable(variable.name, slices)])
      with tf.device(variable.master_device), outside_all_rewrites():
        self._copy_master_to_slices = mesh_impl.register_copy_master_to_slices(
            lambda: self._gen_copy_master_to_slices_op(variable.get_master(), shape, slices))
        in_master_dtype = [tf.cast(s, variable.master_dtype) for s in slices]
        logical_order = [in_master_dtype[mesh_impl.l2p(pnum)] for pnum in range(mesh_impl.size)]
        self._copy_slices_to_master = variable.assign_to_master(
            mesh_impl.combine_slices(logical_order, shape, device=variable.master_device))

    def _create_slices(self, variable, zero_tensor) -> list:
      """Slice variables in physical pnum order, each on its replica's device."""
      mesh_impl = self._mesh_impl
      if tf.executing_eagerly():
        slices = []
        for physical_pnum in range(mesh_impl.size):
          with tf.device(mesh_impl._replica_device(physical_pnum)):  # pylint: disable=protected-access
            slices.append(self._create_slice(variable, zero_tensor, physical_pnum))
        return slices
      # Entering tf.device() once per slice is slow on large pods: reuse per-replica device stacks.
      graph = tf.get_default_graph()
      if not mesh_impl.graph_device_function_stacks:
        for physical_pnum in range(mesh_impl.size):
          with tf.device(mesh_impl._replica_device(physical_pnum)):  # pylint: disable=protected-access
            mesh_impl.graph_device_function_stacks.append(graph._device_function_stack.copy())  # pylint: disable=protected-access
      initial_stack = graph._device_function_stack  # pylint: disable=protected-access
      try:
        slices = []
        for physical_pnum in range(mesh_impl.size):
          graph._device_function_stack = mesh_impl.graph_device_function_stacks[physical_pnum]  # pylint: disable=protected-access
          slices.append(self._create_slice(variable, zero_tensor, physical_pnum))
      finally:
        graph._device_function_stack = initial_stack  # pylint: disable=protected-access
      return slices

    def _create_slice(self, variable, zero_tensor, physical_pnum: int):
      # Resource variables, so that a replicated handle can be formed inside the TPU computation.
      kwargs = dict(trainable=variable.trainable, collections=["TPU_VAR"], dtype=variable.slice_dtype,
                    name=variable.name + "_slice_%d" % physical_pnum, use_resource=True)
      if tf.get_variable_scope().reuse == tf.AUTO_REUSE:
        return tf.get_variable(initializer=zero_tensor, **kwargs)
      # tf.Variable adds far fewer ops to the graph than tf.get_variable.
      return tf.Variable(initial_value=zero_tensor, **kwargs)

    def _gen_copy_master_to_slices_op(self, master, master_shape, slices):
      """Assigns each replica's part of the master (cast to the slice dtype) to its slice."""
      mesh_impl = self._mesh_impl
      if master.dtype.base_dtype != slices[0].dtype.base_dtype:
        master = tf.cast(master, slices[0].dtype.base_dtype)
      parts = mesh_impl.master_parts(master, master_shape)
      return tf.group([tf.assign(slices[mesh_impl.l2p(pnum)], part) for pnum, part in enumerate(parts)])

    def assign_to_slices(self, assign_fn, values):
      """tf.group of assign_fn(mtf_variable, slice, value) on this replica's slice.

      `values`: a LaidOutTensor (or a one-element list) holding this replica's new value.
      """
      values = getattr(values, "tensor_list", values)
      return tf.group([assign_fn(self._variable, self._laid_out_tensor.one_slice, values[0])])

  def laid_out_pnum(self):
    return self.LaidOutTensor([self.pnum_tensor])

  def _create_group_assignment(self, mesh_axes) -> list:
    """Replica groups (physical pnums) of processors that differ only along mesh_axes.

    Within a group, replicas are in increasing logical coordinate along those axes.
    """
    return [[self.l2p(pnum) for pnum in group] for group in processor_groups(self.shape, mesh_axes)]

  def allreduce(self, x, mesh_axes, reduction_fn_string: str):
    """Reduction over the processors that differ only along mesh_axes ("SUM", "MAX", "MIN")."""
    if not mesh_axes:
      return x
    if reduction_fn_string not in self.allreduce_reductions:
      return allreduce_by_allconcat(self, x, mesh_axes, reduction_fn_string, self.allconcat)
    x = x.to_laid_out_tensor()
    group_assignment = self._create_group_assignment(mesh_axes)
    t = x.one_slice
    dtype = t.dtype
    if dtype == tf.float32:
      in_float32 = False
    elif dtype == tf.bfloat16:
      in_float32 = len(group_assignment[0]) > self._allreduce_in_bfloat16_max_group_size
    else:
      in_float32 = True  # XLA cross-replica sums want floats
    if in_float32:
      t = tf.cast(t, tf.float32)
    t = _tpu_ops().cross_replica_sum(t, group_assignment)
    if in_float32:
      t = tf.cast(t, dtype)
    return self.LaidOutTensor([t])

  def allconcat(self, x, mesh_axis: int, concat_axis: int, stack: bool = False):
    """Concatenation (or, with stack, stacking) of a group's slices along concat_axis, on every member.

    Each member places its slice at its coordinate in a zero tensor; a SUM allreduce merges them.
    """
    x = x.to_laid_out_tensor()
    coord = self.laid_out_pcoord(mesh_axis).one_slice
    t = x.one_slice
    old_shape = t.shape.as_list()
    num_parts = self.shape[mesh_axis].size
    t = tf.expand_dims(t, concat_axis)
    mask_shape = [num_parts if i == concat_axis else 1 for i in range(len(old_shape) + 1)]
    t *= tf.reshape(tf.one_hot(coord, num_parts, dtype=t.dtype), mask_shape)
    if not stack:
      new_shape = list(old_shape)
      new_shape[concat_axis] *= num_parts
      t = tf.reshape(t, new_shape)
    return self.allreduce(self.LaidOutTensor([t]), [mesh_axis], "SUM")

  def alltoall(self, x, mesh_axis: int, split_axis: int, concat_axis: int):
    """Member i sends its j-th piece along split_axis to member j, which concatenates in order.

    float32 travels as bfloat16 (a workaround kept from upstream mesh_tensorflow).
    """
    t = x.to_laid_out_tensor().one_slice
    group_assignment = self._create_group_assignment([mesh_axis])
    dtype = t.dtype
    if dtype == tf.float32:
      t = tf.cast(t, tf.bfloat16)
    t = _tpu_ops().all_to_all(t, concat_dimension=concat_axis, split_dimension=split_axis,
                              split_count=len(group_assignment[0]),
                              group_assignment=group_assignment)
    if dtype == tf.float32:
      t = tf.cast(t, tf.float32)
    return self.LaidOutTensor([t])

  def receive(self, x, mesh_axis: int, source_pcoord):
    """Member k of each group along mesh_axis gets member source_pcoord[k]'s slice (or zeros)."""
    t = x.to_laid_out_tensor().one_slice
    source_target_pairs = []
    for pnum in range(self.size):
      coord = pnum_to_processor_coordinates(self.shape, pnum)
      source = source_pcoord[coord[mesh_axis]]
      if source is not None:
        coord[mesh_axis] = source
        source_pnum = processor_coordinates_to_pnum(self.shape, coord)
        source_target_pairs.append([self.l2p(source_pnum), self.l2p(pnum)])
    if not source_target_pairs:
      ret = tf.zeros_like(t)
    elif t.dtype in (tf.float32, tf.bfloat16, tf.int32):
      ret = _tpu_ops().collective_permute(t, source_target_pairs)
    else:
      ret = tf.cast(_tpu_ops().collective_permute(tf.cast(t, tf.float32), source_target_pairs),
                    t.dtype)
    return self.LaidOutTensor([ret])

  def slice(self, tf_tensor, tensor_shape):
    """This replica's slice of a whole tf tensor (its slice_begin looked up by pnum_tensor)."""
    if self.tensor_layout(tensor_shape).is_fully_replicated:
      return self.LaidOutTensor([tf_tensor])
    slice_begins = tf.constant([self.slice_begin(tensor_shape, pnum) for pnum in range(self.size)])
    begin = tf.gather(slice_begins, self.pnum_tensor)
    return self.LaidOutTensor([tf.slice(tf_tensor, begin, self.slice_shape(tensor_shape))])

  def slicewise(self, fn, *inputs):
    """fn applied to this replica's slices (other arguments passed unchanged)."""
    inputs = convert_args_to_laid_out_tensors(inputs)
    ret = fn(*[x.one_slice if isinstance(x, self.LaidOutTensor) else x for x in inputs])
    if isinstance(ret, tuple):
      return tuple(self.LaidOutTensor([t]) for t in ret)
    return self.LaidOutTensor([ret])

  def export_to_tf_tensor(self, x, laid_out_x):
    """The whole value of a fully replicated tensor (every replica holds all of it)."""
    tensor_layout = self.tensor_layout(x.shape)
    if not tensor_layout.is_fully_replicated:
      raise NotImplementedError(
          f"SimdMeshImpl can only export fully replicated tensors; {x.name!r} of {x.shape} has "
          f"layout {tensor_layout}. Reshape it to new (unsplit) dimension names first.")
    return laid_out_x.one_slice

  def import_tf_tensor(self, x, tf_x):
    return self.slice(tf_x, x.shape)


def _check_logical_to_physical(logical_to_physical: list, shape) -> None:
  if sorted(logical_to_physical) != list(range(shape.size)):
    raise ValueError(
        f"logical_to_physical must be a permutation of range({shape.size}) for mesh {shape}, "
        f"got {logical_to_physical}.")
