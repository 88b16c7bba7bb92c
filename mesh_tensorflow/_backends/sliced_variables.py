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

import numpy as np
import tensorflow as tf2
import tensorflow.compat.v1 as tf
from mesh_tensorflow._tf_compat import saveable_object, saveable_object_util

from mesh_tensorflow._lowering import laid_out


class SlicedLaidOutVariable(laid_out.LaidOutVariable):
  """One slice variable per processor and no whole master; parts of them are checkpointed."""

  def __init__(self, variable, mesh_impl):
    self._variable = variable
    self._mesh_impl = mesh_impl
    originals = None if variable.is_layer_stack else getattr(variable, "originals", None)
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
    self.name = variable.name  # the checkpoint name (a layer stack's parts save its layers' names)
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
      if variable.is_layer_stack:
        self._checkpointed.append(LayerStackPart(self.parts[pnum], variable, mesh_impl, pnum))
        continue
      info = tf2.Variable.SaveSliceInfo(
          variable.name, shape.to_integer_list, mesh_impl.slice_begin(shape, pnum), slice_shape)
      if where.cast_on_save:
        self._checkpointed.append(CastPart(self.parts[pnum], info, where.checkpoint_dtype))
      else:
        self.parts[pnum]._set_save_slice_info(info)  # pylint: disable=protected-access
        self._checkpointed.append(self.parts[pnum])
    master = variable.replace_master(self)
    # A layer stack's checkpoint names are its per-layer variables': their masters retire.
    retired = ([v.replace_master(_StackMember(self, i)) for i, v in enumerate(variable.originals)]
               if variable.is_layer_stack else [master])
    if not tf.executing_eagerly():
      for n, master in enumerate(m for m in retired if m is not None):
        _replace_in_collections(master, self._checkpointed if n == 0 else [])

  @property
  def variable(self):
    """The mtf Variable whose master this holds."""
    return self._variable

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
      self._parts = self._mesh_impl.master_parts(_initial_value(self._variable), self._variable.shape)
    return self._parts


def _initial_value(variable):
  """The whole initial value of an mtf Variable's master (a layer stack's: its layers', stacked)."""
  if variable.is_layer_stack:
    return tf.reshape(tf.stack([_initial_value(v) for v in variable.originals]),
                      variable.shape.to_integer_list)
  master = variable.get_master()
  if isinstance(master, tf2.Variable):  # every kind (tf.compat.v1.Variable is a subclass)
    return master.read_value() if tf.executing_eagerly() else master.initial_value
  return master


class _PartStandIn(saveable_object.SaveableObject):
  """A SaveableObject standing for a part in the master's collections (GLOBAL_VARIABLES, ...): it
  also answers what initialisers, ready checks and checkpoint tools ask of a variable there (its
  initializer, is_initialized, op, shape). Its dtype is the checkpoint's."""

  def __init__(self, part, specs: list, master_dtype):
    self._part = part
    self._master_dtype = master_dtype
    super().__init__(part, specs, part.name.rsplit(":", 1)[0])

  def _saved_value(self, index=()):
    def value():
      with tf.device(self._part.device):
        return tf.cast(self._part.read_value()[index], self._master_dtype)
    return value

  def _assign(self, value):
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


class CastPart(_PartStandIn):
  """A part held in the slice dtype, checkpointed in the master dtype: cast on save and restore.

  Its SaveSliceInfo is the part's place in the whole variable.
  """

  def __init__(self, part, save_slice_info, master_dtype):
    self._save_slice_info = save_slice_info
    self._part, self._master_dtype = part, master_dtype  # _saved_value reads them
    spec = saveable_object.SaveSpec(self._saved_value(), save_slice_info.spec, save_slice_info.full_name,
                                    dtype=master_dtype, device=part.device)
    super().__init__(part, [spec], master_dtype)

  def restore(self, restored_tensors, restored_shapes):
    value = restored_tensors[0]
    if restored_shapes is not None:
      value = tf.reshape(value, restored_shapes[0])
    return self._assign(value)


class LayerStackPart(_PartStandIn):
  """A layer stack's part, checkpointed as the parts of the per-layer variables it holds.

  A processor's slice of a LayerStackVariable [stages(, stage_layers)] + shape holds some
  layers' weights (or parts of them): each is saved under its layer's variable name, as the
  unstacked model saves it, so a checkpoint moves between pipelined and unpipelined models.
  `save_slice_infos` lists them (one per layer held), for checkpoint checks.
  """

  def __init__(self, part, variable, mesh_impl, pnum: int):
    rank = len(variable.stack_dims)
    begin = mesh_impl.slice_begin(variable.shape, pnum)
    slice_shape = mesh_impl.slice_shape(variable.shape)
    stack_sizes = [d.size for d in variable.stack_dims]
    layer_shape = variable.originals[0].shape.to_integer_list
    self._slice_shape, self._layer_slice_shape = slice_shape, slice_shape[rank:]
    self.save_slice_infos, specs = [], []
    for local in np.ndindex(*slice_shape[:rank]):
      layer = int(np.ravel_multi_index([b + i for b, i in zip(begin, local)], stack_sizes))
      info = tf2.Variable.SaveSliceInfo(variable.originals[layer].name, layer_shape, begin[rank:],
                                        slice_shape[rank:])
      self.save_slice_infos.append(info)
      specs.append((local, info))
    self._part, self._master_dtype = part, variable.master_dtype  # _saved_value reads them
    super().__init__(part, [
        saveable_object.SaveSpec(self._saved_value(local), info.spec, info.full_name,
                                 dtype=variable.master_dtype, device=part.device)
        for local, info in specs], variable.master_dtype)

  def restore(self, restored_tensors, restored_shapes):
    del restored_shapes
    pieces = [tf.reshape(t, self._layer_slice_shape) for t in restored_tensors]
    return self._assign(tf.reshape(tf.stack(pieces), self._slice_shape))


class _StackMember:
  """The master holder of a layer of a sliced layer stack: that layer's piece of the stack."""

  def __init__(self, stack_holder: _SlicedVariable, index: int):
    self._stack_holder = stack_holder
    self._index = index

  def _layers(self, whole):
    variable = self._stack_holder.variable
    return tf.reshape(whole, [len(variable.originals)] + variable.originals[0].shape.to_integer_list)

  def master_value(self):
    return self._layers(self._stack_holder.master_value())[self._index]

  def assign_master(self, value):
    layers = tf.unstack(self._layers(self._stack_holder.master_value()))
    layers[self._index] = tf.convert_to_tensor(value)
    return self._stack_holder.assign_master(tf.reshape(tf.stack(layers),
                                                       self._stack_holder.variable.shape.to_integer_list))


def _replace_in_collections(master, parts: list) -> None:
  """Puts `parts` in the master's place in every collection of its graph that holds it."""
  graph = master.graph
  for key in graph.get_all_collection_keys():
    members = graph.get_collection_ref(key)
    if any(m is master for m in members):
      members[:] = [p for m in members for p in (parts if m is master else [m])]
