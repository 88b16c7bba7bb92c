"""Lazily evaluated laid-out values: deferred allreduces and deferred computations.

A sum over a split dimension (einsum, reduce_sum, conv) leaves partial sums on each processor.
Keeping them lazy lets consecutive additions of partial sums share a single allreduce.
"""

from __future__ import annotations

from typing import Callable

import tensorflow.compat.v1 as tf


class LazyAllreduceSum:
  """Partial sums over `mesh_axes`; reduced on first use by `to_laid_out_tensor()`.

  Created by `Communicator.lazy_allreduce_sum` (which passes `comm` and `reason`), the allreduce
  is recorded as a communication event of the op that made the partial sums; every
  LazyAllreduceSum the package makes comes from there. Built directly with 0.1.21's arguments
  (mesh_impl, laid_out_input, mesh_axes, add_counter_fn), as a custom op may, no communicator is
  at hand: the backend's allreduce runs and add_counter_fn counts it, as in 0.1.21.
  """

  def __init__(self, mesh_impl, laid_out_input, mesh_axes, add_counter_fn: Callable | None = None,
               comm=None, reason: str = "lazy_allreduce"):
    self.mesh_impl = mesh_impl
    self.laid_out_input = laid_out_input
    self.mesh_axes = mesh_axes
    self.add_counter_fn = add_counter_fn
    self.comm = comm
    self.reason = reason
    self._reduced = None

  def to_laid_out_tensor(self):
    if self._reduced is None:
      if self.comm is not None:
        self._reduced = self.comm.allreduce(self.laid_out_input, self.mesh_axes, "SUM", self.reason)
      else:
        self._reduced = self.mesh_impl.allreduce(self.laid_out_input, self.mesh_axes, "SUM")
      if self.add_counter_fn:
        self.add_counter_fn()
    return self._reduced

  def with_input(self, laid_out_input) -> LazyAllreduceSum:
    """The same pending allreduce over other partial sums."""
    return LazyAllreduceSum(self.mesh_impl, laid_out_input, self.mesh_axes,
                            add_counter_fn=self.add_counter_fn, comm=self.comm, reason=self.reason)

  def __add__(self, other):
    if compatible_lazy_allreduce_sums([self, other]):
      return self.with_input(
          self.mesh_impl.slicewise(tf.add, self.laid_out_input, other.laid_out_input))
    return self.mesh_impl.slicewise(tf.add, self.to_laid_out_tensor(), other.to_laid_out_tensor())

  @property
  def slice_shape(self):
    return self.laid_out_input.slice_shape

  @property
  def is_reduced(self) -> bool:
    """Whether the allreduce has been built (its sums are there to use at no further cost)."""
    return self._reduced is not None


def compatible_lazy_allreduce_sums(xs) -> bool:
  """True iff xs are all LazyAllreduceSums over the same mesh impl and mesh axes."""
  if not xs or not isinstance(xs[0], LazyAllreduceSum):
    return False
  return all(isinstance(x, LazyAllreduceSum) and x.mesh_impl is xs[0].mesh_impl
             and x.mesh_axes == xs[0].mesh_axes for x in xs[1:])


class LazyLaidOutTensor:
  """A laid-out value computed by `to_laid_out_tensor_fn()` on first use."""

  def __init__(self, to_laid_out_tensor_fn: Callable, slice_shape):
    self._to_laid_out_tensor_fn = to_laid_out_tensor_fn
    self._slice_shape = slice_shape
    self._value = None

  def to_laid_out_tensor(self):
    if self._value is None:
      self._value = self._to_laid_out_tensor_fn()
    return self._value

  @property
  def slice_shape(self):
    return self._slice_shape


def convert_args_to_laid_out_tensors(xs) -> list:
  """Forces lazy values; leaves everything else (python numbers, tf tensors) as is."""
  return [x.to_laid_out_tensor() if hasattr(x, "to_laid_out_tensor") else x for x in xs]
