"""The time model: per-processor FLOPs and communication events -> a predicted step time.

    step_s = flops / flops_per_s                                  (compute)
           + sum over collectives of (latency_s + bytes / bandwidth)   (communication)
           + num_ops * op_overhead_s                              (per-op launch cost)
           + step_overhead_s                                      (per-step floor)

The last two are floors that keep a tiny model from claiming peak FLOP/s: every op costs at least
its launch (a kernel launch on a GPU, an executor dispatch on a CPU, a fused XLA kernel on a TPU)
and every step at least its start and end (session run, host-device synchronisation).

Bandwidth and latency may differ per mesh dimension (e.g. a TPU slice's fast inner axis); a
collective over several mesh dimensions uses the slowest of them. `bytes` is what one processor
sends (CommEvent.bytes_per_processor). Presets: rough defaults for a CPU host, a GPU node and a
TPU slice ("cpu", "gpu", "tpu"), and accelerators with their published numbers ("tpu_v3",
"tpu_v4", "tpu_v5e", "a100", "h100", each naming its sources); `calibrate` measures
flops_per_s, bandwidth, latency and the op and step overheads on the actual devices with a short run.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Optional, Sequence, Union

import numpy as np

PerMeshDim = Union[float, dict]


@dataclasses.dataclass(frozen=True)
class Torus:
  """A TPU slice's inter-chip interconnect (ICI): a 2-D or 3-D torus of chips.

  A mesh dimension is laid along some of the torus axes; a collective over it uses the links of
  those axes. Each mesh dimension of size > 1 gets the share of the chip's ICI bandwidth that its
  share of log2(processors) gives it (a 16x32 mesh on a 2-D torus: 4/9 and 5/9; one mesh dimension:
  all of it), and a latency of `step_latency_s` per ring step (size - 1 steps).
  """

  chip_bandwidth_bytes_per_s: float
  step_latency_s: float

  def resolve(self, mesh_shape) -> tuple:
    dims = [d for d in mesh_shape.dims if d.size > 1]
    total = sum(math.log2(d.size) for d in dims)
    bandwidth = {d.name: self.chip_bandwidth_bytes_per_s * math.log2(d.size) / total for d in dims}
    latency = {d.name: self.step_latency_s * (d.size - 1) for d in dims}
    return bandwidth, latency


@dataclasses.dataclass(frozen=True)
class Hosts:
  """GPU hosts: NVLink among `per_host` processors of one host, a network (InfiniBand) between hosts.

  Processors are numbered row-major over the mesh (the last mesh dimension varies fastest), and
  host h holds processors h * per_host ... (h + 1) * per_host - 1. A mesh dimension whose groups
  stay inside a host (its stride times its size is at most per_host) uses NVLink; any other
  crosses hosts and runs at the network's rate. Latency: `*_step_latency_s` per ring step.
  """

  per_host: int
  nvlink_bytes_per_s: float
  nvlink_step_latency_s: float
  network_bytes_per_s: float
  network_step_latency_s: float

  def resolve(self, mesh_shape) -> tuple:
    bandwidth, latency, stride = {}, {}, 1
    for d in reversed(mesh_shape.dims):
      inside = stride * d.size <= self.per_host
      bandwidth[d.name] = self.nvlink_bytes_per_s if inside else self.network_bytes_per_s
      step = self.nvlink_step_latency_s if inside else self.network_step_latency_s
      latency[d.name] = step * (d.size - 1)
      stride *= d.size
    return bandwidth, latency


@dataclasses.dataclass(frozen=True)
class TimeModel:
  """Rates of one processor. Bandwidth and latency: a number, or {mesh dim name: number} (+ "*" default).

  Attributes:
    memory_bytes: the memory of one processor (HBM), for the `fits` verdict; None if unknown.
    topology: a Torus or Hosts that gives per-mesh-dimension bandwidth and latency for a mesh
      (`for_mesh`); without a mesh, bandwidth_bytes_per_s and latency_s apply to every dimension.
    op_overhead_s: seconds every op adds (its launch), whatever its size.
    step_overhead_s: seconds every step adds (starting it, synchronising host and devices).
    sources: where the numbers come from (title and URL of each public source).
  """

  flops_per_s: float
  bandwidth_bytes_per_s: PerMeshDim
  latency_s: PerMeshDim
  op_overhead_s: float = 0.0
  step_overhead_s: float = 0.0
  name: str = "custom"
  memory_bytes: Optional[float] = None
  topology: Union[None, Torus, Hosts] = None
  sources: tuple = ()

  def _per_dim(self, value: PerMeshDim, mesh_dim: str) -> float:
    if isinstance(value, dict):
      return value.get(mesh_dim, value["*"])
    return value

  def bandwidth(self, mesh_dims: Sequence[str]) -> float:
    return min(self._per_dim(self.bandwidth_bytes_per_s, d) for d in mesh_dims)

  def latency(self, mesh_dims: Sequence[str]) -> float:
    return max(self._per_dim(self.latency_s, d) for d in mesh_dims)

  def collective_s(self, bytes_per_processor: float, mesh_dims: Sequence[str]) -> float:
    """Seconds of one collective in which each processor sends `bytes_per_processor`."""
    return self.latency(mesh_dims) + bytes_per_processor / self.bandwidth(mesh_dims)

  def compute_s(self, flops: float) -> float:
    return flops / self.flops_per_s

  def for_mesh(self, mesh_shape) -> TimeModel:
    """This model with the topology's bandwidth and latency for each dimension of `mesh_shape`."""
    if self.topology is None:
      return self
    bandwidth, latency = self.topology.resolve(mesh_shape)
    return dataclasses.replace(
      self,
      bandwidth_bytes_per_s={**bandwidth, "*": _default(self.bandwidth_bytes_per_s)},
      latency_s={**latency, "*": _default(self.latency_s)},
      topology=None,
    )


