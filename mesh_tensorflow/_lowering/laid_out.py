"""LaidOutTensor: a tensor's per-processor slices, as a backend holds them."""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Optional

import tensorflow.compat.v1 as tf
from mesh_tensorflow._tf_compat import resource_variable_ops


class LaidOutTensor:
  """A list of TF tensors, one per slice this program holds (all of them, or only its own).

  It may be *pending*: traced once into a backend's open device-program segment
  (`_backends/device_program.py`) and built on every device when its tensors are first asked
  for. Its slice shape and dtype are known without building it.
  """

  def __init__(self, tensor_list):
    self._tensor_list = list(tensor_list)
    self._pending = None  # (segment, traced tf.Tensor) until built

  @classmethod
  def pending(cls, segment, traced) -> LaidOutTensor:
    """A value of `segment`, traced as `traced`; segment.build_now(x) fills it on first use."""
    x = cls.__new__(cls)
    x._tensor_list = None
    x._pending = (segment, traced)
    return x

  @property
  def is_pending(self) -> bool:
    return self._pending is not None

  @property
  def pending_segment(self):
    return self._pending[0]

  @property
  def traced(self):
    """The traced tensor standing for every slice while pending."""
    return self._pending[1]

  def fill(self, tensor_list) -> None:
    """Called by the segment once the slices are built."""
    self._tensor_list = list(tensor_list)
    self._pending = None

  def __repr__(self):
    if self.is_pending:
      return f"[pending: {self.traced}]"
    return "[" + ",".join(str(t) for t in self._tensor_list) + "]"

  @property
  def tensor_list(self) -> list:
    if self._pending is not None:
      self._pending[0].build_now(self)
    return self._tensor_list

  @property
  def all_slices(self) -> list:
    return self.tensor_list

  @property
  def slice_shape(self) -> list:
    if self._pending is not None:
      return self.traced.shape.as_list()
    return self._tensor_list[0].shape.as_list()

  @property
  def dtype(self):
    if self._pending is not None:
      return self.traced.dtype
    return self._tensor_list[0].dtype

  def to_laid_out_tensor(self) -> LaidOutTensor:
    return self

  @classmethod
  def from_tensor_list(cls, tensor_list) -> LaidOutTensor:
    return cls(tensor_list)


class LaidOutVariable:
  """What backends' laid-out variables share: their slices, and the copy ops built at lowering.

  A subclass sets `_laid_out_tensor`, defines `assign_to_slices`, and either sets the copy ops
  `_copy_master_to_slices` and `_copy_slices_to_master` or has `_build_copies` build them.
  """

  _copy_fns: Optional[tuple] = None  # (to slices, to master) builders, for eager mode

  def _build_copies(self, mesh_impl, to_slices: Callable, to_master: Callable) -> None:
    """Graph mode builds the copy to the slices now (initialisation needs it) and the copy to the
    master when it is first asked for (only saving needs it; building it was a sixth of the
    lowering at 8 devices); eager mode runs the first copy now (it initialises the slices) and
    each later copy when it is asked for."""
    self._copy_fns = (to_slices, to_master)
    self._copy_master_to_slices = mesh_impl.register_copy_master_to_slices(to_slices)
    self._copy_slices_to_master = None

  def read(self) -> LaidOutTensor:
    """The slices as they are now (a fresh read for ReadVariable)."""
    return self._laid_out_tensor

  @property
  def laid_out_tensor(self) -> LaidOutTensor:
    return self._laid_out_tensor

  @property
  def copy_master_to_slices(self):
    """The copy op built at lowering; in eager mode (with _build_copies), the copy itself, run now."""
    if self._copy_fns and tf.executing_eagerly():
      return self._copy_fns[0]()
    return self._copy_master_to_slices

  @property
  def copy_slices_to_master(self):
    """The copy op (with _build_copies, built at the first request); in eager mode the copy
    itself, run now."""
    if self._copy_fns and tf.executing_eagerly():
      return self._copy_fns[1]()
    if self._copy_slices_to_master is None and self._copy_fns:
      self._copy_slices_to_master = self._copy_fns[1]()
    return self._copy_slices_to_master


# TF graph -> {name: slice variable}: a second lowering of the same graph reuses its slices.
_slice_variables = weakref.WeakKeyDictionary()

# The owner of the slice variables lowerings make now (set by slice_variable_owner), or None.
_slice_variable_owner = []


@contextlib.contextmanager
def slice_variable_owner(make: Callable):
  """Within it, slice_variable(...) returns make(full_name, shape, dtype, device).

  For an owner that keeps the variables outside the graph being built: mtf.tf2 lowers inside a
  traced TF function and keeps every variable as an eager tf.Variable of its module.
  """
  _slice_variable_owner.append(make)
  try:
    yield
  finally:
    _slice_variable_owner.pop()


def slice_variable(name: str, shape, dtype, device: str):
  """A processor's slice variable, named `name` in the current variable scope, not initialised.

  A backend's copy of the masters (or of the checkpointed parts) gives it its value. It is in no
  collection, so savers and initialisers leave it alone. An uninitialised resource variable costs
  about a fifth of tf.get_variable's graph building (and no initialiser ops), which a mesh pays
  per variable per device. In graph mode, asking again in the same TF graph returns the same one.
  """
  scope = tf.get_variable_scope().name
  full_name = f"{scope}/{name}" if scope else name
  if _slice_variable_owner:
    return _slice_variable_owner[-1](full_name, shape, dtype, device)
  existing = None if tf.executing_eagerly() else _slice_variables.setdefault(tf.get_default_graph(), {})
  if existing is not None and full_name in existing:
    return existing[full_name]
  with tf.device(device), tf.name_scope(None):
    variable = resource_variable_ops.UninitializedVariable(
        name=full_name, shape=shape, dtype=dtype, trainable=False)
  if existing is not None:
    existing[full_name] = variable
    global_variables = tf.get_collection_ref(tf.GraphKeys.GLOBAL_VARIABLES)  # it adds itself there
    if global_variables and global_variables[-1] is variable:
      global_variables.pop()
  return variable


def dtype_of(laid_out):
  """The dtype of a laid-out value's slices (a backend LaidOutTensor or any object with tensor_list)."""
  dtype = getattr(laid_out, "dtype", None)
  return dtype if dtype is not None else laid_out.tensor_list[0].dtype
