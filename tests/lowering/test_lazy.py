"""LazyLaidOutTensor: 0.1.21's constructor (to_laid_out_tensor_fn, slice_shape), computed on demand."""

from __future__ import annotations

import mesh_tensorflow as mtf


def test_lazy_laid_out_tensor_calls_its_function_once_on_first_use():
  calls = []

  def make():
    calls.append(1)
    return "laid out"

  lazy = mtf.LazyLaidOutTensor(to_laid_out_tensor_fn=make, slice_shape=[2, 3])
  assert calls == [] and lazy.slice_shape == [2, 3]
  assert mtf.convert_args_to_laid_out_tensors([lazy, 5]) == ["laid out", 5]
  assert lazy.to_laid_out_tensor() == "laid out" and calls == [1]