def _default(value: PerMeshDim) -> float:
  return value["*"] if isinstance(value, dict) else value


# Step floors (assumed, like the op overheads): 100 us to run a step on a CPU host (a session run
# of a small graph measures about that here), 50 us on a GPU (launching the step's graph), 30 us on
# a TPU (the host starting a compiled step and reading its outputs back).
CPU = TimeModel(
  flops_per_s=2e10, bandwidth_bytes_per_s=5e9, latency_s=2e-5, op_overhead_s=5e-6, step_overhead_s=1e-4,
  name="cpu",
)
GPU = TimeModel(
  flops_per_s=1e14, bandwidth_bytes_per_s=1e11, latency_s=1e-5, op_overhead_s=5e-6, step_overhead_s=5e-5,
  name="gpu",
)
TPU = TimeModel(
  flops_per_s=1.2e14, bandwidth_bytes_per_s=5e10, latency_s=5e-6, op_overhead_s=1e-6, step_overhead_s=3e-5,
  name="tpu",
)

# Accelerators. One processor is one chip (a TPU v3/v4 chip holds two TensorCores; TF on v3 shows
# each core as a device: for a mesh over v3 cores, halve flops_per_s, memory_bytes and bandwidth).
# Vendors publish no collective latency: the per-step latencies below are assumptions (1 us per ICI
# or NVLink ring step, 5 us per InfiniBand step); `calibrate()` measures them on real devices.
# Op overhead (assumed): 0.5 us per mtf op on TPU (XLA compiles the whole step and fuses the
# elementwise ops, but each matmul, reduction or fusion it leaves is a kernel of at least about a
# microsecond), 5 us per op on GPU (a kernel launch). Step overhead: 30 us on TPU, 50 us on GPU.
_TPU_DOCS = "Google Cloud, Cloud TPU documentation, "
_GIB = 2**30

