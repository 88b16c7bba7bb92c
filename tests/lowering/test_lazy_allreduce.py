"""LazyAllreduceSum: through the communication layer (recorded) or built as in 0.1.21 (counted)."""

from __future__ import annotations

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._lowering import comm as comm_lib
from tests.harness import cpu_devices

XS = [np.full([3], float(k), np.float32) for k in range(4)]


def _impl_and_input():
  impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:4", "", cpu_devices(4))
  return impl, impl.LaidOutTensor(mtf.parallel(impl.devices, tf.constant, XS))


def test_built_with_0_1_21_arguments_it_allreduces_once_and_calls_the_counter():
  impl, x = _impl_and_input()
  calls = []
  lazy = mtf.LazyAllreduceSum(impl, x, [0], add_counter_fn=lambda: calls.append(1))
  assert calls == []
  reduced = lazy.to_laid_out_tensor()
  assert lazy.to_laid_out_tensor() is reduced and calls == [1]
  for t in reduced.tensor_list:
    np.testing.assert_array_equal(np.asarray(t), np.full([3], 6.0))


def test_from_the_communicator_its_allreduce_is_an_event_when_first_used():
  impl, x = _impl_and_input()
  events = []
  lazy = comm_lib.Communicator(impl, events.append, "sum_op").lazy_allreduce_sum(x, [0], "reduce_op")
  total = lazy + lazy  # partial sums added before the one allreduce
  assert events == []
  np.testing.assert_array_equal(np.asarray(total.to_laid_out_tensor().tensor_list[2]),
                                np.full([3], 12.0))
  assert [(e.kind, e.op_name, e.reason, e.bytes_sent) for e in events] == [
      ("allreduce", "sum_op", "reduce_op", 2 * 3 * 12 * 1)]
