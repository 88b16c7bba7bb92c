"""Pipeline parallelism: a stack of identical layers whose stages are a dimension like any other.

Every activation in the pipeline carries the stage dimension (`stages:S`), and so do the layers'
variables, so a layout rule `stages:<mesh dim>` puts each stage on its own processors. A tick
runs every stage at once on the microbatch it holds, then `mtf.shift` moves the activations one
stage on. It is all ordinary mtf ops (einsum, shift, stack), so lowering, `mtf.gradients`,
recomputation, explain and the dry run need nothing special. The schedule itself is pure Python:
see pipeline_schedule.py.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, Shape, convert_to_dimension, convert_to_shape
from mesh_tensorflow._core.errors import LayoutError
from mesh_tensorflow._core.layout import convert_to_layout_rules
from mesh_tensorflow._core.tensor import Tensor
from mesh_tensorflow._ops import _checks as checks
from mesh_tensorflow._ops import binary as binary_ops
from mesh_tensorflow._ops import custom_gradient as custom_gradient_ops
from mesh_tensorflow._ops import einsum as einsum_ops
from mesh_tensorflow._ops import elementwise as elementwise_ops
from mesh_tensorflow._ops import io as io_ops
from mesh_tensorflow._ops import random_keys
from mesh_tensorflow._ops import reshape as reshape_ops
from mesh_tensorflow._ops import shift as shift_ops
from mesh_tensorflow._ops import slicing as slicing_ops
from mesh_tensorflow._ops import variables as variable_ops
from mesh_tensorflow._ops.pipeline_schedule import PipelineSchedule, pipeline_schedule
from mesh_tensorflow._ops.stacking import LayerStackVariable

__all__ = ["pipeline", "pipeline_schedule", "PipelineSchedule"]

MICROBATCH_DIM_NAME = "pipeline_microbatches"


def pipeline(layer_fn: Callable, x: Tensor, num_layers: int, stage_dim, batch_dim,
             num_microbatches: int, *, schedule: str = "fill_drain", layers_per_round: int = 1,
             recompute: bool = False, side_inputs: Sequence[Tensor] = (),
             layer_scopes: Optional[Sequence[str]] = None, microbatch_dim=None, mesh_shape=None,
             layout=None, name: str = "pipeline") -> Tensor:
  """Applies `num_layers` structurally identical layers to x, pipelined over `stage_dim`.

  The batch is cut into microbatches; each of the schedule's ticks runs `layer_fn` on every stage
  at once, then shifts the activations one stage on (`mtf.pipeline_schedule(...).num_ticks`
  ticks: M + S - 1 for fill-drain). The result equals applying the layers one after another.

  Args:
    layer_fn: (h, get_variable) -> Tensor of h's shape: one layer. h is [stage_dim, <x's dims with
      batch_dim cut to the microbatch>]; `get_variable(name, shape, **kwargs)` returns, for each
      stage, the weight of the layer it runs now: a Tensor [stage_dim] + shape. The variable
      behind it is created once, in the variable scope `name`, as [stage_dim, <stage>_layers]
      + shape (no layer dim when each stage holds one layer); kwargs go to mtf.get_variable (an
      initializer initializes that whole stacked variable). Make the layer's variables with it
      only: mtf.get_variable inside layer_fn would share one variable among all layers (or run
      it inside mtf.intercept_get_variable, as the Transformer's LayerStack does). With
      side_inputs, layer_fn(h, get_variable, sides) also gets them, each as
      [stage_dim, <its dims with batch_dim cut to the microbatch>]: every stage's row holds the
      microbatch that stage runs this tick (zeros where it idles).
    x: the input, with batch_dim.
    num_layers: L; the stages must divide it (times layers_per_round when circular).
    stage_dim: the stage Dimension (e.g. Dimension("stages", 4)); a layout rule such as
      "stages:stage" splits it. Not a dimension of x.
    batch_dim: the dimension of x cut into `num_microbatches` microbatches (same name, size / M).
    num_microbatches: M; must divide batch_dim's size.
    schedule: "fill_drain" (GPipe: stage s holds layers s*L/S .. (s+1)*L/S - 1) or "circular"
      (stage s holds layers (r*S + s)*K .. (r*S + s)*K + K - 1 of each round r, K =
      layers_per_round; activations wrap from the last stage to the first for L / (S*K) rounds,
      which shrinks the bubble). See PipelineSchedule for the tick count and the bubble.
    layers_per_round: K, for "circular".
    recompute: recompute each tick's layers on the backward pass (mtf.recompute_grad) instead
      of keeping their activations; only the activations between ticks are kept.
    side_inputs: tensors with batch_dim that every layer reads beside h (a Transformer's
      sequence ids, say); they are not changed by the layers.
    layer_scopes: one variable scope per layer (relative to the scope pipeline is called in):
      then each weight is one variable per layer, named `<scope>/<name>` and shaped as an
      unpipelined model's (so checkpoints do not depend on the pipeline), stacked for the
      stages by an mtf.LayerStackVariable; the initializer initializes each layer's variable.
    microbatch_dim: a dimension of x (and of the side inputs) that already indexes the
      microbatches, e.g. a Transformer's `outer_batch`: microbatch m is x's entry m along it,
      num_microbatches must be its size, batch_dim is not cut, and h lacks microbatch_dim. Its
      layout may split it over the stage mesh dimension (`outer_batch:stage`), so the work before
      and after the pipeline (embeddings, loss) splits over the stages too instead of running on
      every stage's processors in full; each tick then also sums a microbatch over the stages.
    mesh_shape, layout: the mesh shape and layout rules the graph will be lowered with. Given,
      they are checked now (see Raises); otherwise the layout check at lowering catches them.
    name: the variable scope of the layers' variables.

  Returns:
    The last layer's output, with x's shape.

  Raises:
    ValueError: stages that do not divide the layers; microbatches that do not divide the batch;
      a stage_dim that x has; layer_fn changing h's shape.
    LayoutError: (with mesh_shape and layout) the stages and the batch on one mesh dimension, or
      a microbatch that the batch's mesh dimension does not divide.

  Example:
    def layer(h, get_variable):  # h: [stages, batch, d_model]
      w1 = get_variable("w1", [d_model, d_ff], initializer=tf.random_normal_initializer(0, 0.1))
      w2 = get_variable("w2", [d_ff, d_model], initializer=tf.random_normal_initializer(0, 0.1))
      return h + mtf.einsum([mtf.relu(mtf.einsum([h, w1], reduced_dims=[d_model])), w2], h.shape)
    y = mtf.pipeline(layer, x, 8, mtf.Dimension("stages", 4), batch_dim, num_microbatches=4)
    # lowered on mesh "stage:4;batch:2" with layout "stages:stage;batch:batch"
  """
  stage_dim = convert_to_dimension(stage_dim)
  batch_dim = convert_to_dimension(batch_dim)
  checks.check_dim_in("pipeline", "batch_dim", batch_dim, x)
  _check_stage_dim_is_new(stage_dim, x)
  if microbatch_dim is None:
    microbatches = _CutBatch(batch_dim, num_microbatches)
  else:
    microbatches = _GivenMicrobatches(convert_to_dimension(microbatch_dim), num_microbatches, x)
  for side in side_inputs:
    checks.check_dim_in("pipeline", "side_inputs", microbatches.dim, side)
  if layer_scopes is not None and len(layer_scopes) != num_layers:
    raise ValueError(f"pipeline: got {len(layer_scopes)} layer_scopes for {num_layers} layers; give one "
                     f"variable scope per layer.")
  sched = pipeline_schedule(num_layers, stage_dim.size, num_microbatches, schedule, layers_per_round)
  if mesh_shape is not None or layout is not None:
    microbatches.check_layout(stage_dim, mesh_shape, layout)
  outer_scope = tf.get_variable_scope()
  with tf.variable_scope(name):
    weights = _Weights(sched, stage_dim, x.mesh, outer_scope, layer_scopes)
    outputs = _Ticks(layer_fn, sched, stage_dim, x.mesh, x.dtype, recompute, weights,
                     [microbatches.side(t) for t in side_inputs], microbatches).run(microbatches.pieces(x))
  return microbatches.joined(outputs, x)


class _CutBatch:
  """Microbatches cut from batch_dim: microbatch m holds rows m, M + m, 2M + m, ... of the batch."""

  def __init__(self, batch_dim: Dimension, num_microbatches: int):
    _check_microbatches_divide_batch(batch_dim, num_microbatches)
    self.dim = batch_dim
    self.stage_batch_dim = Dimension(batch_dim.name, batch_dim.size // num_microbatches)  # in h
    self._micro_dim = Dimension(MICROBATCH_DIM_NAME, num_microbatches)
    self._num_microbatches = num_microbatches

  def _in_microbatches(self, t: Tensor) -> Tensor:
    return reshape_ops.replace_dimensions(t, self.dim, [self.stage_batch_dim, self._micro_dim])

  def pieces(self, x: Tensor) -> list:
    return slicing_ops.unstack(self._in_microbatches(x), self._micro_dim)

  def side(self, t: Tensor) -> Tensor:
    """t with the microbatch dimension MICROBATCH_DIM_NAME (replicated: it may not be split)."""
    return self._in_microbatches(t)

  def joined(self, outputs: list, x: Tensor) -> Tensor:
    axis = outputs[0].shape.dims.index(self.stage_batch_dim) + 1
    stacked = slicing_ops.stack(outputs, self._micro_dim.name, axis=axis)
    return reshape_ops.replace_dimensions(stacked, [self.stage_batch_dim, self._micro_dim], self.dim)

  def stagewise(self, stage_dim_name: str, stage_scopes: list, microbatches: list) -> random_keys.Stagewise:
    return random_keys.Stagewise(stage_dim_name, self.dim.name, self._num_microbatches, stage_scopes,
                                 microbatches)

  def check_layout(self, stage_dim: Dimension, mesh_shape, layout) -> None:
    _check_layout(stage_dim, self.dim, self._num_microbatches, mesh_shape, layout)


class _GivenMicrobatches:
  """Microbatches given as a dimension of x: microbatch m is x's entry m along it.

  Each is picked out by a one-hot einsum, which sums over that dimension's mesh dimension where
  the layout splits it, and the outputs are put back the same way, so the dimension may be
  split over any mesh dimension, the stages' included.
  """

  def __init__(self, microbatch_dim: Dimension, num_microbatches: int, x: Tensor):
    checks.check_dim_in("pipeline", "microbatch_dim", microbatch_dim, x)
    if microbatch_dim.size != num_microbatches:
      raise ValueError(
          f"pipeline: num_microbatches={num_microbatches}, but microbatch_dim {microbatch_dim.name!r} "
          f"holds {microbatch_dim.size} microbatches; give num_microbatches={microbatch_dim.size}.")
    self.dim = microbatch_dim
    self.stage_batch_dim = None
    self._micro_dim = Dimension(MICROBATCH_DIM_NAME, num_microbatches)
    self._mesh = x.mesh

  def _one_hot(self, m: int, dtype) -> Tensor:
    return io_ops.constant(self._mesh, np.eye(self.dim.size)[m], Shape([self.dim]), dtype)

  def pieces(self, x: Tensor) -> list:
    return [einsum_ops.einsum([x, self._one_hot(m, x.dtype)], output_shape=_without(x.shape, self.dim))
            for m in range(self.dim.size)]

  def side(self, t: Tensor) -> Tensor:
    """t with the microbatches moved to the dimension MICROBATCH_DIM_NAME (replicated)."""
    dtype = t.dtype if t.dtype.is_floating else tf.float32  # ids stay exact in float32
    value = t if t.dtype == dtype else elementwise_ops.cast(t, dtype)
    stacked = slicing_ops.stack(self.pieces(value), self._micro_dim.name, axis=len(value.shape) - 1)
    return stacked if t.dtype == dtype else elementwise_ops.cast(stacked, t.dtype)

  def joined(self, outputs: list, x: Tensor) -> Tensor:
    return binary_ops.add_n([einsum_ops.einsum([out, self._one_hot(m, out.dtype)], output_shape=x.shape)
                                  for m, out in enumerate(outputs)])

  def stagewise(self, stage_dim_name: str, stage_scopes: list, microbatches: list) -> random_keys.Stagewise:
    return random_keys.Stagewise(stage_dim_name, None, self.dim.size, stage_scopes, microbatches)

  def check_layout(self, stage_dim: Dimension, mesh_shape, layout) -> None:
    """Any layout of the microbatch dimension works; the stages still need a mesh dimension."""
    del stage_dim, mesh_shape, layout


class _Ticks:
  """Builds the schedule's ticks, one after another, for one pipeline call."""

  def __init__(self, layer_fn: Callable, sched: PipelineSchedule, stage_dim: Dimension, mesh,
               dtype, recompute: bool, weights: _Weights, sides: list, microbatches):
    self._layer_fn = layer_fn
    self._sched = sched
    self._stage_dim = stage_dim
    self._mesh = mesh
    self._recompute = recompute
    self._weights = weights
    self._sides = sides
    self._microbatches = microbatches  # _CutBatch or _GivenMicrobatches
    eye = np.eye(stage_dim.size)
    self._first = io_ops.constant(mesh, eye[0], Shape([stage_dim]), dtype)
    self._not_first = io_ops.constant(mesh, 1 - eye[0], Shape([stage_dim]), dtype)
    self._last = io_ops.constant(mesh, eye[-1], Shape([stage_dim]), dtype)

  def run(self, pieces: list) -> list:
    """The microbatches' outputs (each without the stage dimension), in microbatch order."""
    sched = self._sched
    last_stage, last_round = sched.num_stages - 1, sched.num_rounds - 1
    outputs = [None] * sched.num_microbatches
    waiting = {}  # (round, microbatch) -> the tensor holding it on stage 0, back from the last stage
    h = None
    for tick in range(sched.num_ticks):
      h = self._run_tick(tick, self._tick_input(tick, h, pieces, waiting))
      done = sched.work(tick, last_stage)
      if done is not None and done[0] == last_round:
        outputs[done[1]] = einsum_ops.einsum([h, self._last], output_shape=_without(h.shape, self._stage_dim))
    return outputs

  def _tick_input(self, tick: int, h: Optional[Tensor], pieces: list, waiting: dict) -> Tensor:
    """Last tick's activations one stage on, with stage 0 holding what it runs this tick."""
    sched = self._sched
    starting = sched.work(tick, 0)
    if h is None:
      return self._on_first_stage(pieces[starting[1]])
    wrap = sched.num_rounds > 1
    shifted = shift_ops.shift(h, 1, self._stage_dim, wrap=wrap)
    if not wrap:  # stage 0 got zeros
      return shifted if starting is None else shifted + self._on_first_stage(pieces[starting[1]])
    back = sched.work(tick - 1, sched.num_stages - 1)
    if back is not None and back[0] < sched.num_rounds - 1:
      waiting[(back[0] + 1, back[1])] = shifted
    if starting is not None and starting[0] > 0 and waiting.get(starting) is shifted:
      del waiting[starting]
      return shifted  # it came back just in time: stage 0 already holds it
    rest = einsum_ops.einsum([shifted, self._not_first], output_shape=shifted.shape)
    if starting is None:
      return rest
    if starting[0] == 0:
      return rest + self._on_first_stage(pieces[starting[1]])
    held = waiting.pop(starting)
    return rest + einsum_ops.einsum([held, self._first], output_shape=held.shape)

  def _on_first_stage(self, piece: Tensor) -> Tensor:
    """piece on stage 0, zeros on the other stages."""
    return einsum_ops.einsum([piece, self._first], output_shape=Shape([self._stage_dim] + piece.shape.dims))

  def _run_tick(self, tick: int, h: Tensor) -> Tensor:
    sides = self._tick_sides(tick)

    def stage_fn(h):
      for k in range(self._sched.layers_per_tick):
        h = self._run_layer(tick, k, h, sides)
      return h
    if self._recompute:
      return custom_gradient_ops.recompute_grad(stage_fn, [h])
    return stage_fn(h)

  def _tick_sides(self, tick: int) -> list:
    """The side inputs as each stage sees them this tick: [stage, <dims of a microbatch>]."""
    if not self._sides:
      return []
    sched = self._sched
    micro_dim = self._sides[0].shape.get_dim_by_name(MICROBATCH_DIM_NAME)
    choice = np.zeros([sched.num_stages, sched.num_microbatches])
    for s in range(sched.num_stages):
      work = sched.work(tick, s)
      if work is not None:
        choice[s, work[1]] = 1
    selectors = {}
    ret = []
    for side in self._sides:
      dtype = side.dtype if side.dtype.is_floating else tf.float32  # ids stay exact in float32
      if dtype not in selectors:
        selectors[dtype] = io_ops.constant(self._mesh, choice, Shape([self._stage_dim, micro_dim]), dtype)
      value = side if side.dtype == dtype else elementwise_ops.cast(side, dtype)
      picked = einsum_ops.einsum([value, selectors[dtype]], output_shape=Shape(
          [self._stage_dim] + _without(side.shape, micro_dim).dims))
      ret.append(picked if side.dtype == dtype else elementwise_ops.cast(picked, side.dtype))
    return ret

  def _run_layer(self, tick: int, k: int, h: Tensor, sides: list) -> Tensor:
    slots = self._slots(tick, k)
    args = [h, lambda name, shape, **kwargs: self._weights.get(slots, name, shape, **kwargs)]
    with self._random_keys(tick, slots):
      out = self._layer_fn(*args, sides) if self._sides else self._layer_fn(*args)
    if not isinstance(out, Tensor) or out.shape != h.shape:
      got = out.shape if isinstance(out, Tensor) else type(out).__name__
      raise ValueError(f"pipeline: layer_fn must return a Tensor of its input's shape {h.shape} (the "
                       f"next stage runs the next layer on it), got {got}.")
    return out

  def _random_keys(self, tick: int, slots: list):
    """With per-layer scopes: random ops of the layer draw, per stage, as its layer unpipelined."""
    scopes = self._weights.layer_scope_names
    if scopes is None:
      return contextlib.nullcontext()
    sched = self._sched
    stage_scopes, running = [], []
    for s in range(sched.num_stages):
      work = sched.work(tick, s)
      layer = sched.layer_at(s, slots[s])
      stage_scopes.append(None if work is None else scopes[layer])
      running.append(0 if work is None else work[1])
    return random_keys.stagewise(self._microbatches.stagewise(self._stage_dim.name, stage_scopes, running))

  def _slots(self, tick: int, k: int) -> list:
    """The weight slot each stage reads for the k-th layer of this tick (idle stages: any slot)."""
    rounds = [w[0] if w else None for w in (self._sched.work(tick, s) for s in range(self._sched.num_stages))]
    busy = [r for r in rounds if r is not None]
    default = max(set(busy), key=busy.count) if busy else 0  # keeps the stages' slots alike if it can
    return [(default if r is None else r) * self._sched.layers_per_tick + k for r in rounds]

class _Weights:
  """The layers' weights as each stage reads them at a tick: [stage_dim] + the weight's shape."""

  def __init__(self, sched: PipelineSchedule, stage_dim: Dimension, mesh, outer_scope,
               layer_scopes: Optional[Sequence[str]]):
    self._sched = sched
    self._stage_dim = stage_dim
    self._mesh = mesh
    self._outer_scope = outer_scope
    self._scope_name = tf.get_variable_scope().name
    self._layer_scopes = layer_scopes
    outer = outer_scope.name
    self.layer_scope_names = None if layer_scopes is None else [
        f"{outer}/{scope}" if outer else scope for scope in layer_scopes]  # each layer's scope, unpipelined
    slots = sched.slots_per_stage
    self._slot_dim = Dimension(f"{stage_dim.name}_layers", slots) if slots > 1 else None

  def get(self, slots: list, name: str, shape, **kwargs) -> Tensor:
    """Each stage's slot `slots[stage]` of weight `name`."""
    shape = convert_to_shape(shape)
    stacked = [self._stage_dim] + ([self._slot_dim] if self._slot_dim else [])
    if self._layer_scopes is None:
      w = variable_ops.get_variable(self._mesh, name, Shape(stacked + shape.dims), **kwargs)
    else:
      w = self._layer_stack(name, shape, stacked, kwargs)
    if self._slot_dim is None:
      return w
    out_shape = Shape([self._stage_dim] + shape.dims)
    if len(set(slots)) == 1:
      # every stage reads the same slot: a slice, no selection
      return reshape_ops.reshape(slicing_ops.mtf_slice(w, slots[0], 1, self._slot_dim.name), out_shape)
    choice = np.eye(self._slot_dim.size)[slots]  # [stage, slot]: each stage's slot this tick
    selector = io_ops.constant(self._mesh, choice, Shape([self._stage_dim, self._slot_dim]), w.dtype)
    return einsum_ops.einsum([w, selector], output_shape=out_shape)

  def _layer_stack(self, name: str, shape: Shape, stack_dims: list, kwargs: dict) -> Tensor:
    """One variable per layer (in its layer scope), stacked in (stage, slot) order."""
    stacked_name = f"{self._scope_name}/{name}"
    existing = self._mesh.graph.name_to_variable.get(stacked_name)
    if existing is not None:
      return existing.outputs[0]
    per_layer = []
    with tf.variable_scope(self._outer_scope, auxiliary_name_scope=False):
      for scope in self._layer_scopes:
        with tf.variable_scope(scope):
          per_layer.append(variable_ops.get_variable(self._mesh, name, shape, **kwargs).operation)
    slots = self._sched.slots_per_stage
    order = sorted(range(len(per_layer)),
                   key=lambda layer: self._sched.layer_position(layer)[0] * slots
                   + self._sched.layer_position(layer)[1])
    return LayerStackVariable([per_layer[layer] for layer in order], stack_dims, stacked_name).outputs[0]


def _without(shape: Shape, dim: Dimension) -> Shape:
  return Shape([d for d in shape.dims if d != dim])


def _check_stage_dim_is_new(stage_dim: Dimension, x: Tensor) -> None:
  if stage_dim.name in x.shape.dimension_names:
    raise ValueError(f"pipeline: x {x.name!r} {x.shape} already has a dimension {stage_dim.name!r}; "
                     f"the stage dimension is added by the pipeline, so give it a new name.")


def _check_microbatches_divide_batch(batch_dim: Dimension, num_microbatches: int) -> None:
  if batch_dim.size % num_microbatches:
    divisors = [d for d in range(1, batch_dim.size + 1) if batch_dim.size % d == 0]
    raise ValueError(
        f"pipeline: num_microbatches={num_microbatches} does not divide the batch dimension "
        f"{batch_dim.name!r} of size {batch_dim.size}, so the microbatches would differ in size. "
        f"Use a num_microbatches among {divisors}, or change the batch size.")


def _check_layout(stage_dim: Dimension, batch_dim: Dimension, num_microbatches: int, mesh_shape,
                  layout) -> None:
  """The activations hold the stages and a microbatch at once: the layout must split both."""
  mesh_shape = convert_to_shape(mesh_shape)
  rules = convert_to_layout_rules(layout)
  stage_axis = rules.tensor_dimension_to_mesh_axis(stage_dim, mesh_shape)
  batch_axis = rules.tensor_dimension_to_mesh_axis(batch_dim, mesh_shape)
  if batch_axis is None:
    return
  mesh_dim = mesh_shape[batch_axis]
  if batch_axis == stage_axis:
    raise LayoutError(
        f"pipeline: the layout puts the stage dimension {stage_dim.name!r} and the batch dimension "
        f"{batch_dim.name!r} on the same mesh dimension {mesh_dim.name!r}, but every activation of "
        f"the pipeline holds both, and a tensor may use a mesh dimension once. Give the stages a "
        f"mesh dimension of their own, e.g. mesh 'stage:{stage_dim.size};{mesh_dim.name}:"
        f"{mesh_dim.size}' with layout '{stage_dim.name}:stage;{batch_dim.name}:{mesh_dim.name}'.",
        dimension=stage_dim.name, mesh_dimension=mesh_dim.name)
  micro_size = batch_dim.size // num_microbatches
  if micro_size % mesh_dim.size:
    raise LayoutError(
        f"pipeline: a microbatch holds {micro_size} of the batch dimension {batch_dim.name!r} "
        f"({batch_dim.size} / {num_microbatches} microbatches), which its mesh dimension "
        f"{mesh_dim.name!r} of size {mesh_dim.size} does not divide. Use fewer microbatches (at most "
        f"{batch_dim.size // mesh_dim.size}) or a larger batch.",
        dimension=batch_dim.name, mesh_dimension=mesh_dim.name)
