"""LayerStack: layers wrapped in gin-chosen sublayers (norm, dropout, residual), and make_layer_stack.

Every sublayer function has the signature `(x, layer_stack, context, ...)`; the defaults give the
pre-norm residual block x + dropout(layer(rms_norm(x))).
"""

from __future__ import annotations

import math
from typing import Optional

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._ops import random_keys
from mesh_tensorflow.transformer._context import Context, ModeKeys, TransformerLayer
from mesh_tensorflow.transformer import _pipelined_stack

GIN_MODULE = "mesh_tensorflow.transformer.transformer"


def _configurable(fn_or_cls):
  return gin.configurable(fn_or_cls, module=GIN_MODULE)


@_configurable
def sublayer_mask_padding(x: mtf.Tensor, layer_stack, context) -> mtf.Tensor:
  """Zeroes x at padding positions (sequence_id == 0)."""
  del layer_stack
  if isinstance(context.sequence_id, mtf.Tensor):
    return x * mtf.cast(mtf.not_equal(context.sequence_id, 0), x.dtype)
  return x


def _check_layer_output(layer, x, y) -> None:
  if y.shape != x.shape:
    raise ValueError(f"LayerStack: layer {layer.name or ''!r} ({type(layer).__name__}) returned shape "
                     f"{y.shape} for input shape {x.shape}; a layer must return its input's shape.")


@_configurable
def sublayer_call_layer(x: mtf.Tensor, layer_stack, context) -> mtf.Tensor:
  """Calls the current layer (on x with padding masked) in a scope named after its class."""
  x = sublayer_mask_padding(x, layer_stack, context)
  layer = context.current_layer
  with tf.variable_scope(type(layer).__name__):
    y = layer.call(context, x)
  _check_layer_output(layer, x, y)
  return y


def _rms_scale(context, shape) -> mtf.Tensor:
  return mtf.get_variable(context.mesh, "scale", mtf.Shape(shape), initializer=tf.ones_initializer(),
                          dtype=context.variable_dtype)


def _rms_normalize(x, dim, epsilon, scale):
  variance = mtf.reduce_mean(mtf.square(x), reduced_dim=dim)
  return x * mtf.rsqrt(variance + epsilon) * scale


@_configurable
def sublayer_rms_norm(x: mtf.Tensor, layer_stack, context, epsilon=1e-6, name="rms_norm") -> mtf.Tensor:
  """x / rms(x over d_model) * scale; variable `<name>/scale` [d_model] (ones)."""
  del layer_stack
  model_dim = context.model.model_dim
  with tf.variable_scope(name):
    scale = _rms_scale(context, context.model.ensemble_dims + [model_dim])
    return _rms_normalize(x, model_dim, epsilon, scale)


@_configurable
def sublayer_legacy_rms_norm(x: mtf.Tensor, layer_stack, context) -> mtf.Tensor:
  """The per-layer norm of legacy LayerStacks (epsilon from the stack, scope `layer_norm`)."""
  return sublayer_rms_norm(x, layer_stack, context, epsilon=layer_stack.norm_epsilon, name="layer_norm")


@_configurable
def sublayer_legacy_final_rms_norm(x: mtf.Tensor, layer_stack, context) -> mtf.Tensor:
  """The final norm of legacy LayerStacks (scope `final_layer_norm`)."""
  return sublayer_rms_norm(x, layer_stack, context, epsilon=layer_stack.norm_epsilon,
                           name="final_layer_norm")


@_configurable
def sublayer_rms_norm_subsampled(x: mtf.Tensor, layer_stack, context, percentage=100.,
                                 epsilon=1e-6) -> mtf.Tensor:
  """RMS norm whose statistic uses only the first `percentage` % of d_model (cheaper on big models)."""
  del layer_stack
  model_dim = context.model.model_dim
  with tf.variable_scope("layer_norm_subsampled"):
    scale = _rms_scale(context, context.model.ensemble_dims + [model_dim])
    size = max(1, int(math.ceil(model_dim.size * percentage / 100.)))
    if size >= model_dim.size:
      return _rms_normalize(x, model_dim, epsilon, scale)
    sample = mtf.slice(x, 0, size, model_dim.name)
    variance = mtf.reduce_mean(mtf.square(sample), reduced_dim=sample.shape.get_dim_by_name(model_dim.name))
    return x * mtf.rsqrt(variance + epsilon) * scale


