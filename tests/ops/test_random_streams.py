"""Random streams: fresh values at every evaluation, reproducible with a seed, equal under every layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf2
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import (
    BACKENDS, MAX_EXAMPLES, MODES, cpu_devices, lower_and_evaluate, mesh_and_layout, session_config)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = {"a": 8, "b": 12, "c": 16}
SHAPE = "a:8;b:12;c:16"


def draws(mesh, shape=SHAPE) -> list:
  """One of each kind of random tensor: uniform, normal, truncated normal, int, bfloat16, dropout."""
  return [mtf.random_uniform(mesh, shape, minval=-2.0, maxval=3.0),
          mtf.random_normal(mesh, shape, mean=1.0, stddev=2.0),
          mtf.RandomOperation(
              mesh, mtf.convert_to_shape(shape), tf.random.truncated_normal).outputs[0],
          mtf.random_uniform(mesh, shape, minval=-5, maxval=7, dtype=tf.int32),
          mtf.random_uniform(mesh, shape, dtype=tf.bfloat16),
          mtf.dropout(mtf.ones(mesh, shape), rate=0.3)]


def lower(mesh_shape="all:1", layout="", build=draws, random_position=None, backend="placement") -> list:
  """Builds `build(mesh)` and lowers it on `backend` in the current mode; returns the TF tensors."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  outputs = build(mesh)
  mesh_shape = mtf.convert_to_shape(mesh_shape)
  impl = BACKENDS[backend](mesh_shape, layout, cpu_devices(mesh_shape.size))
  lowering = mtf.Lowering(graph, {mesh: impl}, random_position=random_position)
  return [lowering.export_to_tf_tensor(x) for x in outputs]


def assert_all_differ(first: list, second: list) -> None:
  for x, y in zip(first, second):
    assert not np.array_equal(x, y)


def assert_all_equal(first: list, second: list) -> None:
  for x, y in zip(first, second):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_every_session_run_draws_fresh_values_and_the_sequence_repeats_with_the_seed():
  def three_runs():
    with tf.Graph().as_default():
      tf.set_random_seed(7)
      outputs = lower("r:2;c:4", "a:r;c:c")
      with tf.Session(config=session_config()) as session:
        return [session.run(outputs) for _ in range(3)]
  first = three_runs()
  assert_all_differ(first[0], first[1])
  assert_all_differ(first[1], first[2])
  for run_a, run_b in zip(first, three_runs()):  # a new session of the same program
    assert_all_equal(run_a, run_b)


def test_the_counter_needs_no_initialiser_and_is_saved_with_the_variables(tmp_path):
  with tf.Graph().as_default():
    tf.set_random_seed(1)
    (u,) = lower(build=lambda mesh: [mtf.random_uniform(mesh, SHAPE)])
    counter = tf.get_collection("mtf_random_counter")[0]
    assert counter in tf.global_variables() and counter not in tf.trainable_variables()
    saver = tf.train.Saver()
    with tf.Session() as session:  # no initialiser run: the first use starts the counter at 0
      values = [session.run(u) for _ in range(3)]
      saver.save(session, str(tmp_path / "ckpt"))
      fourth = session.run(u)
    with tf.Session() as session:
      saver.restore(session, str(tmp_path / "ckpt"))
      np.testing.assert_array_equal(session.run(u), fourth)  # the sequence continues where it was
    with tf.Session() as session:
      session.run(tf.global_variables_initializer())
      np.testing.assert_array_equal(session.run(u), values[0])
  assert len({v.tobytes() for v in values}) == 3


def test_eager_lowerings_draw_fresh_values_and_set_seed_restarts_the_sequence():
  tf2.random.set_seed(11)
  first, second = lower(), lower()
  assert_all_differ(first, second)
  tf2.random.set_seed(11)
  assert_all_equal(lower(), first)
  tf2.random.set_seed(12)
  assert_all_differ(lower(), first)


@pytest.mark.slow
def test_a_tf_function_draws_fresh_values_at_every_call():
  tf2.random.set_seed(3)
  step = tf2.function(lambda: lower("all:2", "b:all"))  # each device compiles the draw: two suffice
  first, second, third = step(), step(), step()
  assert_all_differ(first, second)
  assert_all_differ(second, third)


def test_two_random_ops_of_one_shape_draw_differently():
  def build(mesh):
    return [mtf.random_uniform(mesh, SHAPE), mtf.random_uniform(mesh, SHAPE)]
  first, second = lower_and_evaluate(build, "all:2", "a:all")
  assert not np.array_equal(first, second)


