"""The graph, mesh and outputs a layout search works on (upstream `auto_mtf.memory_estimator`)."""

from __future__ import annotations

from mesh_tensorflow._core.dims import convert_to_shape
from mesh_tensorflow.auto_mtf import graph_interface as graph_interface_lib
from mesh_tensorflow.auto_mtf import valid_layouts


class MemoryEstimator:
  """Holds an mtf graph, a mesh shape and the outputs (kept in memory), with lazily built views.

  Args:
    mtf_graph: the mtf.Graph to lay out.
    mesh_shape: the mesh (a Shape or a string such as "m1:4;m2:2").
    mtf_outputs: mtf Tensors that stay in memory to the end (the step's results).
  """

  def __init__(self, mtf_graph, mesh_shape, mtf_outputs=()):
    self.mtf_graph = mtf_graph
    self.mesh_shape = convert_to_shape(mesh_shape)
    self.mtf_outputs = list(mtf_outputs)
    self._layout_validator = None
    self._graph_interface = None

  def get_layout_validator(self) -> valid_layouts.LayoutValidator:
    if self._layout_validator is None:
      self._layout_validator = valid_layouts.LayoutValidator(self.mtf_graph, self.mesh_shape)
    return self._layout_validator

  def get_graph_interface(self) -> graph_interface_lib.GraphInterface:
    if self._graph_interface is None:
      self._graph_interface = graph_interface_lib.GraphInterface(self.mtf_graph)
      for t in self.mtf_outputs:
        self._graph_interface.set_tensor_final(t.name)
    return self._graph_interface
