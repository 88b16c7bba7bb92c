"""mtf.utils: variable placement across devices, TPU host-call summaries, topology helpers."""

from __future__ import annotations

import heapq
from typing import Optional, Sequence

import tensorflow as tf2
import tensorflow.compat.v1 as tf
from tensorflow.core.framework import summary_pb2

from mesh_tensorflow._lowering.tf_helpers import outside_all_rewrites  # noqa: F401  (public here)

# Lowered mtf.scalar_summary ops add (name, scalar tf.Tensor) pairs to this graph collection.
SCALAR_SUMMARIES_COLLECTION_KEY = "mtf_scalar_summaries"

_VARIABLE_OP_TYPES = ("Variable", "VariableV2", "VarHandleOp")


class BalancedVariablePlacer:
  """A device function that puts each new variable on the device with the fewest bytes so far.

  Pass it as `mtf.Mesh(graph, name, variable_placer)`: master variables are then spread over
  `devices`. Ties go to the smaller device string. Non-variable ops (initializers, reads) follow
  the last variable placed.

  Args:
    devices: device strings to place variables on.
    init_usage: bytes already in use on each device (default all 0).

  Example:
    placer = BalancedVariablePlacer(["cpu:0", "cpu:1"], init_usage=[100, 0])
    mesh = mtf.Mesh(graph, "mesh", placer)  # the first variable goes to "cpu:1"
  """

  def __init__(self, devices: Sequence[str], init_usage: Optional[Sequence[int]] = None):
    devices = list(devices)
    init_usage = list(init_usage) if init_usage else [0] * len(devices)
    if not devices or len(init_usage) != len(devices):
      raise ValueError(
          f"BalancedVariablePlacer needs a non-empty device list and one initial usage per "
          f"device; got devices={devices}, init_usage={init_usage}.")
    self._mem_device_heap = list(zip(init_usage, devices))
    heapq.heapify(self._mem_device_heap)
    self._last_device = devices[0]

  def device_function(self, var) -> str:
    """The device for the op `var`: the least-used device for a variable op, else the last one chosen."""
    if var.type not in _VARIABLE_OP_TYPES:
      return self._last_device
    shape = tf.TensorShape(var.get_attr("shape"))
    if shape.num_elements() is None:
      raise ValueError(f"BalancedVariablePlacer: variable {var.name!r} has a partly unknown shape "
                       f"{shape}; give it a fully defined shape.")
    mem, device = heapq.heappop(self._mem_device_heap)
    mem += shape.num_elements() * var.get_attr("dtype").size
    heapq.heappush(self._mem_device_heap, (mem, device))
    tf.logging.debug("Placing variable %s on %s (now %d bytes).", var.name, device, mem)
    self._last_device = device
    return device


def create_host_call(model_dir: str):
  """A TPU host call that writes the collected mtf scalar summaries as TF2 summaries.

  Reads the (name, scalar) pairs in the default graph's SCALAR_SUMMARIES_COLLECTION_KEY
  collection. Each tensor is passed reshaped to [1] so per-core values can be concatenated; the
  host call writes their mean under `name` at the global step.

  Args:
    model_dir: the folder the summary events are written to.

  Returns:
    (host_call_fn, [global_step reshaped to [1]] + reshaped summaries), or None when there are
    no summaries (a host call that dequeues nothing would hang the TPU outfeed). In graph mode
    host_call_fn returns the summary ops to run; events are flushed when the session closes.
  """
  summaries = tf.get_default_graph().get_collection(SCALAR_SUMMARIES_COLLECTION_KEY)
  reshaped_tensors = [tf.reshape(_summary_dtype(name, t), [1]) for name, t in summaries]
  if not reshaped_tensors:
    return None
  names = [name for name, _ in summaries]

  def host_call_fn(global_step, *args):
    """Writes one scalar summary per mtf summary; returns the graph's v2 summary ops."""
    if len(args) != len(names):
      raise ValueError(f"host_call_fn got {len(args)} summary tensors for summaries {names}.")
    step = tf.cast(global_step[0], tf.int64)
    writer = tf2.summary.create_file_writer(model_dir)
    # Graph mode: initialising an existing writer is a no-op, so the ops carry their own init.
    with writer.as_default(), tf.control_dependencies([writer.init()]):
      for name, tensor in zip(names, args):
        tf2.summary.write(name, tf.reduce_mean(tf.cast(tensor, tf.float32)), step=step,
                          metadata=_scalar_summary_metadata())
    return tf.summary.all_v2_summary_ops()

  global_step = tf.reshape(tf.cast(tf.train.get_or_create_global_step(), tf.int32), [1])
  return host_call_fn, [global_step] + reshaped_tensors


def _scalar_summary_metadata():
  """What tf.summary.scalar attaches (TensorBoard's "scalars" plugin), without needing TensorBoard."""
  return summary_pb2.SummaryMetadata(
      plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))


def _summary_dtype(name: str, tensor):
  """Summaries are written as float32/int32: int64 and bfloat16 do not cross the TPU outfeed."""
  if not tensor.shape.is_compatible_with([]):
    raise ValueError(f"Scalar summary {name!r} holds {tensor.name} of shape {tensor.shape}; "
                     f"summaries must be scalars (reduce first, e.g. with mtf.reduce_mean).")
  if tensor.dtype == tf.int64:
    return tf.cast(tensor, tf.int32)
  if tensor.dtype == tf.bfloat16:
    return tf.cast(tensor, tf.float32)
  return tensor


def remove_summaries() -> None:
  """Empties the mtf scalar summary collection of the default graph."""
  del tf.get_default_graph().get_collection_ref(SCALAR_SUMMARIES_COLLECTION_KEY)[:]


def topology_rank(topology) -> int:
  """Rank of a TPU topology's mesh shape; `topology` is a Topology or its serialized bytes."""
  if isinstance(topology, bytes):
    topology = tf.tpu.experimental.Topology(serialized=topology)
  if not isinstance(topology, tf.tpu.experimental.Topology):
    raise ValueError(f"topology must be a tf.tpu.experimental.Topology or its serialized bytes, "
                     f"got {type(topology).__name__}.")
  return len(topology.mesh_shape)
