"""Universal Transformer layer stack (Dehghani et al. 2018, arXiv:1807.03819), gin name `UTLayerStack`.

The stack applies the same layers recurrently: every step reuses the step-0 variables (mtf
reuses a variable of the same full name). Recurrences: "basic" (num_rec_steps steps), "act"
(adaptive computation time: per-position halting over act_max_steps + 1 steps) and "highway"
(a learned gate mixes the state before and after each step). Parameters and variable names
are 0.1.21's; the options 0.1.21 accepts but cannot build (step_timing_signal_type "sinusoid",
add_or_concat_timing_signal "concat", gate_ffn_layer "dense_relu_dense") are rejected with a
ValueError when the stack is made.
"""

from __future__ import annotations

import contextlib
import math

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer

GIN_MODULE = "mesh_tensorflow.transformer.universal_transformer"
_RECURRENCE_TYPES = ("act", "basic", "highway")
_GATING_TYPES = ("highway", "gru")


def _check_choice(what: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"UTLayerStack: {what}={value!r} is not supported; use one of {tuple(choices)}.")


@gin.configurable(module=GIN_MODULE)
class UTLayerStack(transformer.TransformerLayer):
  """A Universal Transformer stack of `layers` (pre-norm residual layers, shared across steps).

  Variables: each layer's own (in scope `<layer name>/<layer class>`) and pre-norm
  `<layer name>/layer_prepostprocess/layer_norm/*`; the final layer norm
  `layer_prepostprocess/layer_norm/*`; with add_step_timing_signal, `layer_embedding` [layer,
  d_model]; for "act", `sigmoid_activation_for_pondering/dense*/{kernel,bias}`; for the gates,
  `dense*/{kernel,bias}`.
  """

  def __init__(self, layers, dropout_rate: float = 0.0, norm_epsilon: float = 1e-6,
               num_vanilla_transformer_layers: int = 2, couple_carry_transform_gates: bool = True,
               act_type=gin.REQUIRED, recurrence_type=gin.REQUIRED, act_max_steps=gin.REQUIRED,
               act_epsilon=gin.REQUIRED, num_rec_steps=gin.REQUIRED, num_inrecurrence_layers=gin.REQUIRED,
               position_start_index=gin.REQUIRED, add_or_concat_timing_signal=gin.REQUIRED,
               step_timing_signal_type=gin.REQUIRED, add_position_timing_signal=gin.REQUIRED,
               add_step_timing_signal=gin.REQUIRED, mix_with_transformer_before_ut=gin.REQUIRED,
               mix_with_transformer_after_ut=gin.REQUIRED, gates_inputs=gin.REQUIRED,
               gate_ffn_layer=gin.REQUIRED, use_gated_transformer=gin.REQUIRED, gating_type=gin.REQUIRED):
    """Creates the stack.

    Args:
      layers: the TransformerLayers applied at each step (named, e.g. by make_layer_stack).
      dropout_rate: residual dropout (training only).
      norm_epsilon: the layer norms' epsilon.
      num_vanilla_transformer_layers: passes of `layers` before / after the recurrence (see
        mix_with_transformer_before_ut / _after_ut).
      couple_carry_transform_gates: highway recurrence: carry gate = 1 - transform gate.
      act_type: "act" recurrence: "basic", "accumulated", "global" or "random".
      recurrence_type: "act", "basic" or "highway".
      act_max_steps: "act" recurrence: the number of steps (+1).
      act_epsilon: "act" recurrence: a position halts at cumulative probability 1 - act_epsilon.
      num_rec_steps: "basic"/"highway" recurrence: the number of steps.
      num_inrecurrence_layers: passes of `layers` per step.
      position_start_index: for add_position_timing_signal_func: None/0, "random" or "step".
      add_or_concat_timing_signal: "add" (0.1.21's "concat" cannot build).
      step_timing_signal_type: "learned" (0.1.21's "sinusoid" cannot build).
      add_position_timing_signal: unused by call (as in 0.1.21).
      add_step_timing_signal: add a learned per-step embedding at each step.
      mix_with_transformer_before_ut: run the vanilla passes before the recurrence.
      mix_with_transformer_after_ut: run the vanilla passes after the recurrence.
      gates_inputs: highway recurrence: the gate's inputs, a string of "s" (state), "t"
        (transformed state), "i" (stack input).
      gate_ffn_layer: "dense".
      use_gated_transformer: gate each layer's output with `gating_type`.
      gating_type: "highway" or "gru".
    """
    _check_choice("recurrence_type", recurrence_type, _RECURRENCE_TYPES)
    _check_choice("add_or_concat_timing_signal", add_or_concat_timing_signal, ("add",))
    if add_step_timing_signal:
      _check_choice("step_timing_signal_type", step_timing_signal_type, ("learned",))
    if recurrence_type == "highway" or use_gated_transformer:
      _check_choice("gate_ffn_layer", gate_ffn_layer, ("dense",))
    if use_gated_transformer:
      _check_choice("gating_type", gating_type, _GATING_TYPES)
    self._layers = layers
    self._dropout_rate = dropout_rate
    self._norm_epsilon = norm_epsilon
    self.num_vanilla_transformer_layers = num_vanilla_transformer_layers
    self.act_type = act_type
    self.recurrence_type = recurrence_type
    self.act_max_steps = act_max_steps
    self.act_epsilon = act_epsilon
    self.num_rec_steps = num_rec_steps
    self.num_inrecurrence_layers = num_inrecurrence_layers
    self.position_start_index = position_start_index
    self.add_or_concat_timing_signal = add_or_concat_timing_signal
    self.step_timing_signal_type = step_timing_signal_type
    self.add_position_timing_signal = add_position_timing_signal
    self.add_step_timing_signal = add_step_timing_signal
    self.mix_with_transformer_before_ut = mix_with_transformer_before_ut
    self.mix_with_transformer_after_ut = mix_with_transformer_after_ut
    self.gates_inputs = gates_inputs
    self.gate_ffn_layer = gate_ffn_layer
    self.couple_carry_transform_gates = couple_carry_transform_gates
    self.use_gated_transformer = use_gated_transformer
    self.gating_type = gating_type

  @property
  def _num_steps(self) -> int:
    return self.act_max_steps if self.recurrence_type == "act" else self.num_rec_steps

  def get_timing_signal_1d(self, context, length, channels, min_timescale: float = 1.0,
                           max_timescale: float = 1.0e4, start_index=0) -> mtf.Tensor:
    """Sinusoids of the positions (plus start_index): [expanded:1, length, channels].

    Half the channels are sin(position / timescale), half cos, for channels / 2 timescales in
    geometric progression from min_timescale to max_timescale.
    """
    if channels.size % 2:
      raise ValueError(f"UTLayerStack.get_timing_signal_1d: channels {channels} must have an even size.")
    num_timescales = channels.size // 2
    log_increment = math.log(float(max_timescale) / float(min_timescale)) / max(num_timescales - 1, 1)
    half_dim = mtf.Dimension(channels.name, num_timescales)
    inv_timescales = min_timescale * mtf.exp(
        mtf.range(context.mesh, half_dim, context.activation_dtype) * -log_increment)
    position = mtf.cast(context.get_position() + start_index, context.activation_dtype)
    scaled_time = position * inv_timescales
    signal = mtf.concat([mtf.sin(scaled_time), mtf.cos(scaled_time)], concat_dim_name=channels.name)
    return mtf.reshape(signal, mtf.Shape([mtf.Dimension("expanded", 1), length, channels]))

  def add_position_timing_signal_func(self, context, x: mtf.Tensor, step) -> mtf.Tensor:
    """x plus the sinusoidal position signal, positions offset by position_start_index's rule."""
    if not self.position_start_index:
      index = 0
    elif self.position_start_index == "random":
      index = mtf.random_uniform(context.mesh, [], maxval=x.shape.dims[1].size, dtype=tf.int32)
    elif self.position_start_index == "step":
      index = mtf.cast(x.shape.dims[1].size * step / self._num_steps, dtype=tf.int32)
    else:
      raise ValueError(f"UTLayerStack: position_start_index={self.position_start_index!r} is not "
                       f"supported; use None, 'random' or 'step'.")
    signal = self.get_timing_signal_1d(context, context.length_dim, context.model.model_dim,
                                       start_index=index)
    return x + mtf.cast(mtf.reshape(signal, signal.shape.dims[1:]), x.dtype)

  def get_layer_timing_signal_learned_1d(self, context, channels, layer, num_layers: int) -> mtf.Tensor:
    """Row `layer` (int or scalar Tensor) of `layer_embedding` [layer, channels], times sqrt(channels).

    A step past the table (ACT's last step) selects zeros.
    """
    layer_dim = mtf.Dimension("layer", num_layers)
    embedding = mtf.get_variable(
        context.mesh, "layer_embedding", mtf.Shape([layer_dim, channels]), dtype=context.variable_dtype,
        initializer=tf.random_normal_initializer(0, channels.size ** -0.5)) * (channels.size ** 0.5)
    return mtf.gather(embedding, layer, layer_dim)

  def add_step_timing_signal_func(self, context, x: mtf.Tensor, step) -> mtf.Tensor:
    """x plus the learned embedding of the recurrence step."""
    signal = self.get_layer_timing_signal_learned_1d(context, x.shape.dims[-1], step, self._num_steps)
    return x + mtf.cast(signal, x.dtype)

  def step_preprocess(self, context, x: mtf.Tensor, step) -> mtf.Tensor:
    """The input of a recurrence step: x plus the step signal when add_step_timing_signal."""
    if self.add_step_timing_signal:
      x = self.add_step_timing_signal_func(context, x, step)
    return x

  def vanilla_transformer_layer(self, context, x: mtf.Tensor, mask) -> mtf.Tensor:
    """One pass of the layers: x + dropout(layer(layer_norm(x))), gated with use_gated_transformer."""
    for lnum, layer in enumerate(self._layers):
      with tf.variable_scope(layer.name) if layer.name else contextlib.nullcontext():
        norm_x = self._layer_norm(context, _masked(x, mask))
        with tf.variable_scope(type(layer).__name__):
          y = layer.call(context, norm_x)
          if y.shape != x.shape:
            raise ValueError(f"UTLayerStack: layer {type(layer).__name__} returned {y.shape} for input "
                             f"{x.shape}; a layer must return its input's shape.")
          if self.use_gated_transformer:
            y = self.gating(context, x, y, mask)
        x += self._dropout(context, y)
      if lnum != len(self._layers) - 1:
        context.layer_outputs.append(x)
      context.layer_index += 1
    return x

  def _sigmoid_gate(self, context, mask, inputs: list) -> mtf.Tensor:
    return self.ffn_layer_multi_inputs(context, mask, inputs, ffn_layer_type=self.gate_ffn_layer,
                                       activation=mtf.sigmoid, preprocess=True)

  def gating(self, context, x: mtf.Tensor, transformed_x: mtf.Tensor, mask) -> mtf.Tensor:
    """Highway (x * carry + transformed_x * transform) or GRU-style gating of a layer's output."""
    def gate(inputs):
      return self._sigmoid_gate(context, mask, inputs)
    if self.gating_type == "highway":
      transform_gate = gate([x])
      carry_gate = gate([x])
      return x * carry_gate + transformed_x * transform_gate
    update_gate = gate([x, transformed_x])
    reset_gate = gate([x, transformed_x])
    candidate = gate([reset_gate * x, transformed_x])
    return (1 - update_gate) * transformed_x + update_gate * candidate

  def ut_basic(self, context, x: mtf.Tensor, mask) -> mtf.Tensor:
    """num_rec_steps steps of num_inrecurrence_layers passes."""
    for step in range(self.num_rec_steps):
      x = self.step_preprocess(context, x, step)
      for _ in range(self.num_inrecurrence_layers):
        x = self.vanilla_transformer_layer(context, x, mask)
    return x

  def act_layer(self, context, x: mtf.Tensor, mask) -> mtf.Tensor:
    """Adaptive computation time over act_max_steps + 1 steps; the halting-weighted state.

    At each step a position's halting probability p (a sigmoid dense of the state, variable scope
    `sigmoid_activation_for_pondering`; uniform noise for act_type "random"; its mean over the
    length for "global") accumulates; the step's output enters the result with weight p, or the
    remainder 1 - sum(p) on the step that crosses 1 - act_epsilon. The ponder time is summarised
    as `ponder_times`.
    """
    state = x
    threshold = 1.0 - self.act_epsilon
    update_shape = state.shape.dims[:2] if self.act_type == "global" else state.shape.dims[:3]
    halting_probability = mtf.zeros(context.mesh, update_shape, dtype=context.activation_dtype)
    remainders = mtf.zeros(context.mesh, update_shape, dtype=context.activation_dtype)
    n_updates = mtf.zeros(context.mesh, update_shape, dtype=context.activation_dtype)
    previous_state = mtf.zeros_like(state)
    step = mtf.constant(context.mesh, 0, dtype=tf.int32)
    for _ in range(self.act_max_steps + 1):
      state = self.step_preprocess(context, state, step)
      p = self._halting_probability(context, state, halting_probability)
      still_running = mtf.cast(mtf.less(halting_probability, 1.0), context.activation_dtype)
      reached = halting_probability + p * still_running
      new_halted = mtf.cast(mtf.greater(reached, threshold), context.activation_dtype) * still_running
      still_running = mtf.cast(mtf.less_equal(reached, threshold), context.activation_dtype) * still_running
      halting_probability += p * still_running
      remainders += new_halted * (1 - halting_probability)
      halting_probability += new_halted * remainders
      n_updates += still_running + new_halted
      update_weights = p * still_running + new_halted * remainders
      for _ in range(self.num_inrecurrence_layers):
        state = self.vanilla_transformer_layer(context, state, mask)
      if self.act_type == "accumulated":
        previous_state = state * update_weights + previous_state
      else:
        previous_state = state * update_weights + previous_state * (1 - update_weights)
      step += 1
    mtf.scalar_summary("ponder_times", mtf.reduce_mean(n_updates))
    return previous_state

  def _halting_probability(self, context, state: mtf.Tensor, halting_probability: mtf.Tensor) -> mtf.Tensor:
    if self.act_type == "random":
      return mtf.random_uniform(context.mesh, shape=halting_probability.shape.dims,
                                dtype=context.activation_dtype)
    with tf.variable_scope("sigmoid_activation_for_pondering", reuse=tf.AUTO_REUSE):
      p = mtf.layers.dense(state, variable_dtype=context.variable_dtype, reduced_dims=[state.shape.dims[-1]],
                           new_dims=[mtf.Dimension(state.shape.dims[-1].name, 1)], activation=mtf.sigmoid,
                           use_bias=True)
    if self.act_type == "global":
      return mtf.reshape(mtf.reduce_mean(p, reduced_dim=p.shape.dims[1]), p.shape.dims[:1])
    return mtf.reshape(p, p.shape.dims[:-1])

  def ffn_layer_multi_inputs(self, context, mask, inputs_list, ffn_layer_type: str = "dense",
                             kernel_initializer=None, activation=None, preprocess: bool = False,
                             postprocess: bool = False) -> mtf.Tensor:
    """A dense (with bias) of the inputs concatenated along d_model, back to d_model.

    preprocess layer-normalises each input; postprocess layer-normalises the output.
    """
    if not inputs_list:
      raise ValueError("UTLayerStack.ffn_layer_multi_inputs needs at least one input.")
    _check_choice("ffn_layer_type", ffn_layer_type, ("dense",))
    if preprocess:
      inputs_list = [self._layer_norm(context, _masked(t, mask)) for t in inputs_list]
    model_dim = context.model.model_dim
    ffn_inputs = inputs_list[0] if len(inputs_list) == 1 else mtf.concat(inputs_list, model_dim.name)
    output = mtf.layers.dense(ffn_inputs, reduced_dims=[ffn_inputs.shape.dims[-1]], new_dims=[model_dim],
                              activation=activation, use_bias=True, variable_dtype=context.variable_dtype,
                              expert_dims=context.model.ensemble_dims, kernel_initializer=kernel_initializer)
    if postprocess:
      output = self._layer_norm(context, _masked(output, mask))
    return output

  def ut_highway(self, context, layer_inputs, mask) -> mtf.Tensor:
    """Steps whose output is state * carry + transformed_state * transform (gates from gates_inputs)."""
    state, inputs, memory = layer_inputs
    for step in range(self.num_rec_steps):
      transformed = self.step_preprocess(context, state, step)
      for _ in range(self.num_inrecurrence_layers):
        transformed = self.vanilla_transformer_layer(context, transformed, mask)
      gate_inputs = [t for key, t in (("s", state), ("t", transformed), ("i", inputs))
                     if key in self.gates_inputs]

      transform_gate = self._sigmoid_gate(context, mask, gate_inputs)
      if self.couple_carry_transform_gates:
        carry_gate = 1.0 - transform_gate
      else:
        carry_gate = self._sigmoid_gate(context, mask, gate_inputs)
      state = state * carry_gate + transformed * transform_gate
      mtf.scalar_summary("highway_transform_gate_layer", mtf.reduce_mean(transform_gate))
      mtf.scalar_summary("highway_carry_gate_layer", mtf.reduce_mean(carry_gate))
    del memory
    return state

  def call(self, context, x: mtf.Tensor) -> mtf.Tensor:
    """The recurrence (with optional vanilla passes), a final norm, dropout; padding zeroed."""
    if isinstance(context.sequence_id, mtf.Tensor):
      mask = mtf.cast(mtf.not_equal(context.sequence_id, 0), context.activation_dtype)
    else:
      mask = None
    x = self._dropout(context, x)
    context.layer_outputs.append(x)
    if self.mix_with_transformer_before_ut:
      for _ in range(self.num_vanilla_transformer_layers):
        x = self.vanilla_transformer_layer(context, x, mask)
    if self.recurrence_type == "act":
      x = self.act_layer(context, x, mask)
    elif self.recurrence_type == "basic":
      x = self.ut_basic(context, x, mask)
    else:
      x = self.ut_highway(context, (x, x, x), mask)
    if self.mix_with_transformer_after_ut:
      for _ in range(self.num_vanilla_transformer_layers):
        x = self.vanilla_transformer_layer(context, x, mask)
    x = self._dropout(context, self._layer_norm(context, x, name="final_layer_norm"))
    x = _masked(x, mask)
    context.layer_outputs.append(x)
    return x

  def _dropout(self, context, x: mtf.Tensor) -> mtf.Tensor:
    if context.train and self._dropout_rate > 0:
      return mtf.dropout(x, context.train, rate=self._dropout_rate,
                         noise_shape=mtf.Shape(context.batch_dims + [context.model.model_dim]))
    return x

  def _layer_norm(self, context, x: mtf.Tensor, name=None) -> mtf.Tensor:
    """Layer norm over d_model; `name` is ignored (as in 0.1.21: every norm of a scope is shared)."""
    del name
    return mtf.layers.layer_norm(x, context.model.model_dim, self._norm_epsilon)

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  @property
  def layers(self) -> list:
    return self._layers


def _masked(x: mtf.Tensor, mask) -> mtf.Tensor:
  return x if mask is None else x * mask