@_configurable
def sublayer_scale_norm(x: mtf.Tensor, layer_stack, context, epsilon=1e-6, name="scale_norm") -> mtf.Tensor:
  """x / rms(x over d_model) * g, with one scalar g (per ensemble member); variable `<name>/scale`."""
  del layer_stack
  with tf.variable_scope(name):
    scale = _rms_scale(context, context.model.ensemble_dims)
    return _rms_normalize(x, context.model.model_dim, epsilon, scale)


@_configurable
def sublayer_true_layer_norm(x: mtf.Tensor, layer_stack, context, epsilon=1e-6) -> mtf.Tensor:
  """Layer normalisation (mean and variance) over d_model, with scale and bias."""
  del layer_stack
  with tf.variable_scope("true_layer_norm"):
    return mtf.layers.layer_norm(x, context.model.model_dim, epsilon)


@_configurable
def sublayer_residual(x: mtf.Tensor, layer_stack, context) -> mtf.Tensor:
  """x + the input of the current layer."""
  del layer_stack
  return x + context.current_layer_input


def _noise_shape(x, context):
  """Dropout noise shared along the length dimension."""
  if context.length_dim is not None and context.length_dim in x.shape.dims:
    return x.shape - context.length_dim
  return x.shape


@_configurable
def sublayer_dropout(x: mtf.Tensor, layer_stack, context, dropout_rate=0.0) -> mtf.Tensor:
  """Dropout (training only), the same mask at every position of a sequence."""
  del layer_stack
  if context.train and dropout_rate > 0:
    return mtf.dropout(x, context.train, rate=dropout_rate, noise_shape=_noise_shape(x, context))
  return x


@_configurable
def sublayer_legacy_dropout(x: mtf.Tensor, layer_stack, context) -> mtf.Tensor:
  """Dropout at the rate of a legacy LayerStack."""
  return sublayer_dropout(x, layer_stack, context, dropout_rate=layer_stack.dropout_rate)


@_configurable
def sublayer_annealed_dropout(x: mtf.Tensor, layer_stack, context, init_dropout_rate=0.0, start_step=None,
                              end_step=None) -> mtf.Tensor:
  """Dropout whose rate decays linearly to 0 between start_step and end_step (training only)."""
  del layer_stack
  if context.train and init_dropout_rate > 0:
    return mtf.layers.annealed_dropout(x, context.train, start_step, end_step, init_rate=init_dropout_rate,
                                       noise_shape=_noise_shape(x, context))
  return x


@_configurable
def sublayer_clip_activation_gradient(x: mtf.Tensor, layer_stack, context, rms_norm=1.0) -> mtf.Tensor:
  """Identity forward; clips the RMS of the backward gradient to rms_norm."""
  del layer_stack, context
  return mtf.layers.clip_activation_gradient(x, rms_norm)


@_configurable
def sublayer_rezero(x: mtf.Tensor, layer_stack, context, initial_value=0.0) -> mtf.Tensor:
  """x times a learned scalar `rezero/g` (ReZero, arXiv:2003.04887)."""
  del layer_stack
  with tf.variable_scope("rezero"):
    g = mtf.get_variable(context.mesh, "g", [], initializer=tf.constant_initializer(initial_value),
                         dtype=context.variable_dtype)
    return x * g


_DEFAULT_INITIAL = (sublayer_dropout,)
_DEFAULT_PER_LAYER = (sublayer_rms_norm, sublayer_call_layer, sublayer_dropout, sublayer_residual)
_DEFAULT_FINAL = (sublayer_rms_norm, sublayer_dropout)


