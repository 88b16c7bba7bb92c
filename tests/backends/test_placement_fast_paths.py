"""The placement backend picks its collectives' algorithm by where the devices are."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from tensorflow.core.protobuf import rewriter_config_pb2

import mesh_tensorflow as mtf
from mesh_tensorflow._backends import ring_collectives
from mesh_tensorflow._backends.placement import cpus_of_one_process, session_config_for_devices
from tests.harness import MODES, cpu_devices, run_tf

TWO_TASKS = [f"/job:worker/task:{t}/device:CPU:{c}" for t in range(2) for c in range(4)]


@pytest.mark.parametrize("devices,expected", [
    (cpu_devices(8), True), ([""] * 4, True), (["cpu:0", "/device:CPU:1", ""], True),
    (["gpu:0", "gpu:1"], False), (["cpu:0", "gpu:0"], False), (TWO_TASKS, False),
    ([f"/job:worker/task:0/device:CPU:{c}" for c in range(4)], True),
])
def test_cpus_of_one_process_tells_local_cpus_from_gpus_and_other_tasks(devices, expected):
  assert cpus_of_one_process(devices) is expected


def _allreduce_graph(devices, shape=(64, 64), **impl_kwargs):
  """The TF op types an 8-way SUM allreduce builds (graph only, not run), and its results."""
  with tf.Graph().as_default() as graph:
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:8", "", devices, **impl_kwargs)
    xs = []
    for d in devices:
      with tf.device(d):
        xs.append(tf.placeholder(tf.float32, shape))
    before = len(graph.get_operations())
    results = impl.allreduce(impl.LaidOutTensor(xs), [0], "SUM").tensor_list
    return [op.type for op in graph.get_operations()[before:]], results


def _op_types_of_allreduce(devices):
  return _allreduce_graph(devices)[0]


def test_allreduce_on_cpus_of_one_process_is_one_add_n_shared_by_every_device():
  types, results = _allreduce_graph(cpu_devices(8))
  assert types == ["AddN"]
  assert all(r is results[0] for r in results)


def test_allreduce_without_shared_replicas_copies_the_sum_to_each_device():
  types, results = _allreduce_graph(cpu_devices(8), share_replicas=False)
  assert sorted(types) == ["AddN"] + ["Identity"] * 8
  assert [r.device for r in results] == [tf.DeviceSpec.from_string(d).to_string() for d in cpu_devices(8)]


def test_allreduce_across_tasks_keeps_the_chunked_ring():
  types = _op_types_of_allreduce(TWO_TASKS)
  assert "AddN" not in types
  assert types.count("AddV2") == 8 * 8  # n chunks, each summed toward both centre devices


def _constants(devices, arrays):
  ret = []
  for d, a in zip(devices, arrays):
    with tf.device(d):
      ret.append(tf.constant(a))
  return ret


@pytest.mark.parametrize("mode", MODES)
def test_in_process_and_ring_algorithms_give_the_same_results(mode):
  devices = cpu_devices(4)
  rng = np.random.RandomState(0)
  xs = [rng.randint(-9, 9, size=(8, 256)).astype(np.float32) for _ in devices]

  def build():
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", "", devices)
    laid_out = impl.LaidOutTensor(_constants(devices, xs))
    ts = laid_out.tensor_list
    return (impl.allreduce(laid_out, [0], "SUM").tensor_list
            + ring_collectives.allreduce_ring(ts, devices, "SUM")
            + impl.allconcat(laid_out, 0, 1).tensor_list
            + ring_collectives.allconcat_ring(ts, devices, 1))
  got = run_tf(mode, build)
  for k in range(4):
    np.testing.assert_array_equal(got[k], np.sum(xs, axis=0))
    np.testing.assert_array_equal(got[4 + k], got[k])
    np.testing.assert_array_equal(got[8 + k], np.concatenate(xs, 1))
    np.testing.assert_array_equal(got[12 + k], got[8 + k])


def test_session_config_gives_each_kernel_its_processors_share_of_the_cores():
  config = session_config_for_devices(cpu_devices(8), cores=2)
  assert config.device_count["CPU"] == 8 and config.intra_op_parallelism_threads == 1
  assert session_config_for_devices(cpu_devices(8), cores=32).intra_op_parallelism_threads == 4


@pytest.mark.parametrize("devices", [["gpu:0", "gpu:1"], TWO_TASKS[:1], ["cpu:0"]])
def test_session_config_leaves_threads_to_tf_off_several_cpus_of_one_process(devices):
  assert session_config_for_devices(devices, cores=2).intra_op_parallelism_threads == 0


def test_session_config_keeps_what_the_callers_config_sets_and_does_not_change_it():
  given = tf.ConfigProto(intra_op_parallelism_threads=3, allow_soft_placement=True)
  given.device_count["CPU"] = 16
  config = session_config_for_devices(cpu_devices(8), given, cores=2)
  assert (config.intra_op_parallelism_threads, config.device_count["CPU"]) == (3, 16)
  assert config.allow_soft_placement and config is not given
  assert given == tf.ConfigProto(intra_op_parallelism_threads=3, allow_soft_placement=True,
                                 device_count={"CPU": 16})


def test_session_config_on_cpus_skips_grapplers_passes_that_only_cost_the_first_step():
  rewrites = session_config_for_devices(cpu_devices(8), cores=2).graph_options.rewrite_options
  assert rewrites.disable_tfg_optimizer and not rewrites.disable_meta_optimizer
  assert rewrites.memory_optimization == rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
  assert rewrites.meta_optimizer_iterations == rewriter_config_pb2.RewriterConfig.ONE


def test_session_config_keeps_the_callers_rewrite_options_and_tfs_on_gpus():
  given = tf.ConfigProto()
  given.graph_options.rewrite_options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
  config = session_config_for_devices(cpu_devices(8), given, cores=2)
  assert config.graph_options.rewrite_options == given.graph_options.rewrite_options
  gpu_config = session_config_for_devices(["gpu:0", "gpu:1"], cores=2)
  assert not gpu_config.graph_options.HasField("rewrite_options")


def test_a_mesh_runs_in_a_session_configured_by_its_backend():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    x = mtf.import_tf_tensor(mesh, tf.range(8.0), [mtf.Dimension("batch", 8)])
    y = mtf.reduce_sum(x * 2.0, reduced_dim=x.shape.dims[0])
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:8", "batch:all", cpu_devices(8))
    tf_y = mtf.Lowering(graph, {mesh: impl}).export_to_tf_tensor(y)
    with tf.Session(config=impl.session_config()) as sess:
      assert sess.run(tf_y) == 56.0
