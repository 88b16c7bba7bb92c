"""Placement backend facade: one TF tensor per device (CPU, GPU, or devices of several hosts)."""
# ruff: noqa: F401
from mesh_tensorflow._backends.placement import (
    PlacementMeshImpl, lean_graph_optimization, session_config_for_devices)
from mesh_tensorflow._backends.ring_collectives import (
    allconcat_ring, allreduce_ring, allreduce_ring_single_shard, alltoall_pointtwise, alltoall_ring)