@_configurable
class LayerStack(TransformerLayer):
  """A stack of layers, each wrapped in the per-layer sublayers.

  Either give the sublayer lists (or let gin give them), or give both dropout_rate and
  norm_epsilon for the legacy fixed block (legacy dropout, legacy rms norm, call, dropout,
  residual).

  Pipeline parallelism (training and evaluation; decoding runs the layers one after another):
  pipeline_stages = S runs the stack's blocks (make_layer_stack's `block_XXX`, which must be
  alike) with mtf.pipeline over a stage dimension `pipeline_stage_dim_name`:S, which a layout
  rule such as "stages:stage" splits; the batch is cut into num_microbatches. The variables keep
  the unpipelined names and shapes, so checkpoints move between pipelined and unpipelined
  layouts. pipeline_schedule, layers_per_stage_per_round (circular) and recompute_grads (per
  tick) go to mtf.pipeline; see docs/pipeline.md.
  """

  def __init__(self, layers, sublayers_initial=None, sublayers_per_layer=None, sublayers_final=None,
               dropout_rate: Optional[float] = None, norm_epsilon: Optional[float] = None,
               recompute_grads: bool = False, pipeline_stages: Optional[int] = None,
               num_microbatches: int = 1, pipeline_schedule: str = "fill_drain",
               layers_per_stage_per_round: int = 1, pipeline_stage_dim_name: str = "stages"):
    self._layers = list(layers)
    self._recompute_grads = recompute_grads
    self._pipeline = None if pipeline_stages is None else _pipelined_stack.PipelineOptions(
        pipeline_stages, num_microbatches, pipeline_schedule, layers_per_stage_per_round,
        pipeline_stage_dim_name)
    self.dropout_rate = dropout_rate
    self.norm_epsilon = norm_epsilon
    if (dropout_rate is None) != (norm_epsilon is None):
      raise ValueError(f"LayerStack: give both dropout_rate and norm_epsilon (legacy mode) or neither, "
                       f"got dropout_rate={dropout_rate!r}, norm_epsilon={norm_epsilon!r}.")
    if dropout_rate is not None:
      self._sublayers_initial = [sublayer_legacy_dropout]
      self._sublayers_per_layer = [sublayer_legacy_rms_norm, sublayer_call_layer, sublayer_legacy_dropout,
                                   sublayer_residual]
      self._sublayers_final = [sublayer_legacy_final_rms_norm, sublayer_legacy_dropout]
    else:
      self._sublayers_initial = list(_DEFAULT_INITIAL if sublayers_initial is None else sublayers_initial)
      self._sublayers_per_layer = list(self._default_per_layer() if sublayers_per_layer is None
                                       else sublayers_per_layer)
      self._sublayers_final = list(_DEFAULT_FINAL if sublayers_final is None else sublayers_final)

  def _default_per_layer(self):
    return _DEFAULT_PER_LAYER

  def call(self, context: Context, x: mtf.Tensor) -> mtf.Tensor:
    """Initial sublayers, every layer (in its variable scope), final sublayers, padding masked."""
    x = self._call_sublayers(self._sublayers_initial, x, context)
    context.layer_outputs.append(x)
    if self._pipeline is not None and context.mode in (ModeKeys.TRAIN, ModeKeys.EVAL):
      x = _pipelined_stack.call_pipelined(self, self._pipeline, context, x)
    else:
      x = self._call_layers(context, x)
    x = self._call_sublayers(self._sublayers_final, x, context)
    x = sublayer_mask_padding(x, self, context)
    context.layer_outputs.append(x)
    return x

  def _call_layers(self, context: Context, x: mtf.Tensor) -> mtf.Tensor:
    """Every layer in its variable scope, one after another."""
    for lnum, layer in enumerate(self._layers):
      # Random ops are keyed by the layer's scope: a pipelined stack draws the same (_pipelined_stack.py).
      with tf.variable_scope(layer.name or ""), random_keys.scope(tf.get_variable_scope().name):
        if self._recompute_grads:
          x = mtf.recompute_grad(lambda x, layer=layer: self.layer_fn(x, layer, context), [x])
        else:
          x = self.layer_fn(x, layer, context)
      if lnum != len(self._layers) - 1:
        context.layer_outputs.append(x)
      context.layer_index += 1
    return x

  def _call_sublayers(self, sublayers, x, context):
    for s in sublayers:
      x = s(x, self, context)
    return x

  @property
  def recompute_grads(self) -> bool:
    return self._recompute_grads

  def layer_fn(self, x, layer, context):
    """One layer with its per-layer sublayers; the output must have x's shape."""
    context.current_layer = layer
    context.current_layer_input = x
    y = self._call_sublayers(self._sublayers_per_layer, x, context)
    _check_layer_output(layer, x, y)
    return y

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  @property
  def layers(self) -> list:
    return self._layers


