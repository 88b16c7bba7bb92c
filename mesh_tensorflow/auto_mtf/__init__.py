"""Automatic layout search: `auto_mtf.layout(graph, mesh)` and `auto_mtf.layout_and_mesh_shape(graph, n)`.

The interface of the original library's auto_mtf; the objective is the cost model's predicted
step time (see docs/choosing_layouts.md) and the solver needs nothing beyond NumPy.
`auto_mtf.depth.layout_for_depth` plans a deep layer stack from two shallow copies of it.
"""

# ruff: noqa: F401
from mesh_tensorflow.auto_mtf import api, depth
from mesh_tensorflow.auto_mtf.api import layout, layout_and_mesh_shape
