"""Variables without a whole master: `PlacementMeshImpl(..., masters="sliced")`.

With the default `masters="whole"`, every mtf variable has a whole master tf.Variable on the
master device, which checkpoints hold, beside one slice variable per processor. With
`masters="sliced"` the slices are the variable. Of the processors holding the same slice, one
(chosen by the variable's name, so replicated variables spread over their holders) holds the
slice's *part*: the tf.Variable checkpointed as a part of the whole variable with TF's
`SaveSliceInfo`, as partitioned variables are. `tf.train.Saver` therefore writes and reads every
variable whole, under its usual name, shape and dtype, and a checkpoint restores under any layout
and in either mode.

* With share_replicas (CPU devices of one process, PlacementMeshImpl's default there) the
  processors holding the same slice all use its part: one variable per distinct slice, and one
  read of it, so what follows from it is computed once (as whole masters' shared replicas).
* The parts take the master's place in its collections (GLOBAL_VARIABLES, TRAINABLE_VARIABLES,
  ...), so savers and initialisers built after the lowering see them; the master tf.Variable made
  with the mtf Variable is never initialised (it holds no memory; an eager one is dropped).
* A part is initialised with its slice of the whole initial value: the same values as the master
  would have (the initializer runs once, whole, during initialisation).
* A part of another dtype than the master's (bfloat16 slices of a float32 variable) is
  checkpointed in the master's dtype by a `CastPart`, a SaveableObject that casts it on saving
  and restoring and stands in the collections for it; no float32 copy is kept.
* `copy_master_to_slices` copies each part into the other slices equal to it (after initialising
  or restoring, as with whole masters); `copy_slices_to_master` has nothing to do: the parts are
  slices that training updates.
* `Variable.get_master()` is then the whole value assembled from the parts (a tf.Tensor), and
  `assign_to_master(value)` writes `value` into every slice and part.
* A StackedVariable (autostack) has separate slices and parts per stacked variable, read as one
  stacked tensor and assigned through an unstack, so checkpoints keep the stacked names.
"""

from __future__ import annotations

import tensorflow as tf2
import tensorflow.compat.v1 as tf
from mesh_tensorflow._tf_compat import saveable_object, saveable_object_util

from mesh_tensorflow._lowering import laid_out


class SlicedLaidOutVariable(laid_out.LaidOutVariable):
  """One slice variable per processor and no whole master; parts of them are checkpointed."""

  def __init__(self, variable, mesh_impl):
    self._variable = variable
    self._mesh_impl = mesh_impl
    originals = getattr(variable, "originals", None)
    self._stacked = originals is not None
    if self._stacked and mesh_impl.slice_shape(variable.shape)[0] != len(originals):
      raise ValueError(f"Variable {variable.name!r}: masters='sliced' cannot split the 'stacked' "
                       f"dimension of stacked variables; remove the layout rule splitting it.")
    # A second lowering of the same graph (in the same TF graph) reuses the slices and parts.
    with tf.variable_scope(tf.get_variable_scope(), reuse=tf.AUTO_REUSE):
      self._pieces = [_SlicedVariable(v, mesh_impl) for v in originals or [variable]]
    self._build_copies(mesh_impl, self._copy_parts_to_slices, self._copy_slices_to_parts)
    self._reads = self.read().tensor_list
    self._laid_out_tensor = mesh_impl.LaidOutTensor(self._reads)

  @property
  def slice_is_master(self) -> bool:
    return False

  @property
  def saveables(self) -> dict:
    """{checkpoint name: its parts as SaveableObjects}: a var_list for a tf.compat.v1 Saver in
    eager mode, where there are no collections and a Saver cannot take sliced variables."""
    return {piece.name: piece.saveables() for piece in self._pieces}

  def read(self):
    """A fresh read of every slice (stacked variables: the stack of their pieces' slices).

    Processors sharing their slice variables get the same read, so what they compute from it is
    computed once.
    """
    reads, read_of = [], {}
    for pnum, device in enumerate(self._mesh_impl.devices):
      key = self._slice_variables_of(pnum)
      if key not in read_of:
        pieces = []
        for piece in self._pieces:
          with tf.device(piece.slices[pnum].device):
            pieces.append(piece.slices[pnum].read_value())
        with tf.device(device):
          read_of[key] = tf.stack(pieces) if self._stacked else pieces[0]
      reads.append(read_of[key])
    return self._mesh_impl.LaidOutTensor(reads)

  def assign_to_slices(self, assign_fn, values):
    """tf.group of assign_fn(mtf_variable, slice_variable, value) per slice variable (and piece).

    Processors sharing slice variables hold equal values (mtf gives every replica of a tensor the
    same value), so the first one's is assigned. In graph mode the assignments wait for this
    step's reads of the slices.
    """
    ops, assigned = [], set()
    with tf.control_dependencies(None if tf.executing_eagerly() else self._reads):
      for pnum, value in enumerate(getattr(values, "tensor_list", values)):
        key = self._slice_variables_of(pnum)
        if key in assigned:
          continue
        assigned.add(key)
        with tf.device(self._mesh_impl.devices[pnum]):
          pieces = tf.unstack(value) if self._stacked else [value]
        for piece, v in zip(self._pieces, pieces):
          with tf.device(piece.slices[pnum].device):
            ops.append(assign_fn(self._variable, piece.slices[pnum], v))
    return tf.group(ops)

  def _slice_variables_of(self, pnum: int) -> tuple:
    return tuple(id(piece.slices[pnum]) for piece in self._pieces)

  def _copy_parts_to_slices(self):
    return tf.group([piece.copy_parts_to_slices() for piece in self._pieces])

  @staticmethod
  def _copy_slices_to_parts():
    return tf.no_op()  # the parts are slices


