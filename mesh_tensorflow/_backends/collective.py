"""CollectiveMeshImpl: CPU/GPU meshes on TF collective ops, within one process or across several.

Every process runs the same script and builds the same mtf graph; each owns a contiguous block of
the mesh's processors (its local devices) and lowers only those. A LaidOutTensor holds this
process's slices, in pnum order. Collectives go through `tf_collectives.py`: groups held wholly
by this process use plain ops and copies (measured fastest there), groups that span processes use
TF collective ops with keys every process derives identically.

Master variables exist in every process, initialised identically (seeded initializers); copying
slices back to the masters gathers each variable with collectives, so every process's masters
hold the whole value and any one of them (the chief) can write a checkpoint.
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow.compat.v1 as tf

from mesh_tensorflow._backends import tf_collectives
from mesh_tensorflow._backends.placement import PlacementMeshImpl
from mesh_tensorflow._launch.cluster import Cluster
from mesh_tensorflow._lowering import comm as comm_lib
from mesh_tensorflow._lowering.mesh_impl import MeshImpl


def default_devices(num_processors: int, cluster: Optional[Cluster]) -> list:
  """One device per processor: this machine's GPUs (else CPUs), or the cluster's tasks' in turn."""
  if cluster is not None:
    return cluster.devices(num_processors)
  gpus = tf.config.list_logical_devices("GPU")
  local = [d.name for d in gpus] or [d.name for d in tf.config.list_logical_devices("CPU")]
  if len(local) < num_processors:
    raise ValueError(
        f"CollectiveMeshImpl: the mesh has {num_processors} processors but this process sees "
        f"{len(local)} devices ({local}). Pass devices=[...] explicitly, configure more logical "
        f"devices, or spread the mesh over processes with a Cluster.")
  return local[:num_processors]


