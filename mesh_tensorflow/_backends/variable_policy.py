"""Which TF variables exist where: the one decision behind the placement backends' variables.

`PlacementMeshImpl` (and `CollectiveMeshImpl`) take three options that decide the TF variables
an mtf Variable becomes: `masters` ("whole": a master tf.Variable beside the slices; "sliced":
none, the slices are checkpointed as parts), `master_as_slice` (a whole master is also a
processor's slice) and `share_replicas` (processors holding equal slices share one variable).
`VariablePolicy` holds them, resolved, and `VariablePolicy.parts_of` answers, for one variable,
which processor holds a slice variable, which processors read another's, which one's slice is
the master itself, which slice variables are checkpointed as parts, and in which dtype.
`placement.py` builds whole masters' slices from that answer, `sliced_variables.py` the parts,
and the device program shares the computations of shared replicas under the same
`share_replicas`.
docs/architecture.md ("Which variables exist where") tabulates the outcomes.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow._tf_compat import resource_variable_ops

MASTERS = ("whole", "sliced")  # PlacementMeshImpl(masters=...)


@dataclasses.dataclass(frozen=True)
class VariableParts:
  """The TF variables of one mtf Variable on one mesh, per processor this program holds.

  Processors are local indices (positions in the mesh impl's `devices`).

  Attributes:
    owners: per processor, the processor whose slice variable it reads (itself: it holds one).
    master_pnum: with whole masters, the processor whose slice variable is the master (None:
      every holder has a slice variable of its own beside the master).
    slice_is_master: the only processor's slice is the master: no slice variable, no copies.
    part_of: with sliced masters, per processor, the processor whose slice variable is the
      checkpointed part of its slice (one per distinct slice); () with whole masters.
    slice_dtype: the dtype of the slice variables (and parts).
    checkpoint_dtype: the dtype checkpoints hold (the master dtype).
  """

  owners: tuple
  master_pnum: Optional[int]
  slice_is_master: bool
  part_of: tuple
  slice_dtype: tf.DType
  checkpoint_dtype: tf.DType

  @property
  def holders(self) -> list:
    """The processors holding a slice variable (or the master as theirs), in order."""
    return sorted(set(self.owners))

  @property
  def parts(self) -> list:
    """The processors holding a checkpointed part, in the order of the slices' first holders."""
    return list(dict.fromkeys(self.part_of))

  @property
  def cast_on_save(self) -> bool:
    """Parts in another dtype than the checkpoint's are saved and restored through a CastPart."""
    return bool(self.part_of) and self.slice_dtype != self.checkpoint_dtype


@dataclasses.dataclass(frozen=True)
class VariablePolicy:
  """The variable options of a placement-style mesh impl, resolved (see the module docstring).

  Args:
    masters: "whole" or "sliced".
    master_as_slice: a variable the layout leaves whole uses its master as the slice of the
      processor on the master's device (whole masters only).
    share_replicas: processors holding equal slices share the first one's slice variable (with
      sliced masters: the part's).

  Raises:
    ValueError: an unknown `masters`, or master_as_slice with masters="sliced".
  """

  masters: str = "whole"
  master_as_slice: bool = False
  share_replicas: bool = False

  def __post_init__(self):
    if self.masters not in MASTERS:
      raise ValueError(f"PlacementMeshImpl: masters={self.masters!r}; expected one of {MASTERS}.")
    if self.masters == "sliced" and self.master_as_slice:
      raise ValueError("PlacementMeshImpl: master_as_slice=True applies to whole masters; "
                       "masters='sliced' keeps no master to use as a slice. Pass one of them.")

  def parts_of(self, variable, mesh_impl) -> VariableParts:
    """The TF variables `variable` (an mtf Variable) becomes on `mesh_impl`, per processor.

    Args:
      variable: the mtf Variable (its shape, name, dtypes, master and master device).
      mesh_impl: the PlacementMeshImpl it is lowered on (its layout and devices).

    Returns:
      A VariableParts.
    """
    shape = variable.shape
    begins = [tuple(mesh_impl.slice_begin(shape, pnum)) for pnum in mesh_impl.local_pnums]
    dtypes = dict(slice_dtype=variable.slice_dtype, checkpoint_dtype=variable.master_dtype)
    if self.masters == "sliced":
      part_of = _part_holders(begins, variable.name)
      owners = part_of if self.share_replicas else tuple(range(len(begins)))
      return VariableParts(owners, None, False, part_of, **dtypes)
    whole = mesh_impl.slice_shape(shape) == shape.to_integer_list
    master_pnum = self._processor_holding_master(variable, mesh_impl, whole)
    if self.share_replicas:
      first = {} if master_pnum is None else {begins[master_pnum]: master_pnum}
      owners = tuple(first.setdefault(begin, i) for i, begin in enumerate(begins))
    else:
      owners = tuple(range(len(begins)))
    slice_is_master = mesh_impl.size == 1 and master_pnum == 0
    return VariableParts(owners, master_pnum, slice_is_master, (), **dtypes)

  def _processor_holding_master(self, variable, mesh_impl, whole: bool) -> Optional[int]:
    """The processor whose slice can be the master variable itself, or None.

    That needs a whole (unsplit), unstacked slice of the master's dtype on the master's device;
    with several processors, master_as_slice and a resource master, whose reads are snapshots
    that later assignments cannot change. Without master_as_slice, only a one-processor mesh on
    the master's own device uses it.
    """
    master_device = getattr(variable, "master_device", None) or ""
    if not whole or variable.master_dtype != variable.slice_dtype or getattr(variable, "is_stacked", False):
      return None
    if not self.master_as_slice:
      return 0 if mesh_impl.size == 1 and mesh_impl.devices[0] in ("", master_device) else None
    master = variable.get_master()
    if mesh_impl.size > 1 and not isinstance(master, resource_variable_ops.BaseResourceVariable):
      return None
    for pnum, device in enumerate(mesh_impl.devices):
      if device == "" or (master_device and _canonical(device) == _canonical(master_device)):
        return pnum
    return None


def _part_holders(begins: list, name: str) -> tuple:
  """Per processor, the holder of its slice's part: among the processors holding that slice, the
  one the variable's name picks (so replicated variables spread their parts over the holders)."""
  holders = {}
  for pnum, begin in enumerate(begins):
    holders.setdefault(begin, []).append(pnum)
  pick = zlib.crc32(name.encode())
  return tuple(holders[begin][pick % len(holders[begin])] for begin in begins)


def _canonical(device: str) -> tuple:
  """(job, replica, task, type, index); eager's "/job:localhost/replica:0/task:0" means unqualified."""
  spec = tf.DeviceSpec.from_string(device)
  where = (None, None, None) if spec.job == "localhost" else (spec.job, spec.replica, spec.task)
  return where + (spec.device_type, spec.device_index)
