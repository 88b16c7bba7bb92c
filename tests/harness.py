"""Shared test harness: 8 virtual CPU devices, meshes, layouts, and graph/eager evaluation."""

from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf2
import tensorflow.compat.v1 as tf
from hypothesis import strategies as st

import mesh_tensorflow as mtf

NUM_DEVICES = 8
MODES = ("graph", "eager")

# Mesh shapes with 1, 2, 4 and 8 processors, of rank 1, 2 and 3.
MESH_SHAPES = (
    "all:1", "all:2", "all:4", "all:8",
    "rows:2;cols:2", "rows:2;cols:4", "rows:4;cols:2",
    "x:2;y:2;z:2", "x:1;y:2;z:4",
)

# Hypothesis example count: modest by default, MTF_HYPOTHESIS_EXAMPLES=500 for long runs.
MAX_EXAMPLES = int(os.environ.get("MTF_HYPOTHESIS_EXAMPLES", "12"))


def configure_virtual_cpus() -> None:
  """Splits the host CPU into NUM_DEVICES logical devices (must run before any TF op)."""
  cpus = tf2.config.list_physical_devices("CPU")
  if tf2.config.get_logical_device_configuration(cpus[0]):
    return  # already configured (it can be done only once per process)
  tf2.config.set_logical_device_configuration(
      cpus[0], [tf2.config.LogicalDeviceConfiguration()] * NUM_DEVICES)


def cpu_devices(n: int) -> list:
  return ["cpu:%d" % i for i in range(n)]


def session_config() -> tf.ConfigProto:
  return tf.ConfigProto(device_count={"CPU": NUM_DEVICES})


def run_tf(mode: str, fn: Callable) -> list:
  """Runs fn() -> list of tf tensors eagerly or in a fresh graph and session; returns numpy arrays."""
  if mode == "eager":
    return [t.numpy() for t in fn()]
  with tf.Graph().as_default():
    outputs = fn()
    with tf.Session(config=session_config()) as sess:
      return sess.run(outputs)


# Backends that run in one process on the virtual devices: name -> (shape, layout, devices) -> MeshImpl.
BACKENDS = {
    "placement": lambda shape, layout, devices: mtf.placement_mesh_impl.PlacementMeshImpl(
        shape, layout, devices),
    "collective": lambda shape, layout, devices: mtf.collective_mesh_impl.CollectiveMeshImpl(
        shape, layout, devices),
    # TF collective ops between this process's devices too, as between processes (graph mode only);
    # a bounded wait, so a collective that never completes fails the test instead of hanging it.
    "collective_tf_ops": lambda shape, layout, devices: mtf.collective_mesh_impl.CollectiveMeshImpl(
        shape, layout, devices, in_process_fast_path=False, timeout_seconds=120),
    # Every slicewise computation built per device (graph mode fuses them by default).
    "placement_unfused": lambda shape, layout, devices: mtf.placement_mesh_impl.PlacementMeshImpl(
        shape, layout, devices, fuse_slicewise=False),
    "collective_unfused": lambda shape, layout, devices: mtf.collective_mesh_impl.CollectiveMeshImpl(
        shape, layout, devices, fuse_slicewise=False),
    # Every device its own replica of variables and replicated computations, as on GPUs.
    "placement_unshared": lambda shape, layout, devices: mtf.placement_mesh_impl.PlacementMeshImpl(
        shape, layout, devices, share_replicas=False),
}


def lower_and_evaluate(build_fn: Callable, mesh_shape="all:1", layout="", mode: str = "graph",
                       devices: Sequence[str] | None = None, autostack: bool = True,
                       per_processor: bool = False, seed: int = 0, backend: str = "placement") -> list:
  """Builds `build_fn(mesh)` (a list of mtf Tensors), lowers it on `backend`, returns numpy values.

  Variables are initialised from their initializers (masters copied to slices).
  With per_processor, each output is instead the list of its slices, in processor order.
  """
  mesh_shape = mtf.convert_to_shape(mesh_shape)
  devices = list(devices) if devices is not None else cpu_devices(mesh_shape.size)

  def build_and_lower():
    tf.set_random_seed(seed)  # initializers draw the same values on every run: no flaky tolerances
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    outputs = list(build_fn(mesh))
    impl = BACKENDS[backend](mesh_shape, layout, devices)
    lowering = mtf.Lowering(graph, {mesh: impl}, autostack=autostack)
    if per_processor:
      return lowering, [lowering.tensors[x].to_laid_out_tensor().all_slices for x in outputs]
    return lowering, [lowering.export_to_tf_tensor(x) for x in outputs]

  if mode == "graph":
    with tf.Graph().as_default():
      lowering, tf_outputs = build_and_lower()
      with tf.Session(config=session_config()) as sess:
        init = [tf.global_variables_initializer(), tf.local_variables_initializer()]
        copy_masters = lowering.copy_masters_to_slices()  # built before the graph first runs
        sess.run(init)
        sess.run(copy_masters)
        return sess.run(tf_outputs)
  if mode == "eager":
    _, tf_outputs = build_and_lower()
    return tf.nest.map_structure(lambda t: t.numpy(), tf_outputs)
  raise ValueError(f"unknown mode {mode!r}")


