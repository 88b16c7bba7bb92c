"""Mesh shapes, batch sizes, microbatching and training length: the arithmetic utils.run relies on."""

from __future__ import annotations

import math
from typing import Mapping, Sequence, Union

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer._utils import GIN_MODULE

SequenceLength = Union[int, Mapping[str, int]]
BATCH_SIZE_METHODS = (
    "sequences_per_batch", "tokens_per_batch", "sequences_per_replica", "tokens_per_replica")


def _max_length(sequence_length: SequenceLength) -> int:
  if isinstance(sequence_length, Mapping):
    return max(sequence_length.values())
  return int(sequence_length)


@gin.configurable(module=GIN_MODULE)
def get_variable_dtype(master_dtype=tf.bfloat16, slice_dtype=tf.float32,
                       activation_dtype=tf.float32) -> mtf.VariableDType:
  """The model's VariableDType; each dtype may be a tf.DType or its name ("bfloat16")."""
  return mtf.VariableDType(master_dtype=tf.as_dtype(master_dtype), slice_dtype=tf.as_dtype(slice_dtype),
                           activation_dtype=tf.as_dtype(activation_dtype))


def _num_cores(tpu_topology: str) -> int:
  """"v3-128" names its core count; "4x4" names chips, 2 cores each."""
  if tpu_topology.startswith("v"):
    return int(tpu_topology.split("-")[-1])
  try:
    chips = math.prod(int(x) for x in tpu_topology.split("x"))
  except ValueError:
    raise ValueError(
        f"tpu_topology {tpu_topology!r} must look like 'v3-128' (cores) or '4x4' (chips)") from None
  return chips * 2


@gin.configurable(module=GIN_MODULE)
def tpu_mesh_shape(tpu_topology: str = gin.REQUIRED, model_parallelism: int | Sequence = gin.REQUIRED,
                   ensemble_parallelism: int | None = None) -> mtf.Shape:
  """The mesh shape for a TPU slice: dims ensemble, batch, model (each only when larger than 1).

  A list model_parallelism is a HierarchicalTiling spec; the mesh shape then comes from it.
  Example: tpu_mesh_shape("v3-128", 8) == mtf.Shape([Dimension("batch", 16), Dimension("model", 8)]).
  """
  num_cores = _num_cores(tpu_topology)
  if isinstance(model_parallelism, (list, tuple)):
    return mtf.simd_mesh_impl.HierarchicalTiling.spec_to_mesh_shape(model_parallelism, num_cores)
  replicas = ensemble_parallelism or 1
  if num_cores % (model_parallelism * replicas):
    raise ValueError(f"tpu_mesh_shape: {num_cores} cores of {tpu_topology!r} do not divide into "
                     f"{model_parallelism=} x {ensemble_parallelism=}; pick divisors of {num_cores}")
  data_parallelism = num_cores // (model_parallelism * replicas)
  dims = [mtf.Dimension(name, size) for name, size in
          (("ensemble", replicas), ("batch", data_parallelism), ("model", model_parallelism)) if size > 1]
  return mtf.Shape(dims)


def num_batch_replicas(mesh_shape, layout_rules) -> int:
  """How many ways the `batch` and `outer_batch` dimensions are split over the mesh."""
  mesh_shape = mtf.convert_to_shape(mesh_shape)
  layout_rules = mtf.convert_to_layout_rules(layout_rules)
  return math.prod(mtf.tensor_dim_to_mesh_dim_size(layout_rules, mesh_shape, mtf.Dimension(name, 0))
                   for name in ("batch", "outer_batch"))


def compute_batch_size(sequence_length: SequenceLength, mesh_shape, layout_rules,
                       method_and_value: tuple[str, int]) -> int:
  """The number of sequences per batch from (method, value); method is one of BATCH_SIZE_METHODS.

  "..._per_replica" multiplies by the number of batch replicas (splits of batch x outer_batch);
  "tokens_..." divides by the (longest) sequence length.
  """
  method, value = method_and_value
  if method not in BATCH_SIZE_METHODS:
    raise ValueError(f"unknown batch size method {method!r}; use one of {BATCH_SIZE_METHODS}")
  if method.startswith("tokens"):
    value //= _max_length(sequence_length)
  if method.endswith("per_replica"):
    value *= num_batch_replicas(mesh_shape, layout_rules)
  tf.logging.info("compute_batch_size: %s=%d -> %d sequences per batch", method, method_and_value[1], value)
  return value


@gin.configurable(module=GIN_MODULE)
def serialize_num_microbatches(batch_dim: mtf.Dimension, sequence_length: SequenceLength, mesh_shape,
                               layout_rules, tokens_per_microbatch_per_replica: int | None = None) -> int:
  """How many serial microbatches keep each replica at most tokens_per_microbatch_per_replica tokens.

  The microbatch size (sequences per replica) is the largest divisor of the per-replica batch that
  fits the token budget, at least 1; returns 1 when no budget is set.
  """
  if not tokens_per_microbatch_per_replica:
    return 1
  batch_per_replica = mtf.tensor_dim_to_size_per_split(
      mtf.convert_to_layout_rules(layout_rules), mtf.convert_to_shape(mesh_shape), batch_dim)
  microbatch_size = max(1, tokens_per_microbatch_per_replica // _max_length(sequence_length))
  while batch_per_replica % microbatch_size:
    microbatch_size -= 1
  num_microbatches = batch_per_replica // microbatch_size
  tf.logging.info("serialize_num_microbatches: tokens_per_microbatch_per_replica=%d batch_per_replica=%d "
                  "num_microbatches=%d", tokens_per_microbatch_per_replica, batch_per_replica,
                  num_microbatches)
  return int(num_microbatches)


@gin.configurable(module=GIN_MODULE)
def auto_train_steps(batch_size: int, sequence_length: SequenceLength, train_tokens: int = 2 ** 36) -> int:
  """Training steps that process `train_tokens` tokens: train_tokens // (batch_size * sequence_length)."""
  return train_tokens // (batch_size * _max_length(sequence_length))
