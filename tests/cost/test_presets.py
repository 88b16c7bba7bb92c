"""Accelerator presets: their numbers come from the public sources they name, and topologies give
each mesh dimension its bandwidth and latency."""

from __future__ import annotations

import math

import pytest

import mesh_tensorflow as mtf
from mesh_tensorflow import cost_model

# (preset, peak TFLOP/s as the source prints it, memory as the source prints it, its bytes)
PUBLISHED = [
  (cost_model.TPU_V3, "123 teraflops", "32 GiB", 32 * 2**30),
  (cost_model.TPU_V4, "275 teraflops", "32 GiB", 32 * 2**30),
  (cost_model.TPU_V5E, "197 TFLOPs", "16 GB", 16e9),
  (cost_model.A100, "312 TFLOPS", "80 GB", 80e9),
  (cost_model.H100, "989 dense", "80 GB", 80e9),
]


@pytest.mark.parametrize(
  "preset,flops_text,memory_text,memory_bytes", PUBLISHED, ids=lambda p: getattr(p, "name", "")
)
def test_each_accelerator_preset_names_the_public_source_of_its_numbers(
  preset, flops_text, memory_text, memory_bytes
):
  sources = " ".join(preset.sources)
  assert "https://" in sources and preset.__class__ is cost_model.TimeModel
  assert flops_text in sources and preset.flops_per_s == float(flops_text.split()[0]) * 1e12
  assert memory_text in sources and preset.memory_bytes == memory_bytes
  assert cost_model.get_time_model(preset.name) is preset
  assert cost_model.ACCELERATORS[preset.name] is preset


def test_tpu_ici_bandwidth_per_chip_is_the_pods_allreduce_bandwidth_over_its_chips():
  assert "340 TB/s over 1024 chips" in cost_model.TPU_V3.sources[0]
  assert cost_model.TPU_V3.topology.chip_bandwidth_bytes_per_s == 340e12 / 1024
  assert cost_model.TPU_V4.topology.chip_bandwidth_bytes_per_s == 1.1e15 / 4096
  # v5e: both published figures agree (1600 Gbps per chip; 51.2 TB/s over 256 chips).
  assert cost_model.TPU_V5E.topology.chip_bandwidth_bytes_per_s == 1600e9 / 8 == 51.2e12 / 256


def test_a_torus_shares_the_chips_links_among_mesh_dimensions_by_log2_of_their_sizes():
  chip = cost_model.TPU_V3.topology.chip_bandwidth_bytes_per_s
  tm = cost_model.TPU_V3.for_mesh(mtf.convert_to_shape("b:16;m:32"))
  assert math.isclose(tm.bandwidth(["b"]), chip * 4 / 9) and math.isclose(tm.bandwidth(["m"]), chip * 5 / 9)
  assert tm.latency(["m"]) == 31e-6 and tm.latency(["b", "m"]) == 31e-6
  assert cost_model.TPU_V3.for_mesh(mtf.convert_to_shape("all:512")).bandwidth(["all"]) == chip


def test_gpu_hosts_use_nvlink_inside_a_host_and_infiniband_between_hosts():
  h100 = cost_model.H100
  inside = h100.for_mesh(mtf.convert_to_shape("b:2;m:4"))  # 8 processors: one host
  assert inside.bandwidth(["b"]) == inside.bandwidth(["m"]) == 450e9
  across = h100.for_mesh(mtf.convert_to_shape("b:8;m:8"))  # m inside each host, b across hosts
  assert across.bandwidth(["m"]) == 450e9 and across.bandwidth(["b"]) == 50e9
  assert across.bandwidth(["b", "m"]) == 50e9 and across.latency(["b"]) == 7 * 5e-6
  assert h100.for_mesh(mtf.convert_to_shape("all:16")).bandwidth(["all"]) == 50e9
  assert cost_model.A100.for_mesh(mtf.convert_to_shape("b:8;m:8")).bandwidth(["b"]) == 25e9


def test_estimate_cost_times_each_collective_by_its_mesh_dimensions_link():
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "mesh")
  x = mtf.random_uniform(mesh, "b:16;i:64")
  w = mtf.get_variable(mesh, "w", "i:64;j:32")
  y = mtf.tanh(mtf.einsum([x, w], "b:16;j:32"))  # i split over m: an allreduce over m (NVLink)
  loss = mtf.tanh(mtf.reduce_sum(y, output_shape="j:32"))  # b split over h: a sum across hosts
  report = cost_model.estimate_cost(graph, "h:2;m:8", "b:h;i:m", [loss], "h100")
  links = report.time_model
  assert links.bandwidth(["m"]) == 450e9 and links.bandwidth(["h"]) == 50e9
  expected = sum(
    links.latency(names) + e.bytes_per_processor / links.bandwidth(names)
    for e in report.events
    for names in [cost_model_names(report, e)]
  )
  assert {names for e in report.events for names in [cost_model_names(report, e)]} >= {("m",), ("h",)}
  assert math.isclose(report.comm_s, expected)


def cost_model_names(report, event) -> tuple:
  return tuple(report.mesh_shape.dims[a].name for a in event.mesh_axes)


def test_unknown_presets_are_refused_with_the_list_of_names():
  with pytest.raises(ValueError, match="tpu_v3"):
    cost_model.get_time_model("tpu_v9")
