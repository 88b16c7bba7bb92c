"""Mesh TensorFlow: named-dimension distributed tensors, lowered to per-processor TensorFlow.

`import mesh_tensorflow as mtf`, then build a graph of named-dimension ops on an `mtf.Mesh`,
and lower it with `mtf.Lowering(graph, {mesh: mesh_impl})`.
"""
# ruff: noqa: F401, F403
from mesh_tensorflow import _cli_quiet  # first: may load TensorFlow quietly for command-line entry points
from mesh_tensorflow import auto_mtf
from mesh_tensorflow import beam_search
from mesh_tensorflow import cost_model
from mesh_tensorflow.explain import explain
from mesh_tensorflow import collective_mesh_impl
from mesh_tensorflow import layers
from mesh_tensorflow import optimize
from mesh_tensorflow import placement_mesh_impl
from mesh_tensorflow import simd_mesh_impl
from mesh_tensorflow import tpu_variables
from mesh_tensorflow import tf2
from mesh_tensorflow import utils
from mesh_tensorflow.ops_with_redefined_builtins import *
from mesh_tensorflow._lowering.cache import LoweringCache, lowering_cache

__version__ = "0.2.0"
