"""The lowering cache: eager code that builds the same mtf graph again reuses its lowered program.

Eager clients (GPT-Neo, any plain Python function around mtf) build an mtf graph and lower it at
every call; the lowering is Python work per op, the same at every call. With the cache, an eager
`mtf.Lowering` first computes the graph's *structure key*: per op (in graph order, nested ops
included) its class and attributes, with tensors and ops named by their position, TF tensors
imported into the mesh by their shape and dtype, constants by their values, tf.Variables by
identity, plus each mesh implementation's type and configuration (shape, layout, devices, ...),
the graph seed and MTF_SEQUENCE_MODE. Any difference is another key.

* The first graph of a key is lowered eagerly, as without the cache (a graph built once pays
  only the key).
* The second is lowered once more inside a `tf.function`, whose concrete function takes the
  imported TF tensors as inputs, captures the master variables and the entry's own slice
  variables, copies the masters into the slices (as an eager lowering does), runs every op
  (variable updates included) and returns every tensor's slices.
* Every later graph of that key calls the function with its own imported tensors: its Lowering
  holds the values, as an eager lowering does, and no op is lowered.

Random ops read the eager evaluation counter inside the function, so each call draws fresh
values, the same as uncached calls from the same seed. Entries are kept in least-recently-used
order, at most `max_entries` of them. `lowering_cache(enabled=False)` switches the cache off.
Graph mode (tf.compat.v1 graphs, tf.function traces) never uses it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import types
import weakref
from typing import Optional

import numpy as np
import tensorflow as tf2
import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.graph import Mesh
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._lowering import collector, laid_out, random_stream
from mesh_tensorflow._lowering.mesh_impl import sequence_mode
from mesh_tensorflow._tf_compat import resource_variable_ops

# Constants and closed-over TF tensors up to this many elements are keyed by value (larger ones
# by identity: an equal-valued copy misses, which only costs a lowering).
_MAX_ELEMENTS_BY_VALUE = 4096
# Closures nested deeper than this are keyed by identity (a miss, never a wrong hit).
_MAX_DEPTH = 8
# Op names only name the TF ops (a name scope each), and rebuilt graphs differ in them: TF makes
# the variable scopes' default names unique per call (dropout_12/..., then dropout_13/...).
# Random ops draw by their key names instead (random_keys.py), which are part of the key.
_NOT_STRUCTURE = frozenset({"_name"})
# Functions of these packages are module-level and the same object at every call (mtf's own may
# be closures made per call, e.g. cast's lambda over the dtype: those are keyed by code and cells).
_LIBRARIES = ("tensorflow.", "keras.", "numpy.")
# A mesh implementation's run-time state, not its configuration.
_IMPL_STATE = frozenset({"copy_master_to_slice_ops", "_program"})


class LoweringCache:
  """The programs of eager lowerings, by structure key, least recently used first.

  `hits` counts the Lowerings served by a program, `lowerings` those that lowered the graph
  (eagerly, or into a new program); `len(cache)` is the number of entries.
  """

  def __init__(self, max_entries: int = 16):
    if max_entries < 1:
      raise ValueError(f"lowering_cache: max_entries={max_entries}; keep at least 1 entry, or pass "
                       f"enabled=False to switch the cache off.")
    self.max_entries = max_entries
    self.hits = 0
    self.lowerings = 0
    self._entries = collections.OrderedDict()  # structure key -> _Entry

  def __len__(self) -> int:
    return len(self._entries)

  def __repr__(self):
    return (f"LoweringCache(entries={len(self)}, max_entries={self.max_entries}, hits={self.hits}, "
            f"lowerings={self.lowerings})")

  def _entry(self, key: _Key) -> _Entry:
    entry = self._entries.pop(key, None) or _Entry()
    self._entries[key] = entry
    while len(self._entries) > self.max_entries:
      self._entries.popitem(last=False)
    return entry


@dataclasses.dataclass
class _Entry:
  """One structure: seen once (no program yet), or its program and the lowering it traced."""

  seen: bool = False  # lowered eagerly once
  program: Optional[object] = None  # a ConcreteFunction: imported tensors -> every slice
  traced: Optional[object] = None  # the Lowering built while tracing (its graph, variables, operations)
  slices_per_tensor: Optional[list] = None  # per tensor, how many outputs hold it (None: no value)
  counters: Optional[list] = None  # the traced lowering's, before its outputs were forced
  events: Optional[list] = None  # likewise its communication events
  cacheable: bool = True  # False once tracing failed: lowered eagerly from then on


class _Scope:
  """What lowering_cache returns: the cache it installed, restored to the previous one by `with`."""

  def __init__(self, cache: Optional[LoweringCache]):
    self._previous = _current[0]
    self.cache = cache
    _current[0] = cache

  def __enter__(self) -> Optional[LoweringCache]:
    return self.cache

  def __exit__(self, *exc_info) -> None:
    _current[0] = self._previous


def lowering_cache(enabled: bool = True, max_entries: int = 16) -> _Scope:
  """Installs a new, empty lowering cache for eager `mtf.Lowering`s (or none: enabled=False).

  Called plainly it holds from then on; used in a `with` statement, until the block ends (the
  previous cache comes back), and `as` gives the new LoweringCache (None when disabled), whose
  `hits` and `lowerings` count what happened. The process starts with a cache of 16 entries.

  Args:
    enabled: False: every eager Lowering lowers its graph, as without a cache.
    max_entries: how many graph structures to keep (least recently used first out).

  Returns:
    A context manager; `with` gives the installed LoweringCache.

  Example:
    with mtf.lowering_cache(max_entries=4) as cache:
      losses = [train_step(x) for x in batches]   # builds and lowers an mtf graph per call
    print(cache.hits, cache.lowerings)            # e.g. 18 2
  """
  return _Scope(LoweringCache(max_entries) if enabled else None)


_current = [LoweringCache()]  # the installed cache (None: disabled)


@dataclasses.dataclass(frozen=True)
class Served:
  """A Lowering's values, from a program: what `Lowering.__init__` keeps instead of lowering."""

  tensors: dict
  operations: dict
  variables: dict
  counters: list
  events: list


