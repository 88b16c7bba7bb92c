"""The lowering driver: walks the graph in order and asks each op to lower itself."""

from __future__ import annotations

import collections
import contextlib
import weakref

import tensorflow.compat.v1 as tf

from mesh_tensorflow._lowering import cache as lowering_cache
from mesh_tensorflow._lowering import collector
from mesh_tensorflow._lowering import comm as comm_lib
from mesh_tensorflow._lowering import random_bits, random_stream
from mesh_tensorflow._lowering.layout_check import check_mesh_impls
from mesh_tensorflow._lowering.mesh_impl import sequence_mode
from mesh_tensorflow._lowering.tf_helpers import (
    _log_info_also_to_file, log_variable_sizes, outside_all_rewrites)


class Lowering:
  """Lowers `graph` given a MeshImpl per Mesh.

  After construction, `tensors` maps each mtf Tensor to its laid-out value (possibly lazy),
  `operations` maps ops without outputs (Assign, ...) to TF ops, and `variables` maps each
  mtf Variable to its backend LaidOutVariable. `communication_events` lists every collective
  (a `CommEvent`, see `_lowering/comm.py`) in the order it was built; `counters` holds
  (key, value) pairs: "output/<Op>" sizes, op-specific counts, and one entry per event
  (key "<kind>/<mesh axes>/<reason>", value: elements sent between processors).

  Lowering the same graph again (even with autostack) gives the same result: the variables are
  stacked on the first lowering only.

  Args:
    graph: the mtf Graph.
    mesh_to_impl: {mtf.Mesh: MeshImpl}.
    autostack: stack similar variables (fewer, larger slice variables).
    log_file: a file object or a path (opened with tf.io.gfile) for the variable and counter logs.
    random_position: an int scalar TF tensor numbering this evaluation (a training loop's global
      step, say): random ops draw from it, and the caller makes it differ between evaluations.
      Default: mtf's evaluation counter (see `_lowering/random_stream.py`).

  In eager mode a graph built again with the same structure runs the program its earlier
  lowering was traced into, instead of lowering again (`mtf.lowering_cache`, `_lowering/cache.py`).
  """

  def __init__(self, graph, mesh_to_impl: dict, autostack: bool = True, log_file=None,
               random_position=None):
    check_mesh_impls(graph, mesh_to_impl)  # the layout, before anything is built
    self.mesh_to_impl = mesh_to_impl
    self.graph = graph
    _check_every_mesh_has_impl(graph, mesh_to_impl)
    if autostack:
      self.autostack()
    self._counters = []
    self._events = []
    self._current_op = None
    self._loop = None  # (while_loop name, whether events are being recorded)
    self._tf_graph = None if tf.executing_eagerly() else tf.get_default_graph()
    self._random_position = random_position  # this evaluation's number (None: read at first use)
    self._loop_iterations = []  # the iteration counters of the while_loops being lowered
    self.tensors = {}
    self.operations = {}
    self.variables = {}
    served = lowering_cache.serve(self, log_file=log_file, random_position=random_position)
    if served is not None:  # eager, and a graph of this structure has a program: it has run
      self.tensors, self.operations, self.variables = served.tensors, served.operations, served.variables
      self._counters, self._events = list(served.counters), list(served.events)
      self._copies = None  # eager: the copies run when they are asked for
      return
    # What _may_be_read answers from, for the backends that fuse: only in graph mode (an eager
    # op runs at once), so an eager lowering neither builds nor keeps it up.
    self._tensors_of = None  # laid-out value -> the mtf tensors it lowers
    if self._tf_graph is not None:
      self._unlowered_consumers = collections.Counter(
          x for op in graph.operations for x in op.inputs)
      self._sinks = {t for op in graph.operations for t in op.outputs
                     if not self._unlowered_consumers[t]}
      self._tensors_of = weakref.WeakKeyDictionary()
    with contextlib.ExitStack() as fusing:
      if self._tf_graph is None:  # eager: its values are freed as the ops run (see collector.py)
        fusing.enter_context(collector.paused())
      for mesh_impl in {id(m): m for m in mesh_to_impl.values()}.values():
        fusing.enter_context(mesh_impl.fusing(self._may_be_read))
      for op in graph.operations:
        self.lower_operation(op)
        if self._tensors_of is not None:
          self._unlowered_consumers.subtract(op.inputs)
        for out in op.outputs:
          self.add_counter("output/%s" % type(op).__name__, self.laid_out_size(out))
          self.add_counter("output_unique/%s" % type(op).__name__, out.size)
    # The copy to the slices is built now, in graph mode: grouping it later would mark its ops
    # (TF sets an attribute on a control input) after a session may have run the graph, which TF
    # warns will become an error. The copy to the masters, which only saving needs, is built
    # whole (its ops and their group) at the first request. Both outside any rewrite (e.g. a TPU
    # computation being built), where the copies themselves live.
    self._copies = None
    if self._tf_graph is not None:
      with outside_all_rewrites():
        self._copies = [self._build_copy_masters_to_slices(), None]
    with _opened(log_file) as f:
      log_variable_sizes(graph.trainable_variables, "Trainable Variables", verbose=True,
                         mesh_to_impl=mesh_to_impl, log_file=f)
      log_variable_sizes(graph.all_variables, "All Variables", verbose=False,
                         mesh_to_impl=mesh_to_impl, log_file=f)
      _log_info_also_to_file("Counters:\n" + pretty_print_counters(self._counters), log_file=f)

  def lower_operation(self, op) -> None:
    """Lowers one op (in a TF name scope of its name); its collectives are charged to it."""
    previous, self._current_op = self._current_op, op
    try:
      with tf.name_scope(_scope_name(op.name)):
        op.lower(self)
    finally:
      self._current_op = previous

  def comm(self, op=None) -> comm_lib.Communicator:
    """The communication layer for `op` (default: the op being lowered) on its mesh."""
    op = op or self._current_op
    loop_name, recording = self._loop or (None, True)
    record = self._record_event if recording else (lambda event: None)
    return comm_lib.Communicator(self.mesh_impl(op), record, op.name, in_loop=loop_name)

  @contextlib.contextmanager
  def in_while_loop(self, loop_name: str, record: bool, iteration=None):
    """Lowers a while_loop's cond/body: events are tagged with the loop and recorded once.

    Graph mode traces a body once; eager mode runs it per iteration, and only the first run records.
    iteration: the loop's iteration number (a TF scalar), when random ops inside draw per iteration.
    """
    previous, self._loop = self._loop, (loop_name, record)
    if iteration is not None:
      self._loop_iterations.append(iteration)
    try:
      yield
    finally:
      self._loop = previous
      if iteration is not None:
        self._loop_iterations.pop()

  def random_key(self, op_key: int):
    """A random op's stream key (uint64 scalar) for this evaluation and the loop iterations.

    The evaluation number is read once per Lowering (see `_lowering/random_stream.py`).
    """
    if self._random_position is None:
      self._random_position = random_stream.next_position(self._tf_graph)
    return random_bits.stream_key(op_key, [self._random_position] + self._loop_iterations)

  def _record_event(self, event: comm_lib.CommEvent) -> None:
    self._events.append(event)
    self.add_counter(event.counter_key, event.elements_sent)

  @property
  def communication_events(self) -> list:
    """Every collective built so far (forcing a lazy allreduce later adds its event)."""
    return list(self._events)

  def mesh_impl(self, m):
    """The MeshImpl of a Mesh, or of anything with a `.mesh` (Tensor, Operation)."""
    mesh = getattr(m, "mesh", m)
    try:
      return self.mesh_to_impl[mesh]
    except KeyError:
      raise ValueError(
          f"No MeshImpl for {mesh!r}; pass one in mesh_to_impl, e.g. "
          f"Lowering(graph, {{mesh: PlacementMeshImpl(shape, layout, devices)}}).") from None

  def export_to_tf_tensor(self, x):
    """The whole value of an mtf Tensor as one TF tensor (its slices combined).

    Args:
      x: an mtf Tensor of the lowered graph.

    Returns:
      A tf.Tensor of shape x.shape.to_integer_list (an EagerTensor in eager mode).
    """
    mesh_impl = self.mesh_impl(x)
    with comm_lib.charged_to(self.comm(x.operation)):  # gathers across processes are its events
      return mesh_impl.export_to_tf_tensor(x, self.tensors[x].to_laid_out_tensor())

  def lowered_operation(self, op):
    """The TF op an mtf operation without outputs became (e.g. an optimizer's Assign).

    Args:
      op: an mtf Operation of the lowered graph, such as one returned by `apply_grads`.

    Returns:
      A TF operation to run, e.g. `tf.group([lowering.lowered_operation(u) for u in updates])`.
    """
    return self.operations[op]

  def copy_masters_to_slices(self):
    """One op copying every master variable to its slices.

    Run it after the masters are initialised or restored (saver.restore), before the first
    step; mtf.MtfRestoreHook does it for MonitoredTrainingSession. In eager mode it runs at once.
    With MTF_SEQUENCE_MODE=1 the backends chain the copies (each waits for the previous one, to
    bound host memory), so the last copy stands for all of them. Without whole masters
    (`PlacementMeshImpl(masters="sliced")`) it copies each checkpointed slice to its replicas.
    """
    return self._copies[0] if self._copies else self._build_copy_masters_to_slices()

  def copy_slices_to_masters(self):
    """One op copying every variable's slices into its master: run it before saving a checkpoint.

    In eager mode the copies run at once. Graph mode builds the op at the first call (in the
    lowering's TF graph, outside control dependencies) and returns that op from then on.
    Without whole masters (`PlacementMeshImpl(masters="sliced")`) there is nothing to copy: the
    checkpointed parts are slices.
    """
    if not self._copies:
      return self._build_copy_slices_to_masters()
    if self._copies[1] is None:
      with self._tf_graph.as_default(), outside_all_rewrites():
        self._copies[1] = self._build_copy_slices_to_masters()
    return self._copies[1]

  def _build_copy_masters_to_slices(self):
    if sequence_mode() and self.variables:
      return list(self.variables.values())[-1].copy_master_to_slices
    return tf.group([v.copy_master_to_slices for v in self.variables.values()])

  def _build_copy_slices_to_masters(self):
    copies = []
    for variable, laid_out_variable in self.variables.items():
      with comm_lib.charged_to(self.comm(variable)):  # gathers across processes are its events
        copies.append(laid_out_variable.copy_slices_to_master)
    return tf.group(copies)

  def add_counter(self, key: str, value: int) -> None:
    assert isinstance(value, int)
    self._counters.append((key, value))

  @property
  def counters(self) -> list:
    """(key, value) pairs recorded while lowering; see the class docstring and docs/layouts.md."""
    return self._counters

  def laid_out_size(self, tensor) -> int:
    return self.mesh_impl(tensor).laid_out_size(tensor.shape)

  def set_tensor_lowering(self, tensor, laid_out_tensor) -> None:
    self.verify_slice_shapes(tensor, laid_out_tensor)
    self.tensors[tensor] = laid_out_tensor
    if self._tensors_of is None:
      return
    try:
      self._tensors_of.setdefault(laid_out_tensor, []).append(tensor)
    except TypeError:  # a value that cannot be weakly referenced is never left pending
      pass

  def _may_be_read(self, laid_out) -> bool:
    """Whether a laid-out value may still be read: by an op not lowered yet, or as an output.

    Values that lower no mtf tensor (an op's temporaries, a lazy allreduce's partial sums) may.
    """
    tensors = None if self._tensors_of is None else self._tensors_of.get(laid_out)
    if not tensors:
      return True
    return any(self._unlowered_consumers[t] > 0 or t in self._sinks for t in tensors)

  def verify_slice_shapes(self, tensor, laid_out_tensor) -> None:
    expected = self.mesh_impl(tensor).slice_shape(tensor.shape)
    actual = list(laid_out_tensor.slice_shape)
    if actual != expected:
      raise ValueError(
          f"Wrong slice shape lowering {tensor.name!r} ({tensor.shape}): got {actual}, expected "
          f"{expected}. This is a bug in the lowering of {type(tensor.operation).__name__}.")

  def autostack(self) -> None:
    """Stacks similar variables so each processor holds fewer, larger slice variables.

    Done once per graph: a graph that already holds autostacked variables is lowered as it is.
    """
    if any(v.is_stacked and not v.is_layer_stack for v in self.graph.all_variables):
      return
    num_slices = sum(self.mesh_impl(v).size for v in self.graph.all_variables)
    max_combined_slice_size = 2 ** 27 if num_slices >= 2 ** 16 else 2 ** 16
    self.graph.rewrite_stack_variables(mesh_to_impl=self.mesh_to_impl,
                                       max_combined_slice_size=max_combined_slice_size)


