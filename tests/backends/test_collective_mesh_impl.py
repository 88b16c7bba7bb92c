"""CollectiveMeshImpl in one process: every collective on 1-D, 2-D and 3-D meshes, random graphs.

Both of its paths run here: plain ops and copies between the devices of this process (graph and
eager mode), and TF collective ops (`in_process_fast_path=False`, graph mode), which is what runs
between processes. Results must equal NumPy, the placement backend and a one-processor mesh.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from mesh_tensorflow._core.layout import processor_groups
from mesh_tensorflow.collective_mesh_impl import Cluster, CollectiveMeshImpl
from tests.harness import (
    BACKENDS, MAX_EXAMPLES, MODES, cpu_devices, lower_and_evaluate, mesh_and_layout, session_config)
from tests.lowering.test_random_graphs import LAYOUT_DIMS, _program_and_reference, programs

MESHES = ["all:8", "rows:2;cols:4", "x:2;y:2;z:2"]
PATHS = [("collective", "graph"), ("collective", "eager"), ("collective_tf_ops", "graph"),
         ("collective_unfused", "graph")]


def _run(backend, mode, mesh_shape, fn, devices=None):
  """fn(impl, laid_out_input) -> LaidOutTensor on random int-valued slices; (inputs, outputs)."""
  size = mtf.convert_to_shape(mesh_shape).size
  xs = list(np.random.RandomState(size).randint(-9, 9, size=[size, 4, 8]).astype(np.float32))
  impl = BACKENDS[backend](mesh_shape, "", devices or cpu_devices(size))

  def build():
    return fn(impl, impl.LaidOutTensor(mtf.parallel(impl.devices, tf.constant, xs))).tensor_list
  if mode == "eager":
    return xs, [np.asarray(t) for t in build()]
  with tf.Graph().as_default():
    fetches = build()
    with tf.Session(config=session_config()) as sess:
      return xs, sess.run(fetches)


def _axis_subsets(mesh_shape):
  n = len(mtf.convert_to_shape(mesh_shape))
  return [list(c) for r in range(1, n + 1) for c in itertools.combinations(range(n), r)]


@pytest.mark.parametrize("backend,mode", PATHS)
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_allreduce_over_every_subset_of_mesh_axes(backend, mode, mesh_shape):
  for axes, (reduction, np_fn) in itertools.product(_axis_subsets(mesh_shape),
                                                    [("SUM", np.sum), ("MAX", np.max)]):
    xs, got = _run(backend, mode, mesh_shape, lambda impl, x, a=axes, r=reduction: impl.allreduce(x, a, r))
    for group in processor_groups(mtf.convert_to_shape(mesh_shape), axes):
      for pnum in group:
        np.testing.assert_array_equal(got[pnum], np_fn([xs[p] for p in group], axis=0))


@pytest.mark.parametrize("backend,mode", PATHS)
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_allconcat_alltoall_and_shift_along_every_mesh_axis(backend, mode, mesh_shape):
  _check_allconcat_alltoall_and_shift(backend, mode, mesh_shape)


@pytest.mark.parametrize("mesh_shape", MESHES[:2])
def test_tf_collective_ops_follow_tf_ranks_when_devices_are_listed_out_of_order(mesh_shape):
  """TF ranks a group's members by device index; the mesh's member order must still hold."""
  _check_allconcat_alltoall_and_shift("collective_tf_ops", "graph", mesh_shape, cpu_devices(8)[::-1])


def _check_allconcat_alltoall_and_shift(backend, mode, mesh_shape, devices=None):
  shape = mtf.convert_to_shape(mesh_shape)
  for axis in range(len(shape)):
    groups = processor_groups(shape, [axis])
    xs, got = _run(backend, mode, mesh_shape, lambda impl, x, a=axis: impl.allconcat(x, a, 1), devices)
    for group in groups:
      for pnum in group:
        np.testing.assert_array_equal(got[pnum], np.concatenate([xs[p] for p in group], 1))
    xs, got = _run(backend, mode, mesh_shape, lambda impl, x, a=axis: impl.alltoall(x, a, 1, 0), devices)
    for group in groups:
      for j, pnum in enumerate(group):
        n = len(group)
        np.testing.assert_array_equal(
            got[pnum], np.concatenate([np.split(xs[p], n, 1)[j] for p in group], 0))
    xs, got = _run(backend, mode, mesh_shape,
                   lambda impl, x, a=axis: impl.shift_by_n_processors(x, a, 1, False), devices)
    for group in groups:
      for k, pnum in enumerate(group):
        np.testing.assert_array_equal(got[pnum], xs[group[k - 1]] if k else np.zeros_like(xs[0]))


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(), mesh_and_layout(LAYOUT_DIMS), st.sampled_from(PATHS), st.integers(0, 1000))
def test_random_graph_equals_placement_and_one_processor(program, mesh_layout, path, seed):
  backend, mode = path
  build, expected = _program_and_reference(program, seed)
  try:
    got = lower_and_evaluate(build, *mesh_layout, mode, backend=backend)
    placement = lower_and_evaluate(build, *mesh_layout, mode)
  except NotImplementedError:  # a reshape whose new split falls inside an old dimension
    reject()
  for want in (placement, lower_and_evaluate(build, "all:1", "", mode), expected()):
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


def test_checkpoint_names_equal_the_placement_backends():
  def variable_names(backend):
    with tf.Graph().as_default():
      graph = mtf.Graph()
      mesh = mtf.Mesh(graph, "mesh")
      mtf.get_variable(mesh, "w", "a:8;b:4")
      mtf.Lowering(graph, {mesh: BACKENDS[backend]("x:2;y:4", "a:y", cpu_devices(8))})
      return sorted(v.name for v in tf.global_variables())
  assert variable_names("collective") == variable_names("placement") == ["w:0"]


def test_mesh_larger_than_the_visible_devices_is_refused():
  with pytest.raises(ValueError, match="16 processors but this process sees 8 devices"):
    CollectiveMeshImpl("all:16", "")


def test_cluster_from_tf_config_gives_each_task_a_contiguous_block():
  config = {"cluster": {"worker": ["h0:1", "h1:2"]}, "task": {"type": "worker", "index": 1}}
  cluster = Cluster.from_tf_config(config, devices_per_task=4)
  assert cluster.num_tasks == 2 and not cluster.is_chief
  with pytest.raises(ValueError, match="spanning processes .* runs in graph mode only"):
    CollectiveMeshImpl("b:2;m:4", "batch:b", cluster=cluster)  # eager
  with tf.Graph().as_default():
    impl = CollectiveMeshImpl("b:2;m:4", "batch:b", cluster=cluster)
  assert impl.local_pnums == [4, 5, 6, 7] and impl.is_multi_process
  assert impl.devices == ["/job:worker/replica:0/task:1/device:CPU:%d" % d for d in range(4)]
  assert list(cluster.session_config().device_filters) == ["/job:worker/replica:0/task:1"]
  with pytest.raises(ValueError, match="8 processors does not fit 2 tasks x 3 devices"):
    Cluster(["h0:1", "h1:2"], 0, devices_per_task=3).devices(8)
  with pytest.raises(ValueError, match="task_index 2 is not one of the 2 tasks"):
    Cluster(["h0:1", "h1:2"], 2)


def test_no_tf_config_means_one_process(monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  assert Cluster.from_tf_config() is None
  impl = CollectiveMeshImpl("all:4", "")
  assert impl.local_pnums == [0, 1, 2, 3] and not impl.is_multi_process
  assert [d.rsplit(":", 1)[1] for d in impl.devices] == ["0", "1", "2", "3"]


@pytest.mark.parametrize("mode", MODES)
def test_variables_train_and_copy_back_like_placement(mode):
  def build(mesh):
    w = mtf.get_variable(mesh, "w", "a:8;b:4", initializer=tf.random_uniform_initializer(seed=3))
    return [mtf.reduce_sum(mtf.square(w), output_shape="b:4"), w]
  got = lower_and_evaluate(build, "x:2;y:4", "a:y;b:x", mode, backend="collective")
  want = lower_and_evaluate(build, "x:2;y:4", "a:y;b:x", mode)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6)
