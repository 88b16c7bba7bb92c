"""Collective backend facade: CPU/GPU meshes on TF collective ops, in one process or spread over several."""
# ruff: noqa: F401
from mesh_tensorflow._backends.collective import CollectiveMeshImpl
from mesh_tensorflow._launch.cluster import Cluster, LostPeerError
