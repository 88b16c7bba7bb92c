"""Contractions on CPU meshes: one matmul kernel with oneDNN, column blocks with Eigen."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from mesh_tensorflow._backends import cpu_contraction
from tests.harness import MAX_EXAMPLES, MODES, assert_allclose, assert_op_matches_tf, run_tf


@st.composite
def matrix_products(draw):
  """(equation, x shape, y shape): rows, contracted and column letters in any order and sizes."""
  rows, inner, cols = ("ab"[:draw(st.integers(1, 2))], "cd"[:draw(st.integers(1, 2))],
                       "ef"[:draw(st.integers(1, 2))])
  sizes = {c: draw(st.sampled_from([1, 3, 8])) for c in rows + inner}
  sizes.update({c: draw(st.sampled_from([2, 130, 300])) for c in cols})
  x = "".join(draw(st.permutations(rows + inner)))
  y = "".join(draw(st.permutations(inner + cols)))
  out = "".join(draw(st.permutations(rows + cols)))
  return f"{x},{y}->{out}", [sizes[c] for c in x], [sizes[c] for c in y]


def _assert_product_matches_numpy(case, mode, column_blocks: bool) -> None:
  equation, x_shape, y_shape = case
  rng = np.random.RandomState(0)
  x = rng.uniform(-1, 1, x_shape).astype(np.float32)
  y = rng.uniform(-1, 1, y_shape).astype(np.float32)
  [got] = run_tf(mode, lambda: [cpu_contraction.einsum(equation, tf.constant(x), tf.constant(y),
                                                       column_blocks=column_blocks)])
  assert_allclose(got, np.einsum(equation, x, y), rtol=1e-4, atol=1e-4)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(matrix_products(), st.sampled_from(MODES))
def test_blocked_product_matches_numpy_for_any_letter_order(case, mode):
  _assert_product_matches_numpy(case, mode, column_blocks=True)


def _op_types(equation, x_shape, y_shape) -> list:
  with tf.Graph().as_default() as graph:
    cpu_contraction.einsum(equation, tf.zeros(x_shape), tf.zeros(y_shape), column_blocks=True)
  return [op.type for op in graph.get_operations()]


@pytest.mark.parametrize("equation,x_shape,y_shape", [
    ("bld,df->blf", [2, 64, 32], [32, 600]),  # 128 rows, 600 columns: blocks of 256, 256 and 88
    ("blf,bld->df", [2, 64, 600], [2, 64, 32]),  # a weight gradient: 32 rows once x and y swap
])
def test_few_rows_and_many_columns_are_matmuls_of_column_blocks(equation, x_shape, y_shape):
  types = _op_types(equation, x_shape, y_shape)
  assert types.count("MatMul") == 3 and "Einsum" not in types


@pytest.mark.parametrize("equation,x_shape,y_shape", [
    ("bld,df->blf", [16, 64, 32], [32, 600]),  # 1024 rows: one kernel runs well
    ("blf,bld->df", [16, 64, 600], [16, 64, 300]),  # many rows either way round
    ("bld,df->blf", [2, 64, 32], [32, 256]),  # one block of columns
    ("bld,bdf->blf", [2, 4, 8], [2, 8, 512]),  # a batch dimension
    ("bld,df->bf", [2, 4, 8], [8, 512]),  # a dimension summed away
])
def test_other_contractions_stay_one_einsum(equation, x_shape, y_shape):
  types = _op_types(equation, x_shape, y_shape)
  assert "Einsum" in types and "MatMul" not in types


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(matrix_products(), st.sampled_from(MODES))
def test_onednn_product_matches_numpy_for_any_letter_order(case, mode):
  _assert_product_matches_numpy(case, mode, column_blocks=False)


def _onednn_op_types(equation, x_shape, y_shape) -> list:
  with tf.Graph().as_default() as graph:
    cpu_contraction.einsum(equation, tf.zeros(x_shape), tf.zeros(y_shape), column_blocks=False)
  return [op.type for op in graph.get_operations() if op.type not in ("Const", "Fill", "Reshape")]


@pytest.mark.parametrize("equation,x_shape,y_shape,kernel", [
    ("bld,df->blf", [2, 64, 32], [32, 600], "MatMul"),  # activations x weight
    ("blf,bld->df", [2, 64, 600], [2, 64, 32], "MatMul"),  # a weight gradient: transpose_a
    ("blf,df->bld", [2, 64, 600], [32, 600], "BatchMatMulV2"),  # an input gradient: adj_y
])
def test_onednn_products_in_place_are_one_matmul_kernel(equation, x_shape, y_shape, kernel):
  assert _onednn_op_types(equation, x_shape, y_shape) == [kernel]


@pytest.mark.parametrize("equation,x_shape,y_shape", [
    ("bld,df->lbf", [2, 64, 32], [32, 600]),  # the output's rows reordered
    ("lbd,df->blf", [64, 2, 32], [32, 600]),  # an operand's rows out of the output's order
    ("bdl,df->blf", [2, 32, 64], [32, 600]),  # contracted letters amid the rows
    ("bld,bdf->blf", [2, 4, 8], [2, 8, 512]),  # a batch dimension
])
def test_onednn_products_that_move_data_stay_one_einsum(equation, x_shape, y_shape):
  assert _onednn_op_types(equation, x_shape, y_shape) == ["Einsum"]


@pytest.mark.parametrize("equation,x_shape,y_shape,kernel", [
    ("bld,df->blf", [1, 4, 2], [2, 256], "Einsum"),  # GPT-Neo's test model: 2,048 multiply-adds
    ("ab,bc->ac", [64, 64], [64, 255], "Einsum"),  # one column short of 2^20
    ("ab,bc->ac", [64, 64], [64, 256], "MatMul"),  # 2^20
])
def test_onednn_products_under_a_million_multiply_adds_stay_one_einsum(
    equation, x_shape, y_shape, kernel):
  """Eager, tf.einsum runs them faster than the reshapes and MatMul, and needs no oneDNN MatMul
  (whose first call in a process takes 40 ms)."""
  assert _onednn_op_types(equation, x_shape, y_shape) == [kernel]


@pytest.fixture
def eigen_matmuls(monkeypatch):
  """Lower as on a CPU whose TF matmuls are Eigen's, where column blocks help."""
  monkeypatch.setattr(cpu_contraction, "blocks_help", lambda: True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_shape,layout", [("all:8", "batch:all"), ("b:2;m:4", "batch:b;d:m")])
def test_data_parallel_matmul_in_column_blocks_matches_tf_with_gradients(
    mesh_shape, layout, mode, eigen_matmuls):
  rng = np.random.RandomState(0)
  x = (rng.uniform(-1, 1, [16, 4, 8]).astype(np.float32), "batch:16;length:4;d:8")
  w = (rng.uniform(-1, 1, [8, 600]).astype(np.float32), "d:8;f:600")
  assert_op_matches_tf(mtf.matmul, lambda a, b: tf.einsum("bld,df->blf", a, b), [x, w],
                       mesh_shape, layout, mode, rtol=1e-4, atol=1e-4)


def _lowered_matmul_op_types(devices: list, d: int = 8) -> list:
  """The TF op types of a data-parallel [16, d] x [d, 600] matmul lowered onto `devices`."""
  with tf.Graph().as_default() as graph:
    mesh = mtf.Mesh(mtf.Graph(), "mesh")
    x = mtf.import_tf_tensor(mesh, tf.zeros([16, d]), shape=f"batch:16;d:{d}")
    w = mtf.import_tf_tensor(mesh, tf.zeros([d, 600]), shape=f"d:{d};f:600")
    y = mtf.matmul(x, w)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:8", "batch:all", devices,
                                                     fuse_slicewise=False)
    mtf.Lowering(mesh.graph, {mesh: impl}).export_to_tf_tensor(y)
  return [op.type for op in graph.get_operations()]


