"""One view of a tf.Graph or an mtf.Graph for scheduling and memory (public as `auto_mtf.graph_interface`).

Operations are numbered in graph order; tensors are named by their graph names ("einsum:0"). Sizes
may be asked for per processor, under a partial layout {tensor dim: mesh dim}.
"""

from __future__ import annotations

import collections
from typing import Iterator, Optional

import tensorflow.compat.v1 as tf
from tensorflow.core.framework import cost_graph_pb2

from mesh_tensorflow._core.graph import Graph as MtfGraph
from mesh_tensorflow._core.tensor import Tensor as MtfTensor


class GraphInterface:
  """Operations, tensors, sizes and final (kept) tensors of a tf.Graph or an mtf.Graph.

  Args:
    graph: a tf.Graph or an mtf.Graph.
    canonical_device: for tf graphs, the device whose tensors count as this processor's.
  """

  def __init__(self, graph, canonical_device: Optional[str] = None):
    if isinstance(graph, tf.Graph):
      self._operations = graph.get_operations()
    elif isinstance(graph, MtfGraph):
      self._operations = list(graph.operations)
    else:
      raise TypeError(f"GraphInterface needs a tf.Graph or an mtf.Graph, got a {type(graph).__name__}.")
    self._graph = graph
    self.canonical_device = canonical_device
    self._operation_ids = {op.name: i for i, op in enumerate(self._operations)}
    self._tensor_ids = {
      t.name: (i, j) for i, op in enumerate(self._operations) for j, t in enumerate(op.outputs)
    }
    self._final_tensors = set()

  def get_num_operations(self) -> int:
    return len(self._operations)

  def get_all_operation_names(self) -> list:
    return [op.name for op in self._operations]

  def get_operation_input_names(self, operation_name: str) -> Iterator[str]:
    for t in self._operation(operation_name).inputs:
      yield t.name

  def get_operation_output_names(self, operation_name: str) -> Iterator[str]:
    for t in self._operation(operation_name).outputs:
      yield t.name

  def get_all_tensor_names(self) -> list:
    return list(self._tensor_ids)

  def get_tensor_dtype(self, tensor_name: str) -> tf.DType:
    return tf.as_dtype(self._tensor(tensor_name).dtype)

  def get_tensor_shape(self, tensor_name: str) -> tf.TensorShape:
    t = self._tensor(tensor_name)
    if isinstance(t, MtfTensor):
      return tf.TensorShape(t.shape.to_integer_list)
    return t.shape

  def get_tensor_num_entries(
    self,
    tensor_name: str,
    partial_layout: Optional[dict] = None,
    mesh_dimension_to_size: Optional[dict] = None,
  ) -> int:
    """Elements of the tensor, or of one processor's slice when a partial layout is given."""
    num = 1
    for d in self.get_tensor_shape(tensor_name).as_list():
      num *= d
    for name in self.get_tensor_mtf_dimension_names(tensor_name):
      if partial_layout and name in partial_layout:
        num //= mesh_dimension_to_size[partial_layout[name]]
    return num

  def get_tensor_size(
    self,
    tensor_name: str,
    partial_layout: Optional[dict] = None,
    mesh_dimension_to_size: Optional[dict] = None,
  ) -> int:
    """Bytes of the tensor (or of one processor's slice under a partial layout)."""
    return self.get_tensor_dtype(tensor_name).size * self.get_tensor_num_entries(
      tensor_name, partial_layout, mesh_dimension_to_size
    )

  def get_tensor_device(self, tensor_name: str) -> Optional[str]:
    """The tf tensor's device; None for mtf tensors (they live on every processor)."""
    t = self._tensor(tensor_name)
    return None if isinstance(t, MtfTensor) else t.device

  def is_tensor_on_canonical_device(self, tensor_name: str) -> bool:
    device = self.get_tensor_device(tensor_name)
    return not device or device == self.canonical_device

  def get_operation_device(self, operation_name: str) -> Optional[str]:
    op = self._operation(operation_name)
    return op.device if isinstance(op, tf.Operation) else None

  def get_tensor_mtf_dimension_names(self, tensor_name: str) -> list:
    t = self._tensor(tensor_name)
    return t.shape.dimension_names if isinstance(t, MtfTensor) else []

  def get_operation_mtf_dimension_names(self, operation_name: str) -> set:
    names = set()
    for t in (
      *self.get_operation_input_names(operation_name),
      *self.get_operation_output_names(operation_name),
    ):
      names.update(self.get_tensor_mtf_dimension_names(t))
    return names

  def set_tensor_final(self, tensor_name: str) -> None:
    """Marks a tensor as an output: kept in memory to the end of the schedule."""
    self._final_tensors.add(self._tensor(tensor_name))

  def is_tensor_final(self, tensor_name: str) -> bool:
    return self._tensor(tensor_name) in self._final_tensors

  def compute_cost_graph(self, devices: Optional[list] = None) -> cost_graph_pb2.CostGraphDef:
    """A CostGraphDef: one node per operation in graph order, with its inputs and output sizes.

    Outputs on a device outside `devices` (when given) get size 0 and no shape.
    """
    cost_graph = cost_graph_pb2.CostGraphDef()
    for i, op_name in enumerate(self.get_all_operation_names()):
      node = cost_graph.node.add(name=op_name, device=self.get_operation_device(op_name) or "", id=i)
      for input_name in self.get_operation_input_names(op_name):
        preceding_node, preceding_port = self._tensor_ids[input_name]
        node.input_info.add(preceding_node=preceding_node, preceding_port=preceding_port)
      for output_name in self.get_operation_output_names(op_name):
        device = self.get_tensor_device(output_name)
        dtype = self.get_tensor_dtype(output_name).as_datatype_enum
        if devices is None or device is None or device in devices:
          node.output_info.add(
            size=self.get_tensor_size(output_name),
            alias_input_port=-1,
            dtype=dtype,
            shape=self.get_tensor_shape(output_name).as_proto(),
          )
        else:
          node.output_info.add(size=0, alias_input_port=-1, dtype=dtype)
        if self.is_tensor_final(output_name):
          node.is_final = True
    return cost_graph

  def compute_memory_contents_under_schedule(self, schedule) -> list:
    """Per scheduled operation, the frozenset of tensor names in memory while it runs.

    A tensor is allocated when its operation runs and freed after its last consumer (final
    tensors are never freed; a tensor nobody consumes is freed right after its operation).
    """
    uses = self._initial_uses()
    live, contents = set(), []
    for op_id in schedule:
      op_name = self._operations[op_id].name
      outputs = list(self.get_operation_output_names(op_name))
      live.update(outputs)
      contents.append(frozenset(live))
      for name in outputs:
        if uses[name] == 0:
          live.discard(name)
      for name in self.get_operation_input_names(op_name):
        uses[name] -= 1
        if uses[name] == 0:
          live.discard(name)
    return contents

  def _initial_uses(self) -> collections.Counter:
    uses = collections.Counter(
      {name: 1 for name in self.get_all_tensor_names() if self.is_tensor_final(name)}
    )
    for op_name in self.get_all_operation_names():
      uses.update(self.get_operation_input_names(op_name))
    return uses

  def _operation(self, operation_name: str):
    return self._operations[self._operation_ids[operation_name]]

  def _tensor(self, tensor_name: str):
    i, j = self._tensor_ids[tensor_name]
    return self._operations[i].outputs[j]