@_configurable
class ReversibleLayerStack(LayerStack):
  """A LayerStack of RevNet blocks: activations are rebuilt on the backward pass, not stored.

  Layer n maps (x1, x2) to (x2, x1 + f_n(x2)); the per-layer sublayers (by default rms norm,
  call, dropout: no residual, the block adds it) make f_n. The output is x1 + x2.
  """

  def _default_per_layer(self):
    return (sublayer_rms_norm, sublayer_call_layer, sublayer_dropout)

  def call(self, context: Context, x: mtf.Tensor) -> mtf.Tensor:
    x = self._call_sublayers(self._sublayers_initial, x, context)
    context.layer_outputs.append(x)
    x1, x1_backwards, x2, x2_backwards = x, None, x, None
    for lnum, layer in enumerate(self._layers):
      with tf.variable_scope(layer.name or ""):
        x1, x1_backwards, x2, x2_backwards = mtf.layers.reversible_half_residual_and_swap(
            x1, x1_backwards, x2, x2_backwards,
            lambda x, layer=layer: self.layer_fn(x, layer, context),
            recompute_grads=self._recompute_grads)
      if lnum != len(self._layers) - 1:
        context.layer_outputs.append(x2)
      context.layer_index += 1
    x = self._call_sublayers(self._sublayers_final, x1 + x2, context)
    x = sublayer_mask_padding(x, self, context)
    context.layer_outputs.append(x)
    return x


def _parse_layer_entry(entry):
  """A make_layer_stack entry -> (class, name or None, kwargs)."""
  if not isinstance(entry, (list, tuple)):
    return entry, None, {}
  cls, name, kwargs = entry[0], None, {}
  for item in entry[1:]:
    if isinstance(item, str):
      name = item
    elif isinstance(item, dict):
      kwargs = item
    else:
      raise ValueError(f"make_layer_stack: entry {entry!r} may hold a layer class, a name string and a "
                       f"kwargs dict; got {item!r}.")
  return cls, name, kwargs


@_configurable
def make_layer_stack(layers=gin.REQUIRED, layer_stack_cls=LayerStack, num_layers: int = 6,
                     block_scope: bool = True) -> LayerStack:
  """num_layers blocks of `layers`, named `block_%03d/<name or layer_%03d>` (or flat names).

  Args:
    layers: entries, each a TransformerLayer class or a list/tuple (class, optional name string,
      optional kwargs dict).
    layer_stack_cls: the stack class to build.
    num_layers: number of blocks.
    block_scope: name layers `block_XXX/...` (else `layer_XXX` counted over the whole stack).
  Example: make_layer_stack([SelfAttention, DenseReluDense], num_layers=2) has four layers.
  """
  stack = []
  for block in range(num_layers):
    for n, entry in enumerate(layers):
      cls, name, kwargs = _parse_layer_entry(entry)
      if not callable(cls):
        raise ValueError(f"make_layer_stack: layer entry {entry!r} is not a layer class.")
      layer = cls(**kwargs)
      if block_scope:
        layer.set_name("block_%03d/%s" % (block, name or "layer_%03d" % n))
      else:
        layer.set_name(name or "layer_%03d" % len(stack))
      stack.append(layer)
  return layer_stack_cls(stack)