def serve(lowering, log_file=None, random_position=None) -> Optional[Served]:
  """The values of `lowering`'s graph from the cache, or None: lower it (and maybe remember it).

  Called by an eager Lowering before it lowers (its graph autostacked); None in graph mode,
  with a log file or a random position (their lowering has effects a program would not repeat),
  or a backend without whole masters.
  """
  cache = _current[0]
  if (cache is None or not tf.executing_eagerly() or log_file is not None
      or random_position is not None or not _whole_masters(lowering.mesh_to_impl)):
    return None
  with collector.paused():  # the key's tuples: freed at once when the entry has no program
    walk = _Walk(lowering.graph, lowering.mesh_to_impl)
    if walk.key is None:
      return None
    entry = cache._entry(walk.key)
    if entry.program is None and (not entry.seen or not entry.cacheable):
      cache.lowerings += 1  # a graph built once pays no trace
      entry.seen = True
      walk.key.forget_parts()
      return None
  if entry.program is None:
    cache.lowerings += 1
    if not _trace(entry, lowering, walk):
      walk.key.forget_parts()
      return None
  else:
    cache.hits += 1
  random_stream.restart_if_reseeded()  # tf.random.set_seed restarts the count, as uncached
  return _run(entry, lowering, walk)


def _whole_masters(mesh_to_impl: dict) -> bool:
  return all(getattr(impl, "masters", None) == "whole" for impl in mesh_to_impl.values())


def _trace(entry: _Entry, lowering, walk: _Walk) -> bool:
  """Lowers the graph inside a tf.function into entry.program; False if it cannot be traced."""
  class _Traced(type(lowering)):  # the Lowering being served (lowering.py imports this module)
    def _may_be_read(self, laid_out_value) -> bool:
      """Every tensor is an output of the program (its Lowering holds them all), so the fused
      device programs must keep every value."""
      del laid_out_value
      return True

  owned_slices = {}

  def slice_variable(name: str, shape, dtype, device: str):
    """An eager variable of the entry. The class itself, not tf.Variable, which tf.function would
    see as made by the trace and trace again."""
    if name not in owned_slices:
      with tf.init_scope(), tf.device(device):
        owned_slices[name] = resource_variable_ops.ResourceVariable(
            tf.zeros(shape, dtype), trainable=False, name=name)
    return owned_slices[name]

  def program(*inputs):
    fed = [(op, attribute, getattr(op, attribute)) for op, attribute in walk.inputs]
    try:
      for (op, attribute, _), x in zip(fed, inputs):
        setattr(op, attribute, x)
      with laid_out.slice_variable_owner(slice_variable):
        traced = _Traced(lowering.graph, lowering.mesh_to_impl, autostack=False)
    finally:
      for op, attribute, value in fed:
        setattr(op, attribute, value)
    entry.traced = traced
    # What the lowering itself recorded; forcing every output below may add allreduces of lazy
    # sums nobody exports (an eager lowering records those only when they are exported).
    entry.counters, entry.events = list(traced.counters), traced.communication_events
    entry.slices_per_tensor, outputs = [], []
    for t in walk.tensors:
      value = traced.tensors.get(t)
      slices = [] if value is None else value.to_laid_out_tensor().tensor_list
      entry.slices_per_tensor.append(len(slices) if value is not None else None)
      outputs.extend(slices)
    return outputs

  specs = [tf.TensorSpec(getattr(op, attribute).shape, getattr(op, attribute).dtype)
           for op, attribute in walk.inputs]
  try:
    entry.program = tf2.function(program, autograph=False).get_concrete_function(*specs)
  except Exception as e:  # pylint: disable=broad-except  # an op that only lowers eagerly
    tf.logging.info("Lowering cache: the graph cannot be traced (%s: %s); it is lowered eagerly.",
                    type(e).__name__, e)
    entry.cacheable, entry.program, entry.traced = False, None, None
    return False
  return True


