"""The lowering cache (mtf.lowering_cache): an eager graph built again runs its lowered program.

Each test builds its mtf graph anew at every call, as eager clients do, and counts the Lowerings
that lowered ops (the `lowered` fixture). A structure is lowered eagerly the first time, traced
into a program the second time, and served by that program from then on; any difference in
the structure lowers again, and every value equals the uncached one.
"""

import gc

import numpy as np
import pytest
import tensorflow as tf2
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import cpu_devices
from tests.tf2 import test_eager_clients

BATCH, INPUT, HIDDEN = 8, 4, 16
inp, hidden = mtf.Dimension("inp", INPUT), mtf.Dimension("hidden", HIDDEN)
SCALE = np.linspace(0.5, 2.0, HIDDEN).astype(np.float32)
_rng = np.random.RandomState(0)
X = _rng.randn(BATCH, INPUT).astype(np.float32)
W = _rng.randn(INPUT, HIDDEN).astype(np.float32)


@pytest.fixture
def lowered(monkeypatch) -> list:
  """The Lowerings that lowered at least one op since the test began (eagerly or into a program)."""
  seen = []
  lower_operation = mtf.Lowering.lower_operation

  def counting(self, op):
    if not any(lowering is self for lowering in seen):
      seen.append(self)
    return lower_operation(self, op)
  monkeypatch.setattr(mtf.Lowering, "lower_operation", counting)
  return seen


def _impl(shape: str = "all:2", layout: str = "batch:all", devices=None):
  devices = devices or cpu_devices(mtf.convert_to_shape(shape).size)
  return mtf.placement_mesh_impl.PlacementMeshImpl(shape, layout, devices)