@pytest.fixture(params=["v2", "v1"])
def control_flow(request):
  """Loops built as TF2's functional While, then as tf.compat.v1's WhileContext (as TPU loops are)."""
  from tensorflow.python.ops import control_flow_util
  enabled = control_flow_util.ENABLE_CONTROL_FLOW_V2
  control_flow_util.ENABLE_CONTROL_FLOW_V2 = request.param == "v2"
  yield request.param
  control_flow_util.ENABLE_CONTROL_FLOW_V2 = enabled


ITERATIONS = 4


def loop_draws(mesh) -> list:
  """A while_loop whose body draws a row of noise per iteration, written into row i of `rows`."""
  rows_dim, c = mtf.Dimension("rows", ITERATIONS), mtf.Dimension("c", 16)

  def body(i, rows):
    noise = mtf.random_uniform(mesh, [c])
    return i + 1, rows + mtf.one_hot(i, rows_dim, dtype=tf.float32) * noise
  _, rows = mtf.while_loop(lambda i, rows: mtf.less(i, ITERATIONS), body,
                           [mtf.constant(mesh, 0, dtype=tf.int32), mtf.zeros(mesh, [rows_dim, c])])
  return [rows]


@pytest.mark.parametrize("mode", MODES)
def test_while_loop_iterations_draw_fresh_values_under_every_layout(mode, control_flow):
  del control_flow
  rows = [lower_and_evaluate(loop_draws, mesh_shape, layout, mode)[0]
          for mesh_shape, layout in [("all:1", ""), ("all:4", "c:all"), ("r:2;s:2", "c:s")]]
  assert len({row.tobytes() for row in rows[0]}) == ITERATIONS
  for other in rows[1:]:
    np.testing.assert_array_equal(other, rows[0])


@st.composite
def shapes_meshes_layouts(draw):
  sizes = {name: draw(st.sampled_from([1, 2, 4, 8])) * 2 for name in "abc"}
  mesh_shape, layout = draw(mesh_and_layout(sizes))
  return sizes, mesh_shape, layout, draw(st.sampled_from(MODES))


@pytest.mark.slow
@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(shapes_meshes_layouts())
def test_values_are_the_same_on_one_device_and_under_any_mesh_and_layout(case):
  sizes, mesh_shape, layout, mode = case
  shape = ";".join(f"{name}:{size}" for name, size in sizes.items())
  build = lambda mesh: draws(mesh, shape)  # noqa: E731
  expected = lower_and_evaluate(build, "all:1", "", mode, seed=5)
  actual = lower_and_evaluate(build, mesh_shape, layout, mode, seed=5)
  assert_all_equal(actual, expected)


@pytest.mark.slow
def test_normal_values_do_not_depend_on_the_slice_size():
  """TF's erfinv kernel is 1 ulp apart on its vectorised and scalar paths (slices of 3 elements
  take the scalar one, the whole tensor the vectorised one); the draw's XLA function is not."""
  def build(mesh):
    return [mtf.random_normal(mesh, "a:8;b:3"), mtf.RandomOperation(
        mesh, mtf.convert_to_shape("a:8;b:3"), tf.random.truncated_normal, dtype=tf.float64).outputs[0]]
  for mode in MODES:
    expected = lower_and_evaluate(build, "all:1", "", mode, seed=3)
    for mesh_shape in ["all:2", "all:4", "all:8"]:
      assert_all_equal(lower_and_evaluate(build, mesh_shape, "a:all", mode, seed=3), expected)