class CollectiveMeshImpl(PlacementMeshImpl):
  """Mesh implementation for CPU/GPU devices in one or several processes, on TF collective ops.

  Processor `pnum` (row-major over the mesh shape) computes on `all_devices[pnum]`; this process
  holds the processors whose device belongs to its own task (all of them without a cluster).

  Args:
    shape: the mesh shape, an mtf.Shape or a string such as "rows:2;cols:4".
    layout: layout rules, an mtf.LayoutRules or a string such as "batch:rows;d_ff:cols".
    devices: one TF device string per processor (default: this machine's GPUs or CPUs, or with a
      cluster, each task's devices in task order, so each task owns a contiguous block).
    cluster: a `mesh_tensorflow.collective_mesh_impl.Cluster` when the mesh spans processes
      (e.g. `Cluster.from_tf_config()`); None for a single process.
    timeout_seconds: a collective between processes that waits longer than this for a peer fails
      (0: no limit). Defaults to the cluster's `collective_timeout_seconds`.
    in_process_fast_path: False makes groups within this process use TF collective ops too.
    fuse_slicewise, jit_compile: as for PlacementMeshImpl (each local device calls one traced
      program per segment of slicewise computations); share_replicas as for PlacementMeshImpl,
      within this process (its devices are this process's devices).
    masters: "whole" (default) or "sliced" (no whole master variables; see PlacementMeshImpl).
      "sliced" needs every processor in this process: across processes each one holds only its
      own slices, and one process (the chief) writes the checkpoint, which must hold every
      variable whole; there the whole masters, gathered by every process, do that.

  Example:
    cluster = Cluster.from_tf_config()  # None when TF_CONFIG is unset
    mesh_impl = CollectiveMeshImpl("rows:2;cols:4", "batch:rows;d_ff:cols", cluster=cluster)
  """

  def __init__(self, shape, layout, devices: Optional[Sequence[str]] = None,
               cluster: Optional[Cluster] = None, timeout_seconds: Optional[float] = None,
               in_process_fast_path: bool = True, *, masters: str = "whole",
               fuse_slicewise: bool = True, jit_compile: bool = False,
               share_replicas: Optional[bool] = None):
    if devices is None:
      devices = default_devices(MeshImpl(shape, layout).size, cluster)
    super().__init__(shape, layout, list(devices), masters=masters, fuse_slicewise=fuse_slicewise,
                     jit_compile=jit_compile, share_replicas=share_replicas)
    self._all_devices = list(devices)
    self._cluster = cluster
    if cluster is None:
      self._local_pnums = list(range(self.size))
    elif tf.executing_eagerly():
      raise ValueError(
          "CollectiveMeshImpl: a mesh spanning processes (a Cluster was given) runs in graph mode "
          "only; call tf.compat.v1.disable_eager_execution() first, or build under "
          "tf.Graph().as_default().")
    else:
      self._local_pnums = [p for p, d in enumerate(self._all_devices) if cluster.is_local(d)]
      if not self._local_pnums:
        raise ValueError(
            f"CollectiveMeshImpl: none of the devices {self._all_devices} belongs to this process "
            f"(task {cluster.task_index} of job {cluster.job!r}); give each task a block of devices.")
    if masters == "sliced" and self.is_multi_process:
      raise ValueError(
          f"CollectiveMeshImpl: masters='sliced' needs every processor in one process, but this "
          f"process holds {len(self._local_pnums)} of the mesh's {self.size}. Across processes use "
          f"masters='whole' (the default): every process gathers whole masters, so the chief can "
          f"write checkpoints holding every variable (docs/multi_process.md).")
    self._compute_on([self._all_devices[p] for p in self._local_pnums], share_replicas)
    if timeout_seconds is None:
      timeout_seconds = cluster.collective_timeout_seconds if cluster is not None else 0.0
    self._settings = tf_collectives.CollectiveSettings(
        timeout_seconds=timeout_seconds, in_process_fast_path=in_process_fast_path)

  class LaidOutTensor(PlacementMeshImpl.LaidOutTensor):
    """This process's slices, one tf.Tensor per local processor, in pnum order."""

  @property
  def all_devices(self) -> list:
    """Every processor's device, in pnum order."""
    return self._all_devices

  @property
  def local_pnums(self) -> list:
    """The processors this process holds and lowers (a contiguous block)."""
    return self._local_pnums

  @property
  def is_multi_process(self) -> bool:
    return len(self._local_pnums) < self.size

  @property
  def cluster(self) -> Optional[Cluster]:
    return self._cluster

  def laid_out_pnum(self):
    return self.LaidOutTensor(list(self._local_pnums))

  def allreduce(self, x, mesh_axes, reduction_fn_string):
    return self._by_group(x, mesh_axes, lambda xs, d: tf_collectives.allreduce(
        xs, d, reduction_fn_string, self._settings, share_result=self.share_replicas))

  def allconcat(self, x, mesh_axis, concat_axis):
    return self._by_group(x, [mesh_axis], lambda xs, d: tf_collectives.allconcat(
        xs, d, concat_axis, self._settings, share_result=self.share_replicas))

  def alltoall(self, x, mesh_axis, split_axis, concat_axis):
    return self._by_group(x, [mesh_axis], lambda xs, d: tf_collectives.alltoall(
        xs, d, split_axis, concat_axis, self._settings))

  def receive(self, x, mesh_axis, source_pcoord):
    return self._by_group(x, [mesh_axis], lambda xs, d: tf_collectives.receive(
        xs, d, source_pcoord, self._settings))

  # ---- whole tensors <-> this process's slices ----

  def make_slices(self, tf_tensor, tensor_shape) -> list:
    """This process's slices of a whole tf tensor, in pnum order, on the tensor's device."""
    every = super().make_slices(tf_tensor, tensor_shape)
    return [every[p] for p in self._local_pnums]

  def master_parts(self, master, master_shape) -> list:
    """Per local processor, its part of the whole tensor `master`."""
    every = super().master_parts(master, master_shape)
    return [every[p] for p in self._local_pnums]

  def combine_slices(self, slices: list, tensor_shape, device=None):
    """The whole tensor from this process's slices; across processes, gathered with collectives."""
    if not self.is_multi_process:
      return super().combine_slices(slices, tensor_shape, device)
    x = self.LaidOutTensor(list(slices))
    comm = comm_lib.for_backend(self)  # recorded as an event of the op the lowering charges
    for mesh_axis, tensor_axis in enumerate(
        self.tensor_layout(tensor_shape).mesh_axis_to_tensor_axis(self.ndims)):
      if tensor_axis is not None:
        x = comm.allconcat(x, mesh_axis, tensor_axis, "combine_slices")
    with tf.device(device if device else self._devices[0]):
      return tf.identity(x.tensor_list[0])

  def import_tf_tensor(self, x, tf_x):
    return self.LaidOutTensor(self.make_slices(tf_x, x.shape))
