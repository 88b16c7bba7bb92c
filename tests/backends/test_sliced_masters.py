"""PlacementMeshImpl(masters="sliced"): no whole master variables, checkpoints as with masters.

What is proved here: no device holds more variable bytes than its slices need; checkpoints hold
every variable whole under its usual name, shape and dtype, and restore bit-identically across
layouts, meshes and both modes; training is the same as with whole masters (SGD, Adafactor, Adam,
bfloat16 slices, stacked variables), in graph and eager mode, on both in-process backends.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from benchmarks import _transformer_model as transformer
from benchmarks.bench_transformer import needed_bytes_per_processor, ops_run_by, variable_bytes_per_device
from mesh_tensorflow.collective_mesh_impl import Cluster, CollectiveMeshImpl
from tests.harness import cpu_devices, session_config

# One worker runs the module: its trainings are shared by its tests, done once.
pytestmark = [pytest.mark.xdist_group("sliced_masters"), pytest.mark.slow]

OPTIMIZERS = {
    "sgd": lambda: mtf.optimize.SgdOptimizer(0.1),
    "adafactor": lambda: mtf.optimize.AdafactorOptimizer(),
    "adam": lambda: mtf.optimize.AdamWeightDecayOptimizer(0.01),
}
# A 2-D layout the checkpoints are written under, and the meshes they are read back on.
WRITTEN_UNDER = ("rows:2;cols:4", "batch:rows;hidden:cols")
READ_UNDER = [("all:8", "batch:all"), ("x:2;y:2;z:2", "batch:x;hidden:y;d_in:z"),
              ("rows:4;cols:2", "hidden:rows;d_in:cols"), ("all:1", "")]


def _impl(mesh_shape, layout, masters, backend="placement", share_replicas=None):
  devices = cpu_devices(mtf.convert_to_shape(mesh_shape).size)
  if backend == "collective":
    return CollectiveMeshImpl(mesh_shape, layout, devices, masters=masters)
  return mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, devices, masters=masters,
                                                   share_replicas=share_replicas)


def _build(mesh_shape, layout, masters, optimizer="adafactor", slice_dtype=tf.float32,
           backend="placement", share_replicas=None):
  """An MLP whose two input kernels (and biases) stack; returns (lowering, loss, train op, {name: value}).

  The values are every variable's (optimizer slots included) read back through its slices.
  """
  tf.set_random_seed(7)
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  batch, d_in = mtf.Dimension("batch", 8), mtf.Dimension("d_in", 4)
  hidden, out = mtf.Dimension("hidden", 8), mtf.Dimension("out", 2)
  rng = np.random.RandomState(0)
  x = mtf.import_tf_tensor(mesh, tf.constant(rng.randn(8, 4), tf.float32), [batch, d_in])
  dtype = mtf.VariableDType(tf.float32, slice_dtype, tf.float32)
  h = 0
  for name in ("a", "b"):
    w = mtf.get_variable(mesh, name + "/kernel", [d_in, hidden], dtype=dtype,
                         initializer=tf.random_normal_initializer())
    bias = mtf.get_variable(mesh, name + "/bias", [hidden], dtype=dtype,
                            initializer=tf.random_uniform_initializer())
    h += mtf.relu(mtf.einsum([x, w], [batch, hidden]) + bias)
  w_out = mtf.get_variable(mesh, "out/kernel", [hidden, out], dtype=dtype,
                           initializer=tf.random_normal_initializer())
  loss = mtf.reduce_mean(mtf.square(mtf.einsum([h, w_out], [batch, out]) - 1.0))
  trained = list(graph.trainable_variables)
  updates = OPTIMIZERS[optimizer]().apply_grads(mtf.gradients([loss], [v.outputs[0] for v in trained]),
                                                trained)
  values = {v.name: v.outputs[0] for v in graph.all_variables}  # before autostack rewrites them
  lowering = mtf.Lowering(graph, {mesh: _impl(mesh_shape, layout, masters, backend, share_replicas)})
  train_op = tf.group([lowering.lowered_operation(u) for u in updates])
  return (lowering, lowering.export_to_tf_tensor(loss), train_op,
          {name: lowering.export_to_tf_tensor(t) for name, t in values.items()})


def _train_and_save(path, mesh_shape, layout, masters, steps=2, **kwargs):
  """Trains `steps` steps from the seeded initial values and saves; returns (losses, values)."""
  with tf.Graph().as_default():
    lowering, loss, train_op, values = _build(mesh_shape, layout, masters, **kwargs)
    init, copy_in = tf.global_variables_initializer(), lowering.copy_masters_to_slices()
    copy_out, saver = lowering.copy_slices_to_masters(), tf.train.Saver()
    with tf.Session(config=session_config()) as sess:
      sess.run(init)
      sess.run(copy_in)
      losses = [sess.run([loss, train_op])[0] for _ in range(steps)]
      sess.run(copy_out)
      saver.save(sess, path)
      return losses, sess.run(values)


def _restore(path, mesh_shape, layout, masters, **kwargs):
  """Restores `path` the usual way (init, restore, copy masters to slices); the values and a loss."""
  return _restore_each([path], mesh_shape, layout, masters, **kwargs)[0]


def _restore_each(paths, mesh_shape, layout, masters, **kwargs):
  """(values, loss) of each checkpoint in `paths`, restored in turn into one program and session."""
  with tf.Graph().as_default():
    lowering, loss, _, values = _build(mesh_shape, layout, masters, **kwargs)
    init, copy_in = tf.global_variables_initializer(), lowering.copy_masters_to_slices()
    saver = tf.train.Saver()
    with tf.Session(config=session_config()) as sess:
      restored = []
      for path in paths:
        sess.run(init)
        saver.restore(sess, path)
        sess.run(copy_in)
        restored.append((sess.run(values), sess.run(loss)))
      return restored


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """train(masters, **_build's options) -> (checkpoint path, losses, values) of 3 steps under
  WRITTEN_UNDER; each distinct training runs once per module and is shared by the tests reading it."""
  runs = {}

  def train(masters, optimizer="adafactor", slice_dtype=tf.float32, backend="placement",
            share_replicas=None):
    key = (masters, optimizer, slice_dtype.name, backend, share_replicas)
    if key not in runs:
      path = str(tmp_path_factory.mktemp("trained") / "model")
      losses, values = _train_and_save(path, *WRITTEN_UNDER, masters, steps=3, optimizer=optimizer,
                                       slice_dtype=slice_dtype, backend=backend,
                                       share_replicas=share_replicas)
      runs[key] = path, losses, values
    return runs[key]
  return train


def _assert_same(values, expected):
  assert sorted(values) == sorted(expected)
  for name in expected:
    np.testing.assert_array_equal(values[name], expected[name], err_msg=name)


# ---- memory ----

# Every layout with both slice dtypes and both replica modes, and every (dtype, mode) pair: the
# dtype scales each slice's bytes, the mode decides where replicas live, independently.
@pytest.mark.parametrize("mesh_shape,layout,dtype,share_replicas", [
    ("all:8", "batch:all", tf.float32, None),
    ("all:8", "batch:all", tf.bfloat16, False),
    ("all:8", "d_ff:all;vocab:all;d_kv:all", tf.float32, False),
    ("all:8", "d_ff:all;vocab:all;d_kv:all", tf.bfloat16, None),
    ("b:2;m:4", "batch:b;d_ff:m;heads:m;vocab:m", tf.float32, None),
    ("b:2;m:4", "batch:b;d_ff:m;heads:m;vocab:m", tf.bfloat16, False),
])
def test_no_device_holds_more_variable_bytes_than_its_slices_need(mesh_shape, layout, dtype,
                                                                   share_replicas):
  cfg = transformer.Config(num_layers=1, d_model=64, d_ff=128, length=8, vocab=128)
  for masters in ("sliced", "whole"):
    with tf.Graph().as_default() as tf_graph:
      inputs = tf.zeros([cfg.batch, cfg.length], tf.int32)
      graph = mtf.Graph()
      mesh = mtf.Mesh(graph, "mesh")
      loss, updates = transformer.mtf_train_step(cfg, mesh, inputs, inputs, transformer.initial_values(cfg),
                                                 slice_dtype=dtype, activation_dtype=dtype)
      impl = _impl(mesh_shape, layout, masters, share_replicas=share_replicas)
      lowering = mtf.Lowering(graph, {mesh: impl})
      run = [tf.global_variables_initializer(), lowering.copy_masters_to_slices(),
             lowering.export_to_tf_tensor(loss), *[lowering.lowered_operation(u) for u in updates]]
      per_device = variable_bytes_per_device(tf_graph, run)
      needed = needed_bytes_per_processor(graph, impl)
      if masters == "whole":  # the measure sees the master copies on the first device
        assert per_device["CPU:0"] > 1.5 * needed
        continue
      for device, n in per_device.items():
        assert n <= 1.05 * needed, device
      if share_replicas is False:  # every processor holds its slices (as on GPUs)
        assert sorted(per_device) == ["CPU:%d" % i for i in range(8)]
        assert min(per_device.values()) >= needed
      else:  # processors holding the same slice share one variable: each slice is held once
        distinct_slices = sum(
            len({tuple(impl.slice_begin(v.shape, p)) for p in range(impl.size)})
            * int(np.prod(impl.slice_shape(v.shape))) * v.slice_dtype.size for v in graph.all_variables)
        assert sum(per_device.values()) == distinct_slices
      # The variables the program never runs are exactly the masters left in the graph.
      reached = ops_run_by(run)
      never_run = {op.name for op in tf_graph.get_operations()
                   if op.type == "VarHandleOp" and op not in reached}
      assert never_run == set(transformer.initial_values(cfg))


def test_bfloat16_slices_are_checkpointed_as_float32_without_a_float32_copy():
  with tf.Graph().as_default() as tf_graph:
    lowering, loss, train_op, _ = _build("all:8", "batch:all", "sliced", optimizer="sgd",
                                         slice_dtype=tf.bfloat16)
    checkpointed = tf.global_variables()
    assert checkpointed and all("_slice_" in v.name for v in checkpointed), checkpointed
    assert {v.dtype.base_dtype for v in checkpointed} == {tf.float32}
    per_device = variable_bytes_per_device(
        tf_graph, [tf.global_variables_initializer(), lowering.copy_masters_to_slices(), loss, train_op])
    # bfloat16, each variable once (the 8 replicas share it), and nothing in float32
    assert sum(per_device.values()) == sum(v.size * 2 for v in lowering.graph.all_variables)


# ---- checkpoints ----

def test_a_sliced_checkpoint_holds_every_variable_whole_in_the_master_dtype(trained):
  whole, sliced = trained("whole", slice_dtype=tf.bfloat16)[0], trained("sliced", slice_dtype=tf.bfloat16)[0]
  expected, got = tf.train.load_checkpoint(whole), tf.train.load_checkpoint(sliced)
  assert got.get_variable_to_shape_map() == expected.get_variable_to_shape_map()
  assert got.get_variable_to_dtype_map() == expected.get_variable_to_dtype_map()
  assert got.get_variable_to_dtype_map()["a/kernel"] == tf.float32
  assert "a/kernel" in got.get_variable_to_shape_map()  # a stacked variable keeps its own name
  for name in expected.get_variable_to_shape_map():
    np.testing.assert_array_equal(got.get_tensor(name), expected.get_tensor(name), err_msg=name)


@pytest.mark.parametrize("read,written", [("sliced", ["sliced", "whole"]), ("whole", ["sliced"])],
                         ids=["sliced_and_whole_into_sliced", "sliced_into_whole"])
def test_checkpoints_restore_bit_identically_under_other_meshes_and_modes(trained, read, written):
  """Each checkpoint written (sliced or whole masters) restores into `read` masters on every mesh."""
  checkpoints = [trained(masters) for masters in written]
  reference_loss = {}
  for mesh_shape, layout in READ_UNDER:
    restored = _restore_each([path for path, _, _ in checkpoints], mesh_shape, layout, read)
    for masters, (_, _, saved), (values, loss) in zip(written, checkpoints, restored):
      _assert_same(values, saved)
      reference_loss.setdefault(masters, loss)
      np.testing.assert_allclose(loss, reference_loss[masters], rtol=1e-6,
                                 err_msg=f"{masters} masters' checkpoint read under {mesh_shape}")


def test_a_bfloat16_sliced_checkpoint_restores_into_float32_whole_masters(trained):
  path, _, saved = trained("sliced", slice_dtype=tf.bfloat16)
  values, _ = _restore(path, "all:4", "hidden:all", "whole")
  _assert_same(values, saved)


def test_a_checkpoint_of_whole_masters_restores_into_bfloat16_sliced_parts(trained):
  path, _, saved = trained("whole", slice_dtype=tf.bfloat16)
  for mesh_shape, layout in READ_UNDER:
    values, _ = _restore(path, mesh_shape, layout, "sliced", slice_dtype=tf.bfloat16)
    _assert_same(values, saved)


@pytest.mark.parametrize("slice_dtype", [tf.float32, tf.bfloat16])
def test_monitored_session_hooks_resume_a_sliced_run_as_if_uninterrupted(tmp_path, slice_dtype):
  def train(steps):
    with tf.Graph().as_default():
      lowering, loss, train_op, _ = _build(*WRITTEN_UNDER, "sliced", optimizer="sgd",
                                           slice_dtype=slice_dtype)
      step = tf.train.get_or_create_global_step()
      with tf.control_dependencies([train_op]):
        train_op = tf.assign_add(step, 1)
      hooks = [mtf.MtfRestoreHook(lowering),
               tf.train.CheckpointSaverHook(str(tmp_path), save_steps=3,
                                            listeners=[mtf.MtfCheckpointSaverListener(lowering)]),
               tf.train.StopAtStepHook(last_step=steps)]
      losses = []
      with tf.train.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), hooks=hooks,
                                             save_checkpoint_secs=None, save_summaries_steps=None,
                                             config=session_config()) as sess:
        while not sess.should_stop():
          losses.append(sess.run([loss, train_op])[0])
      return losses

  losses = train(3) + train(6)  # the second run restores step 3
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith("-6")
  uninterrupted, _ = _train_and_save(str(tmp_path / "reference"), *WRITTEN_UNDER, "whole", steps=6,
                                     optimizer="sgd", slice_dtype=slice_dtype)
  np.testing.assert_array_equal(losses, uninterrupted)


# ---- training ----

@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("slice_dtype", [tf.float32, tf.bfloat16])
def test_training_is_the_same_as_with_whole_masters(trained, optimizer, slice_dtype):
  (_, sliced_losses, sliced), (_, whole_losses, whole) = (
      trained(masters, optimizer, slice_dtype) for masters in ("sliced", "whole"))
  np.testing.assert_array_equal(sliced_losses, whole_losses)
  _assert_same(sliced, whole)


@pytest.mark.parametrize("slice_dtype", [tf.float32, tf.bfloat16])
def test_a_slice_variable_per_processor_trains_and_saves_as_shared_ones(trained, slice_dtype):
  _, shared_losses, shared = trained("sliced", "adam", slice_dtype)
  path, own_losses, own = trained("sliced", "adam", slice_dtype, share_replicas=False)
  np.testing.assert_array_equal(own_losses, shared_losses)
  _assert_same(own, shared)
  values, _ = _restore(path, "all:8", "hidden:all", "sliced", optimizer="adam", slice_dtype=slice_dtype)
  _assert_same(values, shared)


def test_the_collective_backend_has_sliced_masters_too(trained):
  _, _, expected = trained("whole")
  path, _, got = trained("sliced", backend="collective")
  _assert_same(got, expected)
  values, _ = _restore(path, "all:8", "hidden:all", "whole")
  _assert_same(values, expected)


def test_a_stacked_variable_checkpoints_each_stacked_variable_under_its_own_name():
  with tf.Graph().as_default():
    lowering, _, _, _ = _build(*WRITTEN_UNDER, "sliced")
    stacked = [v for v in lowering.graph.all_variables if getattr(v, "is_stacked", False)]
    assert {tuple(v.original_names) for v in stacked} >= {("a/kernel", "b/kernel"), ("a/bias", "b/bias")}
    for v in stacked:
      saveables = lowering.variables[v].saveables
      assert sorted(saveables) == sorted(v.original_names)
      assert {s.name for parts in saveables.values() for s in parts} == set(v.original_names)


# ---- get_master / assign_to_master ----

def test_get_master_is_the_whole_value_and_assign_to_master_writes_every_slice():
  with tf.Graph().as_default():
    lowering, _, _, values = _build("all:8", "hidden:all", "sliced", optimizer="sgd")
    kernel = lowering.graph.name_to_variable["out/kernel"]
    stacked_kernel = lowering.graph.name_to_variable["a/kernel"]
    new_value = np.arange(16, dtype=np.float32).reshape(8, 2)
    init, copy_in = tf.global_variables_initializer(), lowering.copy_masters_to_slices()
    with tf.Session(config=session_config()) as sess:
      sess.run(init)
      sess.run(copy_in)
      assert isinstance(kernel.get_master(), tf.Tensor)
      np.testing.assert_array_equal(sess.run(kernel.get_master()), sess.run(values["out/kernel"]))
      np.testing.assert_array_equal(sess.run(stacked_kernel.get_master()), sess.run(values["a/kernel"]))
      sess.run(kernel.assign_to_master(new_value))
      np.testing.assert_array_equal(sess.run(values["out/kernel"]), new_value)
      np.testing.assert_array_equal(sess.run(kernel.get_master()), new_value)


# ---- eager ----

@pytest.mark.parametrize("slice_dtype", [tf.float32, tf.bfloat16])
def test_eager_mode_drops_the_masters_and_saves_the_parts(tmp_path, slice_dtype):
  assert tf.executing_eagerly()  # the test default; lowering runs the first update at once
  whole, _, _, expected = _build(*WRITTEN_UNDER, "whole", optimizer="adam", slice_dtype=slice_dtype)
  whole.copy_slices_to_masters()
  created = []

  def keep_weak_reference(next_creator, **kwargs):
    variable = next_creator(**kwargs)
    created.append(weakref.ref(variable))
    return variable
  with tf.variable_creator_scope(keep_weak_reference):
    lowering, _, _, values = _build(*WRITTEN_UNDER, "sliced", optimizer="adam", slice_dtype=slice_dtype)
  gc.collect()
  alive = {ref().name for ref in created if ref() is not None}
  assert alive and all("_slice_" in name for name in alive), alive  # the masters are gone
  _assert_same({k: v.numpy() for k, v in values.items()}, {k: v.numpy() for k, v in expected.items()})
  masters = {name: v.get_master().numpy() for name, v in lowering.graph.name_to_variable.items()}
  _assert_same(masters, {name: v.get_master().numpy() for name, v in whole.graph.name_to_variable.items()})
  path = str(tmp_path / "eager")
  saveables = {name: parts for lv in lowering.variables.values() for name, parts in lv.saveables.items()}
  tf.train.Saver(saveables).save(None, path)
  with tf.Graph().as_default():
    restored, _ = _restore(path, "all:1", "", "whole", optimizer="adam", slice_dtype=slice_dtype)
  _assert_same(restored, masters)


# ---- refused combinations ----

def test_masters_sliced_is_refused_across_processes_and_with_master_as_slice():
  cluster = Cluster(["localhost:1", "localhost:2"], task_index=0, devices_per_task=4)
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="masters='sliced' needs every processor in one process.*"
                                         "holds 4 of the mesh's 8"):
      CollectiveMeshImpl("all:8", "", cluster=cluster, masters="sliced")
  with pytest.raises(ValueError, match="master_as_slice=True applies to whole masters"):
    mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "", ["", ""], True, masters="sliced")
  with pytest.raises(ValueError, match=r"masters='none'; expected one of \('whole', 'sliced'\)"):
    mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "", ["", ""], masters="none")