class _SlicedVariable:
  """One checkpointed variable's slices and parts: the holder its mtf Variable's master is.

  Args:
    variable: an mtf Variable (not stacked), whose master tf.Variable this replaces.
    mesh_impl: the PlacementMeshImpl it is lowered on.
  """

  def __init__(self, variable, mesh_impl):
    self._variable = variable
    self._mesh_impl = mesh_impl
    self.name = variable.name  # the checkpoint name
    shape = variable.shape
    slice_shape = mesh_impl.slice_shape(shape)
    devices = mesh_impl.devices
    where = mesh_impl.variable_policy.parts_of(variable, mesh_impl)  # `variable_policy.py`
    self._part_pnum = where.part_of
    initial_parts = _InitialParts(variable, mesh_impl)

    def new_variable(name, pnum, dtype, initialised):
      if not initialised:  # a replica: copy_masters_to_slices gives it its part's value
        return laid_out.slice_variable(name, slice_shape, dtype, devices[pnum])
      with tf.device(devices[pnum]):
        return tf.get_variable(
            name, slice_shape, dtype=dtype, collections=[], trainable=False, use_resource=True,
            initializer=initial_parts.initializer(pnum))

    # With share_replicas the processors holding a slice share its part; else each has a variable.
    own = {pnum: new_variable("%s_slice_%d" % (variable.name, pnum), pnum, where.slice_dtype,
                              self._part_pnum[pnum] == pnum)
           for pnum in where.holders}
    self.slices = [own[owner] for owner in where.owners]
    self._own_pnums = where.holders  # the processors holding a slice variable, each variable once
    self.parts = {pnum: self.slices[pnum] for pnum in where.parts}  # each slice's part
    self._checkpointed = []  # what stands in the master's collections: a part or its CastPart
    for pnum in where.parts:
      info = tf2.Variable.SaveSliceInfo(
          variable.name, shape.to_integer_list, mesh_impl.slice_begin(shape, pnum), slice_shape)
      if where.cast_on_save:
        self._checkpointed.append(CastPart(self.parts[pnum], info, where.checkpoint_dtype))
      else:
        self.parts[pnum]._set_save_slice_info(info)  # pylint: disable=protected-access
        self._checkpointed.append(self.parts[pnum])
    master = variable.replace_master(self)
    if master is not None and not tf.executing_eagerly():
      _replace_in_collections(master, self._checkpointed)

  def saveables(self) -> list:
    """The parts as SaveableObjects (for a Saver given them by hand)."""
    return [p if isinstance(p, CastPart) else saveable_object_util.ResourceVariableSaveable(
        p, p._save_slice_info.spec, self.name) for p in self._checkpointed]  # pylint: disable=protected-access

  def copy_parts_to_slices(self):
    """Each slice takes the value of its part (if it is not the part itself)."""
    ops = []
    for pnum, (device, slice_var) in enumerate(zip(self._mesh_impl.devices, self.slices)):
      part = self.parts[self._part_pnum[pnum]]
      if part is not slice_var:
        with tf.device(device):
          ops.append(slice_var.assign(tf.cast(part.read_value(), slice_var.dtype), read_value=False))
    return tf.group(ops)

  def master_value(self):
    """The whole value in master_dtype, assembled from the parts (what a save now would write)."""
    reads = {}
    for pnum, part in self.parts.items():
      with tf.device(self._mesh_impl.devices[pnum]):
        reads[pnum] = tf.cast(part.read_value(), self._variable.master_dtype)
    every = [reads[self._part_pnum[pnum]] for pnum in range(len(self.slices))]
    return self._mesh_impl.combine_slices(every, self._variable.shape)

  def assign_master(self, value):
    """Writes the whole `value` into every slice and every part."""
    per_pnum = self._mesh_impl.master_parts(tf.convert_to_tensor(value), self._variable.shape)
    ops = []
    for pnum in self._own_pnums:
      target = self.slices[pnum]
      with tf.device(self._mesh_impl.devices[pnum]):
        ops.append(target.assign(tf.cast(per_pnum[pnum], target.dtype), read_value=False))
    return tf.group(ops)


