"""The time model: per-processor FLOPs and communication events -> a predicted step time.

    step_s = flops / flops_per_s                                  (compute)
           + sum over collectives of (latency_s + bytes / bandwidth)   (communication)
           + num_ops * op_overhead_s                              (per-op launch cost)

Bandwidth and latency may differ per mesh dimension (e.g. a TPU slice's fast inner axis); a
collective over several mesh dimensions uses the slowest of them. `bytes` is what one processor
sends (CommEvent.bytes_per_processor). Presets give rough defaults for a CPU host, a GPU node and
a TPU slice; `calibrate` measures flops_per_s, bandwidth, latency and op overhead on the actual
devices with a short run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Sequence, Union

import numpy as np

PerMeshDim = Union[float, dict]


@dataclasses.dataclass(frozen=True)
class TimeModel:
  """Rates of one processor. Bandwidth and latency: a number, or {mesh dim name: number} (+ "*" default)."""

  flops_per_s: float
  bandwidth_bytes_per_s: PerMeshDim
  latency_s: PerMeshDim
  op_overhead_s: float = 0.0
  name: str = "custom"

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


CPU = TimeModel(flops_per_s=2e10, bandwidth_bytes_per_s=5e9, latency_s=2e-5, op_overhead_s=5e-6, name="cpu")
GPU = TimeModel(flops_per_s=1e14, bandwidth_bytes_per_s=1e11, latency_s=1e-5, op_overhead_s=5e-6, name="gpu")
TPU = TimeModel(
  flops_per_s=1.2e14, bandwidth_bytes_per_s=5e10, latency_s=5e-6, op_overhead_s=1e-6, name="tpu"
)
PRESETS = {"cpu": CPU, "gpu": GPU, "tpu": TPU}


def get_time_model(time_model: Union[None, str, TimeModel]) -> TimeModel:
  """A TimeModel from None (the CPU preset), a preset name ("cpu", "gpu", "tpu") or a TimeModel."""
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
  two medians); chains of 1 and 101 elementwise sines for op_overhead_s. The same bandwidth
  and latency then apply to every mesh dimension.

  Args:
    devices: device strings, one per processor.
    reps: timed runs per measurement (the median is used).
    size: edge of the square matrices each processor multiplies.
    session_config: a tf.ConfigProto for the measuring sessions.
  """
  import tensorflow.compat.v1 as tf

  import mesh_tensorflow as mtf

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
      impl = mtf.placement_mesh_impl.PlacementMeshImpl(f"all:{n}", "rows:all;p:all", list(devices))
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
  return TimeModel(
    flops_per_s=2 * size**3 / matmul_s,
    bandwidth_bytes_per_s=bandwidth,
    latency_s=max(small_s - small_bytes / bandwidth, 1e-6),
    op_overhead_s=max(long_s - short_s, 0.0) / 100,
    name="calibrated",
  )
