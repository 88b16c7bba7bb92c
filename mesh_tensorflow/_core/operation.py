"""Operation: the node type of the lazy graph.

Each subclass keeps together its output-shape rule (constructor), its `lower(lowering)` and
its `gradient(grad_ys)`. The lowering engine only calls those; it knows nothing op-specific.
"""

from __future__ import annotations

import functools
from typing import Iterable, Optional

from mesh_tensorflow._core.errors import GradientNotImplementedError


class Operation:
  """Base class of every mtf op; appends itself to its mesh's graph on construction.

  A constructor that raises (a subclass rejecting its arguments) takes the op back out of the
  graph, so a rejected call leaves no half-built op behind.
  """

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if "__init__" in cls.__dict__:
      cls.__init__ = _unregister_on_failure(cls.__dict__["__init__"])

  def __init__(self, inputs, mesh=None, name: Optional[str] = None):
    inputs = list(inputs)
    if mesh is None:
      if not inputs:
        raise ValueError(f"Operation {name!r} has no inputs, so its mesh must be given explicitly.")
      mesh = inputs[0].mesh
    _check_same_mesh(name, inputs, mesh)
    self._inputs = inputs
    self._outputs = []
    self._mesh = mesh
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_splittable_and_unsplittable_dims("splittable"))
    assert name is not None, "every Operation needs a default name"
    self._name = mesh.graph.unique_name(name)
    for t in inputs:
      if not t.usable:
        raise ValueError(
            f"Operation {self._name!r} reads tensor {t.name!r}, which is internal to a "
            f"custom_gradient/recompute_grad block and may not be used outside it.")
    mesh.graph.operations.append(self)

  @property
  def graph(self):
    return self._mesh.graph

  @property
  def mesh(self):
    return self._mesh

  @property
  def name(self) -> str:
    return self._name

  @property
  def inputs(self) -> list:
    return self._inputs[:]

  @property
  def outputs(self) -> list:
    return self._outputs[:]

  @property
  def splittable_dims(self) -> frozenset:
    """Names of dimensions that may be split over a mesh dimension when lowering this op."""
    return self._splittable_dims

  @property
  def unsplittable_dims(self) -> frozenset:
    """Names of dimensions that must stay replicated when lowering this op."""
    return self._unsplittable_dims

  @property
  def layout_unsplittable_dims(self) -> frozenset:
    """The dims the layout check keeps whole: `unsplittable_dims`, unless an op overrides it.

    A few ops (conv back-prop, generic gradients) declare every dim splittable, as the original
    library did and as its tests read, yet can't lower a split spatial dim; they override this.
    """
    return self.unsplittable_dims

  @property
  def to_string(self) -> str:
    return "%s[Inputs=(%s) Outputs=(%s)]" % (
        type(self).__name__,
        ", ".join(t.to_string for t in self.inputs),
        ", ".join(t.to_string for t in self.outputs))

  def __repr__(self):
    return self.to_string

  @property
  def has_gradient(self):
    return ([t for t in self.inputs if t.dtype.is_floating]
            and [t for t in self.outputs if t.dtype.is_floating])

  def gradient(self, grad_ys):
    raise GradientNotImplementedError(
        f"{type(self).__name__} {self.name!r} has no gradient, but mtf.gradients needs one to "
        f"differentiate through it (a second-order gradient?). Differentiate a graph that does not "
        f"pass through it, or cut the path with mtf.stop_gradient.")

  def lower(self, lowering):
    raise NotImplementedError(f"{type(self).__name__} ({self.name!r}) has no lowering.")

  def unsplittable_reason(self, dim_name: str) -> str:
    """Why `dim_name` must stay whole on each processor here (and what to do instead).

    The layout check quotes it after "but"; ops override it with what they do along the dimension.
    """
    return f"{type(self).__name__} declares {dim_name!r} unsplittable"

  def nested_operations(self) -> list:
    """Ops lowered inside this one rather than by the graph walk (a while loop's body), recursively."""
    return []

  def _initialize_splittable_and_unsplittable_dims(
      self, default_splittability: str, exception_dims_iterable: Optional[Iterable[str]] = None):
    """(splittable, unsplittable) frozensets over all dim names of inputs and outputs.

    "splittable": every dim but the exceptions may be split; "unsplittable": only the exceptions.
    """
    default_dims = set()
    exception_dims = set(exception_dims_iterable or ())
    for t in self._inputs + self._outputs:
      default_dims.update(t.shape.dimension_names)
    default_dims -= exception_dims
    if default_splittability == "splittable":
      return frozenset(default_dims), frozenset(exception_dims)
    if default_splittability == "unsplittable":
      return frozenset(exception_dims), frozenset(default_dims)
    raise ValueError(
        f"default_splittability must be 'splittable' or 'unsplittable', got {default_splittability!r}.")

  def _initialize_all_dimensions_as_splittable(self):
    """(splittable, unsplittable) with every dimension splittable; callers assign the pair."""
    return self._initialize_splittable_and_unsplittable_dims("splittable")


def _check_same_mesh(name, inputs, mesh) -> None:
  for t in inputs:
    if t.mesh is not mesh:
      raise ValueError(
          f"Operation {name!r} combines tensors of different meshes: {t.name!r} is on "
          f"{t.mesh!r} but the op is on {mesh!r}. Move tensors between meshes explicitly "
          f"(export to TensorFlow and import into the other mesh).")


def _unregister_on_failure(init):
  """Wraps a subclass __init__: if it raises, the half-built op leaves its graph's lists."""
  @functools.wraps(init)
  def wrapped(self, *args, **kwargs):
    try:
      init(self, *args, **kwargs)
    except BaseException:
      _unregister(self)
      raise
  return wrapped


def _unregister(op) -> None:
  mesh = getattr(op, "_mesh", None)
  if mesh is None:  # rejected before the base constructor registered it
    return
  graph = mesh.graph
  for ops in (graph.operations, graph.all_variables, graph.trainable_variables):
    if any(o is op for o in ops):
      ops[:] = [o for o in ops if o is not op]
  for name in [n for n, v in graph.name_to_variable.items() if v is op]:
    del graph.name_to_variable[name]
