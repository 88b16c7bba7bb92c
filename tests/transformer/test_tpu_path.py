"""The TPU training path of utils.run, checked without a TPU.

* device assignment and mesh arithmetic on hand-made v3-8 / v3-32 topologies;
* the replica training step on the SIMD emulation (8 virtual CPUs, TPU collectives replaced by TF
  collective ops, as tests/backends/test_simd_mesh_impl.py does) against the CPU placement path;
* the errors of run(tpu=...) when no TPU answers, raised before any graph is built;
* the whole TPU graph (tpu.replicate + on-device loop + infeed) built, not run.
"""

from __future__ import annotations

import dataclasses
import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from tensorflow.python.tpu import topology as topology_lib

import mesh_tensorflow as mtf
from mesh_tensorflow import tpu_variables
from mesh_tensorflow._backends import simd
from mesh_tensorflow.transformer import utils
from mesh_tensorflow.transformer._train import checkpoints, loop, model_fn
from mesh_tensorflow.transformer._train import run as run_lib
from mesh_tensorflow.transformer._train import tpu as tpu_lib
from mesh_tensorflow.transformer._utils.mesh_sizes import tpu_mesh_shape
from mesh_tensorflow.transformer._utils.models import build_model
from tests.backends.test_simd_mesh_impl import _EmulatedTpuOps
from tests.harness import cpu_devices, session_config
from tests.transformer import tiny_run

LAYOUT = "batch:batch;d_ff:model;heads:model;vocab:model"


def _v3_topology(chips_x: int, chips_y: int):
  """A v3 slice of chips_x x chips_y chips (2 cores each), 2x2 chips per host, as TF describes one."""
  hosts = []
  for hx in range(0, chips_x, 2):
    for hy in range(0, chips_y, 2):
      hosts.append([[x, y, 0, c] for x in range(hx, min(hx + 2, chips_x))
                    for y in range(hy, min(hy + 2, chips_y)) for c in range(2)])
  return topology_lib.Topology(mesh_shape=[chips_x, chips_y, 1, 2], device_coordinates=np.array(hosts))


TOPOLOGIES = {"v3-8": (2, 2), "v3-32": (4, 4)}


# ---- (a) device assignment and mesh shapes ----

