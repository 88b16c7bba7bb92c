"""Training on a Cloud TPU without TPUEstimator: SimdMeshImpl inside `tpu.replicate`, fed by infeed.

The pieces, in the order `train` uses them:

1. `connect`: resolve `--tpu` (a TPU name or a `grpc://host:port` address) and check, with a
   timeout, that a TPU worker answers and has TPU devices. Every failure is a `TpuUnavailableError`
   naming the flag and what to install or check, raised before any model graph is built.
2. `query_topology`: run `tf.tpu.initialize_system()` there; it returns the slice's topology.
3. `assign_devices`: replica r runs on the core at physical pnum r (row-major over the 3-D
   physical shape `[y * z, x, cores]` the logical-to-physical helpers use), so
   `auto_logical_to_physical_tpu` (or a HierarchicalTiling spec) maps the mtf mesh onto
   neighbouring cores.
4. `build_training_graph`: master variables and the global step on the host CPUs; the step every
   replica runs is `replica_train_step`, the very model_fn code of the CPU/GPU loop
   (`model_fn.build_model_graph`), wrapped in an on-device while loop of up to
   `iterations_per_loop` steps that dequeues one batch per step from the infeed. The batch is
   read on the first host from the training pipeline (`inputs.training_features`) and broadcast
   to every replica's infeed; each replica takes its slice (`mtf.import_tf_tensor`).
5. `train`: the session loop on the TPU worker. A host thread enqueues one batch per step while
   the TPU runs the loop; after each loop the same progress line and TensorBoard scalars as on
   CPUs (`progress.ProgressReporter`) and, every `save_checkpoints_steps`, the same atomic
   `model.ckpt-<step>` checkpoints of the master variables (`checkpoints.CheckpointManager`, slices
   copied to masters first), so a TPU checkpoint restores on CPUs and the other way round.

Nothing here has run on a real TPU (see docs/tpu.md); the replica step runs in the tests on 8
virtual CPUs with the TPU collectives emulated, and the whole graph is built without a TPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue as queue_lib
import threading
import time
from typing import Callable, Optional, Sequence

import gin
import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow import _tf_compat
from mesh_tensorflow._core.layout import pnum_to_processor_coordinates
from mesh_tensorflow.transformer._train import checkpoints, inputs, loop, model_fn, progress

# How long `connect` waits for the TPU worker to answer before giving up.
CONNECT_TIMEOUT_SECONDS = 60.0


class TpuUnavailableError(RuntimeError):
  """No TPU could be reached through the --tpu / --tpu_zone / --gcp_project flags."""


@dataclasses.dataclass
class TpuCluster:
  """A reachable TPU worker: its session target, cluster and TPU job name."""
  master: str
  cluster_def: object
  job: Optional[str]
  tpu_devices: list


def connect(tpu: str, zone: Optional[str] = None, project: Optional[str] = None,
            job_name: Optional[str] = None, timeout_seconds: Optional[float] = None) -> TpuCluster:
  """Resolves `tpu` and checks that its worker answers and has TPU devices.

  Raises:
    TpuUnavailableError: naming the flag and what to install or check, when the TPU name cannot
      be resolved, the worker does not answer within the timeout, or it has no TPU devices.
  """
  timeout_seconds = CONNECT_TIMEOUT_SECONDS if timeout_seconds is None else timeout_seconds
  try:
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu, zone=zone, project=project)
    master, cluster_spec = resolver.get_master(), resolver.cluster_spec()
  except (RuntimeError, ValueError, ImportError, OSError) as e:  # OSError: no metadata server
    raise TpuUnavailableError(
        f"--tpu={tpu!r} (utils.run tpu): could not resolve the TPU ({type(e).__name__}: {e}). A TPU "
        f"name needs the cloud-tpu-client package (pip install cloud-tpu-client), Google Cloud "
        f"credentials, and --tpu_zone / --gcp_project unless this is a Cloud VM in the TPU's zone "
        f"and project; or pass the worker's address as --tpu=grpc://HOST:8470.") from e
  cluster_def = cluster_spec.as_cluster_def() if cluster_spec else None
  config = tf.ConfigProto(operation_timeout_in_ms=int(timeout_seconds * 1000), cluster_def=cluster_def)
  try:
    with tf.Graph().as_default(), tf.Session(master, config=config) as session:
      devices = [d.name for d in session.list_devices()]
  except tf.errors.OpError as e:
    raise TpuUnavailableError(
        f"--tpu={tpu!r} (utils.run tpu): the TPU worker at {master} did not answer within "
        f"{timeout_seconds:g}s ({type(e).__name__}: {e.message.strip()[:200]}). Check that the TPU is "
        f"running (gcloud compute tpus list), that --tpu / --tpu_zone / --gcp_project name it, and "
        f"that this machine can reach port 8470 of its workers.") from e
  tpu_devices = [d for d in devices if "/device:TPU:" in d]
  if not tpu_devices:
    raise TpuUnavailableError(
        f"--tpu={tpu!r} (utils.run tpu): {master} answered but has no TPU devices (it has "
        f"{devices[:4]}{' ...' if len(devices) > 4 else ''}). Point --tpu at a TPU worker, or leave "
        f"--tpu unset to train on CPUs/GPUs with utils.run.mesh_devices.")
  job = job_name or (cluster_spec.jobs[0] if cluster_spec and cluster_spec.jobs else None)
  return TpuCluster(master=master, cluster_def=cluster_def, job=job, tpu_devices=tpu_devices)


def query_topology(cluster: TpuCluster):
  """Initialises the TPU system and returns its tf.tpu.experimental.Topology."""
  with tf.Graph().as_default():
    serialized = tf.tpu.initialize_system(job=cluster.job)
    with tf.Session(cluster.master, config=tf.ConfigProto(cluster_def=cluster.cluster_def)) as session:
      return tf.tpu.experimental.Topology(serialized=session.run(serialized))


def physical_shape(topology) -> list:
  """The 3-D physical shape [y * z, x, cores_per_chip] of a topology's [x, y, z, cores] mesh."""
  return mtf.simd_mesh_impl.physical_shape_3d_from_topology_proto_4d(
      [int(n) for n in topology.mesh_shape])


