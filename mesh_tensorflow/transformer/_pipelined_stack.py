"""A LayerStack's blocks run as an mtf.pipeline (LayerStack(pipeline_stages=...)).

The stack's blocks (`block_000/...`, `block_001/...`, made by make_layer_stack) must be alike:
block 0's layers are the template the pipeline runs for every stage. Their mtf.get_variable
calls are intercepted and become per-layer variables under the unpipelined names
(`block_007/layer_000/SelfAttention/q`), stacked over the stages. The context's tensors with a
batch dimension (sequence ids, positions, the encoder's output, ...) travel with the
microbatches as the pipeline's side inputs.

The per-layer variables are created first, block after block in the order the template asks for
them (found by running it once on a scratch mesh), as an unpipelined stack creates them: TF
seeds initializers by creation order, so a pipelined model starts from the unpipelined one's
initial values.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._ops import random_keys

# Context attributes a layer may read that hold the batch dimension.
_BATCHED_CONTEXT_ATTRIBUTES = ("position", "sequence_id", "subsequence_id", "inputs", "encoder_output",
                               "encoder_sequence_id", "encoder_inputs")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
  """A LayerStack's pipeline settings (see LayerStack)."""

  num_stages: int
  num_microbatches: int
  schedule: str
  layers_per_round: int
  stage_dim_name: str


def blocks_of(layers: list) -> list:
  """The layers grouped by block ([[block 0's layers], ...]), checked to be alike."""
  blocks, names = {}, {}
  for layer in layers:
    block, _, rest = (layer.name or "").partition("/")
    if not block.startswith("block_") or not rest:
      raise ValueError(
          f"LayerStack(pipeline_stages=...): layer {layer.name!r} is not in a block; a pipeline runs "
          f"alike blocks, so build the stack with make_layer_stack(..., block_scope=True), which "
          f"names every layer 'block_XXX/<name>'.")
    blocks.setdefault(block, []).append(layer)
    names.setdefault(block, []).append((rest, type(layer)))
  first = next(iter(names.values()))
  for block, block_names in names.items():
    if block_names != first:
      raise ValueError(
          f"LayerStack(pipeline_stages=...): block {block!r} holds layers {block_names}, but the first "
          f"block holds {first}; every stage runs the same block, so the blocks must be alike.")
  return list(blocks.values())


