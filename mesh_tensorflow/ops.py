"""The mtf op namespace (`mesh_tensorflow.ops`): everything public, plus helpers tests reach for.

This module only re-exports: the code lives in `_core` (names, shapes, layouts, graph),
`_lowering` (driver, MeshImpl contract, lazy values), `_autodiff` and the `_ops` families.
"""
# ruff: noqa: F401, F403
import tensorflow.compat.v1 as tf

from mesh_tensorflow._autodiff import gradients
from mesh_tensorflow._core.dims import (
    Dimension, Shape, anonymous_shape, combined_dimension, convert_to_dimension, convert_to_shape,
    is_subsequence, list_product)
from mesh_tensorflow._core.errors import (
    BroadcastWarning, DimensionSpecError, GradientNotImplementedError, LayoutError, LayoutRuleWarning,
    UnsplittableDimensionError)
from mesh_tensorflow._core.graph import Graph, Mesh
from mesh_tensorflow._core.layout import (
    LayoutRules, TensorLayout, convert_to_layout_rules, pnum_to_group,
    pnum_to_processor_coordinates, processor_coordinates_to_pnum, processor_groups,
    tensor_dim_to_mesh_dim_size, tensor_dim_to_size_per_split)
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.parsing import _parse_string_to_list_of_pairs
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._backends.tpu_topology import (
    pnum_to_processor_coordinates_nd, processor_coordinates_to_pnum_map_nd)
from mesh_tensorflow._lowering.comm import CommEvent
from mesh_tensorflow._lowering.dry_run import DryRunResult, dry_run
from mesh_tensorflow._lowering.lazy import (
    LazyAllreduceSum, LazyLaidOutTensor, compatible_lazy_allreduce_sums,
    convert_args_to_laid_out_tensors)
from mesh_tensorflow._lowering.layout_check import check_layout
from mesh_tensorflow._lowering.lowering import Lowering, pretty_print_counters
from mesh_tensorflow._lowering.mesh_impl import MeshImpl
from mesh_tensorflow._lowering.mesh_impl import expand_dims_to as _expand_dims
from mesh_tensorflow._lowering.tf_helpers import (
    binary_reduction_fn, log_variable_sizes, parallel, pool_fn, reduction_fn,
    transpose_list_of_lists)
from mesh_tensorflow._ops._checks import verify_no_new_dims
from mesh_tensorflow._ops.binary import *
from mesh_tensorflow._ops.binary import _infer_binary_broadcast_shape
from mesh_tensorflow._ops.checkpoint_hooks import *
from mesh_tensorflow._ops.control import *
from mesh_tensorflow._ops.conv import *
from mesh_tensorflow._ops.custom_gradient import *
from mesh_tensorflow._ops.einsum import *
from mesh_tensorflow._ops.elementwise import *
from mesh_tensorflow._ops.gather import *
from mesh_tensorflow._ops.halo import *
from mesh_tensorflow._ops.indexing import *
from mesh_tensorflow._ops.io import *
from mesh_tensorflow._ops.pipeline import *
from mesh_tensorflow._ops.pool import *
from mesh_tensorflow._ops.random import *
from mesh_tensorflow._ops.reduce import *
from mesh_tensorflow._ops.reshape import *
from mesh_tensorflow._ops.shift import *
from mesh_tensorflow._ops.slicing import *
from mesh_tensorflow._ops.softmax import *
from mesh_tensorflow._ops.stacking import *
from mesh_tensorflow._ops.variables import *
