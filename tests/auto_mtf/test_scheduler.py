"""scheduler.minimize_peak_memory: NAIVE is graph order; LIST finishes a branch before starting another."""

import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.auto_mtf import graph_interface, scheduler


def _peak(gi, schedule):
  contents = gi.compute_memory_contents_under_schedule(schedule)
  return max(sum(gi.get_tensor_size(t) for t in c) for c in contents)


class SchedulerTest(tf.test.TestCase):

  def _two_branches(self):
    """Two big inputs each reduced to a scalar; graph order creates both big tensors first."""
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    big1 = mtf.zeros(mesh, "a:1000")
    big2 = mtf.zeros(mesh, "b:1000")
    s1 = mtf.reduce_sum(big1)
    s2 = mtf.reduce_sum(big2)
    out = s1 + s2
    gi = graph_interface.GraphInterface(graph)
    gi.set_tensor_final(out.name)
    return gi

  def test_naive_is_graph_order(self):
    gi = self._two_branches()
    self.assertEqual(scheduler.minimize_peak_memory(gi, "NAIVE"), list(range(gi.get_num_operations())))

  def test_list_is_a_topological_order_with_a_lower_peak(self):
    gi = self._two_branches()
    schedule = scheduler.minimize_peak_memory(gi, "LIST")
    self.assertCountEqual(schedule, range(gi.get_num_operations()))
    names = gi.get_all_operation_names()
    position = {names[op_id]: k for k, op_id in enumerate(schedule)}
    for op in names:
      for t in gi.get_operation_input_names(op):
        self.assertLess(position[t.split(":")[0]], position[op])
    naive = scheduler.minimize_peak_memory(gi, "NAIVE")
    self.assertLess(_peak(gi, schedule), _peak(gi, naive))

  def test_unknown_algorithm_is_rejected(self):
    with self.assertRaisesRegex(ValueError, "NAIVE"):
      scheduler.minimize_peak_memory(self._two_branches(), "FAST")
