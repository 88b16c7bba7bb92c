"""Two-operand einsums shaped for TF's CPU matmul kernels.

TF's CPU einsum kernel moves data where a matmul kernel would not: measured on the 2-core
AVX-512 machine with oneDNN (benchmarks/RESULTS.md, 2026-12-07), a weight gradient
"ab,ac->cb" of [64, 1024] and [64, 4096] took 8.5 to 10 ms as tf.einsum against 4.1 ms as one
MatMul with transpose_a. Which kernel is fastest depends on the backend:

- **oneDNN** (TF's default on CPUs with AVX512_VNNI, AVX512_BF16 or AMX): a contraction that is
  a matrix product of its operands as they lie in memory (each one a matrix or a transposed
  matrix once its dimensions are grouped) runs as one MatMul; when the right-hand matrix is
  transposed, as a BatchMatMulV2 with adj_y, because oneDNN's MatMul with transpose_b took 9.7
  ms where BatchMatMulV2 took 3.5 ms; products of fewer than `MIN_ONEDNN_MATMUL` multiply-adds
  stay tf.einsum.
- **Eigen** (oneDNN off): a product with few rows and many columns is slow per flop:
  measured single-threaded on a 2-core AVX2 machine (`benchmarks/bench_contraction.py`),
  [128, 256] x [256, 1024] took 1.6x to 1.9x as long per flop as the same product with 1024
  rows, and as four products of 256 columns concatenated it costs 30 to 38% less. Slices of
  data-parallel meshes are exactly such products: each device has a fraction of the rows. Those
  are computed as 2-D MatMuls whose columns are split in blocks of `COLUMN_BLOCK` when they have
  at most `MAX_ROWS` rows and more than one block of columns (with x and y swapped if that makes
  the rows few: a weight gradient [d, bl] x [bl, f]).

Anything else is tf.einsum. The result is the same up to float rounding: each output element is
one dot product either way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow import _tf_compat
from mesh_tensorflow._lowering.tf_helpers import transpose_unless_identity

MAX_ROWS = 256  # products with more rows run well as one kernel
COLUMN_BLOCK = 256  # columns per MatMul of a blocked product
# oneDNN: smaller products stay tf.einsum. Eager, one einsum of up to 2^20 multiply-adds took
# 0.02 to 0.13 ms against 0.12 to 0.3 ms for the reshapes and MatMul, and a process's first
# oneDNN MatMul takes 40 ms to start, which small models (GPT-Neo's tests) never need to pay.
MIN_ONEDNN_MATMUL = 2 ** 20


@functools.cache
def blocks_help() -> bool:
  """Whether TF's CPU matmuls are Eigen's (blocks help), not oneDNN's (blocks do not)."""
  try:
    util_port = _tf_compat.util_port  # TF's own "is oneDNN on" switch
  except ImportError:
    return False  # unknown: leave TF's einsum alone
  return not util_port.IsMklEnabled()


def einsum(equation: str, x, y, column_blocks: Optional[bool] = None):
  """tf.einsum(equation, x, y), computed by the matmul kernel that runs it fastest on CPUs.

  column_blocks: Eigen's kernels (blocked products) or oneDNN's (one matmul); default
  `blocks_help()`.
  """
  if column_blocks is None:
    column_blocks = blocks_help()
  inputs, arrow, out = equation.partition("->")
  x_letters, comma, y_letters = inputs.partition(",")
  if arrow and comma and "," not in y_letters and "." not in equation:
    for plan, operands in ((_MatmulPlan.of(x_letters, y_letters, out, x.shape, y.shape), (x, y)),
                           (_MatmulPlan.of(y_letters, x_letters, out, y.shape, x.shape), (y, x))):
      if plan is None:
        continue
      if column_blocks and plan.num_rows <= MAX_ROWS and plan.num_cols > COLUMN_BLOCK:
        return plan.blocked_matmul(*operands)
      if not column_blocks and plan.is_one_matmul_in_place() and plan.size >= MIN_ONEDNN_MATMUL:
        return plan.one_matmul(*operands)
  return tf.einsum(equation, x, y)


