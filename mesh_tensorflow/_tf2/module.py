"""MeshModule: mtf computations lowered once into TF functions, with variables a tf.Module owns.

`MeshModule.function(fn, input_signature)` builds the mtf graph of `fn` and lowers it once,
in a TF1-style function graph (`tf.compat.v1.wrap_function`), then keeps only what its outputs and
updates need (`prune`), as a session runs only what it fetches. Each later call is one call of
that TF function: no mtf graph building, no lowering, no Python per op. The graph is the one
session mode builds, so a step gives session mode's values.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import tensorflow as tf2
import tensorflow.compat.v1 as tf

from mesh_tensorflow._autodiff import gradients
from mesh_tensorflow._core.graph import Graph, Mesh
from mesh_tensorflow._lowering.lowering import Lowering
from mesh_tensorflow._optimize.base import Optimizer
from mesh_tensorflow._tf2.variables import VariableStore, WholeValue


class MeshModule(tf2.Module):
  """A tf.Module owning the variables of mtf computations on one mesh.

  Every function made with `function` on this module shares its variables (by name): a
  training step and an evaluation see the same weights. `tf.train.Checkpoint(model=module)`
  saves each mtf variable's whole value under its name and the step counter `step`, so a
  checkpoint restores into a module of any layout of the same model.

  Args:
    mesh_impl: the MeshImpl every function lowers with (a PlacementMeshImpl or
      CollectiveMeshImpl of this process, whole masters).
    mesh_name: the name of the mtf.Mesh passed to each function's graph builder.
    name: the tf.Module's name.

  Raises:
    ValueError: a mesh implementation without whole masters.

  Example:
    module = mtf.tf2.MeshModule(mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "batch:all",
                                                                          ["cpu:0", "cpu:1"]))
    step = mtf.tf2.TrainStep(module, loss_fn, lambda: mtf.optimize.SgdOptimizer(0.1),
                             [tf.TensorSpec([8, 4], tf.float32)])
    loss = step(x)
  """

  def __init__(self, mesh_impl, mesh_name: str = "mesh", name: Optional[str] = None):
    super().__init__(name=name)
    if mesh_impl.masters != "whole":
      raise ValueError(
          f"MeshModule: mesh_impl has masters={mesh_impl.masters!r}; a MeshModule checkpoints whole "
          f"masters. Build the mesh implementation with masters='whole' (the default).")
    self._mesh_impl = mesh_impl
    self._mesh_name = mesh_name
    self._holder = _Untracked(VariableStore())
    self.step = tf2.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    self.mtf_variables = {}  # checkpointed: mtf variable name -> WholeValue
    self._lowerings = []
    self._masters_stale = False  # a restore wrote masters the slices have not been given yet
    self._slices_ahead = False  # a call may have changed slices the masters have not been given

  @property
  def mesh_impl(self):
    return self._mesh_impl

  def function(self, fn: Callable, input_signature: Sequence, random_position: Optional[str] = None):
    """`fn` lowered once into a TF function; returns a MeshFunction to call with TF tensors.

    Args:
      fn: fn(mesh, *inputs) -> (outputs, operations): builds the mtf graph on `mesh` from TF
        tensors `inputs` (import them with mtf.import_tf_tensor / import_fully_replicated);
        `outputs` is a nest of mtf Tensors, returned as TF tensors; `operations` a list of mtf
        Operations (variable updates) each call runs.
      input_signature: one tf.TensorSpec per input (fixed shapes: mtf shapes are static).
      random_position: None: random ops draw fresh values at each call (mtf's evaluation
        counter); "step": from the module's step counter, so a resumed run draws what the
        uninterrupted one would have.

    Returns:
      A MeshFunction.
    """
    return MeshFunction(self, fn, list(input_signature), random_position)

  def _lower(self, fn: Callable, tf_inputs: list, random_position: Optional[str]):
    """Builds and lowers fn in the current (function) graph: (outputs, run op, Lowering)."""
    graph = Graph()
    mesh = Mesh(graph, self._mesh_name)
    position = self.step.read_value() if random_position == "step" else None
    store = self._holder.value
    tf.add_to_collection(tf.GraphKeys.GLOBAL_STEP, self.step)  # what optimizers' schedules read
    with store.owning():
      outputs, operations = fn(mesh, *tf_inputs)
      lowering = Lowering(graph, {mesh: self._mesh_impl}, random_position=position)
    tf_outputs = tf.nest.map_structure(lowering.export_to_tf_tensor, outputs)
    run = tf.group([lowering.lowered_operation(op) for op in operations])
    return tf_outputs, run, lowering, list(store.created)

  def _adopt(self, lowering, created: list) -> None:
    """After a trace: initialise the new variables' slices and checkpoint their whole values.

    The copy covers every variable of the new lowering, some of which earlier functions may have
    trained: their masters are brought up to date first.
    """
    self.sync_masters()
    self._lowerings.append(lowering)
    _copy_eagerly([lowering], "copy_master_to_slices")
    for variable in lowering.graph.all_variables:
      if variable.name in created and variable.name not in self.mtf_variables:
        self.mtf_variables[variable.name] = WholeValue(
            variable.get_master(), self.sync_masters, self._mark_masters_restored)

  def sync_masters(self) -> None:
    """Copies every variable's slices into its master (saving does it; the slices are current)."""
    if self._slices_ahead:
      _copy_eagerly(self._lowerings, "copy_slices_to_master")
      self._slices_ahead = False

  def _mark_masters_restored(self) -> None:
    self._masters_stale = True
    self._slices_ahead = False

  def _before_call(self) -> None:
    if self._masters_stale:
      self._masters_stale = False
      _copy_eagerly(self._lowerings, "copy_master_to_slices")
    self._slices_ahead = True


