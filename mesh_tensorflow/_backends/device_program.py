"""One traced program per device: a backend's slicewise computations fused into TF functions.

A placement-style backend holds one TF tensor per processor, and every slicewise computation
(elementwise ops, per-slice einsums, reshapes, ...) would otherwise be built once per device:
the lowered program, and the time to build it, grow with the device count. While a Lowering runs
in graph mode, `DeviceProgram` instead traces each computation once into an open *segment* (a
FuncGraph whose arguments are the per-device values). When a value of the segment is needed
outside it (by a collective, an assignment, an export), the segment closes: its ops become one TF
function, called once on every device with that device's arguments. The program grows by one
call per device per segment, and lowering costs about what one device's lowering costs.

Results are those of building every device's ops: each call computes exactly what the per-device
ops computed. The calls run their body as traced (not inlined into the session's graph, and not
optimised again per device), so a session starts quickly; with `jit_compile` each call is
compiled by XLA instead.

With `share_replicas` (CPU devices of one process, where a tensor of one device is read on another
without a copy), devices whose arguments are the very same tensors share one call: a value the
layout replicates (a layer norm of replicated activations, the update of a replicated variable) is
computed once per distinct slice instead of once per device, and every device holding that slice
gets the same tensor. Computations are kept in one open segment per *signature* (which devices
hold equal values), so the replicated part of a layer is not dragged into the per-device calls of
the split part that follows it.

A computation is built per device, as before, where fusing could change its meaning: outside a
Lowering, in eager mode, inside control flow or control dependencies, for arguments that are not
tensors or numbers, and when tracing it fails.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import weakref
from typing import Callable, Optional

import tensorflow.compat.v1 as tf
from tensorflow.core.protobuf import config_pb2
from mesh_tensorflow._tf_compat import atomic_function, context
from mesh_tensorflow._tf_compat import func_graph as func_graph_lib

from mesh_tensorflow._lowering.laid_out import LaidOutTensor

_segment_numbers = itertools.count()
# With jit_compile, smaller segments (an optimizer's update of one variable, a cast) are not
# worth an XLA compilation per device.
_MIN_OPS_TO_COMPILE = 16


class _Unfusable(Exception):
  """This computation must be built per device."""


class DeviceProgram:
  """Fuses slicewise computations on `devices` into per-device calls of traced TF functions.

  Args:
    devices: one TF device string per slice this program holds, in slice order.
    jit_compile: compile each segment with XLA (one compiled cluster per device).
    share_replicas: devices given the same argument tensors share one call and its results.
  """

  def __init__(self, devices: list, jit_compile: bool = False, share_replicas: bool = False):
    self._devices = list(devices)
    self.jit_compile = jit_compile
    self.share_replicas = share_replicas
    self._graph = None  # the TF graph a Lowering builds in; None: nothing is fused
    self._segments: dict = {}  # signature -> its open _Segment
    self.is_needed: Callable = lambda laid_out: True

  @contextlib.contextmanager
  def fusing(self, is_needed: Optional[Callable] = None):
    """While a Lowering runs: fuse slicewise computations built in the current graph.

    is_needed(laid_out) says whether a pending value may still be read when its segment is
    built (default: always). On exit the open segment is built.
    """
    if tf.executing_eagerly():
      yield
      return
    previous = self._graph, self.is_needed
    self._graph = tf.get_default_graph()
    self.is_needed = is_needed or (lambda laid_out: True)
    try:
      yield
    finally:
      self.flush()
      self._graph, self.is_needed = previous

  def flush(self) -> None:
    """Builds the open segments' calls (values nobody holds any more are dropped)."""
    segments, self._segments = self._segments, {}
    for segment in segments.values():
      segment.close()

  def detach(self, segment: _Segment) -> None:
    """segment takes no more computations (it is being built)."""
    if self._segments.get(segment.signature) is segment:
      del self._segments[segment.signature]

  def slicewise(self, fn: Callable, inputs: list, laid_out_cls: type):
    """fn traced once into the open segment: a pending laid_out_cls (or a tuple of them).

    inputs: LaidOutTensors (one value per slice) or values given to every slice. Returns None
    when fn must be built per device instead (the caller then does so).
    """
    if not self._can_fuse():
      return None
    try:
      signature = self._signature(inputs)
      if signature not in self._segments:
        self._segments[signature] = _Segment(self, self._graph, signature)
      return self._segments[signature].trace(fn, inputs, laid_out_cls)
    except _Unfusable:
      return None

  def _signature(self, inputs: list) -> tuple:
    """Per device, the first device computing the same values from these inputs.

    Without share_replicas every device computes its own: (0, 1, ..., n - 1).
    """
    n = len(self._devices)
    if not self.share_replicas:
      return tuple(range(n))
    classes = [()] * n
    for x in inputs:
      if isinstance(x, LaidOutTensor):
        mine = x.is_pending and x.pending_segment.program is self
        x_signature = x.pending_segment.signature if mine else _signature_of(x.tensor_list, n)
        classes = [c + (s,) for c, s in zip(classes, x_signature)]
    return _first_with_equal_key(classes)

  def _can_fuse(self) -> bool:
    if self._graph is None or tf.executing_eagerly():
      return False
    graph = tf.get_default_graph()
    if graph is not self._graph or graph._control_dependencies_stack:  # pylint: disable=protected-access
      return False
    if graph._get_control_flow_context() is not None:  # pylint: disable=protected-access
      return False
    return not any(segment.tracing for segment in self._segments.values())