@dataclasses.dataclass(frozen=True)
class _MatmulPlan:
  """How an einsum of x and y maps onto one 2-D MatMul: lhs [rows, inner] x rhs [inner, cols]."""

  x_letters: str
  y_letters: str
  out_letters: str
  rows: tuple  # letters of x that are output rows, in x's order
  inner: tuple  # contracted letters, in x's order
  cols: tuple  # letters of y that are output columns, in y's order
  sizes: dict

  @classmethod
  def of(cls, xl: str, yl: str, out: str, x_shape, y_shape) -> Optional[_MatmulPlan]:
    """The plan of einsum "xl,yl->out", or None if it is not a matrix product of static shapes."""
    if (len(set(xl)) < len(xl) or len(set(yl)) < len(yl) or len(set(out)) < len(out)
        or not x_shape.is_fully_defined() or not y_shape.is_fully_defined()):
      return None
    rows = tuple(c for c in xl if c not in yl)
    inner = tuple(c for c in xl if c in yl)
    cols = tuple(c for c in yl if c not in xl)
    if set(out) != set(rows + cols) or any(c in out for c in inner):
      return None  # a batch dimension, a summed-away one or a broadcast one
    sizes = dict(zip(xl, x_shape.as_list()))
    sizes.update(zip(yl, y_shape.as_list()))
    return cls(xl, yl, out, rows, inner, cols, sizes)

  def _size(self, letters) -> int:
    return math.prod(self.sizes[c] for c in letters)

  @property
  def num_rows(self) -> int:
    return self._size(self.rows)

  @property
  def num_cols(self) -> int:
    return self._size(self.cols)

  @property
  def size(self) -> int:
    """Multiply-adds: rows x inner x columns."""
    return self._size(self.rows + self.inner + self.cols)

  def blocked_matmul(self, x, y):
    """The einsum as MatMuls of lhs with blocks of COLUMN_BLOCK columns of rhs, concatenated."""
    lhs, transpose_lhs = self._as_matrix(x, self.x_letters, self.rows, self.inner)
    rhs, transpose_rhs = self._as_matrix(y, self.y_letters, self.inner, self.cols)
    n = self.num_cols
    widths = [COLUMN_BLOCK] * (n // COLUMN_BLOCK) + ([n % COLUMN_BLOCK] if n % COLUMN_BLOCK else [])
    product = tf.concat([tf.matmul(lhs, block, transpose_a=transpose_lhs, transpose_b=transpose_rhs)
                         for block in tf.split(rhs, widths, axis=0 if transpose_rhs else 1)], axis=1)
    product = tf.reshape(product, [self.sizes[c] for c in self.rows + self.cols])
    return _transposed(product, self.rows + self.cols, self.out_letters)

  def is_one_matmul_in_place(self) -> bool:
    """Whether both operands are matrices (or transposed ones) as they lie, with out's order."""
    return (tuple(self.out_letters) == self.rows + self.cols
            and tuple(self.x_letters) in (self.rows + self.inner, self.inner + self.rows)
            and tuple(self.y_letters) in (self.inner + self.cols, self.cols + self.inner))

  def one_matmul(self, x, y):
    """The einsum as one matmul of x and y reshaped (not transposed) into matrices."""
    lhs, transpose_lhs = self._as_matrix(x, self.x_letters, self.rows, self.inner)
    rhs, transpose_rhs = self._as_matrix(y, self.y_letters, self.inner, self.cols)
    if transpose_rhs:  # oneDNN's MatMul is slow with transpose_b; its BatchMatMulV2 is not
      product = tf.raw_ops.BatchMatMulV2(x=lhs, y=rhs, adj_x=transpose_lhs, adj_y=True)
    else:
      product = tf.matmul(lhs, rhs, transpose_a=transpose_lhs)
    return tf.reshape(product, [self.sizes[c] for c in self.out_letters])

  def _as_matrix(self, t, letters: str, first: tuple, second: tuple):
    """(t as a matrix [first, second], False) or, with no data moved, ([second, first], True)."""
    if tuple(letters) == second + first:
      return tf.reshape(t, [self._size(second), self._size(first)]), True
    return tf.reshape(_transposed(t, letters, first + second), [self._size(first), self._size(second)]), False


def _transposed(t, letters, order):
  """t with its axes (named by letters) in `order`."""
  return transpose_unless_identity(t, [list(letters).index(c) for c in order])
