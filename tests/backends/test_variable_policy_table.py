"""docs/architecture.md's table "Which variables exist where", checked row by row on 8 virtual CPUs.

Each row names PlacementMeshImpl options; the test lowers the table's two variables with them
(`w` [a=4, b=8] split over rows of the mesh rows:2;cols:4, `v` [b=8] unsplit), counts the TF
variables each became, reads their dtype, saves a checkpoint and lists it, and compares all of
it with the row. Also: `VariablePolicy.parts_of` answers each row as the backends built it.
"""

from __future__ import annotations

import os
import re

import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import cpu_devices, session_config

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "architecture.md")
HEADING = "### Which variables exist where"

BF16 = dict(dtype=mtf.VariableDType(tf.float32, tf.bfloat16))
ROWS = {  # the table's first column -> (PlacementMeshImpl options, variable options)
    "defaults on CPUs of one process": ({}, {}),
    "defaults on GPUs (`share_replicas=False`)": ({"share_replicas": False}, {}),
    "`master_as_slice=True`": ({"master_as_slice": True}, {}),
    "`master_as_slice=True, share_replicas=False`": (
        {"master_as_slice": True, "share_replicas": False}, {}),
    "`masters=\"sliced\"`": ({"masters": "sliced"}, {}),
    "`masters=\"sliced\", share_replicas=False`": ({"masters": "sliced", "share_replicas": False}, {}),
    "bfloat16 slices (`VariableDType(tf.float32, tf.bfloat16)`)": ({}, BF16),
    "bfloat16 slices, `masters=\"sliced\"`": ({"masters": "sliced"}, BF16),
}


def _table() -> dict:
  """{first cell: [other cells]} of the table under HEADING."""
  with open(DOC, encoding="utf-8") as f:
    text = f.read()
  section = text[text.index(HEADING):]
  rows = {}
  for line in section.splitlines()[1:]:
    if line.startswith("#"):
      break
    if line.startswith("|") and not line.startswith("|---"):
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      rows[cells[0]] = cells[1:]
  rows.pop("options")  # the header
  return rows


def _variables_cell(cell: str) -> dict:
  """'master + 2 slices' -> {"master": 1, "slices": 2, "parts": 0} (a note in parentheses aside)."""
  cell = re.sub(r"\(.*?\)", "", cell)
  counts = {"master": int("master" in cell), "slices": 0, "parts": 0}
  for number, kind in re.findall(r"(\d+) (slice|part)s?\b", cell):
    counts[kind + "s"] = int(number)
  return counts


def _built(impl_options: dict, variable_options: dict, tmp_path):
  """What the lowering made of w and v: {name: counts}, slice dtypes, checkpoint contents."""
  with tf.Graph().as_default() as g:
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    w = mtf.get_variable(mesh, "w", "a:4;b:8", **variable_options)
    v = mtf.get_variable(mesh, "v", "b:8", **variable_options)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("rows:2;cols:4", "a:rows", cpu_devices(8),
                                                     **impl_options)
    lowering = mtf.Lowering(graph, {mesh: impl}, autostack=False)
    checkpointed = {getattr(x, "name", "").split(":")[0] for x in tf.global_variables()}
    handles = [op for op in g.get_operations() if op.type == "VarHandleOp"]
    counts, dtypes, parts = {}, set(), {}
    for name in ("w", "v"):
      slices = {op.name for op in handles if op.name.startswith(name + "_slice_")}
      parts[name] = [impl.variable_policy.parts_of(x.operation, impl)
                     for x in (w, v) if x.operation.name == name][0]
      counts[name] = {"master": int(name in checkpointed),
                      "parts": len(slices & checkpointed), "slices": len(slices - checkpointed)}
      dtypes |= {op.get_attr("dtype").name for op in handles if op.name in slices}
      # the policy's answer is what was built: a variable per holder (the master, for its own)
      assert len(parts[name].holders) == (counts[name]["slices"] + counts[name]["parts"]
                                          + (parts[name].master_pnum is not None))
    with tf.Session(config=session_config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      sess.run(lowering.copy_slices_to_masters())
      path = tf.train.Saver().save(sess, str(tmp_path / "model"))
  reader = tf.train.load_checkpoint(path)
  checkpoint = {name: (shape, reader.get_variable_to_dtype_map()[name].name)
                for name, shape in tf.train.list_variables(path)}
  return counts, dtypes, checkpoint, parts


def test_the_table_has_one_row_per_checked_option_combination():
  assert sorted(_table()) == sorted(ROWS)


@pytest.mark.parametrize("row", sorted(ROWS))
def test_a_row_states_the_variables_the_backend_creates(row, tmp_path):
  w_cell, v_cell, dtype_cell, shared_cell, checkpoint_cell = _table()[row]
  counts, dtypes, checkpoint, parts = _built(*ROWS[row], tmp_path)
  assert counts == {"w": _variables_cell(w_cell), "v": _variables_cell(v_cell)}
  assert dtypes == {dtype_cell.strip("`")}
  # w's 2 distinct slices on 8 processors: shared iff fewer than 8 per-processor variables
  per_processor = len(set(parts["w"].owners))
  assert shared_cell in ("yes", "no") and (shared_cell == "yes") == (per_processor < 8)
  for name, cell in (("w", w_cell), ("v", v_cell)):  # notes on whose slice the master is
    if "(cpu:0's slice)" in cell:
      assert parts[name].master_pnum == 0 and parts[name].owners[1:] == tuple(range(1, 8))
    if "(every processor's slice)" in cell:
      assert parts[name].master_pnum == 0 and parts[name].owners == (0,) * 8
  assert checkpoint == {"w": ([4, 8], "float32"), "v": ([8], "float32")}
  assert checkpoint_cell == "`w` [4, 8], `v` [8], float32"
