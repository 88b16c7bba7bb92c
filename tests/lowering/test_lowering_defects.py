"""Lowering defects fixed with the communication layer, each shown by a test that failed before."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._backends import simd
from tests.backends.test_simd_mesh_impl import _EmulatedTpuOps
from tests.harness import cpu_devices, session_config


def _variables_graph(mesh):
  """Three stackable variables with distinct initial values, and a value computed from them."""
  vs = [mtf.get_variable(mesh, "v%d" % i, "a:4;b:2", initializer=tf.constant_initializer(i + 1.0))
        for i in range(3)]
  return vs, mtf.reduce_sum(vs[0] * vs[1] + vs[2], output_shape="b:2")


def _placement(mesh_shape="all:4", layout="a:all"):
  return mtf.placement_mesh_impl.PlacementMeshImpl(
      mesh_shape, layout, cpu_devices(mtf.convert_to_shape(mesh_shape).size))


def test_lowering_the_same_graph_twice_gives_the_same_result():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    _, y = _variables_graph(mesh)
    first = mtf.Lowering(graph, {mesh: _placement()})  # autostack rewrites the graph once
    second = mtf.Lowering(graph, {mesh: _placement()})
    fetches = []
    for lowering in (first, second):
      fetches.append((lowering.copy_masters_to_slices(), lowering.export_to_tf_tensor(y)))
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      values = []
      for copy, out in fetches:
        sess.run(copy)
        values.append(sess.run(out))
  np.testing.assert_array_equal(values[0], values[1])
  np.testing.assert_array_equal(values[0], [4 * (1 * 2 + 3)] * 2)


def test_sequence_mode_copies_every_variable_on_the_placement_backend(monkeypatch):
  monkeypatch.setenv("MTF_SEQUENCE_MODE", "1")
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    vs, _ = _variables_graph(mesh)
    lowering = mtf.Lowering(graph, {mesh: _placement()}, autostack=False)
    slices = [lowering.tensors[v.outputs[0]].to_laid_out_tensor().all_slices for v in
              (v.operation for v in vs)]
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      values = sess.run(slices)
  for i, per_processor in enumerate(values):
    for value in per_processor:
      np.testing.assert_array_equal(value, np.full([1, 2], i + 1.0))


def test_print_prints_on_the_simd_backend(capfd):
  with tf.Graph().as_default(), pytest.MonkeyPatch.context() as patch:
    patch.setattr(simd, "_tpu_ops", lambda: _EmulatedTpuOps(2))
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    x = mtf.constant(mesh, 3.0, "a:4")
    y = mtf.Print(x, [x], "simd says")
    lowering = mtf.Lowering(graph, {mesh: simd.SimdMeshImpl("all:2", "a:all")})
    with tf.Session() as sess:
      sess.run(lowering.tensors[y].to_laid_out_tensor().one_slice)
  assert "simd says" in capfd.readouterr().err


def test_log_file_may_be_a_path(tmp_path):
  path = tmp_path / "lowering.log"
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    _variables_graph(mesh)
    mtf.Lowering(graph, {mesh: _placement()}, log_file=str(path))
  text = path.read_text()
  assert "Trainable Variables" in text and "Counters:" in text


def test_copying_masters_after_a_session_ran_does_not_change_run_ops(capfd):
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    _variables_graph(mesh)
    lowering = mtf.Lowering(graph, {mesh: _placement()})
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())  # asked for only now, as examples/classifier.py does
      sess.run(lowering.copy_slices_to_masters())
  assert "was changed by setting attribute after it was run" not in capfd.readouterr().err