@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("model_parallelism", [1, 2, 4])
def test_device_assignment_puts_one_replica_on_each_core_and_model_groups_on_neighbouring_chips(
    name, model_parallelism):
  topology = _v3_topology(*TOPOLOGIES[name])
  mesh_shape = tpu_mesh_shape(name, model_parallelism)
  cores = int(name.split("-")[1])
  assert mesh_shape.size == cores
  assignment, l2p = tpu_lib.assign_devices(topology, mesh_shape)
  assert assignment.num_replicas == cores and sorted(l2p) == list(range(cores))
  coords = [tuple(assignment.coordinates(r, 0)) for r in range(cores)]
  assert len(set(coords)) == cores  # every core once
  # Replica r is physical pnum r: row-major over [y, x, core] (z = 0 on v3).
  assert coords == [(x, y, 0, c) for y in range(TOPOLOGIES[name][1]) for x in range(TOPOLOGIES[name][0])
                    for c in range(2)]
  impl = mtf.simd_mesh_impl.SimdMeshImpl(mesh_shape, LAYOUT, device_assignment=assignment,
                                         logical_to_physical=l2p)
  assert impl.devices == [assignment.tpu_device(replica=l2p[p]) for p in range(cores)]
  if model_parallelism > 1:
    model_axis = mesh_shape.dimension_names.index("model")
    for group in mtf.processor_groups(mesh_shape, [model_axis]):
      chips = {coords[l2p[p]][:2] for p in group}
      assert len(chips) == model_parallelism // 2  # two cores per chip
      span = [max(c[i] for c in chips) - min(c[i] for c in chips) for i in range(2)]
      assert sum(span) == len(chips) - 1  # a compact row or column of chips
  hosts = tpu_lib.host_devices(assignment, "worker")
  assert sorted(hosts) == ["/job:worker/task:%d/device:CPU:0" % t for t in range(cores // 8)]
  assert hosts[0] == assignment.host_device(replica=0, job="worker")  # masters and data live there


def test_hierarchical_tiling_spec_gives_the_logical_to_physical_map():
  spec = [("batch", None), ("model", [2, 2, 1])]
  mesh_shape = tpu_mesh_shape("v3-32", spec)
  assert mesh_shape == mtf.convert_to_shape("batch:8;model:4")
  _, l2p = tpu_lib.assign_devices(_v3_topology(4, 4), mesh_shape, spec)
  assert l2p == mtf.simd_mesh_impl.HierarchicalTiling(spec, [4, 4, 2]).logical_to_physical


def test_hierarchical_tiling_spec_is_read_from_the_tpu_mesh_shape_binding():
  gin.clear_config()
  assert tpu_lib.hierarchical_tiling_spec() is None
  with gin.unlock_config():
    gin.bind_parameter("utils.tpu_mesh_shape.model_parallelism", 2)
    assert tpu_lib.hierarchical_tiling_spec() is None
    gin.bind_parameter("utils.tpu_mesh_shape.model_parallelism", [("batch", None), ("model", [2, 2, 1])])
  assert tpu_lib.hierarchical_tiling_spec() == [("batch", None), ("model", [2, 2, 1])]
  gin.clear_config()


def test_mesh_of_the_wrong_size_for_the_tpu_is_refused():
  with pytest.raises(ValueError, match=r"16 processors but the TPU has 8 cores.*tpu_topology.*'v3-8'"):
    tpu_lib.assign_devices(_v3_topology(2, 2), "batch:16")


@pytest.mark.parametrize("start, total, per_loop, save, expected", [
    (0, 10, 4, 100, [4, 4, 2]),
    (0, 10, 4, 6, [4, 2, 2, 2]),
    (5, 12, 4, 100, [3, 4]),
    (10, 10, 4, 5, []),
])
def test_loop_lengths_end_where_the_cpu_loop_reports_or_saves(start, total, per_loop, save, expected):
  lengths = tpu_lib.loop_lengths(start, total, per_loop, save)
  assert lengths == expected and start + sum(lengths) == max(start, total)


def _queue_loop(capacity: int, failing: str = "") -> tpu_lib.TrainingGraph:
  """A TrainingGraph whose 'TPU loop' sums num_steps items dequeued from a FIFO queue standing in
  for the infeed, and whose enqueue op puts 1, 2, 3, ... into it; `failing` ("loop" or "infeed")
  makes that side fail at its first step."""
  queue = tf.queue.FIFOQueue(capacity, [tf.int32], shapes=[[]])
  counter = tf.Variable(0, use_resource=True)
  num_steps = tf.placeholder(tf.int32, [])

  def body(i, total):
    if failing == "loop":
      with tf.control_dependencies([tf.debugging.assert_less(i, 0, message="the TPU loop failed")]):
        i = tf.identity(i)
    return i + 1, total + queue.dequeue()
  total = tf.while_loop(lambda i, total: i < num_steps, body, [0, 0])[1]
  value = counter.assign_add(1)
  if failing == "infeed":
    with tf.control_dependencies([tf.debugging.assert_less(value, 0, message="the input pipeline failed")]):
      value = tf.identity(value)
  return tpu_lib.TrainingGraph(loop_outputs=[total], num_steps=num_steps, enqueue_op=queue.enqueue(value),
                               lowering=None, new_global_step=None, set_global_step=None)


def test_a_loop_consumes_the_batches_enqueued_alongside_it():
  with tf.Graph().as_default():
    graph = _queue_loop(capacity=2)  # fewer slots than steps: enqueue and loop must overlap
    with tf.Session() as session:
      session.run(tf.global_variables_initializer())
      assert tpu_lib._run_loop(session, graph, 5) == [15]
      assert tpu_lib._run_loop(session, graph, 2) == [6 + 7]


@pytest.mark.parametrize("failing, message", [("loop", "the TPU loop failed"),
                                              ("infeed", "the input pipeline failed")])
def test_a_failure_on_either_side_is_raised_while_the_other_side_waits(failing, message):
  with tf.Graph().as_default():
    graph = _queue_loop(capacity=1, failing=failing)  # the other side blocks on the queue
    with tf.Session() as session:
      session.run(tf.global_variables_initializer())
      with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        tpu_lib._run_loop(session, graph, 3)


# ---- (b) the replica step on emulated TPU replicas equals the CPU placement path ----

VOCAB = 300
BATCH, LENGTH, STEPS = 8, 16, 3


@pytest.fixture
def tiny_model(tmp_path):
  tiny_run.configure_gin(tiny_run.write_corpus(str(tmp_path)), ["dropout_rate = 0.1"])  # masks too
  yield lambda mesh_shape: build_model(model_type="lm", input_vocab_size=VOCAB, output_vocab_size=VOCAB,
                                       layout_rules=LAYOUT, mesh_shape=mesh_shape)
  gin.clear_config()
  utils.FLAGS.unparse_flags()


def _schedule(step):
  return 0.05 / tf.sqrt(tf.cast(step, tf.float32) + 1.0)


def _config(model_dir, mesh_shape):
  return loop.TrainConfig(model_dir=str(model_dir), batch_size=BATCH, train_steps=STEPS,
                          mesh_shape=mesh_shape, layout_rules=LAYOUT, learning_rate_schedule=_schedule,
                          optimizer=mtf.optimize.AdafactorOptimizer)


VARIABLE_DTYPE = mtf.VariableDType(tf.float32, tf.float32, tf.float32)


def _batches():
  """Batches a, b, a: the third loss, below the first, shows the updates took effect."""
  rng = np.random.RandomState(0)
  a, b = ({"targets": rng.randint(2, 256, size=[BATCH, LENGTH]).astype(np.int32)} for _ in range(2))
  return [a, b, a]


def _placement_losses(model, config, batches):
  """Losses of the CPU path's graph (model_fn.build_model_graph on PlacementMeshImpl); saves the
  initial variables as model.ckpt-0 and returns (losses, the names that checkpoint holds)."""
  with tf.Graph().as_default():
    tf.set_random_seed(loop.DEFAULT_RANDOM_SEED)
    features = {"targets": tf.placeholder(tf.int32, [BATCH, LENGTH])}
    global_step = tf.train.get_or_create_global_step()
    impl = model_fn.make_mesh_impl(config.mesh_shape, LAYOUT, cpu_devices(4))
    built = model_fn.build_model_graph(model, features, "train", impl, VARIABLE_DTYPE,
                                       optimizer=config.optimizer,
                                       learning_rate=_schedule(global_step))
    manager = checkpoints.CheckpointManager(config.model_dir, tf.global_variables())
    with tf.Session(config=session_config()) as session:
      loop.initialize_and_restore(session, built.lowering, None)
      names = sorted(tf.train.load_checkpoint(manager.save(session, 0)).get_variable_to_shape_map())
      losses = [session.run([built.outputs["loss"], built.train_op],
                            {features["targets"]: b["targets"]})[0] for b in batches]
  return losses, names


class _EmulatedReplicateContext:
  """Stands in for the TPU replicate context: a replicated variable resolves to this replica's copy."""

  def __init__(self, emulator):
    self._emulator = emulator

  def get_replicated_var_handle(self, name, handle_id, variables):
    del name, handle_id
    return variables[self._emulator.replica].handle


def _emulated_tpu_losses(model, config, batches, l2p, monkeypatch):
  """Losses of tpu.replica_train_step built once per emulated replica (one per virtual CPU).

  As on a TPU, each replica has its own copy of the global step, reads and updates its own slice
  of every variable (the shared ReplicatedVariables), and gets the whole batch.
  """
  num_replicas = mtf.convert_to_shape(config.mesh_shape).size
  emulator = _EmulatedTpuOps(num_replicas)
  with tf.Graph().as_default() as graph:
    tf.set_random_seed(loop.DEFAULT_RANDOM_SEED)
    features = {"targets": tf.placeholder(tf.int32, [BATCH, LENGTH])}
    steps = []
    with monkeypatch.context() as patch:
      patch.setattr(simd, "_tpu_ops", lambda: emulator)
      patch.setattr(tpu_variables, "_enclosing_tpu_context", lambda: _EmulatedReplicateContext(emulator))
      for replica in range(num_replicas):
        emulator.replica = replica
        graph.clear_collection(tf.GraphKeys.GLOBAL_STEP)
        tf.add_to_collection(tf.GraphKeys.GLOBAL_STEP, tf.Variable(
            0, dtype=tf.int64, trainable=False, use_resource=True, name="global_step_replica_%d" % replica))
        impl = mtf.simd_mesh_impl.SimdMeshImpl(config.mesh_shape, LAYOUT, logical_to_physical=l2p)
        with tf.device("/cpu:%d" % replica), tf.variable_scope("", reuse=tf.AUTO_REUSE):
          steps.append(tpu_lib.replica_train_step(model, features, impl, VARIABLE_DTYPE, config))
    masters = [v for v in tf.global_variables() if "global_step" not in v.op.name]
    names = sorted(v.op.name for v in masters)
    copy_in = steps[0].lowering.copy_masters_to_slices()
    with tf.Session(config=session_config()) as session:
      session.run(tf.global_variables_initializer())
      tf.train.Saver(masters).restore(session, checkpoints.checkpoint_path(config.model_dir, 0))
      session.run(copy_in)
      losses = []
      for b in batches:
        values = session.run([[s.outputs["loss"] for s in steps], [s.train_op for s in steps]],
                             {features["targets"]: b["targets"]},
                             options=tf.RunOptions(timeout_in_ms=120_000))[0]
        np.testing.assert_allclose(values, values[0], rtol=1e-6)  # the loss is replicated
        losses.append(values[0])
  return losses, names


@pytest.mark.slow
def test_replica_step_on_emulated_tpu_replicas_gives_the_placement_losses(tmp_path, tiny_model, monkeypatch):
  mesh_shape = "batch:2;model:2"
  model = tiny_model(mesh_shape)
  config = _config(tmp_path / "model", mesh_shape)
  batches = _batches()
  expected, cpu_names = _placement_losses(model, config, batches)
  actual, tpu_names = _emulated_tpu_losses(model, config, batches, [2, 0, 3, 1], monkeypatch)
  assert tpu_names == [n for n in cpu_names if n != "global_step"]  # the same checkpoint names
  assert expected[2] < expected[0]  # it trains
  np.testing.assert_allclose(actual, expected, rtol=2e-5)


# ---- (c) errors when no TPU answers ----

def _run_tpu(tmp_path, tpu, mode="train", gcp_project=None, tpu_zone=None):
  return utils.run(tpu_job_name=None, tpu=tpu, gcp_project=gcp_project, tpu_zone=tpu_zone,
                   model_dir=str(tmp_path), mode=mode, mesh_shape="batch:2", layout_rules="batch:batch")


@pytest.fixture
def no_graph_building(monkeypatch):
  """Fails the test if run() gets as far as building the model."""
  def refuse(**kwargs):
    raise AssertionError("run() built the model before checking the TPU")
  monkeypatch.setattr(run_lib, "build_model", refuse)


def test_a_tpu_name_without_cloud_tpu_client_is_a_clear_error(tmp_path, no_graph_building):
  with pytest.raises(tpu_lib.TpuUnavailableError, match=r"--tpu='my-tpu'.*pip install cloud-tpu-client"):
    _run_tpu(tmp_path, "my-tpu", gcp_project="my-project", tpu_zone="europe-west4-a")


def test_a_worker_without_tpu_devices_is_a_clear_error(tmp_path, no_graph_building):
  server = tf.distribute.Server.create_local_server()
  with pytest.raises(tpu_lib.TpuUnavailableError, match=r"no TPU devices.*leave --tpu unset"):
    _run_tpu(tmp_path, server.target)


def test_a_worker_that_does_not_answer_is_a_clear_error(tmp_path, no_graph_building, monkeypatch):
  monkeypatch.setattr(tpu_lib, "CONNECT_TIMEOUT_SECONDS", 1.0)
  with pytest.raises(tpu_lib.TpuUnavailableError, match=r"did not answer within 1s.*port 8470"):
    _run_tpu(tmp_path, "grpc://localhost:1")


def test_modes_other_than_train_are_refused_on_tpu(tmp_path, no_graph_building):
  with pytest.raises(NotImplementedError, match="only 'train'.*leave --tpu unset"):
    _run_tpu(tmp_path, "grpc://localhost:1", mode="perplexity_eval")


# ---- (d) the TPU graph is built without a TPU ----

def test_tpu_training_graph_builds_without_a_tpu(tmp_path, tiny_model):
  mesh_shape = tpu_mesh_shape("v3-8", 2)
  model = tiny_model(mesh_shape)
  config = _config(tmp_path / "model", mesh_shape)
  assignment, l2p = tpu_lib.assign_devices(_v3_topology(2, 2), mesh_shape)
  with tf.Graph().as_default() as graph:
    dataset = tf.data.Dataset.from_tensors({"targets": np.ones([LENGTH], np.int32)})
    built = tpu_lib.build_training_graph(model, dataset, config, VARIABLE_DTYPE, assignment, l2p,
                                         job="worker")
    copy_out = built.lowering.copy_slices_to_masters()
    ops = graph.get_operations()
    masters = tf.global_variables()
    slices = tf.get_collection("TPU_VAR")
  types = {op.type for op in ops}
  assert {"TPUReplicateMetadata", "InfeedDequeueTuple", "CrossReplicaSum", "TPUReplicatedInput"} <= types
  assert types & {"While", "StatelessWhile"} or "Enter" in types  # the on-device loop
  enqueues = [op for op in ops if op.type == "InfeedEnqueueTuple"]
  assert sorted(op.get_attr("device_ordinal") for op in enqueues) == list(range(8))
  assert {op.device for op in enqueues} == {"/job:worker/task:0/device:CPU:0"}
  assert all(v.device == "/job:worker/task:0/device:CPU:0" for v in masters)
  assert all("/device:TPU:" in v.device for v in slices) and len(slices) % 8 == 0
  assert "global_step" in {v.op.name for v in masters}
  assert not any("_slice_" in v.op.name for v in masters)  # checkpoints hold masters only
  assert len(built.loop_outputs) == 3 and copy_out.type == "NoOp"
  assert built.set_global_step.device == "/job:worker/task:0/device:CPU:0"


def test_tpu_training_graph_takes_the_outer_batch_size_of_tpu_estimator_model_fn(tmp_path, tiny_model):
  """explain --search prints tpu_estimator_model_fn.outer_batch_size for a pipeline over the
  outer batch: the TPU training graph's features are then [outer_batch, batch, length]."""
  mesh_shape = tpu_mesh_shape("v3-8", 2)
  model = tiny_model(mesh_shape)
  config = dataclasses.replace(_config(tmp_path / "model", mesh_shape), outer_batch_size=2)
  assignment, l2p = tpu_lib.assign_devices(_v3_topology(2, 2), mesh_shape)
  with tf.Graph().as_default():
    dataset = tf.data.Dataset.from_tensors({"targets": np.ones([LENGTH], np.int32)})
    built = tpu_lib.build_training_graph(model, dataset, config, VARIABLE_DTYPE, assignment, l2p,
                                         job="worker")
  shapes = {op.outputs[0].shape for op in built.lowering.graph.operations
            if isinstance(op, mtf.ImportOperation) and op.outputs[0].shape.ndims}  # not the scalars
  assert shapes == {mtf.Shape([mtf.Dimension("outer_batch", 2), mtf.Dimension("batch", BATCH // 2),
                               mtf.Dimension("length", LENGTH)])}