class _InitialParts:
  """Per processor, its slice of the variable's whole initial value, computed once when asked for.

  Graph mode: the initial value of the master tf.Variable made with the mtf Variable (its
  initializer, seeded as it was then); eager mode: that master's value (or the whole value of an
  earlier lowering's slices).
  """

  def __init__(self, variable, mesh_impl):
    self._variable = variable
    self._mesh_impl = mesh_impl
    self._parts = None

  def initializer(self, pnum: int):
    def init(shape, dtype=None, **kwargs):
      del shape, kwargs  # the part's
      value = self._slices()[pnum]
      return value if dtype is None else tf.cast(value, dtype)
    return init

  def _slices(self) -> list:
    if self._parts is None:
      master = self._variable.get_master()
      if isinstance(master, tf2.Variable):  # every kind (tf.compat.v1.Variable is a subclass)
        master = master.read_value() if tf.executing_eagerly() else master.initial_value
      self._parts = self._mesh_impl.master_parts(master, self._variable.shape)
    return self._parts


class CastPart(saveable_object.SaveableObject):
  """A part held in the slice dtype, checkpointed in the master dtype: cast on save and restore.

  It stands for the part in the master's collections (GLOBAL_VARIABLES, ...), so it also answers
  what initialisers, ready checks and checkpoint tools ask of a variable there: its initializer,
  is_initialized, op, shape and SaveSliceInfo. Its dtype is the checkpoint's.
  """

  def __init__(self, part, save_slice_info, master_dtype):
    self._part = part
    self._save_slice_info = save_slice_info
    self._master_dtype = master_dtype

    def saved_value():
      with tf.device(part.device):
        return tf.cast(part.read_value(), master_dtype)
    spec = saveable_object.SaveSpec(saved_value, save_slice_info.spec, save_slice_info.full_name,
                                    dtype=master_dtype, device=part.device)
    super().__init__(part, [spec], part.name.rsplit(":", 1)[0])

  def restore(self, restored_tensors, restored_shapes):
    value = restored_tensors[0]
    if restored_shapes is not None:
      value = tf.reshape(value, restored_shapes[0])
    with tf.device(self._part.device):
      return self._part.assign(tf.cast(value, self._part.dtype), read_value=False)

  @property
  def dtype(self):
    return self._master_dtype

  @property
  def shape(self):
    return self._part.shape

  @property
  def initializer(self):
    return self._part.initializer

  def is_initialized(self, name=None):
    return self._part.is_initialized(name=name)


def _replace_in_collections(master, parts: list) -> None:
  """Puts `parts` in the master's place in every collection of its graph that holds it."""
  graph = master.graph
  for key in graph.get_all_collection_keys():
    members = graph.get_collection_ref(key)
    if any(m is master for m in members):
      members[:] = [p for m in members for p in (parts if m is master else [m])]
