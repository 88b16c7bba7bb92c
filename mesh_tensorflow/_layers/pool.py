"""Non-overlapping max / average pooling (strides = window) over the dims before the channel dim."""

from __future__ import annotations

from mesh_tensorflow import ops_with_redefined_builtins as mtf

__all__ = ["max_pool2d", "max_pool3d", "avg_pool2d", "avg_pool3d"]


def _pool(x: mtf.Tensor, ksize, pool_fn_string: str, name: str) -> mtf.Tensor:
  ksize = tuple(ksize)
  if all(k == 1 for k in ksize):
    return x
  return mtf.PoolOperation(x, ksize, strides=ksize, pool_fn_string=pool_fn_string, name=name).outputs[0]


def max_pool2d(x: mtf.Tensor, ksize=(2, 2), name: str = "max_pool2d") -> mtf.Tensor:
  """Max over non-overlapping (kh, kw) windows of the h, w dims of x [batch..., h, w, channels]."""
  return _pool(x, ksize, "MAX_2D", name)


def max_pool3d(x: mtf.Tensor, ksize=(2, 2, 2), name: str = "max_pool3d") -> mtf.Tensor:
  """Max over non-overlapping (kd, kh, kw) windows of x [batch..., d, h, w, channels]."""
  return _pool(x, ksize, "MAX_3D", name)


def avg_pool2d(x: mtf.Tensor, ksize=(2, 2), name: str = "avg_pool2d") -> mtf.Tensor:
  """Mean over non-overlapping (kh, kw) windows of the h, w dims of x [batch..., h, w, channels]."""
  return _pool(x, ksize, "AVG_2D", name)


def avg_pool3d(x: mtf.Tensor, ksize=(2, 2, 2), name: str = "avg_pool3d") -> mtf.Tensor:
  """Mean over non-overlapping (kd, kh, kw) windows of x [batch..., d, h, w, channels]."""
  return _pool(x, ksize, "AVG_3D", name)