TPU_V3 = TimeModel(
  flops_per_s=123e12,
  memory_bytes=32 * _GIB,
  bandwidth_bytes_per_s=340e12 / 1024,
  latency_s=1e-6,
  op_overhead_s=5e-7,
  step_overhead_s=3e-5,
  topology=Torus(chip_bandwidth_bytes_per_s=340e12 / 1024, step_latency_s=1e-6),
  name="tpu_v3",
  sources=(
    _TPU_DOCS + '"TPU v3", https://cloud.google.com/tpu/docs/v3: peak compute per chip 123 teraflops '
    "(bf16); HBM2 32 GiB per chip; 2D torus; all-reduce bandwidth per Pod 340 TB/s over 1024 chips "
    "(= 332 GB/s of ICI per chip).",
  ),
)
TPU_V4 = TimeModel(
  flops_per_s=275e12,
  memory_bytes=32 * _GIB,
  bandwidth_bytes_per_s=1.1e15 / 4096,
  latency_s=1e-6,
  op_overhead_s=5e-7,
  step_overhead_s=3e-5,
  topology=Torus(chip_bandwidth_bytes_per_s=1.1e15 / 4096, step_latency_s=1e-6),
  name="tpu_v4",
  sources=(
    _TPU_DOCS + '"TPU v4", https://cloud.google.com/tpu/docs/v4: peak compute per chip 275 teraflops '
    "(bf16); HBM2 32 GiB per chip; 3D mesh/torus; all-reduce bandwidth per Pod 1.1 PB/s over 4096 "
    "chips (= 269 GB/s of ICI per chip).",
  ),
)
TPU_V5E = TimeModel(
  flops_per_s=197e12,
  memory_bytes=16e9,
  bandwidth_bytes_per_s=51.2e12 / 256,
  latency_s=1e-6,
  op_overhead_s=5e-7,
  step_overhead_s=3e-5,
  topology=Torus(chip_bandwidth_bytes_per_s=51.2e12 / 256, step_latency_s=1e-6),
  name="tpu_v5e",
  sources=(
    _TPU_DOCS + '"TPU v5e", https://cloud.google.com/tpu/docs/v5e: peak compute per chip 197 TFLOPs '
    "(bf16); HBM2 16 GB per chip; 2D torus; interchip interconnect 1600 Gbps per chip, and all-reduce "
    "bandwidth per Pod 51.2 TB/s over 256 chips (both = 200 GB/s per chip).",
  ),
)
A100 = TimeModel(
  flops_per_s=312e12,
  memory_bytes=80e9,
  bandwidth_bytes_per_s=300e9,
  latency_s=1e-6,
  op_overhead_s=5e-6,
  step_overhead_s=5e-5,
  topology=Hosts(
    per_host=8,
    nvlink_bytes_per_s=300e9,
    nvlink_step_latency_s=1e-6,
    network_bytes_per_s=25e9,
    network_step_latency_s=5e-6,
  ),
  name="a100",
  sources=(
    'NVIDIA, "NVIDIA A100 Tensor Core GPU" datasheet, https://www.nvidia.com/content/dam/en-zz/'
    "Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf: BFLOAT16 "
    "Tensor Core 312 TFLOPS (dense; 624 with sparsity); A100 80GB SXM: 80 GB HBM2e; NVLink 600 GB/s "
    "(both directions: 300 GB/s each way).",
    'NVIDIA, "DGX A100 User Guide", https://docs.nvidia.com/dgx/dgxa100-user-guide/: 8 GPUs per '
    "system, one 200 Gb/s HDR InfiniBand ConnectX-6 adapter per GPU (25 GB/s).",
  ),
)
H100 = TimeModel(
  flops_per_s=989e12,
  memory_bytes=80e9,
  bandwidth_bytes_per_s=450e9,
  latency_s=1e-6,
  op_overhead_s=5e-6,
  step_overhead_s=5e-5,
  topology=Hosts(
    per_host=8,
    nvlink_bytes_per_s=450e9,
    nvlink_step_latency_s=1e-6,
    network_bytes_per_s=50e9,
    network_step_latency_s=5e-6,
  ),
  name="h100",
  sources=(
    'NVIDIA, "NVIDIA H100 Tensor Core GPU" datasheet, https://resources.nvidia.com/en-us-tensor-core/'
    "nvidia-tensor-core-gpu-datasheet: H100 SXM BFLOAT16 Tensor Core 1,979 TFLOPS with sparsity "
    "(989 dense); 80 GB HBM3; NVLink 900 GB/s (both directions: 450 GB/s each way).",
    'NVIDIA, "DGX H100 User Guide", https://docs.nvidia.com/dgx/dgxh100-user-guide/: 8 GPUs per '
    "system, one 400 Gb/s NDR InfiniBand ConnectX-7 port per GPU (50 GB/s).",
  ),
)
ACCELERATORS = {m.name: m for m in (TPU_V3, TPU_V4, TPU_V5E, A100, H100)}
PRESETS = {"cpu": CPU, "gpu": GPU, "tpu": TPU, **ACCELERATORS}