def _run(entry: _Entry, lowering, walk: _Walk) -> Served:
  """Calls entry.program with this graph's imported tensors; its values keyed by this graph."""
  outputs = entry.program(*[getattr(op, attribute) for op, attribute in walk.inputs])
  traced = entry.traced
  tensors, i = {}, 0
  for t, n in zip(walk.tensors, entry.slices_per_tensor):
    if n is not None:
      tensors[t] = lowering.mesh_impl(t).LaidOutTensor(outputs[i:i + n])
      i += n
  mine = dict(zip(traced.graph.operations, walk.ops))  # the traced graph's ops -> this graph's
  return Served(tensors=tensors,
                operations={mine[op]: None for op in traced.operations},  # eager ops return None
                variables={mine[v]: laid_out_variable for v, laid_out_variable in traced.variables.items()},
                counters=entry.counters, events=entry.events)


class _Walk:
  """A graph's structure key, its fed attributes (op, name) and its ops' outputs, in graph order.

  `key` is None when some attribute cannot be keyed (the graph is then lowered every time).
  """

  def __init__(self, graph, mesh_to_impl: dict):
    self.ops = list(graph.operations)
    self.tensors = [t for op in self.ops for t in op.outputs]
    self.inputs = []
    self._numbers = {}  # id(object) -> its number in this walk (ops, tensors, meshes: the graph's)
    try:
      self.key = _Key((_context_key(),
                       tuple(self._impl(mesh, impl) for mesh, impl in mesh_to_impl.items()),
                       tuple(self._op(op) for op in self._all_ops(self.ops))))
    except (_Unkeyable, TypeError):  # TypeError: an unhashable value
      self.key = None

  @staticmethod
  def _all_ops(ops):
    for op in ops:
      yield op
      yield from op.nested_operations()  # itself recursive

  def _number(self, obj) -> int:
    numbers = self._numbers
    return numbers.setdefault(id(obj), len(numbers))

  def _impl(self, mesh, impl) -> tuple:
    config = tuple((name, self._value(value, 0)) for name, value in sorted(vars(impl).items())
                   if name not in _IMPL_STATE)
    return ("mesh", self._number(mesh), type(impl), config)

  def _op(self, op) -> tuple:
    cls = type(op)
    fed, skipped = _op_class_attributes(cls)
    parts = [cls, self._number(op)]
    tensor, value_key = self._tensor, self._value
    for name, value in vars(op).items():
      if name in skipped:
        continue
      if type(value) is list and (name == "_inputs" or name == "_outputs"):  # the commonest: tensors
        parts.append((name, (list,) + tuple(tensor(v) if type(v) is Tensor else value_key(v, 1)
                                            for v in value)))
      elif name in fed and isinstance(value, tf.Tensor):
        self.inputs.append((op, name))
        parts.append((name, "input", tuple(value.shape.as_list()), value.dtype.name))
      else:
        parts.append((name, value_key(value, 0)))
    return tuple(parts)

  def _tensor(self, t: Tensor) -> tuple:
    """Its number, shape and dtype, in types Python hashes and compares without calling back."""
    numbers = self._numbers
    return ("tensor", numbers.setdefault(id(t), len(numbers)), tuple(t._shape._dims), t._dtype.name)

  def _value(self, value, depth: int):  # noqa: C901 (one case per kind of attribute)
    """A hashable stand-in for an attribute value: equal stand-ins lower alike.

    The commonest kinds (an op's input and output lists, its dimension name sets) come first.
    """
    cls = type(value)
    if value is None or cls is str or cls is bytes:
      return value
    if cls is Tensor:
      return self._tensor(value)
    if cls is list or cls is tuple:
      return (cls,) + tuple(self._tensor(v) if type(v) is Tensor else self._value(v, depth + 1)
                            for v in value)
    if cls is frozenset and all(type(v) is str for v in value):
      return value
    if cls is Mesh:
      return ("mesh", self._number(value))
    if cls is types.FunctionType and value.__module__.startswith(_LIBRARIES):
      return value  # a library's function (tf.negative, ...): the same object at every call
    if isinstance(value, (bool, int, float, complex)):
      return (cls, value)
    if depth > _MAX_DEPTH:
      return _Same(value)
    if isinstance(value, Tensor):
      return self._tensor(value)
    if isinstance(value, Operation):
      return ("op", self._number(value))
    if isinstance(value, Mesh):
      return ("mesh", self._number(value))
    if isinstance(value, (list, tuple)):
      return (cls,) + tuple(self._value(v, depth + 1) for v in value)
    if isinstance(value, (set, frozenset)):
      return frozenset(self._value(v, depth + 1) for v in value)
    if isinstance(value, dict):
      return ("dict",) + tuple((self._value(k, depth + 1), self._value(v, depth + 1))
                               for k, v in value.items())
    if isinstance(value, np.ndarray | np.generic):
      return _array_key(np.asarray(value))
    if isinstance(value, tf.Tensor):  # eager: a value captured by the program
      small = value.shape.num_elements() <= _MAX_ELEMENTS_BY_VALUE
      return _array_key(value.numpy()) if small else _Same(value)
    if isinstance(value, tf2.Variable):  # (tf.compat.v1.Variable is another class)
      return _Same(value)
    if isinstance(value, tf.DType):
      return value.name
    if isinstance(value, types.FunctionType):
      cells = tuple(self._value(_cell(c), depth + 1) for c in value.__closure__ or ())
      return (value.__code__, self._value(value.__defaults__, depth + 1),
              self._value(value.__kwdefaults__, depth + 1), cells)
    if isinstance(value, functools.partial):
      return ("partial", self._value(value.func, depth + 1), self._value(value.args, depth + 1),
              self._value(value.keywords, depth + 1))
    if isinstance(value, types.MethodType):
      return ("method", self._value(value.__func__, depth + 1), self._value(value.__self__, depth + 1))
    if _has_value_equality(value):
      return value  # Shape, LayoutRules, Signature, ...: equal values lower alike
    if hasattr(value, "__dict__") and cls.__module__.startswith("mesh_tensorflow."):
      return (cls,) + tuple((k, self._value(v, depth + 1)) for k, v in vars(value).items())
    return _Same(value)


