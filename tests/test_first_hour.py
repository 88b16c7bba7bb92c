"""A new user's first hour: layout typos are named, command lines explain themselves, macOS works."""

from __future__ import annotations

import io
import logging as std_logging
import os
import subprocess
import warnings

import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests import warm_python
from tests.harness import cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dense_graph():
  """A training step of loss = sum(relu(x @ w)), x [batch, d_in], w [d_in, hidden] (the gradient of a
  split batch is summed over processors: an allreduce)."""
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  batch, d_in, hidden = mtf.Dimension("batch", 8), mtf.Dimension("d_in", 16), mtf.Dimension("hidden", 32)
  x = mtf.ones(mesh, [batch, d_in])
  w = mtf.get_variable(mesh, "w", [d_in, hidden], initializer=tf.ones_initializer())
  loss = mtf.reduce_sum(mtf.relu(mtf.einsum([x, w], output_shape=[batch, hidden])))
  [grad] = mtf.gradients([loss], [w])
  mtf.assign_sub(w, grad)
  return graph, mesh, loss


def _lowering_warnings(mesh_shape: str, layout: str) -> list:
  """The LayoutRuleWarnings of one lowering of the dense graph on 8 CPU devices."""
  impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, cpu_devices(8))
  with tf.Graph().as_default(), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    graph, mesh, _ = _dense_graph()
    mtf.Lowering(graph, {mesh: impl})
  return [w for w in caught if issubclass(w.category, mtf.LayoutRuleWarning)]


def test_a_misspelled_mesh_dimension_warns_once_naming_the_rule_the_mesh_and_the_closest_name():
  [warning] = _lowering_warnings("batch:2;model:4", "batch:batch;hidden:modle")
  message = str(warning.message)
  assert "Layout rule hidden:modle" in message and "its dimensions: batch, model" in message
  assert "did you mean 'model'?" in message and "'hidden' is not split" in message
  assert warning.filename == __file__  # points at the caller's mtf.Lowering(...), not at the package


def test_a_rule_for_a_mesh_dimension_absent_and_unlike_any_stays_silent_beside_a_typo():
  # Shipped layout files name `model` on meshes without it: only the near miss `colz` is reported.
  caught = _lowering_warnings("rows:2;cols:4", "batch:rows;hidden:colz;d_ff:model")
  assert [str(w.message).split(" names ")[0] for w in caught] == ["Layout rule hidden:colz"]


def test_explain_treats_a_misspelled_rule_as_not_applying_and_warns():
  graph, _, loss = _dense_graph()
  with pytest.warns(mtf.LayoutRuleWarning, match="did you mean 'model'"):
    typo = mtf.explain(graph, "batch:2;model:4", "batch:batch;hidden:modle", [loss], file=io.StringIO())
  without = mtf.explain(graph, "batch:2;model:4", "batch:batch", [loss], file=io.StringIO())
  assert typo.report.events == without.report.events
  assert typo.report.memory == without.report.memory


def test_the_transformer_command_line_keeps_layout_typo_warnings_when_quiet():
  from mesh_tensorflow.transformer import main

  saved = tf.logging.get_verbosity()
  try:
    with warnings.catch_warnings(record=True) as caught:
      main.configure_logging(verbose=False)
      warnings.warn("a typo", mtf.LayoutRuleWarning, stacklevel=1)
      warnings.warn("other noise", UserWarning, stacklevel=1)
  finally:
    tf.logging.set_verbosity(saved)
    std_logging.getLogger("absl").setLevel(std_logging.NOTSET)
  assert [str(w.message) for w in caught] == ["a typo"]


def _run_module(*args, cwd=ROOT) -> subprocess.CompletedProcess:
  return warm_python.run(["-m", *args], cwd=cwd)


def test_transformer_main_help_lists_the_gin_flags():
  result = _run_module("mesh_tensorflow.transformer.main", "--help")  # absl exits with status 1
  for flag in ("--gin_file", "--gin_param", "--gin_location_prefix"):
    assert flag in result.stdout


def test_a_missing_gin_file_is_reported_alone_and_last(tmp_path):
  model_dir = tmp_path / "model"
  result = _run_module("mesh_tensorflow.transformer.main", "--gin_file=layouts/nope.gin",
                       f"--model_dir={model_dir}", cwd=tmp_path)
  lines = (result.stdout + result.stderr).strip().splitlines()
  assert result.returncode != 0
  assert len(lines) == 1 and lines[0].startswith("Error: --gin_file=layouts/nope.gin: no such file"), lines
  assert not model_dir.exists()  # nothing written for a run that never started


def test_launch_help_is_complete_and_shows_the_command_after_a_double_dash():
  result = _run_module("mesh_tensorflow.launch", "--help")
  assert result.returncode == 0, result.stderr
  usage = result.stdout.split("\n\n")[0]
  assert "-- command" in usage
  assert "once as that task. See docs/multi_process.md." in result.stdout  # the description, whole


def test_python_m_explain_prints_no_runtime_warning():
  result = _run_module("mesh_tensorflow.explain", "--help")
  assert result.returncode == 0, result.stderr
  assert "usage: python -m mesh_tensorflow.explain" in result.stdout
  assert "Warning" not in result.stderr, result.stderr


def test_session_config_builds_where_the_os_has_no_cpu_affinity(monkeypatch):
  monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
  monkeypatch.setattr(os, "cpu_count", lambda: 16)
  config = mtf.placement_mesh_impl.session_config_for_devices(cpu_devices(8))
  assert config.intra_op_parallelism_threads == 2  # 16 cores shared by 8 devices