def get_time_model(time_model: Union[None, str, TimeModel]) -> TimeModel:
  """A TimeModel from None (the CPU preset), a preset name (see PRESETS) or a TimeModel."""
  if time_model is None:
    return CPU
  if isinstance(time_model, TimeModel):
    return time_model
  if time_model in PRESETS:
    return PRESETS[time_model]
  raise ValueError(f"Unknown time model {time_model!r}; use one of {sorted(PRESETS)} or a TimeModel.")


def calibrate(devices: Sequence[str], reps: int = 5, size: int = 256, session_config=None) -> TimeModel:
  """Measures a TimeModel on `devices` (one per processor) with a few short runs.

  Runs on a 1-D mesh over all devices (graph mode, placement backend): a matmul split over every
  processor (no communication; all processors at once, so devices sharing cores count as slower)
  for flops_per_s; allreduces of two sizes for latency and bandwidth (a straight line through the
  two medians); chains of 1 and 101 elementwise sines for op_overhead_s (their difference) and
  step_overhead_s (the 1-op step less its op). The same bandwidth
  and latency then apply to every mesh dimension.

  Args:
    devices: device strings, one per processor.
    reps: timed runs per measurement (the median is used).
    size: edge of the square matrices each processor multiplies.
    session_config: a tf.ConfigProto for the measuring sessions.
  """
  import tensorflow.compat.v1 as tf

  from mesh_tensorflow import ops_with_redefined_builtins as mtf
  from mesh_tensorflow._backends.placement import PlacementMeshImpl

  n = len(devices)
  rows = mtf.Dimension("rows", n * size)
  cols, inner = mtf.Dimension("cols", size), mtf.Dimension("inner", size)

  def median_s(build):
    with tf.Graph().as_default():
      graph = mtf.Graph()
      mesh = mtf.Mesh(graph, "calibration")
      feed = {}

      def fed(shape):  # a fed input: TF would constant-fold mtf's deterministic random ops
        shape = mtf.convert_to_shape(shape)
        placeholder = tf.placeholder(tf.float32, shape.to_integer_list)
        feed[placeholder] = np.random.uniform(size=shape.to_integer_list).astype(np.float32)
        return mtf.import_tf_tensor(mesh, placeholder, shape)

      out = build(fed)
      impl = PlacementMeshImpl(f"all:{n}", "rows:all;p:all", list(devices))
      lowering = mtf.Lowering(graph, {mesh: impl})
      fetch = lowering.export_to_tf_tensor(out)
      with tf.Session(config=session_config) as sess:
        sess.run(fetch, feed)
        times = []
        for _ in range(reps):
          start = time.perf_counter()
          sess.run(fetch, feed)
          times.append(time.perf_counter() - start)
      sent = sum(e.bytes_per_processor for e in lowering.communication_events)
      return statistics.median(times), sent

  def matmul(fed):
    a, b = fed([rows, inner]), fed([inner, cols])
    x = mtf.einsum([a, b], [rows, cols])
    return mtf.reduce_sum(x, output_shape=[rows])

  def allreduce(elements):
    e = mtf.Dimension("e", elements)
    return lambda fed: mtf.reduce_sum(fed([mtf.Dimension("p", n), e]), output_shape=[e])

  def chain(length):
    def build(fed):
      x = fed([mtf.Dimension("rows", n)])
      for _ in range(length):
        x = mtf.sin(x)
      return x

    return build

  matmul_s, _ = median_s(matmul)
  small_s, small_bytes = median_s(allreduce(1024))
  large_s, large_bytes = median_s(allreduce(256 * 1024))
  short_s, _ = median_s(chain(1))
  long_s, _ = median_s(chain(101))
  bandwidth = (large_bytes - small_bytes) / max(large_s - small_s, 1e-6)
  op_overhead_s = max(long_s - short_s, 0.0) / 100
  return TimeModel(
    flops_per_s=2 * size**3 / matmul_s,
    bandwidth_bytes_per_s=bandwidth,
    latency_s=max(small_s - small_bytes / bandwidth, 1e-6),
    op_overhead_s=op_overhead_s,
    step_overhead_s=max(short_s - op_overhead_s, 0.0),
    name="calibrated",
  )