@functools.cache
def _op_class_attributes(cls) -> tuple:
  """(fed, skipped) attribute names of an op class: the TF tensors fed to its program, and those
  left out of the key (its own lowering_cache_ignores and _NOT_STRUCTURE)."""
  return (frozenset(getattr(cls, "lowering_cache_inputs", ())),
          frozenset(getattr(cls, "lowering_cache_ignores", ())) | _NOT_STRUCTURE)


class _Key:
  """A structure key with its hash computed once (a dict lookup would hash the tuple again).

  An entry without a program keeps only its key's hash (`forget_parts`): a key holds tens of
  thousands of tuples for a large graph, and keeping them for every graph seen once makes the
  collector's full passes over TF's half a million objects come sooner (one took 0.4 s in
  GPT-Neo's test_sampling). A key then equals one of the same hash; two structures of one
  64-bit hash would only mean that the second is traced at its first lowering, since a traced
  entry keeps its whole key (the one it was traced for) and is served only to equal structures.
  """

  __slots__ = ("parts", "_hash")

  def __init__(self, parts: tuple):
    self.parts = parts
    self._hash = hash(parts)

  def forget_parts(self) -> None:
    self.parts = None

  def __eq__(self, other):
    if not isinstance(other, _Key) or self._hash != other._hash:
      return False
    return self.parts is None or other.parts is None or self.parts == other.parts

  def __hash__(self):
    return self._hash


def _context_key() -> tuple:
  """What a lowering reads besides the graph: the graph seed, MTF_SEQUENCE_MODE."""
  return (random_stream.graph_random_seed(), sequence_mode())


class _Unkeyable(Exception):
  pass


class _Same:
  """Stands for an object by identity, through a weak reference where it takes one.

  An entry's key must neither keep a graph's variables alive (a client that makes new variables
  at every call would have the cache hold every set) nor match an object that merely reuses a
  dead one's id: a dead reference equals nothing.
  """

  __slots__ = ("_ref", "_id")

  def __init__(self, obj):
    try:
      self._ref = weakref.ref(obj)
    except TypeError:  # no weak references: held (an entry holds it until it is evicted)
      self._ref = lambda: obj
    self._id = id(obj)

  def __eq__(self, other):
    mine = self._ref()
    return isinstance(other, _Same) and mine is not None and other._ref() is mine

  def __hash__(self):
    return self._id


def _cell(cell):
  try:
    return cell.cell_contents
  except ValueError:  # an empty cell (a closure variable not assigned yet)
    return None


def _array_key(array: np.ndarray) -> tuple:
  if array.dtype == object:
    raise _Unkeyable()
  digest = hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=16).digest()
  return ("array", array.dtype.str, array.shape, digest)


def _has_value_equality(value) -> bool:
  cls = type(value)
  return cls.__eq__ is not object.__eq__ and cls.__hash__ is not None and cls.__hash__ is not object.__hash__