def test_cpu_meshes_with_eigen_matmuls_lower_products_to_column_blocks(eigen_matmuls):
  types = _lowered_matmul_op_types([f"/cpu:{i}" for i in range(8)])
  assert types.count("MatMul") == 8 * 3 and "Einsum" not in types


def test_cpu_meshes_with_onednn_matmuls_lower_a_product_to_one_matmul(monkeypatch):
  monkeypatch.setattr(cpu_contraction, "blocks_help", lambda: False)
  types = _lowered_matmul_op_types([f"/cpu:{i}" for i in range(8)], d=1024)  # 2 x 1024 x 600 each
  assert types.count("MatMul") == 8 and "Einsum" not in types


def test_gpu_meshes_keep_tf_einsum(eigen_matmuls):
  types = _lowered_matmul_op_types([f"/gpu:{i}" for i in range(8)])
  assert "Einsum" in types and "MatMul" not in types


@pytest.mark.slow
@pytest.mark.parametrize("onednn,blocks", [("0", True), ("1", False)])
def test_blocks_help_follows_tfs_onednn_switch(onednn, blocks):
  code = "from mesh_tensorflow._backends import cpu_contraction; print(cpu_contraction.blocks_help())"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": onednn}).stdout
  assert out.split()[-1] == str(blocks)
