"""SIMD backend facade: TPU SPMD execution and logical-to-physical processor maps."""
# ruff: noqa: F401
from mesh_tensorflow._backends.simd import SimdMeshImpl
from mesh_tensorflow._backends.tpu_topology import (
    HierarchicalTiling, _logical_1d_to_physical_subspace_auto, _logical_to_physical_v1, _ring_2d,
    auto_logical_to_physical_tpu, physical_shape_3d_from_topology_proto_4d,
    pnum_to_processor_coordinates_nd, processor_coordinates_to_pnum_map_nd)
