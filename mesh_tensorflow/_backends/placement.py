"""PlacementMeshImpl: one TF tensor per processor, each placed with tf.device.

Works with any device strings: "" (no placement), "cpu:N", "gpu:N", or
"/job:worker/task:K/device:CPU:0" in a TF cluster; in graph mode and in eager mode.

Collectives pick their algorithm by where the devices are (`benchmarks/bench_transformer.py`
and `benchmarks/bench_collectives.py` measure them):

* CPU devices of one process: an allreduce is one reduction on the group's first device, and an
  allconcat one concat, whose result every member reads (with share_replicas; else a copy, or a
  concat, per member), because reading between CPU devices of one process costs almost nothing
  (8 MB in 32 tensors over 8 devices: ~3 ms, against ~40 ms for a ring of copies or TF's
  CollectiveReduceV2);
* anything else (GPUs, devices of several tasks or hosts): bidirectional rings of copies
  (`ring_collectives.py`), which spread the bytes each link carries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from typing import Optional, Sequence

import tensorflow.compat.v1 as tf
from tensorflow.core.protobuf import rewriter_config_pb2

from mesh_tensorflow._backends import cpu_contraction, ring_collectives, tf_collectives
from mesh_tensorflow._backends.device_program import DeviceProgram
from mesh_tensorflow._backends.sliced_variables import SlicedLaidOutVariable
from mesh_tensorflow._backends.variable_policy import VariablePolicy
from mesh_tensorflow._core.layout import processor_groups
from mesh_tensorflow._lowering import laid_out
from mesh_tensorflow._lowering.lazy import convert_args_to_laid_out_tensors
from mesh_tensorflow._lowering.mesh_impl import MeshImpl
from mesh_tensorflow._lowering.tf_helpers import parallel, transpose_list_of_lists

class PlacementMeshImpl(MeshImpl):
  """Mesh implementation for CPU/GPU device lists (one slice per device).

  Processor `pnum` (row-major over the mesh shape, last dimension fastest) computes on
  `devices[pnum]`; collectives are copies between those devices.

  Args:
    shape: the mesh shape, an mtf.Shape or a string such as "rows:2;cols:4".
    layout: layout rules, an mtf.LayoutRules or a string such as "batch:rows;d_ff:cols".
    devices: one TF device string per processor: "" (no placement), "cpu:N", "gpu:N", or
      "/job:worker/task:K/device:GPU:N" in a TF cluster.
    master_as_slice: for a variable the layout leaves whole, the processor on the master's device
      uses the master itself as its slice, so that device holds one copy instead of two. Then
      the master must be changed only through copy_masters_to_slices (assigning it directly
      would change that processor's slice and not the others').
    masters: "whole" (default): each variable has a whole master tf.Variable on its master device
      (mesh.variable_placer_fn), which checkpoints hold, beside the slices. "sliced": no whole
      master; the slices are checkpointed as parts of the whole variables (TF's SaveSliceInfo),
      so no device holds more than its slices (`_backends/sliced_variables.py`,
      docs/checkpoints.md). Checkpoints are the same in both modes; "whole" stays the default
      because scripts may read or assign the masters as tf.Variables.
    fuse_slicewise: in graph mode, trace each slicewise computation once into a per-device
      program called on every device (`_backends/device_program.py`) instead of building its
      ops per device: the same results, a program and a lowering time that barely grow with the
      device count.
    jit_compile: compile each fused per-device program with XLA.
    share_replicas: processors holding equal slices of a variable (the layout replicates it
      along some mesh dimensions) share one slice variable, on the first one's device, which is
      updated once per step; and processors holding equal values share one computation of what
      follows from them (the device program's calls, collectives' results). None (default):
      share when every device is a CPU of this process, where reading a tensor of another
      device is no copy; GPUs keep a replica each and compute it in parallel.

  Raises:
    ValueError: the number of devices differs from the number of processors, or an unknown
      `masters`, or master_as_slice with masters="sliced".

  Example:
    mesh_impl = PlacementMeshImpl("rows:2;cols:4", "batch:rows", ["gpu:%d" % i for i in range(8)])
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
  """

  def __init__(self, shape, layout, devices, master_as_slice: bool = False, *,
               masters: str = "whole", fuse_slicewise: bool = True, jit_compile: bool = False,
               share_replicas: Optional[bool] = None):
    super().__init__(shape, layout)
    devices = list(devices)
    if len(devices) != self.size:
      raise ValueError(
          f"PlacementMeshImpl: mesh {self.shape} has {self.size} processors but {len(devices)} "
          f"devices were given ({devices}); pass exactly one device string per processor.")
    self._variable_policy = VariablePolicy(masters, master_as_slice)  # share_replicas: below
    self._cpus_of_one_process = cpus_of_one_process(devices)
    if masters == "sliced":
      self.LaidOutVariable = SlicedLaidOutVariable  # what Variable.lower builds, for this mesh
    self._fuse_slicewise = fuse_slicewise
    self._jit_compile = jit_compile
    self._compute_on(devices, share_replicas)

  def _compute_on(self, devices: list, share_replicas: Optional[bool]) -> None:
    """The devices this process holds slices on, whether they share replicas, and their program."""
    self._devices = devices
    self._cpu_contractions = all_cpus(devices)
    if share_replicas is None:
      share_replicas = cpus_of_one_process(devices)
    self._variable_policy = dataclasses.replace(self._variable_policy, share_replicas=share_replicas)
    self._program = DeviceProgram(devices, self._jit_compile, share_replicas)

  class LaidOutTensor(laid_out.LaidOutTensor):
    """One tf.Tensor per processor, in pnum order."""

  class LaidOutVariable(laid_out.LaidOutVariable):
    """A master variable plus one slice variable per processor (slices are not checkpointed).

    With master_as_slice, a variable the layout does not split, held whole by every processor,
    has the master itself as the slice of the processor on the master's device (when their
    dtypes agree and the master is a resource variable), so no device holds a second copy of it.

    With share_replicas, processors whose slices are equal share the first one's slice variable:
    the others use its read (the same tf.Tensor, so the device program computes with it once)
    and their assignments are dropped, since mtf gives every replica of a tensor the same value.

    The graph reads each slice once (a snapshot) and every assignment waits for those reads, so a
    step that both reads and updates a variable sees its old value everywhere. In eager mode the
    copies between master and slices run when they are asked for.
    """

    def __init__(self, variable, mesh_impl):
      self._variable = variable
      self._mesh_impl = mesh_impl
      shape = variable.outputs[0].shape
      master_device = getattr(variable, "master_device", None) or ""
      slice_shape = mesh_impl.slice_shape(shape)
      parts = mesh_impl.variable_policy.parts_of(variable, mesh_impl)
      master_pnum, self._slice_is_master, self._owners = (
          parts.master_pnum, parts.slice_is_master, parts.owners)
      if self._slice_is_master:
        self._slices = [variable.get_master()]
        copies = (tf.no_op, tf.no_op)
      else:
        self._slices = []
        for i, device in enumerate(mesh_impl.devices):
          if self._owners[i] != i:
            self._slices.append(self._slices[self._owners[i]])
          elif i == master_pnum:
            self._slices.append(variable.get_master())
          else:
            self._slices.append(laid_out.slice_variable(
                variable.name + "_slice_%d" % i, slice_shape, variable.slice_dtype, device))
        copies = (functools.partial(self._assign_master_to_slices, shape),
                  functools.partial(self._combine_slices_into_master, shape, master_device))
      self._build_copies(mesh_impl, *copies)
      self._reads = self.read().tensor_list
      self._laid_out_tensor = mesh_impl.LaidOutTensor(self._reads)

    def _assign_master_to_slices(self, master_shape):
      parts = self._mesh_impl.master_parts(self._variable.get_master(), master_shape)
      return self._assign(
          lambda variable, slice_var, value: tf.assign(slice_var, tf.cast(value, variable.slice_dtype)),
          parts, after_reads=False)

    def _combine_slices_into_master(self, master_shape, master_device):
      variable = self._variable
      return variable.assign_to_master(self._mesh_impl.combine_slices(
          [tf.cast(s, variable.master_dtype) for s in self._slices], master_shape, device=master_device))

    def read(self):
      """A fresh read of every slice (ReadVariable uses it to see values assigned earlier)."""
      reads = []
      for i, (device, slice_var) in enumerate(zip(self._mesh_impl.devices, self._slices)):
        if self._owners[i] != i:  # the owner's read itself, so computations on it are shared too
          reads.append(reads[self._owners[i]])
          continue
        with tf.device(device):
          reads.append(slice_var.read_value() if hasattr(slice_var, "read_value")
                       else tf.identity(slice_var))
      return self._mesh_impl.LaidOutTensor(reads)

    def assign_to_slices(self, assign_fn, values):
      """tf.group of assign_fn(mtf_variable, slice_variable, value) per processor.

      `values`: a LaidOutTensor (or a list of per-processor tensors). In graph mode the
      assignments wait for this step's reads of the slices.
      """
      return self._assign(assign_fn, getattr(values, "tensor_list", values), after_reads=True)

    def _assign(self, assign_fn, values: list, after_reads: bool):
      """The assignments, waiting for the slice reads if after_reads (master copies need not)."""
      reads = self._reads if after_reads and not tf.executing_eagerly() else None
      owners = [i for i, owner in enumerate(self._owners) if owner == i]
      values = list(values)
      with tf.control_dependencies(reads):
        return tf.group(parallel([self._mesh_impl.devices[i] for i in owners], assign_fn,
                                 [self._variable] * len(owners), [self._slices[i] for i in owners],
                                 [values[i] for i in owners]))

    @property
    def slice_is_master(self):
      return self._slice_is_master

  @property
  def devices(self):
    return self._devices

  @property
  def all_devices(self) -> list:
    """Every processor's device, in pnum order (here: `devices`, every one held by this process)."""
    return self._devices

  @property
  def variable_policy(self) -> VariablePolicy:
    """Which TF variables each mtf Variable becomes (`_backends/variable_policy.py`)."""
    return self._variable_policy

  @property
  def share_replicas(self) -> bool:
    """Whether processors with equal slices share one slice variable and one computation of them.

    Unless set at construction: when this process's devices are all CPUs of one process.
    """
    return self._variable_policy.share_replicas

  @property
  def master_as_slice(self) -> bool:
    """Whether a variable the layout leaves whole uses its master as a processor's slice."""
    return self._variable_policy.master_as_slice

  def session_config(self, config: Optional[tf.ConfigProto] = None) -> tf.ConfigProto:
    """A copy of `config` (or a new ConfigProto) set up to run this mesh in a tf.Session.

    See `session_config_for_devices`: virtual CPU devices for the mesh, and on CPU devices of
    one process each kernel limited to its processor's share of the cores.
    """
    return session_config_for_devices(self._devices, config)

  @property
  def masters(self) -> str:
    """"whole" (a master tf.Variable per variable) or "sliced" (checkpointed slices, no master)."""
    return self._variable_policy.masters

  def fusing(self, is_needed=None):
    """While a Lowering runs: slicewise computations go into the per-device program.

    is_needed(laid_out): whether a pending value may be read again (see DeviceProgram.fusing).

    Not for a program on one device, unless it is compiled: there the program is as small either
    way, and the per-device ops' steps measured 5-8% faster than one traced call's.
    """
    if self._fuse_slicewise and (len(self._devices) > 1 or self._jit_compile):
      return self._program.fusing(is_needed)
    return contextlib.nullcontext()

  def slicewise(self, fn, *inputs):
    """Applies fn per processor (slice held); non-laid-out arguments are given to every one.

    While a Lowering fuses (graph mode), fn is traced once and its result stays pending until
    a value is needed (see `_backends/device_program.py`).
    """
    inputs = convert_args_to_laid_out_tensors(inputs)
    fused = self._program.slicewise(fn, inputs, self.LaidOutTensor)
    if fused is not None:
      return fused
    n = len(self._devices)
    inputs = [x.tensor_list if isinstance(x, self.LaidOutTensor) else [x] * n for x in inputs]
    ret = parallel(self._devices, fn, *inputs)
    if isinstance(ret[0], tuple):
      return tuple(self.LaidOutTensor(list(t)) for t in transpose_list_of_lists(ret))
    return self.LaidOutTensor(ret)

  def Print(self, x, data, message, **kwargs):  # pylint: disable=invalid-name
    tf.logging.info("PlacementMeshImpl::Print")
    x = x.to_laid_out_tensor()
    new_slices = x.tensor_list[:]
    with tf.device(self._devices[0]):
      new_slices[0] = tf.Print(new_slices[0], [t for d in data for t in d.tensor_list],
                               message, **kwargs)
    return self.LaidOutTensor(new_slices)

  def _by_group(self, x, mesh_axes, collective):
    """Runs collective(xs, devices) within every group of processors along mesh_axes.

    The one group dispatcher of the placement-style backends: xs and devices are the group's, in
    coordinate order; a member this process does not hold (CollectiveMeshImpl across processes)
    gives None and gets None back.
    """
    if not mesh_axes:
      return x
    x = x.to_laid_out_tensor()
    held = dict(zip(self.local_pnums, x.tensor_list))
    ret = {}
    for group in processor_groups(self.shape, mesh_axes):
      ys = collective([held.get(p) for p in group], [self.all_devices[p] for p in group])
      ret.update({p: y for p, y in zip(group, ys) if y is not None})
    return self.LaidOutTensor([ret[p] for p in self.local_pnums])

  def einsum(self, equation: str, *slices):
    """On CPUs, a product runs on the matmul kernel that is fastest there (cpu_contraction)."""
    if self._cpu_contractions and len(slices) == 2:
      return cpu_contraction.einsum(equation, *slices)
    return super().einsum(equation, *slices)

  def allreduce(self, x, mesh_axes, reduction_fn_string):
    if self._cpus_of_one_process:
      def collective(xs, devices):
        return tf_collectives.allreduce(xs, devices, reduction_fn_string,
                                        share_result=self.share_replicas)
    else:
      def collective(xs, devices):
        return ring_collectives.allreduce_ring(xs, devices, reduction_fn_string)
    return self._by_group(x, mesh_axes, collective)

  def allconcat(self, x, mesh_axis, concat_axis):
    if self._cpus_of_one_process:
      def collective(xs, devices):
        return tf_collectives.allconcat(xs, devices, concat_axis, share_result=self.share_replicas)
    else:
      def collective(xs, devices):
        return ring_collectives.allconcat_ring(xs, devices, concat_axis)
    return self._by_group(x, [mesh_axis], collective)

  def alltoall(self, x, mesh_axis, split_axis, concat_axis):
    return self._by_group(
        x, [mesh_axis],
        lambda xs, devices: ring_collectives.alltoall_pointtwise(xs, devices, split_axis, concat_axis))

  def receive(self, x, mesh_axis, source_pcoord):
    x = x.to_laid_out_tensor()
    shape = x.tensor_list[0].shape
    dtype = x.tensor_list[0].dtype

    def _collective(xs, devices):
      ret = []
      for device, source in zip(devices, source_pcoord):
        with tf.device(device):
          ret.append(tf.zeros(shape, dtype) if source is None else tf.identity(xs[source]))
      return ret
    return self._by_group(x, [mesh_axis], _collective)

  def laid_out_pnum(self):
    return self.LaidOutTensor(list(range(self.size)))

  def export_to_tf_tensor(self, x, laid_out_x):
    return self.combine_slices(laid_out_x.all_slices, x.shape)

  def import_tf_tensor(self, x, tf_x):
    return self.LaidOutTensor(self.make_slices(tf_x, x.shape))



