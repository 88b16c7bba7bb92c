"""Decoder inputs from targets: shifting right, segment starts, and the inputs part of delimited LMs."""

from __future__ import annotations

from typing import Optional

import gin

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer._layer_stack import GIN_MODULE


@gin.configurable(module=GIN_MODULE)
def shift_targets(targets: mtf.Tensor, bos_id: int = 0, eos_id: int = 1) -> mtf.Tensor:
  """Deprecated (use autoregressive_inputs): targets shifted right, 0 after each eos, bos_id at starts."""
  length_dim = targets.shape.dims[-1]
  shifted = mtf.shift(targets, offset=1, dim=length_dim, wrap=False)
  shifted *= mtf.to_int32(mtf.not_equal(shifted, eos_id))
  if bos_id:
    shifted += mtf.to_int32(mtf.logical_and(mtf.equal(shifted, 0), mtf.not_equal(targets, 0))) * bos_id
  return shifted


def autoregressive_inputs(targets: mtf.Tensor, sequence_id: Optional[mtf.Tensor] = None) -> mtf.Tensor:
  """Decoder inputs: targets shifted right by one (0 first), absolute values, 0 at segment starts.

  Example: targets [3, 4, 1, 5, 1] with sequence_id [1, 1, 1, 2, 2] give [0, 3, 4, 0, 5].
  """
  length_dim = targets.shape.dims[-1]
  inputs = mtf.abs(mtf.shift(targets, offset=1, dim=length_dim, wrap=False))
  if sequence_id is not None:
    same_segment = mtf.equal(sequence_id, mtf.shift(sequence_id, offset=1, dim=length_dim, wrap=False))
    inputs *= mtf.cast(same_segment, inputs.dtype)
  return inputs


def delimited_lm_inputs_mask(ids: mtf.Tensor, eos_id: int = 1) -> mtf.Tensor:
  """True on the "inputs" halves of packed [inputs, eos, targets, eos, ...] sequences.

  A position is an input position when an even number of eos tokens precede it.
  """
  length_dim = ids.shape.dims[-1]
  eos_before = mtf.cumsum(mtf.to_int32(mtf.equal(ids, eos_id)), length_dim, exclusive=True)
  return mtf.equal(mtf.mod(eos_before, 2), 0)