def test_eager_uniform_draws_by_numpy_equal_the_compiled_draws_and_only_large_slices_compile(
    monkeypatch):
  """Compiling a configuration's XLA draw costs about 50 ms, and TF's uint64 kernels about 30 ms
  to start: an eager client drawing new shapes (GPT-Neo's tests) must pay neither, and the values
  may not depend on which path ran (split slices, each dtype)."""
  from mesh_tensorflow._lowering import random_bits
  monkeypatch.setattr(random_bits, "_compiled", {})
  monkeypatch.setattr(random_bits, "_eager_draws", random_bits.collections.Counter())
  key = random_bits.stream_key(11, [3, tf.constant(2, tf.int64)])
  with tf2.Graph().as_default():  # the key of a graph, from TF's ops
    graph_key = random_bits.stream_key(11, [3, tf.constant(2, tf.int64)])
    with tf.Session() as session:
      assert session.run(graph_key) == key.numpy()
  small = random_bits.SliceGeometry((6, 7), (3, 7), ((1, 2), None))  # rows split in two
  large = random_bits.SliceGeometry((512, 256), (512, 256), (None, None))
  assert random_bits._eager_draws_before_compiling(small) is None
  assert random_bits._eager_draws_before_compiling(large) == 2
  for dtype, kwargs in [(tf.float32, {"minval": -2.0, "maxval": 3.0}), (tf.float64, {}),
                        (tf.int32, {"minval": -5, "maxval": 7}), (tf.bfloat16, {})]:
    by_numpy = {pnum: [random_bits.draw("uniform", small, pnum, key, dtype, **kwargs)
                       for _ in range(20)] for pnum in (0, 1)}
    assert ("uniform", dtype, small.static_key) not in random_bits._compiled
    assert not np.array_equal(by_numpy[0][0].numpy(), by_numpy[1][0].numpy())  # their own rows
    int_range = tf.constant([-5, 7] if dtype.is_integer else [0, 0], tf.int64)
    for pnum, values in by_numpy.items():
      compiled = random_bits._standard_compiled(
          "uniform", dtype, small, tf.constant(pnum), key, int_range)
      if not dtype.is_integer:
        compiled = random_bits._affine(
            tf.cast(compiled, dtype), *([-2.0, 5.0] if kwargs else [0, 1]), dtype)
      for value in values:
        np.testing.assert_array_equal(value.numpy(), compiled.numpy())
  first = random_bits.draw("uniform", large, 0, key)
  assert ("uniform", tf.float32, large.static_key) not in random_bits._compiled
  np.testing.assert_array_equal(random_bits.draw("uniform", large, 0, key).numpy(), first.numpy())
  assert ("uniform", tf.float32, large.static_key) in random_bits._compiled  # its second draw
  random_bits.draw("normal", small, 0, key, tf.float32)  # normals: the XLA function at once
  assert ("normal", tf.float32, small.static_key) in random_bits._compiled


@pytest.mark.slow
def test_other_backends_draw_the_placement_backends_values():
  backends = ["placement", "collective", "collective_tf_ops", "placement_unshared"]
  with tf.Graph().as_default():
    tf.set_random_seed(2)
    outputs = [lower("r:2;c:4", "a:r;c:c", backend=backend) for backend in backends]
    with tf.Session(config=session_config()) as session:  # one session: the draw compiles once
      expected, *others = session.run(outputs)
  for backend, values in zip(backends[1:], others):
    for kind, (x, y) in enumerate(zip(values, expected)):
      np.testing.assert_array_equal(x, y, err_msg=f"{backend}, draw {kind}")


def test_dropout_keeps_each_element_with_probability_keep_prob_independently():
  """2^18 elements, keep_prob 0.9: the kept fraction is within 5 standard deviations (0.003) of
  0.9, neighbours and the masks of two steps agree as independent draws would (p^2 + (1-p)^2)."""
  keep_prob, n = 0.9, 2 ** 18
  with tf.Graph().as_default():
    tf.set_random_seed(4)
    (y,) = lower("r:2;c:4", "a:r;b:c",
                 build=lambda mesh: [mtf.dropout(mtf.ones(mesh, "a:64;b:64;c:64"), keep_prob=keep_prob)])
    with tf.Session(config=session_config()) as session:
      first, second = session.run(y), session.run(y)
  assert set(np.unique(first)) == {0.0, np.float32(1.0 / keep_prob)}
  kept, kept_next = first != 0, second != 0
  tolerance = 5 * np.sqrt(keep_prob * (1 - keep_prob) / n)
  assert abs(kept.mean() - keep_prob) < tolerance
  agree = keep_prob ** 2 + (1 - keep_prob) ** 2
  assert abs((kept == kept_next).mean() - agree) < 5 * np.sqrt(agree * (1 - agree) / n)
  assert abs((kept[..., 1:] == kept[..., :-1]).mean() - agree) < 5 * np.sqrt(agree * (1 - agree) / n)
  assert abs((kept[1:] == kept[:-1]).mean() - agree) < 5 * np.sqrt(agree * (1 - agree) / n)