def _copy_eagerly(lowerings: list, direction: str) -> None:
  """Runs each laid-out variable's copy now: in eager mode its copy property runs the copy.

  (Lowering.copy_masters_to_slices would return the op built in the traced graph instead.)
  """
  for lowering in lowerings:
    for laid_out_variable in lowering.variables.values():
      getattr(laid_out_variable, direction)


class MeshFunction:
  """An mtf computation lowered once (at the first call) into a pruned TF function.

  Calls take TF tensors matching the input signature and return the outputs as TF tensors.
  `lowerings` counts the lowerings done (one per MeshFunction).
  """

  def __init__(self, module: MeshModule, fn: Callable, input_signature: list,
               random_position: Optional[str]):
    if random_position not in (None, "step"):
      raise ValueError(f"MeshModule.function: random_position={random_position!r}; expected None "
                       f"(fresh values at every call) or 'step' (the module's step counter).")
    self._module = module
    self._fn = fn
    self._input_signature = input_signature
    self._random_position = random_position
    self._call = None
    self._increments_step = False

  def _build(self) -> None:
    module, found = self._module, {}

    def traced(*tf_inputs):
      outputs, run, lowering, created = module._lower(self._fn, list(tf_inputs), self._random_position)
      if self._increments_step:
        with tf.control_dependencies([run]):
          run = module.step.assign_add(1, read_value=False)
      found.update(outputs=outputs, run=run, lowering=lowering, created=created)
      return outputs

    wrapped = tf.wrap_function(traced, self._input_signature)
    self._call = wrapped.prune(wrapped.inputs, (found["outputs"], found["run"]))
    module._adopt(found["lowering"], found["created"])

  def __call__(self, *inputs):
    if self._call is None:
      self._build()
    if len(inputs) != len(self._input_signature):
      raise ValueError(f"{type(self).__name__}: got {len(inputs)} inputs for an input signature of "
                       f"{len(self._input_signature)} ({self._input_signature}); pass one tensor each.")
    self._module._before_call()
    return self._call(*[tf.convert_to_tensor(x, spec.dtype)
                        for x, spec in zip(inputs, self._input_signature)])[0]


class TrainStep(MeshFunction):
  """A training step: the loss, its gradients (mtf.gradients) and the optimizer's updates.

  Each call runs one step on a batch and returns the loss (a TF scalar of the step's weights,
  before the update) and adds one to the module's `step`, which the optimizer's learning-rate
  schedules read as the global step.

  Args:
    module: the MeshModule owning the variables.
    loss_fn: loss_fn(mesh, *inputs) -> an mtf scalar loss.
    optimizer_fn: a function returning an mtf.optimize.Optimizer, e.g.
      `lambda: mtf.optimize.AdafactorOptimizer()`. It is called while the step is lowered, where
      the module's step is the global step: AdafactorOptimizer reads the global step when it is
      constructed, so one built eagerly beforehand would keep that step's rates for ever.
    input_signature: one tf.TensorSpec per input.
    random_position: "step" (default): dropout masks follow the step counter, so a run resumed
      from a checkpoint draws the masks an uninterrupted run would; None: mtf's evaluation counter.
  """

  def __init__(self, module: MeshModule, loss_fn: Callable, optimizer_fn: Callable,
               input_signature: Sequence, random_position: Optional[str] = "step"):
    if not callable(optimizer_fn) or isinstance(optimizer_fn, Optimizer):
      raise ValueError(
          f"TrainStep: optimizer_fn must be a function returning an mtf optimizer, got "
          f"{optimizer_fn!r}; pass e.g. `lambda: mtf.optimize.AdafactorOptimizer()`, so that it is "
          f"built inside the step and reads the module's step counter as the global step.")

    def step_fn(mesh, *inputs):
      loss = loss_fn(mesh, *inputs)
      if loss.shape.ndims != 0:
        raise ValueError(f"TrainStep: loss_fn returned a tensor of shape {loss.shape}; return a "
                         f"scalar loss (mtf.reduce_mean / reduce_sum over every dimension).")
      variables = mesh.graph.trainable_variables
      grads = _gradients(loss, variables)
      with tf.name_scope("optimizer"):
        updates = optimizer_fn().apply_grads(grads, variables)
      return loss, updates

    super().__init__(module, step_fn, list(input_signature), random_position)
    self._increments_step = True


def _gradients(loss, variables: list) -> list:
  return gradients([loss], [v.outputs[0] for v in variables])


class _Untracked:
  """Holds an object out of tf.Module's tracking (the store's variables are not checkpointed)."""

  def __init__(self, value):
    self.value = value