@contextlib.contextmanager
def _opened(log_file):
  """A path is opened for writing (and closed after); a file object or None is passed through."""
  if isinstance(log_file, (str, bytes)) or hasattr(log_file, "__fspath__"):
    with tf.io.gfile.GFile(log_file, "w") as f:
      yield f
  else:
    yield log_file


def _check_every_mesh_has_impl(graph, mesh_to_impl: dict) -> None:
  for op in graph.operations:
    if op.mesh not in mesh_to_impl:
      raise ValueError(
          f"Operation {op.name!r} is on {op.mesh!r}, which has no MeshImpl; add it to "
          f"mesh_to_impl (known meshes: {list(mesh_to_impl)}).")


def _scope_name(op_name: str) -> str:
  """TF name scopes reject some characters mtf names may hold (e.g. ':')."""
  return "".join(c if (c.isalnum() or c in "._-/") else "_" for c in op_name)


def pretty_print_counters(counters) -> str:
  """Totals per '/'-separated prefix, sorted, indented by depth: "  output/Einsum: 1.02e+03"."""
  totals = {}
  for key, value in counters:
    parts = key.split("/")
    for i in range(1, len(parts) + 1):
      prefix = "/".join(parts[:i])
      totals[prefix] = totals.get(prefix, 0) + value
  return "\n".join("%s%s: %.3g" % ("  " * k.count("/"), k, v) for k, v in sorted(totals.items()))