def _signature_of(values: list, n: int) -> tuple:
  """Per device, the first device holding the same value (the same tensor, or an equal number)."""
  if len(values) != n:
    raise _Unfusable()
  if not all(isinstance(v, (tf.Tensor, numbers.Number)) for v in values):
    raise _Unfusable()
  return _first_with_equal_key([id(v) if isinstance(v, tf.Tensor) else ("number", v) for v in values])


def _first_with_equal_key(keys: list) -> tuple:
  """Per position, the first position whose key equals its key: a signature."""
  first = {}
  return tuple(first.setdefault(key, d) for d, key in enumerate(keys))


class _Segment:
  """An open trace: slicewise computations not built yet, and the per-device values they read."""

  def __init__(self, program: DeviceProgram, graph, signature: tuple):
    self.program = program
    self.graph = graph
    self.signature = signature  # per device, the device whose call it shares
    with graph.as_default():
      self._trace_graph = func_graph_lib.FuncGraph(f"mtf_segment_{next(_segment_numbers)}")
    self._arguments = []  # (placeholder, one value per device)
    self._argument_keys = {}  # what a placeholder stands for -> placeholder
    self._pending = []  # weak references to the LaidOutTensors this segment will fill
    self._closed = False
    self._functions = 0  # functions built from the trace (a value computed again adds one)
    self.tracing = False

  # ---- tracing ----

  def trace(self, fn: Callable, inputs: list, laid_out_cls: type):
    """fn on the traced arguments; its outputs become pending LaidOutTensors."""
    args = [self._argument(x) if isinstance(x, LaidOutTensor) else x for x in inputs]
    num_ops = len(self._trace_graph.get_operations())
    self.tracing = True
    try:
      with self._trace_graph.as_default(), self._name_scope():
        ret = fn(*args)
    except _Unfusable:
      raise
    except Exception as e:  # built per device instead, where the error (if any) is raised again
      raise _Unfusable() from e
    finally:
      self.tracing = False
    if any(_needs_its_own_op_per_device(op) for op in self._trace_graph.get_operations()[num_ops:]):
      raise _Unfusable()
    outputs = ret if isinstance(ret, tuple) else (ret,)
    if not all(isinstance(t, tf.Tensor) for t in outputs):
      raise _Unfusable()
    pending = tuple(self._pending_output(laid_out_cls, t) for t in outputs)
    return pending if isinstance(ret, tuple) else pending[0]

  def _name_scope(self):
    """The lowering's name scope (the op being lowered) inside the trace."""
    scope = self.graph.get_name_scope()
    return self._trace_graph.name_scope(scope + "/") if scope else contextlib.nullcontext()

  def _argument(self, x: LaidOutTensor):
    """The traced value of x: its trace in this segment, a placeholder, or a shared number."""
    if x.is_pending and x.pending_segment is self:
      return x.traced
    values = x.tensor_list  # another program's pending value is built now
    if len(values) != len(self.program._devices):  # pylint: disable=protected-access
      raise _Unfusable()
    if all(isinstance(v, tf.Tensor) and v.graph is self.graph for v in values):
      if len({(v.dtype, tuple(v.shape.as_list() if v.shape.rank is not None else [None]))
              for v in values}) != 1:
        raise _Unfusable()
      return self._placeholder(("tensors",) + tuple(id(v) for v in values), values,
                               values[0].dtype, values[0].shape)
    if all(isinstance(v, numbers.Number) and not isinstance(v, bool) for v in values):
      if all(v == values[0] for v in values):
        return values[0]
      dtype = tf.int32 if all(isinstance(v, numbers.Integral) for v in values) else tf.float32
      return self._placeholder(("numbers", dtype) + tuple(values), list(values), dtype, [])
    raise _Unfusable()

  def _placeholder(self, key: tuple, values: list, dtype, shape):
    if key not in self._argument_keys:
      with self._trace_graph.as_default():
        placeholder = tf.placeholder(dtype, shape, name="per_device_input")
      self._argument_keys[key] = placeholder
      self._arguments.append((placeholder, values))
    return self._argument_keys[key]

  def _pending_output(self, laid_out_cls: type, traced: tf.Tensor) -> LaidOutTensor:
    x = laid_out_cls.pending(self, traced)
    self._pending.append(weakref.ref(x))
    return x

  # ---- building the calls ----

  def build_now(self, x: LaidOutTensor) -> None:
    """x's tensors are asked for: the segment is built (called by LaidOutTensor)."""
    if self.tracing:  # a computation being traced reads a pending value: build it per device
      raise _Unfusable()
    self.program.detach(self)
    if not self._closed:
      self.close()
    if x.is_pending:  # not needed when the segment was built: computed again from its inputs
      self._build([x])

  def close(self) -> None:
    """Calls the traced function on every device and fills the pending values still needed.

    A value nothing will read again (its mtf consumers are all lowered) is not an output: it
    stays pending and is computed again if it is ever asked for, so the segment's body keeps its
    intermediates to itself (XLA fuses them away, TF frees them early).
    """
    self._closed = True
    held = [x for x in (ref() for ref in self._pending) if x is not None and x.is_pending]
    needed = [x for x in held if self.program.is_needed(x)]
    self._pending = [weakref.ref(x) for x in held if not self.program.is_needed(x)]
    self._build(needed)

  def _build(self, values: list) -> None:
    """Calls the traced function with `values` as outputs on every device, and fills them."""
    if not values:
      return
    n = len(self.program._devices)  # pylint: disable=protected-access
    per_device = {}  # id(traced tensor) -> one value per device
    for placeholder, arguments in self._arguments:
      per_device[id(placeholder)] = arguments
    captures = list(self._trace_graph.captures)
    for outer, inner in captures:
      per_device[id(inner)] = [outer] * n
    outputs = []
    for x in values:
      if id(x.traced) not in per_device and x.traced.graph is not self._trace_graph:
        per_device[id(x.traced)] = [x.traced] * n  # an outer tensor returned as it is
      elif id(x.traced) not in per_device:
        per_device[id(x.traced)] = None
        outputs.append(x.traced)
    if outputs:
      for output, slices in zip(outputs, self._call(outputs, captures)):
        per_device[id(output)] = slices
    for x in values:
      x.fill(per_device[id(x.traced)])

  def _call(self, outputs: list, captures: list) -> list:
    """The traced function with `outputs`, called per device: one value list per output."""
    fg = self._trace_graph
    fg.inputs = [p for p, _ in self._arguments] + [inner for _, inner in captures]
    fg.outputs = list(outputs)
    fg.structured_outputs = list(outputs)
    jit = self.program.jit_compile and len(fg.get_operations()) >= _MIN_OPS_TO_COMPILE
    attrs = {"_noinline": True, "_XlaMustCompile": True} if jit else {"_noinline": True}
    self._functions += 1
    function = atomic_function.from_func_graph(f"{fg.name}_{self._functions}", fg, attrs)
    calls = []
    with _at_top_level(self.graph), _calls_instantiated_as_traced():
      for d, device in enumerate(self.program._devices):  # pylint: disable=protected-access
        if self.signature[d] != d:  # the same arguments as an earlier device: its results
          calls.append(calls[self.signature[d]])
          continue
        with tf.device(device):
          args = [_per_device_number(values[d], p.dtype) if not isinstance(values[d], tf.Tensor)
                  else values[d] for p, values in self._arguments]
          calls.append(function.call_flat(*args, *[outer for outer, _ in captures]))
    return [list(values) for values in zip(*calls)]


