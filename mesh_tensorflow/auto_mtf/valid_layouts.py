"""Which tensor dimensions may be split over which mesh dimensions (upstream `auto_mtf.valid_layouts`)."""

from __future__ import annotations

import math

from mesh_tensorflow._core.dims import convert_to_shape


def _is_anonymous(name: str) -> bool:
  return name.startswith("_anonymous_")


class LayoutValidator:
  """Answers "may dimension d be split over mesh dimension m?" for one graph and mesh shape.

  A dimension is splittable if it is named (not anonymous) and no op declares it unsplittable; it
  may go on a mesh dimension whose size divides every size the dimension has in the graph.
  """

  def __init__(self, mtf_graph, mesh_shape):
    names, unsplittable, gcd = set(), set(), {}
    for op in mtf_graph.operations:
      unsplittable.update(op.unsplittable_dims)
      for t in op.outputs:
        for d in t.shape.dims:
          gcd[d.name] = math.gcd(gcd.get(d.name, 0), d.size)
          if not _is_anonymous(d.name):
            names.add(d.name)
    self._splittable = names - unsplittable
    self._size_gcd = gcd
    self._mesh_sizes = {d.name: d.size for d in convert_to_shape(mesh_shape).dims}

  @property
  def splittable_mtf_dimension_names(self) -> set:
    return set(self._splittable)

  @property
  def mesh_dimension_name_to_size(self) -> dict:
    return dict(self._mesh_sizes)

  @property
  def mtf_dimension_name_to_size_gcd(self) -> dict:
    """Per dimension name, the gcd of its sizes in the graph (what a mesh dimension must divide)."""
    return dict(self._size_gcd)

  def is_valid_assignment(self, mtf_dimension_name: str, mesh_dimension_name: str) -> bool:
    """True if the dimension is splittable and the mesh dimension's size divides all its sizes."""
    return (
      mtf_dimension_name in self._splittable
      and self._size_gcd[mtf_dimension_name] % self._mesh_sizes[mesh_dimension_name] == 0
    )
