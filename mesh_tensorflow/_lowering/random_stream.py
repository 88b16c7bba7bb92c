"""The evaluation counter that makes random ops draw fresh values at every evaluation.

Random ops hash (op key, evaluation number, loop iterations, element index) (see random_bits.py).
The evaluation number comes from an int64 counter that advances by one at each evaluation:

* in a tf.compat.v1 graph, a resource variable named `mtf_random_counter` (a global variable, so
  `tf.train.Saver` and mtf's checkpoints save it, and a resumed run continues the sequence an
  uninterrupted run would have drawn); one increment op per graph, which a `Session.run` runs
  once whatever it fetches, so every random op of that run reads the same number;
* inside a tf.function, the counter of the context the function is called from (a variable
  created outside the function), incremented once per call;
* eagerly, one increment per Lowering (each eager computation lowers anew); `tf.random.set_seed`
  restarts the count, as it restarts TF's own random sequences, so two processes (or two parts of
  one program) that set the same seed draw the same values.

The counter starts at 0 and needs no initialiser run: the increment initialises it if needed.
"""

from __future__ import annotations

import weakref

import tensorflow.compat.v1 as tf

from mesh_tensorflow import _tf_compat

COUNTER_NAME = "mtf_random_counter"
# The collection holding a graph's counter variable (a list of one).
COUNTER_COLLECTION = "mtf_random_counter"

_positions = weakref.WeakKeyDictionary()  # TF graph -> its increment's result (old value)


class _EagerCounter:
  """The eager counter, restarted whenever tf.random.set_seed installs a new seed generator."""

  variable = None
  seed_generator = None  # held, so that its identity is never reused


def next_position(graph=None):
  """This evaluation's number, an int64 scalar tensor.

  Args:
    graph: the TF graph random ops are built in (None when executing eagerly). Each graph has
      one increment op, shared by all its Lowerings; eagerly, every call increments.
  """
  if graph is None:
    return _increment(_counter())
  if graph not in _positions:
    with graph.as_default(), tf.control_dependencies(None), tf.name_scope(None):
      _positions[graph] = _increment(_counter())
  return _positions[graph]


def restart_if_reseeded() -> None:
  """Restarts the eager counter if tf.random.set_seed was called since it was last used.

  A cached eager lowering (`_lowering/cache.py`) reads the counter without that Python check.
  """
  if _EagerCounter.variable is not None:
    _eager_counter()


def graph_random_seed():
  """The graph-level seed set by tf.set_random_seed (graph or eager), or None."""
  if tf.executing_eagerly():
    return _tf_compat.context.global_seed()
  return tf.get_default_graph().seed


def graph_counter(graph):
  """The counter variable of a tf.compat.v1 graph, or None if no random op used one."""
  found = graph.get_collection(COUNTER_COLLECTION)
  return found[0] if found else None


def is_counter(variable) -> bool:
  """Whether `variable` is a graph's random counter."""
  return any(variable is c for c in variable.graph.get_collection(COUNTER_COLLECTION))


def _counter():
  """The counter of the outermost context (the graph a tf.function is traced from, or eager)."""
  with tf.init_scope():
    if tf.executing_eagerly():
      return _eager_counter()
    graph = tf.get_default_graph()
    counter = graph_counter(graph)
    if counter is None:
      with tf.control_dependencies(None), tf.name_scope(None):
        counter = tf.Variable(0, dtype=tf.int64, trainable=False, name=COUNTER_NAME,
                              use_resource=True,
                              collections=[tf.GraphKeys.GLOBAL_VARIABLES, COUNTER_COLLECTION])
    return counter


def _eager_counter():
  generator = _seed_generator()
  if _EagerCounter.variable is None:
    _EagerCounter.variable = tf.Variable(0, dtype=tf.int64, trainable=False, name=COUNTER_NAME)
  elif generator is not _EagerCounter.seed_generator:
    _EagerCounter.variable.assign(0)
  _EagerCounter.seed_generator = generator
  return _EagerCounter.variable


def _seed_generator():
  """The eager context's op-seed generator, which each tf.random.set_seed call replaces."""
  return getattr(_tf_compat.context.context(), "_rng", None)  # absent until a seed is set


def _increment(counter):
  """counter += 1, returning the value before; a graph's counter is initialised to 0 if need be."""
  if tf.executing_eagerly() or not hasattr(counter, "is_initialized") or _is_captured(counter):
    return counter.assign_add(1, read_value=True) - 1

  def initialised():
    return counter.assign_add(1, read_value=True) - 1

  def first_use():
    with tf.control_dependencies([counter.assign(1, read_value=False)]):
      return tf.constant(0, tf.int64)
  return tf.cond(counter.is_initialized(), initialised, first_use)


def _is_captured(counter) -> bool:
  """Whether the counter is an eager variable read from a tf.function (always initialised)."""
  return getattr(counter, "_in_graph_mode", True) is False