def _per_device_number(value, dtype) -> tf.Tensor:
  """A device's number (a shard's offset, say) as an argument grappler does not fold into a copy.

  TF's function optimizer specialises a function for every call with a constant argument: each
  device's call got a body of its own, optimised and instantiated separately. A
  PlaceholderWithDefault is no constant to it, so the devices keep calling one function.
  """
  return tf.placeholder_with_default(tf.constant(value, dtype), [])


def _needs_its_own_op_per_device(op) -> bool:
  """Stateful ops (random draws, variables) differ per device; one traced op would repeat itself.

  Print is stateful too, but printing from each device is what the per-device ops did.
  """
  return op._is_stateful and op.type not in ("Print", "PrintV2")  # pylint: disable=protected-access


@contextlib.contextmanager
def _calls_instantiated_as_traced():
  """Function calls built here run their body as traced: not inlined, no graph optimisation.

  A session would otherwise inline every device's call and run TF's graph optimisers over all
  the copies, or optimise the body again for each device it is instantiated on: measured on the
  benchmark Transformer (8 devices), 4.1 s of CPU at the first step, against 1.4 s as traced,
  with no slower steps.
  """
  ctx = context.context()
  previous = ctx.function_call_options
  config = config_pb2.ConfigProto(allow_soft_placement=True)
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  ctx.function_call_options = context.FunctionCallOptions(config_proto=config)
  try:
    yield
  finally:
    ctx.function_call_options = previous


@contextlib.contextmanager
def _at_top_level(graph):
  """Builds in `graph` outside any control flow, control dependencies and device scope."""
  with graph.as_default(), tf.control_dependencies(None), tf.device(None):
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    graph._set_control_flow_context(None)  # pylint: disable=protected-access
    try:
      with tf.name_scope("mtf_device_program"):
        yield
    finally:
      graph._set_control_flow_context(context)  # pylint: disable=protected-access