def test_uniform_and_normal_values_follow_their_distributions():
  with tf.Graph().as_default():
    tf.set_random_seed(9)
    uniform, normal, truncated, ints, halves, _ = lower("all:8", "c:all", build=lambda mesh: draws(
        mesh, "a:64;b:64;c:64"))
    with tf.Session(config=session_config()) as session:
      uniform, normal, truncated, ints, halves = session.run([uniform, normal, truncated, ints, halves])
  assert -2.0 <= uniform.min() and uniform.max() < 3.0 and abs(uniform.mean() - 0.5) < 0.01
  assert abs(normal.mean() - 1.0) < 0.02 and abs(normal.std() - 2.0) < 0.02
  assert np.abs(truncated).max() < 2.0 and abs(truncated.std() - 0.8796) < 0.01
  assert ints.min() == -5 and ints.max() == 6 and abs(ints.mean() - 0.5) < 0.05
  assert halves.dtype.name == "bfloat16" and 0.0 <= halves.astype(np.float32).min()
  assert halves.astype(np.float32).max() < 1.0


def test_recompute_grad_sees_the_dropout_mask_of_the_forward_pass():
  x_value = np.random.RandomState(0).uniform(1.0, 2.0, size=(8, 12, 16)).astype(np.float32)

  def build(mesh):
    x = mtf.import_tf_tensor(mesh, tf.constant(x_value), SHAPE)
    y = mtf.recompute_grad(lambda x: mtf.dropout(x * 3.0, rate=0.5), [x])
    return [y, mtf.gradients([mtf.reduce_sum(y)], [x])[0]]
  for mode in MODES:
    y, dx = lower_and_evaluate(build, "r:2;c:4", "a:r;c:c", mode)
    np.testing.assert_allclose(dx, np.where(y != 0, 6.0, 0.0), rtol=1e-6)


def test_the_dry_run_counts_no_communication_for_random_ops():
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  draws(mesh)
  result = mtf.dry_run(graph, "r:2;c:4", "a:r;c:c")
  assert not result.events and result.bytes_sent == 0


# Every seeded case on both backends; the unseeded one on the placement backend.
PROCESS_CASES = [(21, "placement"), (21, "collective"), (22, "placement"), (22, "collective"),
                 (None, "placement")]


def three_runs_of_each_case() -> dict:
  """{"<graph seed> <backend>": three session runs of `draws`}, every case lowered in one program.

  Each case's seed is the graph seed while its random ops are lowered (their keys read it then);
  the cases share the session, so the draw's XLA function compiles once for all of them.
  """
  with tf.Graph().as_default():
    tensors = {}
    for seed, backend in PROCESS_CASES:
      tf.set_random_seed(seed)
      outputs = lower("r:2;c:4", "a:r;c:c", backend=backend)
      tensors[f"{seed} {backend}"] = [tf.cast(x, tf.float64) for x in outputs]  # JSON-ready
    with tf.Session(config=session_config()) as session:
      runs = [session.run(tensors) for _ in range(3)]
  return {key: [[v.tolist() for v in run[key]] for run in runs] for key in tensors}


_PROCESS_SCRIPT = """
import json
from tests.ops.test_random_streams import three_runs_of_each_case
print(json.dumps({"hash": hash("mesh_tensorflow"), "runs": three_runs_of_each_case()}))
"""


@pytest.mark.slow
def test_processes_with_one_seed_draw_the_same_runs_on_both_backends_and_other_seeds_differ():
  """This process and a fresh one with another PYTHONHASHSEED (string hashes differ) draw alike."""
  hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", PYTHONHASHSEED=hash_seed)
  process = subprocess.Popen([sys.executable, "-c", _PROCESS_SCRIPT], cwd=ROOT, text=True, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    first = three_runs_of_each_case()  # while the other process runs
  except BaseException:
    process.kill()
    raise
  out, err = process.communicate(timeout=300)
  assert process.returncode == 0, err[-3000:]
  other = json.loads(out.strip().splitlines()[-1])
  assert other["hash"] != hash("mesh_tensorflow")  # the processes hash strings differently
  second = other["runs"]
  for key in ["21 placement", "21 collective", "22 placement", "22 collective"]:
    assert first[key] == second[key], key
  assert first["21 placement"] == first["21 collective"]
  assert first["21 placement"] != first["22 placement"]
  assert first["21 placement"][0] != first["21 placement"][1] != first["21 placement"][2]
  assert first["None placement"][0] != second["None placement"][0]  # unseeded: each run its own
