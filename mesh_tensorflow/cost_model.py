"""The cost model (public): what a layout costs each processor, and a predicted step time.

    report = mtf.cost_model.estimate_cost(graph, "batch:2;model:4", "batch:batch;d_ff:model")
    report.step_s, report.flops, report.comm_bytes_by_kind(), report.memory.total_bytes

Communication comes from a dry run (`mtf.dry_run`), so it is exactly what the lowering sends; FLOPs
follow `_cost/flops.py`'s model; memory counts variable and optimizer slices, the activation
peak under a schedule and the largest collective's buffer; `TimeModel` turns these into seconds:
rough presets CPU, GPU, TPU; accelerators TPU_V3, TPU_V4, TPU_V5E, A100, H100 with their memory,
topology and public sources (`ACCELERATORS`); or `calibrate(devices)`.
"""

# ruff: noqa: F401
from mesh_tensorflow._cost.flops import op_flops, per_processor_elements
from mesh_tensorflow._cost.memory import MemoryReport, estimate_memory, variable_slice_bytes
from mesh_tensorflow._cost.model import CostReport, estimate_cost
from mesh_tensorflow._cost.time_model import (
  A100,
  ACCELERATORS,
  CPU,
  GPU,
  H100,
  PRESETS,
  TPU,
  TPU_V3,
  TPU_V4,
  TPU_V5E,
  Hosts,
  TimeModel,
  Torus,
  calibrate,
  get_time_model,
)