def forward(x=X, w=W, scale=SCALE, impl=None) -> np.ndarray:
  """relu(x w) * scale, built, lowered and exported now (x and w imported TF tensors)."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  batch = mtf.Dimension("batch", x.shape[0])
  h = mtf.relu(mtf.einsum([mtf.import_tf_tensor(mesh, tf.constant(x), [batch, inp]),
                           mtf.import_fully_replicated(mesh, tf.constant(w), [inp, hidden])],
                          [batch, hidden]))
  y = h * mtf.constant(mesh, scale, [hidden])
  lowering = mtf.Lowering(graph, {mesh: impl or _impl()})
  return lowering.export_to_tf_tensor(y).numpy()


def expected(x=X, w=W, scale=SCALE) -> np.ndarray:
  return np.maximum(x @ w, 0) * scale


def test_a_graph_built_again_is_lowered_twice_then_served_by_its_program(lowered):
  with mtf.lowering_cache() as cache:
    for i in range(5):
      x = X + i  # other values of the same shape: the same structure
      np.testing.assert_allclose(forward(x), expected(x), rtol=1e-5)
  assert len(lowered) == 2  # eagerly, then into the program
  assert (cache.lowerings, cache.hits, len(cache)) == (2, 3, 1)


NEAR_MISSES = {
    "another shape": lambda: forward(x=np.tile(X, [2, 1])),
    "another layout": lambda: forward(impl=_impl("all:2", "hidden:all")),
    "another constant": lambda: forward(scale=SCALE[::-1].copy()),
    "another mesh implementation": lambda: forward(impl=mtf.collective_mesh_impl.CollectiveMeshImpl(
        "all:2", "batch:all", cpu_devices(2))),
    "other devices": lambda: forward(impl=_impl(devices=["cpu:2", "cpu:3"])),
}
NEAR_MISS_VALUES = {
    "another shape": expected(x=np.tile(X, [2, 1])),
    "another constant": expected(scale=SCALE[::-1]),
}


@pytest.mark.parametrize("near_miss", list(NEAR_MISSES))
def test_a_near_miss_is_lowered_again_and_gets_its_own_values(lowered, near_miss):
  with mtf.lowering_cache() as cache:
    forward()
    forward()
    np.testing.assert_allclose(forward(), expected(), rtol=1e-5)  # served
    assert (len(lowered), cache.hits) == (2, 1)
    value = NEAR_MISSES[near_miss]()
  np.testing.assert_allclose(value, NEAR_MISS_VALUES.get(near_miss, expected()), rtol=1e-5)
  assert (len(lowered), cache.hits) == (3, 1)


def test_a_structure_without_a_program_keeps_only_its_keys_hash_and_is_still_traced_when_built_again(
    lowered):
  """A key holds tuples per op attribute; kept for every graph seen once, they would bring on the
  collector's full passes over TF's objects (0.4 s in GPT-Neo's test_sampling)."""
  with mtf.lowering_cache() as cache:
    forward()
    assert [key.parts for key in cache._entries] == [None]
    forward()  # traced: its entry keeps the whole key, which later graphs must equal
    assert all(key.parts is not None for key in cache._entries)
    np.testing.assert_allclose(forward(), expected(), rtol=1e-5)
    assert (len(lowered), cache.hits) == (2, 1)
    np.testing.assert_allclose(forward(scale=SCALE[::-1].copy()), expected(scale=SCALE[::-1]),
                               rtol=1e-5)  # another constant: another structure, lowered
    assert (len(lowered), cache.hits) == (3, 1)


def test_the_key_is_computed_with_the_garbage_collector_paused_and_its_state_restored(monkeypatch):
  from mesh_tensorflow._lowering import cache as cache_module
  enabled_in_walk = []
  walk_init = cache_module._Walk.__init__

  def recording(self, graph, mesh_to_impl):
    enabled_in_walk.append(gc.isenabled())
    walk_init(self, graph, mesh_to_impl)
  monkeypatch.setattr(cache_module._Walk, "__init__", recording)
  with mtf.lowering_cache():
    forward()
    assert gc.isenabled()
    gc.disable()
    try:
      forward()
      assert not gc.isenabled()  # the caller's choice is kept
    finally:
      gc.enable()
  assert enabled_in_walk == [False, False]


def _variable_step(variable, mesh_impl):
  """Assigns variable + 1 to an mtf variable whose master is `variable`; returns its old value."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  with tf2.variable_creator_scope(lambda next_creator, **kwargs: variable):  # the master
    v = mtf.get_variable(mesh, "v", [inp, hidden])
  mtf.assign(v, v + 1.0)
  lowering = mtf.Lowering(graph, {mesh: mesh_impl})
  old = lowering.export_to_tf_tensor(v).numpy()
  lowering.copy_slices_to_masters()
  return old


def test_another_variable_misses_and_each_variable_is_updated_through_the_program(lowered):
  a = tf2.Variable(np.zeros([INPUT, HIDDEN], np.float32), name="v")
  b = tf2.Variable(np.full([INPUT, HIDDEN], 10.0, np.float32), name="v")
  with mtf.lowering_cache() as cache:
    olds = [_variable_step(a, _impl(layout="hidden:all")) for _ in range(4)]
    assert (len(lowered), cache.hits) == (2, 2)
    assert _variable_step(b, _impl(layout="hidden:all"))[0, 0] == 10.0  # b's own value
    assert (len(lowered), cache.hits) == (3, 2)
  assert [o[0, 0] for o in olds] == [0.0, 1.0, 2.0, 3.0]
  np.testing.assert_array_equal(a.numpy(), np.full([INPUT, HIDDEN], 4.0))
  np.testing.assert_array_equal(b.numpy(), np.full([INPUT, HIDDEN], 11.0))


def train_step(x_np):
  """One SGD step of a 2x4-split MLP with dropout (getting_started's eager loop): loss, mask."""
  batch, d_ff = mtf.Dimension("batch", BATCH), mtf.Dimension("d_ff", HIDDEN)
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  x = mtf.import_tf_tensor(mesh, tf.constant(x_np), shape=[batch, inp])
  init = tf.random_normal_initializer(stddev=0.5, seed=1)
  w1 = mtf.get_variable(mesh, "w1", [inp, d_ff], initializer=init)
  w2 = mtf.get_variable(mesh, "w2", [d_ff, inp], initializer=init)
  h = mtf.dropout(mtf.relu(mtf.einsum([x, w1], output_shape=[batch, d_ff])), is_training=True, rate=0.5)
  loss = mtf.reduce_mean(mtf.square(mtf.einsum([h, w2], output_shape=[batch, inp]) - x))
  grads = mtf.gradients([loss], [v.outputs[0] for v in graph.trainable_variables])
  mtf.optimize.SgdOptimizer(0.1).apply_grads(grads, graph.trainable_variables)
  mesh_impl = _impl("rows:2;cols:4", "batch:rows;d_ff:cols")
  lowering = mtf.Lowering(graph, {mesh: mesh_impl})
  lowering.copy_slices_to_masters()
  return lowering.export_to_tf_tensor(loss).numpy(), lowering.export_to_tf_tensor(h).numpy() != 0


def _train(enabled: bool) -> tuple:
  tf2.random.set_seed(7)
  step = tf.make_template("model", train_step)  # the same variables at every call
  with mtf.lowering_cache(enabled=enabled) as cache:
    results = [step(X) for _ in range(20)]
  return [loss for loss, _ in results], [mask for _, mask in results], cache


def test_twenty_training_steps_with_dropout_equal_the_uncached_run(lowered):
  losses, masks, cache = _train(enabled=True)
  assert (len(lowered), cache.hits) == (2, 18)
  uncached_losses, uncached_masks, _ = _train(enabled=False)
  assert len(lowered) == 22
  np.testing.assert_allclose(losses, uncached_losses, rtol=1e-5)
  for mask, uncached_mask in zip(masks, uncached_masks):
    np.testing.assert_array_equal(mask, uncached_mask)  # the same masks from the same seed
  assert all((a != b).any() for a, b in zip(masks, masks[1:]))  # a fresh mask per call
  assert losses[-1] < 0.8 * losses[0]  # the updates reached the variables


def _draw() -> np.ndarray:
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  u = mtf.random_uniform(mesh, [mtf.Dimension("batch", BATCH), hidden])
  return mtf.Lowering(graph, {mesh: _impl()}).export_to_tf_tensor(u).numpy()


def test_setting_the_seed_again_restarts_a_served_graphs_draws():
  with mtf.lowering_cache() as cache:
    tf2.random.set_seed(3)
    first = [_draw() for _ in range(3)]
    tf2.random.set_seed(3)
    again = [_draw() for _ in range(3)]  # all three served by the program
  assert cache.hits == 4
  np.testing.assert_array_equal(again, first)
  assert not np.array_equal(first[1], first[2])


def test_the_cache_keeps_the_most_recently_used_structures():
  with mtf.lowering_cache(max_entries=2) as cache:
    forward()
    forward()  # traced
    forward(x=np.tile(X, [2, 1]))
    forward(x=np.tile(X, [3, 1]))  # the first structure is the least recently used: dropped
    assert len(cache) == 2
    forward()
  assert (cache.lowerings, cache.hits) == (5, 0)


def test_switched_off_every_call_lowers(lowered):
  with mtf.lowering_cache(enabled=False) as cache:
    for _ in range(3):
      np.testing.assert_allclose(forward(), expected(), rtol=1e-5)
  assert cache is None and len(lowered) == 3


def test_a_plain_call_switches_the_cache_off_until_the_next_call(lowered):
  scope = mtf.lowering_cache(enabled=False)
  try:
    for _ in range(3):
      forward()
  finally:
    scope.__exit__(None, None, None)  # the process's cache back, for the other tests
  assert len(lowered) == 3


def _eager_only() -> np.ndarray:
  """A graph whose slicewise function reads its slice as a NumPy array: it runs eagerly only."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  x = mtf.import_tf_tensor(mesh, tf.constant(X), [mtf.Dimension("batch", BATCH), inp])
  y = mtf.slicewise(lambda s: tf.constant(s.numpy() * 2), [x], output_shape=x.shape, output_dtype=x.dtype,
                    splittable_dims=x.shape.dims)
  return mtf.Lowering(graph, {mesh: _impl()}).export_to_tf_tensor(y).numpy()


def test_a_graph_that_cannot_be_traced_is_lowered_eagerly_every_time(lowered):
  with mtf.lowering_cache() as cache:
    values = [_eager_only() for _ in range(3)]
  for value in values:
    np.testing.assert_array_equal(value, 2 * X)
  assert (cache.lowerings, cache.hits) == (3, 0)


def test_graph_mode_lowers_every_time(lowered):
  with mtf.lowering_cache() as cache, tf.Graph().as_default():
    for _ in range(3):
      graph = mtf.Graph()
      mesh = mtf.Mesh(graph, "mesh")
      x = mtf.import_tf_tensor(mesh, tf.constant(X), [mtf.Dimension("batch", BATCH), inp])
      mtf.Lowering(graph, {mesh: _impl()}).export_to_tf_tensor(x)
  assert (len(lowered), cache.lowerings, cache.hits, len(cache)) == (3, 0, 0, 0)


def test_an_eager_client_agrees_with_its_function_with_the_cache_on():
  with mtf.lowering_cache() as cache:
    test_eager_clients.test_the_mtf_layers_model_and_its_sampling_agree_eagerly_and_as_a_function()
    test_eager_clients.test_the_mtf_layers_model_and_its_sampling_agree_eagerly_and_as_a_function()
  assert cache.hits == 0  # its variables are new at every call: another structure each time


@pytest.mark.parametrize("build", [test_eager_clients.neo_next_tokens,  # mtf.layers, sampling
                                   test_eager_clients.unitransformer_samples],  # while loops
                         ids=["mtf_layers", "transformer_layers"])
def test_an_eager_client_keeping_its_variables_is_served_with_its_uncached_values(build):
  def run():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    outputs = build(mesh, tf.constant(test_eager_clients._tokens()))
    lowering = mtf.Lowering(graph, {mesh: test_eager_clients._mesh_impl()})
    return [lowering.export_to_tf_tensor(x).numpy() for x in outputs]

  results = {}
  for enabled in (False, True):
    tf2.random.set_seed(test_eager_clients.SEED)
    step = tf.make_template("neo", run)
    with mtf.lowering_cache(enabled=enabled) as cache:
      results[enabled] = [step() for _ in range(3)]
  assert cache.hits == 1
  for cached, uncached in zip(results[True], results[False]):
    for got, want in zip(cached, uncached):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