def _core_coordinates(topology_shape: Sequence[int], physical_pnum: int) -> list:
  """Topology coordinates [x, y, z, core] of physical pnum (row-major over [y * z, x, cores])."""
  x_size, y_size, z_size, cores = (int(n) for n in topology_shape)
  yz, x, core = pnum_to_processor_coordinates([y_size * z_size, x_size, cores], physical_pnum)
  return [x, yz % y_size, yz // y_size, core]


def assign_devices(topology, mesh_shape, hierarchical_tiling_spec=None) -> tuple:
  """(DeviceAssignment, logical_to_physical) placing one replica of `mesh_shape` on each core.

  Replica r is physical pnum r; logical_to_physical comes from the HierarchicalTiling spec when
  one is given (a list `utils.tpu_mesh_shape.model_parallelism`), else from
  `auto_logical_to_physical_tpu`.

  Raises:
    ValueError: if the mesh does not have one processor per core of the topology.
  """
  mesh_shape = mtf.convert_to_shape(mesh_shape)
  topology_shape = [int(n) for n in topology.mesh_shape]
  num_cores = topology.num_tasks * topology.num_tpus_per_task
  if mesh_shape.size != num_cores:
    raise ValueError(
        f"mesh_shape {mesh_shape} has {mesh_shape.size} processors but the TPU has {num_cores} cores "
        f"(topology {topology_shape}). Set utils.tpu_mesh_shape.tpu_topology to this TPU (e.g. "
        f"'v3-{num_cores}') or pick a layout gin file for {num_cores} cores.")
  shape_3d = physical_shape(topology)
  if hierarchical_tiling_spec is not None:
    tiling = mtf.simd_mesh_impl.HierarchicalTiling(hierarchical_tiling_spec, shape_3d)
    logical_to_physical = tiling.logical_to_physical
  else:
    logical_to_physical = mtf.simd_mesh_impl.auto_logical_to_physical_tpu(
        mesh_shape.to_integer_list, shape_3d)
  core_assignment = np.array([[_core_coordinates(topology_shape, p)] for p in range(num_cores)])
  return tf.tpu.experimental.DeviceAssignment(topology, core_assignment), list(logical_to_physical)


def host_devices(device_assignment, job: Optional[str]) -> list:
  """The distinct host CPUs of the replicas, in replica order (where masters and data live)."""
  hosts = []
  for replica in range(device_assignment.num_replicas):
    host = device_assignment.host_device(replica=replica, job=job)
    if host not in hosts:
      hosts.append(host)
  return hosts


def replica_train_step(model, features: dict, mesh_impl, variable_dtype, config: loop.TrainConfig,
                       variable_placer=None, random_position=None) -> model_fn.LoweredModel:
  """One training step as every replica runs it: the CPU/GPU loop's model_fn with a TPU mesh.

  The learning rate follows the global step, which the returned train op increments; random ops
  draw for random_position (default: the global step).
  """
  return model_fn.build_model_graph(
      model, features, "train", mesh_impl, variable_dtype, autostack=config.autostack,
      optimizer=config.optimizer,
      learning_rate=loop._learning_rate(config.learning_rate_schedule,  # pylint: disable=protected-access
                                        tf.train.get_or_create_global_step()),
      variable_filter=config.variable_filter, variable_placer=variable_placer,
      random_position=random_position, outer_batch_size=config.outer_batch_size)


def hierarchical_tiling_spec() -> Optional[list]:
  """The HierarchicalTiling spec when gin binds a list to utils.tpu_mesh_shape.model_parallelism."""
  try:
    value = gin.query_parameter("tpu_mesh_shape.model_parallelism")
  except ValueError:
    return None
  return list(value) if isinstance(value, (list, tuple)) else None


def _check_static_shapes(features: dict) -> None:
  for key, value in sorted(features.items()):
    if not value.shape.is_fully_defined():
      raise ValueError(
          f"TPU infeed needs fixed shapes, but training feature {key!r} has shape {value.shape}. "
          f"Pad or pack the training dataset to utils.run.sequence_length.")


@dataclasses.dataclass
class TrainingGraph:
  """What the TPU session loop runs."""
  loop_outputs: list           # replica 0's [last loss, last learning rate, tokens of the loop]
  num_steps: tf.Tensor         # placeholder: steps in the next loop
  enqueue_op: tf.Operation     # one batch into every replica's infeed
  lowering: mtf.Lowering
  new_global_step: tf.Tensor   # placeholder: the global step after a loop
  set_global_step: tf.Operation


def build_training_graph(model, dataset: tf.data.Dataset, config: loop.TrainConfig, variable_dtype,
                         device_assignment, logical_to_physical, job: Optional[str] = None,
                         start_step: int = 0) -> TrainingGraph:
  """Builds, in the default graph, the replicated training loop, its infeed and the host state.

  Runs nowhere: the graph is the same with or without a TPU.
  """
  tpu_feed, training_loop = _tf_compat.tpu_feed, _tf_compat.tpu_training_loop
  hosts = host_devices(device_assignment, job)
  num_replicas = device_assignment.num_replicas
  with tf.device(hosts[0]):
    global_step = tf.get_variable(tf.GraphKeys.GLOBAL_STEP, shape=[], dtype=tf.int64, trainable=False,
                                  initializer=tf.zeros_initializer(), use_resource=True,
                                  collections=[tf.GraphKeys.GLOBAL_VARIABLES, tf.GraphKeys.GLOBAL_STEP])
    batch = inputs.training_features(dataset, config.batch_size, start_step - config.seen_data_init_step)
    _check_static_shapes(batch)
    keys = sorted(batch)
    flat = [tf.cast(batch[k], tf.int32) for k in keys]
    num_steps = tf.placeholder(tf.int32, [], name="steps_per_loop")
    new_global_step = tf.placeholder(tf.int64, [], name="new_global_step")
    set_global_step = global_step.assign(new_global_step, read_value=False)
  queue = tpu_feed.InfeedQueue(tuple_types=[tf.int32] * len(keys), tuple_shapes=[t.shape for t in flat])
  enqueue_op = tf.group(queue.generate_enqueue_ops(
      [flat] * num_replicas,
      tpu_ordinal_function=lambda r: device_assignment.tpu_ordinal(replica=r),
      placement_function=lambda r: device_assignment.host_device(replica=r, job=job)))
  mesh_impl = mtf.simd_mesh_impl.SimdMeshImpl(config.mesh_shape, config.layout_rules,
                                              device_assignment=device_assignment,
                                              logical_to_physical=logical_to_physical)
  placer = mtf.utils.BalancedVariablePlacer(hosts)
  built = {}

  def body(i, loss, learning_rate, tokens):
    del loss, learning_rate
    features = dict(zip(keys, queue.generate_dequeue_op()))
    # The global step is set after each loop: inside it, step number = loop start + iteration.
    position = global_step.read_value() + tf.cast(i, tf.int64)
    step = replica_train_step(model, features, mesh_impl, variable_dtype, config, placer, position)
    built["lowering"] = step.lowering
    with tf.control_dependencies([step.train_op]):
      return (i + 1, tf.identity(step.outputs["loss"]), tf.identity(step.outputs["learning_rate"]),
              tokens + tf.cast(step.outputs["tokens"], tf.int32))

  def computation(steps):
    initial = [tf.constant(0), tf.constant(0.0), tf.constant(0.0), tf.constant(0)]
    return training_loop.while_loop(lambda i, *_: i < steps, body, initial)[1:]

  with _v1_control_flow():
    outputs = tf.tpu.replicate(computation, inputs=[[num_steps]] * num_replicas,
                               device_assignment=device_assignment)
  return TrainingGraph(loop_outputs=outputs[0], num_steps=num_steps, enqueue_op=enqueue_op,
                       lowering=built["lowering"], new_global_step=new_global_step,
                       set_global_step=set_global_step)


@contextlib.contextmanager
def _v1_control_flow():
  """Builds the on-device loop with v1 control flow (a WhileContext, as TPUEstimator did).

  With TF2's functional While, the loop body is a function graph, and the slice variables the
  lowering creates in it cannot be lifted out (their initial values live in the body); v1
  control flow lets them be created at the top level of the graph.
  """
  control_flow_util = _tf_compat.control_flow_util
  enabled = control_flow_util.ENABLE_CONTROL_FLOW_V2
  control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
  try:
    yield
  finally:
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = enabled


def loop_lengths(start_step: int, train_steps: int, iterations_per_loop: int,
                 save_checkpoints_steps: int) -> list:
  """Steps per on-device loop: at most iterations_per_loop, each ending where the CPU loop would
  report (multiples of iterations_per_loop) or checkpoint (multiples of save_checkpoints_steps),
  and the last at train_steps."""
  lengths, step = [], start_step
  while step < train_steps:
    end = min(train_steps, (step // iterations_per_loop + 1) * iterations_per_loop,
              (step // save_checkpoints_steps + 1) * save_checkpoints_steps)
    lengths.append(end - step)
    step = end
  return lengths


def _run_loop(session, graph: TrainingGraph, num_steps: int) -> list:
  """Runs one on-device loop of num_steps while another thread enqueues its num_steps batches.

  Whichever of the two fails first, its error is raised here at once; the other, blocked on the
  infeed, is a daemon thread cancelled when the session closes.
  """
  finished = queue_lib.Queue()

  def call(name, fn):
    try:
      finished.put((name, fn(), None))
    except Exception as e:  # pylint: disable=broad-except  (re-raised in the calling thread)
      finished.put((name, None, e))

  def enqueue_all():
    for _ in range(num_steps):
      session.run(graph.enqueue_op)

  def run_loop():
    return session.run(graph.loop_outputs, feed_dict={graph.num_steps: num_steps})

  for name, fn in (("infeed", enqueue_all), ("loop", run_loop)):
    threading.Thread(target=call, args=(name, fn), name="tpu_" + name, daemon=True).start()
  results = {}
  for _ in range(2):
    name, value, error = finished.get()
    if error is not None:
      raise error
    results[name] = value
  return results["loop"]


def train(model, dataset_fn: Callable[[], tf.data.Dataset], config: loop.TrainConfig, variable_dtype,
          print_fn: Callable = print, *, cluster: TpuCluster, hierarchical_tiling_spec=None) -> dict:
  """Trains on the TPU until global step config.train_steps; returns {"step", "loss", "first_step_seconds"}.

  dataset_fn() builds the (unbatched) training dataset; a resumed run skips the batches the
  checkpointed steps consumed. cluster: the connected TPU; hierarchical_tiling_spec: optional.
  """
  started = time.time()
  with loop.guarded_model_dir(config.model_dir, print_fn) as (latest, stop):
    done = loop.nothing_to_train(latest, config, print_fn)
    return done or _train(model, dataset_fn, config, variable_dtype, print_fn, cluster,
                          hierarchical_tiling_spec, started, latest, stop)


def _train(model, dataset_fn, config, variable_dtype, print_fn, cluster, hierarchical_tiling_spec, started,
           latest, stop) -> dict:
  start_step = loop.checkpoint_step(latest) if latest else 0
  topology = query_topology(cluster)
  device_assignment, logical_to_physical = assign_devices(topology, config.mesh_shape,
                                                          hierarchical_tiling_spec)
  with tf.Graph().as_default():
    loop.set_random_seed(config.random_seed)
    graph = build_training_graph(model, dataset_fn(), config, variable_dtype, device_assignment,
                                 logical_to_physical, cluster.job, start_step)
    manager = checkpoints.CheckpointManager(config.model_dir, tf.global_variables(),
                                            config.keep_checkpoint_max,
                                            before_save=graph.lowering.copy_slices_to_masters())
    session_config = tf.ConfigProto(cluster_def=cluster.cluster_def, allow_soft_placement=True,
                                    isolate_session_state=True)
    with tf.Session(cluster.master, config=session_config) as session:
      session.run(tf.tpu.initialize_system(job=cluster.job))
      if latest:
        print_fn(f"Resuming from {latest} at step {start_step}.")
      loop.initialize_and_restore(session, graph.lowering, latest, manager, config.init_checkpoint, print_fn)
      writer = progress.summary_writer(config.model_dir)  # only once the checkpoint restored
      reporter = progress.ProgressReporter(writer, start_step, config.train_steps, print_fn)
      step, saved_step, loss, first_step_seconds = start_step, start_step, None, None
      for num_steps in loop_lengths(start_step, config.train_steps, config.iterations_per_loop,
                                    config.save_checkpoints_steps):
        if stop.signum is not None:
          if step > saved_step:
            latest = manager.save(session, step)
          loop.report_stop(stop, step, start_step, latest, print_fn)
          break
        loss, learning_rate, tokens = _run_loop(session, graph, num_steps)
        step += num_steps
        # Each replica incremented its copy of the global step; the host's is set explicitly so
        # that checkpoints carry the right step whichever copy the TPU wrote back.
        session.run(graph.set_global_step, {graph.new_global_step: step})
        if first_step_seconds is None:
          first_step_seconds = time.time() - started
          print_fn(f"First training loop ({num_steps} steps) done {first_step_seconds:.1f}s after start.")
          loop._write_operative_config(config.model_dir)  # pylint: disable=protected-access
        reporter.add_tokens(tokens)
        if step % config.iterations_per_loop == 0 or step == config.train_steps:
          reporter.report(step, float(loss), float(learning_rate))
        if step % config.save_checkpoints_steps == 0 or step == config.train_steps:
          latest, saved_step = manager.save(session, step), step
      session.run(tf.tpu.shutdown_system(job=cluster.job))
    writer.close()
  return {"step": step, "loss": None if loss is None else float(loss),
          "first_step_seconds": first_step_seconds}
