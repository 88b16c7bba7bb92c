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
  with tf.Graph().as_default():
    lowering, loss, _, values = _build(mesh_shape, layout, masters, **kwargs)
    init, copy_in = tf.global_variables_initializer(), lowering.copy_masters_to_slices()
    saver = tf.train.Saver()
    with tf.Session(config=session_config()) as sess:
      sess.run(init)
      saver.restore(sess, path)
      sess.run(copy_in)
      return sess.run(values), sess.run(loss)


def _assert_same(values, expected):
  assert sorted(values) == sorted(expected)
  for name in expected:
    np.testing.assert_array_equal(values[name], expected[name], err_msg=name)


# ---- memory ----

@pytest.mark.parametrize("share_replicas", [None, False])
@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
@pytest.mark.parametrize("mesh_shape,layout", [
    ("all:8", "batch:all"),
    ("all:8", "d_ff:all;vocab:all;d_kv:all"),
    ("b:2;m:4", "batch:b;d_ff:m;heads:m;vocab:m"),
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

def test_a_sliced_checkpoint_holds_every_variable_whole_in_the_master_dtype(tmp_path):
  whole, sliced = str(tmp_path / "whole"), str(tmp_path / "sliced")
  _train_and_save(whole, *WRITTEN_UNDER, "whole", slice_dtype=tf.bfloat16)
  _train_and_save(sliced, *WRITTEN_UNDER, "sliced", slice_dtype=tf.bfloat16)
  expected, got = tf.train.load_checkpoint(whole), tf.train.load_checkpoint(sliced)
  assert got.get_variable_to_shape_map() == expected.get_variable_to_shape_map()
  assert got.get_variable_to_dtype_map() == expected.get_variable_to_dtype_map()
  assert got.get_variable_to_dtype_map()["a/kernel"] == tf.float32
  assert "a/kernel" in got.get_variable_to_shape_map()  # a stacked variable keeps its own name
  for name in expected.get_variable_to_shape_map():
    np.testing.assert_array_equal(got.get_tensor(name), expected.get_tensor(name), err_msg=name)


@pytest.mark.parametrize("written,read", [("sliced", "sliced"), ("sliced", "whole"), ("whole", "sliced")])
def test_checkpoints_restore_bit_identically_under_other_meshes_and_modes(tmp_path, written, read):
  path = str(tmp_path / "model")
  _, saved = _train_and_save(path, *WRITTEN_UNDER, written)
  reference_loss = None
  for mesh_shape, layout in READ_UNDER:
    values, loss = _restore(path, mesh_shape, layout, read)
    _assert_same(values, saved)
    reference_loss = loss if reference_loss is None else reference_loss
    np.testing.assert_allclose(loss, reference_loss, rtol=1e-6)


def test_a_bfloat16_sliced_checkpoint_restores_into_float32_whole_masters(tmp_path):
  path = str(tmp_path / "model")
  _, saved = _train_and_save(path, *WRITTEN_UNDER, "sliced", slice_dtype=tf.bfloat16)
  values, _ = _restore(path, "all:4", "hidden:all", "whole")
  _assert_same(values, saved)


def test_a_checkpoint_of_whole_masters_restores_into_bfloat16_sliced_parts(tmp_path):
  path = str(tmp_path / "model")
  _, saved = _train_and_save(path, *WRITTEN_UNDER, "whole", slice_dtype=tf.bfloat16)
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
def test_training_is_the_same_as_with_whole_masters(tmp_path, optimizer, slice_dtype):
  runs = {masters: _train_and_save(str(tmp_path / masters), *WRITTEN_UNDER, masters, steps=3,
                                   optimizer=optimizer, slice_dtype=slice_dtype)
          for masters in ("whole", "sliced")}
  np.testing.assert_array_equal(runs["sliced"][0], runs["whole"][0])
  _assert_same(runs["sliced"][1], runs["whole"][1])


@pytest.mark.parametrize("slice_dtype", [tf.float32, tf.bfloat16])
def test_a_slice_variable_per_processor_trains_and_saves_as_shared_ones(tmp_path, slice_dtype):
  runs = {share: _train_and_save(str(tmp_path / str(share)), *WRITTEN_UNDER, "sliced", steps=3,
                                 optimizer="adam", slice_dtype=slice_dtype, share_replicas=share)
          for share in (None, False)}
  np.testing.assert_array_equal(runs[False][0], runs[None][0])
  _assert_same(runs[False][1], runs[None][1])
  values, _ = _restore(str(tmp_path / "False"), "all:8", "hidden:all", "sliced", optimizer="adam",
                       slice_dtype=slice_dtype)
  _assert_same(values, runs[None][1])


def test_the_collective_backend_has_sliced_masters_too(tmp_path):
  _, expected = _train_and_save(str(tmp_path / "whole"), *WRITTEN_UNDER, "whole")
  _, got = _train_and_save(str(tmp_path / "sliced"), *WRITTEN_UNDER, "sliced", backend="collective")
  _assert_same(got, expected)
  values, _ = _restore(str(tmp_path / "sliced"), "all:8", "hidden:all", "whole")
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
