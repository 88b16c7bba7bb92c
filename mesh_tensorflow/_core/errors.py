"""Named errors of the core. Each subclasses the builtin type older code and tests expect."""

from __future__ import annotations

from typing import Optional


class DimensionSpecError(TypeError, ValueError):
  """Something that is not a Dimension where one is expected (a bare int or name, a bad pair).

  A TypeError (a bare int cannot be unpacked into name and size, as upstream raised) and a
  ValueError (the value itself is wrong), so callers catching either keep working.
  """


class LayoutError(ValueError):
  """A layout the graph cannot be lowered with. Carries the op, tensor dimension and mesh dimension."""

  def __init__(self, message: str, op=None, dimension: Optional[str] = None,
               mesh_dimension: Optional[str] = None):
    super().__init__(message)
    self.op = op
    self.dimension = dimension
    self.mesh_dimension = mesh_dimension


class UnsplittableDimensionError(LayoutError):
  """The layout splits a dimension that an op declares unsplittable."""


class LayoutRuleWarning(UserWarning):
  """A layout rule names a mesh dimension the mesh lacks but has a close name for: likely a typo.

  The rule does not apply (its tensor dimension stays replicated); filter this category to
  silence it, or turn it into an error with `warnings.simplefilter("error", mtf.LayoutRuleWarning)`.
  """


class BroadcastWarning(UserWarning):
  """An einsum output dimension is in no input, so the result is copied along it (0.1.21's meaning).

  Usually a mistake (a misnamed or forgotten dimension trains a wrong model), so einsum warns once
  per op unless the caller names the dimension in `broadcast_dims`. Filter this category to
  silence it, or make it an error with `warnings.simplefilter("error", mtf.BroadcastWarning)`.
  """


class GradientNotImplementedError(NotImplementedError):
  """mtf.gradients reached an op that has no gradient (e.g. a second-order gradient)."""
