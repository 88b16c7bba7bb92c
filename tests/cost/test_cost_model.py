"""The cost model: communication equals what the lowering sends; FLOPs, memory and time as documented."""

from __future__ import annotations

import pytest
import tensorflow.compat.v1 as tf
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from mesh_tensorflow import cost_model
from tests.harness import MAX_EXAMPLES, cpu_devices, mesh_and_layout
from tests.lowering.test_communication import FAMILIES, _build, placement_events
from tests.lowering.test_random_graphs import LAYOUT_DIMS, _program_and_reference, programs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_communication_equals_the_real_lowerings_for_every_op_family(family):
  build_fn, mesh_shape, layout = FAMILIES[family]
  events, _, _ = placement_events(build_fn, mesh_shape, layout)
  with tf.Graph().as_default():
    graph, _, _ = _build(build_fn)
    report = cost_model.estimate_cost(graph, mesh_shape, layout)
  assert list(report.events) == events
  assert report.bytes_sent == sum(e.bytes_sent for e in events) > 0


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(), mesh_and_layout(LAYOUT_DIMS), st.integers(0, 1000))
def test_communication_equals_the_real_lowerings_on_random_graphs(program, mesh_layout, seed):
  mesh_shape, layout = mesh_layout
  build, _ = _program_and_reference(program, seed)
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    build(mesh)
    try:
      report = cost_model.estimate_cost(graph, mesh_shape, layout)
    except NotImplementedError:  # a reshape whose new split falls inside an old dimension
      reject()
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, [""] * report.mesh_shape.size)
    events = mtf.Lowering(graph, {mesh: impl}).communication_events
  assert list(report.events) == events
  assert report.comm_bytes_per_processor == sum(e.bytes_per_processor for e in events)


def _dense(mesh):
  x = mtf.random_uniform(mesh, "b:8;i:16")
  w = mtf.get_variable(mesh, "w", "i:16;j:32")
  return mtf.tanh(mtf.einsum([x, w], "b:8;j:32"))  # tanh needs the sum: the allreduce happens


def test_flops_memory_and_time_follow_the_documented_model():
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  y = _dense(mesh)
  tm = cost_model.TimeModel(
    flops_per_s=1e9, bandwidth_bytes_per_s={"x": 1e6, "*": 1e9}, latency_s=1e-3, op_overhead_s=1e-4,
    step_overhead_s=2e-3,
  )
  report = cost_model.estimate_cost(graph, "x:2;y:4", "b:x;i:y", [y], time_model=tm)
  einsum = y.operation.inputs[0].operation
  assert report.op_flops[einsum.name] == 2 * 8 * 16 * 32 // 8
  assert report.op_flops[y.operation.name] == 8 * 32 // 2
  assert report.memory.variable_bytes == 16 * 32 * 4 // 4
  (event,) = report.events  # the sum over the split contracted dim i
  assert event.kind == "allreduce" and event.mesh_axes == (1,)
  assert report.comm_s == pytest.approx(1e-3 + event.bytes_per_processor / 1e9)
  assert report.compute_s == pytest.approx(report.flops / 1e9)
  assert report.overhead_s == pytest.approx(len(graph.operations) * 1e-4 + 2e-3)  # per op, per step
  assert report.step_s == pytest.approx(report.compute_s + report.comm_s + report.overhead_s)
  assert report.comm_bytes_by_kind() == {("allreduce", ("y",)): event.bytes_per_processor}
  assert report.memory.activation_peak_bytes >= 8 * 32 * 4 // 2  # the output slice is kept


def test_time_model_presets_and_bad_names():
  assert cost_model.get_time_model("tpu") is cost_model.TPU
  assert cost_model.get_time_model(None) is cost_model.CPU
  with pytest.raises(ValueError, match="Unknown time model 'fpga'"):
    cost_model.get_time_model("fpga")


def test_calibration_measures_rates_of_a_cpu_in_seconds_on_the_virtual_devices():
  tm = cost_model.calibrate(cpu_devices(2), reps=1, size=64)
  # Two loaded cores: 8e7 to 5e8 FLOP/s and 1 to 6 ms per transfer measured at this size; the
  # bounds catch a unit error (milliseconds for seconds, a missing factor of a thousand).
  assert 1e6 < tm.flops_per_s < 1e13, tm
  assert 1e-6 <= tm.latency_s < 1.0 and 0 <= tm.op_overhead_s < 0.1 and 0 <= tm.step_overhead_s < 1.0, tm
  assert tm.bandwidth_bytes_per_s > 0, tm   # a difference of two short timings: no useful upper bound


def test_recompute_grad_adds_the_forward_flops_of_the_recomputed_layer():
  """recompute_grad's copies of the forward ops keep their names; each copy's FLOPs still count."""
  def training_graph(recompute: bool):
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    x = mtf.random_uniform(mesh, "b:8;i:16")
    w = mtf.get_variable(mesh, "w", "i:16;j:32")

    def layer(x):
      return mtf.tanh(mtf.einsum([x, w], "b:8;j:32", name="matmul"))
    y = mtf.recompute_grad(layer, [x]) if recompute else layer(x)
    mtf.gradients([mtf.reduce_sum(y)], [w])
    return graph

  def report(graph):
    return cost_model.estimate_cost(graph, "x:2", "b:x")
  plain, recomputed = report(training_graph(False)), report(training_graph(True))
  forward_matmul = 2 * 8 * 16 * 32 // 2
  forward_tanh = 8 * 32 // 2
  assert plain.op_flops["matmul"] == forward_matmul
  assert recomputed.op_flops["matmul"] == 2 * forward_matmul      # the original and its copy
  assert recomputed.flops == plain.flops + forward_matmul + forward_tanh