@st.composite
def mesh_and_layout(draw, dims: dict, mesh_shapes: Sequence[str] = MESH_SHAPES):
  """Draws (mesh_shape_string, layout_string) with each mesh dim splitting a divisible tensor dim.

  `dims` maps tensor dimension names to sizes. Each tensor dimension is used at most once.
  """
  mesh_shape = mtf.convert_to_shape(draw(st.sampled_from(mesh_shapes)))
  rules, used = [], set()
  for mesh_dim in mesh_shape:
    candidates = [name for name, size in sorted(dims.items())
                  if name not in used and size % mesh_dim.size == 0]
    choice = draw(st.sampled_from([None] + candidates))
    if choice is not None:
      used.add(choice)
      rules.append(f"{choice}:{mesh_dim.name}")
  return ";".join(f"{d.name}:{d.size}" for d in mesh_shape), ";".join(rules)


def align_to_names(tf_x, names, out_names):
  """A TF tensor with axes `names`, transposed into `out_names` order with size-1 axes for absent names.

  This is how an mtf binary op broadcasts by name; references use it to do the same in plain TF.
  """
  present = [n for n in out_names if n in names]
  if present:
    tf_x = tf.transpose(tf_x, [names.index(n) for n in present])
  for i, n in enumerate(out_names):
    if n not in names:
      tf_x = tf.expand_dims(tf_x, i)
  return tf_x


def assert_allclose(actual, expected, rtol=1e-5, atol=1e-5):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def assert_op_matches_tf(mtf_fn: Callable, tf_fn: Callable, inputs: Sequence, mesh_shape="all:1",
                         layout="", mode: str = "graph", check_gradients: bool = True,
                         rtol: float = 1e-5, atol: float = 1e-5, seed: int = 0) -> None:
  """Checks an mtf computation against the same computation in plain (unsharded) TensorFlow.

  Args:
    mtf_fn: (*mtf_tensors) -> mtf Tensor.
    tf_fn: (*tf_tensors) -> tf.Tensor, with axes in the order of mtf_fn's output shape.
    inputs: (numpy_array, shape_string) pairs; imported with that mtf shape.
    check_gradients: also compare d(sum(out * w))/d(float inputs), w random, against
      tf.GradientTape on tf_fn.
  """
  arrays = [np.asarray(a) for a, _ in inputs]
  float_idx = [i for i, a in enumerate(arrays) if np.issubdtype(a.dtype, np.floating)]
  rng = np.random.RandomState(seed)
  holder = {}

  def build(mesh):
    xs = [mtf.import_tf_tensor(mesh, tf.constant(a), shape=s) for a, (_, s) in zip(arrays, inputs)]
    y = mtf_fn(*xs)
    holder["shape"] = y.shape.to_integer_list
    outs = [y]
    if check_gradients and float_idx:
      w = rng.uniform(-1, 1, size=y.shape.to_integer_list).astype(y.dtype.as_numpy_dtype)
      holder["w"] = w
      loss = mtf.reduce_sum(y * mtf.import_tf_tensor(mesh, tf.constant(w), shape=y.shape))
      grads = mtf.gradients([loss], [xs[i] for i in float_idx])
      outs += [g if g is not None else mtf.zeros_like(xs[i]) for g, i in zip(grads, float_idx)]
    return outs

  actual = lower_and_evaluate(build, mesh_shape, layout, mode)
  with tf.Graph().as_default():
    tf_xs = [tf.constant(a) for a in arrays]
    expected_y = tf_fn(*tf_xs)
    fetches = [expected_y]
    if check_gradients and float_idx:
      loss = tf.reduce_sum(expected_y * tf.constant(holder["w"]))
      grads = tf.gradients(loss, [tf_xs[i] for i in float_idx], unconnected_gradients="zero")
      fetches += [tf.convert_to_tensor(g) for g in grads]  # densify IndexedSlices (tf.gather)
    with tf.Session() as sess:
      expected = sess.run(fetches)
  assert list(np.shape(actual[0])) == holder["shape"], (np.shape(actual[0]), holder["shape"])
  for a, e in zip(actual, expected):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64) if a.dtype != bool else a,
                               np.asarray(e, dtype=np.float64) if e.dtype != bool else e,
                               rtol=rtol, atol=atol)


def lowering_counters(build_fn: Callable, mesh_shape="all:1", layout="") -> dict:
  """Lowers `build_fn(mesh)` (graph mode), exports its outputs, and returns {counter key: total}.

  Exporting forces lazy allreduces, so their counters are included.
  """
  mesh_shape = mtf.convert_to_shape(mesh_shape)
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    outputs = list(build_fn(mesh))
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, cpu_devices(mesh_shape.size))
    lowering = mtf.Lowering(graph, {mesh: impl})
    for x in outputs:
      lowering.export_to_tf_tensor(x)
  totals = {}
  for key, value in lowering.counters:
    totals[key] = totals.get(key, 0) + value
  return totals