def session_config_for_devices(devices: Sequence[str], config: Optional[tf.ConfigProto] = None,
                               cores: Optional[int] = None) -> tf.ConfigProto:
  """A copy of `config` (or a new ConfigProto) for a session computing on `devices`.

  * device_count["CPU"]: enough virtual CPU devices for the highest "cpu:N" named (unless set);
  * on several CPU devices of one process, intra_op_parallelism_threads = max(1, cores //
    devices) (unless set): the processors' kernels already run concurrently, so each kernel gets
    its processor's share of the machine's `cores` (default: the cores this process may use).
    Measured on the benchmark Transformer, 8 virtual devices on 2 cores (benchmarks/RESULTS.md):
    steps 10-25% faster than with TF's default of every core for every kernel;
  * on CPU devices, `lean_graph_optimization` (unless `config` sets any rewrite option).
  """
  ret = tf.ConfigProto()
  if config is not None:
    ret.CopyFrom(config)
  cpu_ids = [int(m.group(1)) for d in devices for m in [re.search(r"cpu:(\d+)$", d.lower())] if m]
  if cpu_ids and "CPU" not in ret.device_count:
    ret.device_count["CPU"] = max(cpu_ids) + 1
  if len(devices) > 1 and cpus_of_one_process(devices) and not ret.intra_op_parallelism_threads:
    cores = cores or usable_cores()
    ret.intra_op_parallelism_threads = max(1, cores // len(devices))
  if devices and all_cpus(devices) and not ret.graph_options.HasField("rewrite_options"):
    lean_graph_optimization(ret.graph_options.rewrite_options)
  return ret


def usable_cores() -> int:
  """The cores this process may run on: its CPU affinity where the OS has one (Linux), else all."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def lean_graph_optimization(rewrite_options) -> None:
  """Sets TF's graph optimiser (grappler) to skip what costs a mesh's first step and gains no step.

  A lowered graph calls a function per segment of its device program, and grappler optimises
  every function body at the session's first run. Its MLIR pass (tfg), its memory optimiser and
  its second round of every pass took about half of that time; without them, model-parallel 8's
  first step took 0.66 s instead of 1.20 s and 2x4's 0.72 s instead of 1.14 s, with steps as
  fast (benchmarks/RESULTS.md, "Lean grappler").
  """
  rewrite_options.disable_tfg_optimizer = True
  rewrite_options.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
  rewrite_options.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE


def all_cpus(devices) -> bool:
  """True if every device is a CPU (or unplaced, "")."""
  return all(tf.DeviceSpec.from_string(d).device_type in (None, "CPU") for d in devices)


def cpus_of_one_process(devices) -> bool:
  """True if every device is a CPU (or unplaced, "") of one and the same task."""
  specs = [tf.DeviceSpec.from_string(d) for d in devices]
  return all_cpus(devices) and len({(s.job, s.replica, s.task) for s in specs}) == 1