def call_pipelined(stack, options: PipelineOptions, context, x: mtf.Tensor) -> mtf.Tensor:
  """stack's layers on x, as a pipeline of options.num_stages stages."""
  blocks = blocks_of(stack.layers)
  batch_dim = _batch_dim(context, x)
  given = _given_microbatches(context, x, batch_dim, options.num_microbatches)
  sides = [(name, getattr(context, name)) for name in _BATCHED_CONTEXT_ATTRIBUTES
           if _is_batched(getattr(context, name, None), batch_dim)
           and not (name == "position" and context.position_is_default)]
  template = blocks[0]
  stage_dim = mtf.Dimension(options.stage_dim_name, options.num_stages)
  # a microbatch's batch dimension inside the pipeline (None: the given microbatches' is dropped)
  micro_batch_dim = None if given else mtf.Dimension(batch_dim.name,
                                                     batch_dim.size // max(options.num_microbatches, 1))
  scopes = [block[0].name.partition("/")[0] for block in blocks]
  if batch_dim.size % options.num_microbatches == 0:  # else mtf.pipeline explains the mistake
    requests = _variable_requests(stack, template, context, x, sides, stage_dim, batch_dim, micro_batch_dim)
    for scope in scopes:
      with tf.variable_scope(scope):
        for name, shape, kwargs in requests:
          mtf.get_variable(context.mesh, name, shape, **kwargs)

  def layer_fn(h, get_variable, side_values=()):
    root = tf.get_variable_scope().name

    def redirect(mesh, name, shape, **kwargs):
      del mesh
      within = tf.get_variable_scope().name[len(root) + 1:]
      return get_variable(f"{within}/{name}" if within else name, shape, **kwargs)

    saved = {name: getattr(context, name) for name, _ in sides}
    for (name, _), value in zip(sides, side_values):
      setattr(context, name, value)
    try:
      with mtf.intercept_get_variable(redirect):
        for layer in template:
          within = layer.name.partition("/")[2]
          with tf.variable_scope(within), random_keys.scope(within):  # per stage: its layer's scope
            h = stack.layer_fn(h, layer, context)
    finally:
      for name, value in saved.items():
        setattr(context, name, value)
    return h

  y = mtf.pipeline(
      layer_fn, x, len(blocks), stage_dim, given or batch_dim, options.num_microbatches,
      schedule=options.schedule, layers_per_round=options.layers_per_round, recompute=stack.recompute_grads,
      side_inputs=[value for _, value in sides], layer_scopes=scopes,
      microbatch_dim=batch_dim if given else None)
  context.layer_index += len(stack.layers)
  return y


def _variable_requests(stack, template: list, context, x: mtf.Tensor, sides: list, stage_dim, batch_dim,
                       micro_batch_dim) -> list:
  """(name within a block, shape, kwargs) of every variable the template's layers make, in order.

  The template runs once as a trial (mtf.Graph.trial: its ops are dropped), on zeros shaped as
  the pipeline's activations and side inputs, with mtf.get_variable answering zeros.
  """
  mesh = context.mesh
  requests = []

  def in_pipeline(shape: mtf.Shape) -> mtf.Shape:
    dims = [micro_batch_dim if d == batch_dim else d for d in shape.dims]
    return mtf.Shape([stage_dim] + [d for d in dims if d is not None])

  def record(mesh, name, shape, **kwargs):
    within = tf.get_variable_scope().name[len(root) + 1:]
    shape = mtf.convert_to_shape(shape)
    requests.append((f"{within}/{name}" if within else name, shape, kwargs))
    dtype = kwargs.get("dtype")
    dtype = dtype.activation_dtype if isinstance(dtype, mtf.VariableDType) else (dtype or tf.float32)
    return mtf.zeros(mesh, mtf.Shape([stage_dim] + shape.dims), dtype)

  saved = {name: getattr(context, name) for name, _ in sides}
  saved_cache = dict(context.cache)
  saved_lists = {name: list(getattr(context, name)) for name in ("losses", "layer_outputs")
                 if isinstance(getattr(context, name, None), list)}
  try:
    with mesh.graph.trial(), tf.variable_scope("pipeline_template") as scope, \
        mtf.intercept_get_variable(record), random_keys.scope("pipeline_template"):
      root = scope.name
      for name, value in sides:
        setattr(context, name, mtf.zeros(mesh, in_pipeline(value.shape), value.dtype))
      h = mtf.zeros(mesh, in_pipeline(x.shape), x.dtype)
      for layer in template:
        with tf.variable_scope(layer.name.partition("/")[2]):
          h = stack.layer_fn(h, layer, context)
  finally:  # what the trial added to the context (losses, cached tensors) is dropped
    context.cache = saved_cache
    for name, value in saved.items():
      setattr(context, name, value)
    for name, value in saved_lists.items():
      getattr(context, name)[:] = value
  return requests


def _batch_dim(context, x: mtf.Tensor) -> mtf.Dimension:
  for dim in context.batch_dims:
    if dim in x.shape.dims:
      return dim
  raise ValueError(f"LayerStack(pipeline_stages=...): the input {x.shape} has none of the batch "
                   f"dimensions {context.batch_dims}, which the pipeline cuts into microbatches.")


def _given_microbatches(context, x: mtf.Tensor, batch_dim: mtf.Dimension,
                        num_microbatches: int) -> Optional[mtf.Dimension]:
  """x's batch dimension after batch_dim when batch_dim (an outer_batch) holds exactly the
  microbatches: the pipeline then takes its entries as the microbatches (mtf.pipeline's
  microbatch_dim), which a layout may split over the stages' mesh dimension."""
  inner = [d for d in context.batch_dims if d in x.shape.dims and d != batch_dim]
  return inner[0] if inner and batch_dim.size == num_microbatches else None


def _is_batched(value, batch_dim: mtf.Dimension) -> bool:
  return isinstance(value, mtf.Tensor) and batch_dim in value.shape.dims
