"""Halo exchange: give each block of a blocked dimension the margins of its neighbouring blocks.

A spatial dim of size n stored as [blocks, block_size] (blocks * block_size = n, `blocks` split over
a mesh dim) lets each processor hold whole blocks. A convolution with a filter of size 2k+1 needs k
extra entries on each side of a block: `halo_exchange(x, blocks, block_size, k)` fetches them with
shifts along `blocks` (neighbouring processors) and concatenates them onto `block_size`; a VALID conv
of the result equals the SAME conv of the unblocked tensor. Built from shift, slice and concat, so it
is differentiable and works for any layout that leaves `block_size` whole.
"""

from __future__ import annotations

from mesh_tensorflow._core.dims import Dimension
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._ops import _checks as checks
from mesh_tensorflow._ops import shift as shift_ops
from mesh_tensorflow._ops import slicing as slicing_ops

__all__ = ["halo_exchange", "left_halo_exchange"]


def _check_args(fn_name: str, x: Tensor, blocks_dim: Dimension, block_size_dim: Dimension,
                halo_size) -> None:
  for what, dim in (("blocks_dim", blocks_dim), ("block_size_dim", block_size_dim)):
    checks.check_dim_in(fn_name, what, dim, x)
  if blocks_dim == block_size_dim:
    raise ValueError(f"{fn_name}: blocks_dim and block_size_dim are both {blocks_dim}; they must be "
                     f"two different dimensions of {x.shape}.")
  if not isinstance(halo_size, int) or halo_size < 0:
    raise ValueError(f"{fn_name}: halo_size must be a non-negative int, got {halo_size!r}.")


def _margin(x: Tensor, blocks_dim: Dimension, block_size_dim: Dimension, halo_size: int, wrap: bool,
            from_left: bool) -> list:
  """The `halo_size` entries next to each block on one side, as parts in index order.

  A margin wider than a block takes whole neighbouring blocks (shifted 1, 2, ... blocks over)
  plus a partial slice from the next block out. Without `wrap`, blocks past the ends read zeros.
  """
  block_size = block_size_dim.size
  num_complete, partial = divmod(halo_size, block_size)
  sign = 1 if from_left else -1  # shift(x, +i) hands block b the contents of block b - i
  nearest_first = [shift_ops.shift(x, sign * i, blocks_dim, wrap) for i in range(1, num_complete + 1)]
  if partial:
    edge = slicing_ops.mtf_slice(x, block_size - partial if from_left else 0, partial, block_size_dim.name)
    nearest_first.append(shift_ops.shift(edge, sign * (num_complete + 1), blocks_dim, wrap))
  return nearest_first[::-1] if from_left else nearest_first


def halo_exchange(x: Tensor, blocks_dim: Dimension, block_size_dim: Dimension, halo_size: int,
                  wrap: bool = False) -> Tensor:
  """Concatenates onto each block the `halo_size` entries on either side of it.

  Args:
    x: a Tensor with dims `blocks_dim` and `block_size_dim` (usually blocks_dim split, block_size_dim
      not).
    blocks_dim: the Dimension indexing blocks.
    block_size_dim: the Dimension within a block; it grows by 2 * halo_size.
    halo_size: entries taken from each side; may exceed the block size.
    wrap: treat the blocks as a ring; otherwise the outermost halos are zeros.

  Returns:
    x with block_size_dim resized to block_size + 2 * halo_size.

  Example: blocks [[1, 2], [3, 4]] with halo_size 1 become [[0, 1, 2, 3], [2, 3, 4, 0]].
  """
  _check_args("halo_exchange", x, blocks_dim, block_size_dim, halo_size)
  if halo_size == 0:
    return x
  parts = (_margin(x, blocks_dim, block_size_dim, halo_size, wrap, from_left=True) + [x]
           + _margin(x, blocks_dim, block_size_dim, halo_size, wrap, from_left=False))
  return slicing_ops.concat(parts, block_size_dim.name)


def left_halo_exchange(x: Tensor, blocks_dim: Dimension, block_size_dim: Dimension, halo_size: int,
                       wrap: bool = False) -> Tensor:
  """Like halo_exchange, but only prepends the `halo_size` entries to the left of each block.

  A VALID conv of the result is a causal conv (output i sees inputs i - halo_size ... i).
  Example: blocks [[1, 2], [3, 4]] with halo_size 1 become [[0, 1, 2], [2, 3, 4]].
  """
  _check_args("left_halo_exchange", x, blocks_dim, block_size_dim, halo_size)
  if halo_size == 0:
    return x
  return slicing_ops.concat(_margin(x, blocks_dim, block_size_dim, halo_size, wrap, from_left=True) + [x],
                            block_size_dim.name)
