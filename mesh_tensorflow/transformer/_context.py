"""The model-call context: mode strings, the TransformerLayer base class and `Context`.

A `Context` carries everything a layer may need besides its input (mesh, dims, mode, positions,
segment ids, encoder output, decoding states, losses) through one call of a model.
"""

from __future__ import annotations

import json
from typing import Optional

import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf


class ModeKeys:
  """Mode strings (the values of the removed `tf.estimator.ModeKeys`); modes compare by value.

  Decoding adds two internal modes: "first_part" (one pass over the known prefix, recording
  per-layer states) and "incremental" (one position per call, reading and updating them).
  """
  TRAIN = "train"
  EVAL = "eval"
  PREDICT = "infer"
  FIRST_PART = "first_part"
  INCREMENTAL = "incremental"


class TransformerLayer:
  """Base class of the layers of a LayerStack: `call(context, x)` returns a tensor shaped like x."""

  def call(self, context: Context, x: mtf.Tensor) -> mtf.Tensor:
    """Applies the layer; subclasses implement it."""
    raise NotImplementedError(f"{type(self).__name__} must implement call(context, x).")

  def to_json(self) -> str:
    """The layer's class and attributes as JSON (non-JSON values by their str)."""
    return json.dumps({"class": type(self).__name__, "attributes": vars(self)}, default=str,
                      sort_keys=True)

  def set_name(self, name: Optional[str]) -> None:
    """Sets the variable scope the LayerStack calls this layer in."""
    self._name = name

  @property
  def name(self) -> Optional[str]:
    return getattr(self, "_name", None)


class Context:
  """Per-call state shared by the layers of a model (a plain attribute bag, plus helpers).

  Args are stored under their own names. Decoding uses `states`/`new_states` (the per-layer
  recurrent states: read in order with get_states in "incremental" mode, appended with
  record_new_states) and `constant_states` (computed once in "first_part", read in order).
  `sequence_id` is an int32 Tensor (0 = padding), the int 1 (one unpadded sequence per row)
  or None.
  """

  def __init__(self, model, mesh: mtf.Mesh, batch_dims, length_dim, variable_dtype,
               beam_dim=None, mode: str = ModeKeys.TRAIN, position=None, position_is_default: bool = False,
               sequence_id=None, subsequence_id=None, states=None, new_states=None, losses=None,
               initial_position=None, layer_outputs=None, encoder_output=None,
               encoder_sequence_id=None, constant_states=None, shared_params=None,
               encoder_layer_outputs=None, write_priority=None, read_priority=None, inputs=None,
               encoder_inputs=None, num_microbatches: int = 1):
    self.model = model
    self.mesh = mesh
    self.batch_dims = batch_dims
    self.length_dim = length_dim
    self.variable_dtype = variable_dtype
    self.beam_dim = beam_dim
    self.mode = mode
    self.position = position
    self.position_is_default = position_is_default
    self.sequence_id = sequence_id
    self.subsequence_id = subsequence_id
    self.states = states
    self.new_states = new_states
    self.losses = losses
    self.initial_position = initial_position
    self.layer_outputs = [] if layer_outputs is None else layer_outputs
    self.encoder_output = encoder_output
    self.encoder_sequence_id = encoder_sequence_id
    self.constant_states = constant_states
    self.next_constant_state = 0
    self.shared_params = {} if shared_params is None else shared_params
    self.encoder_layer_outputs = encoder_layer_outputs
    self.write_priority = write_priority
    self.read_priority = read_priority
    self.inputs = inputs
    self.encoder_inputs = encoder_inputs
    self.num_microbatches = num_microbatches
    self.layer_index = 0
    self.cache = {}
    self.input_embeddings = None  # the embedded input tokens, set by the Unitransformer

  @property
  def train(self) -> bool:
    return self.mode == ModeKeys.TRAIN

  @property
  def activation_dtype(self) -> tf.DType:
    return self.variable_dtype.activation_dtype

  @property
  def encoder_length_dim(self) -> mtf.Dimension:
    """The `memory_length` dimension of encoder_output."""
    for d in self.encoder_output.shape.dims:
      if d.name == "memory_length":
        return d
    raise ValueError(f"Context.encoder_length_dim: encoder_output {self.encoder_output.shape} has no "
                     f"'memory_length' dimension; rename its length dim with "
                     f"mtf.layers.rename_length_to_memory_length.")

  @property
  def nonpadding(self):
    """None (no segment ids), 1 (no padding) or a float mask of the non-padding positions."""
    if self.sequence_id is None:
      return None
    if not isinstance(self.sequence_id, mtf.Tensor) and self.sequence_id == 1:
      return 1
    return mtf.cast(mtf.not_equal(self.sequence_id, 0), self.activation_dtype)

  def get_states(self, n: int) -> list:
    """The next n recurrent states ("incremental" mode): those after the ones already recorded."""
    start = len(self.new_states)
    if start + n > len(self.states):
      raise ValueError(f"Context.get_states({n}): only {len(self.states) - start} of "
                       f"{len(self.states)} states are left; the incremental call must read the "
                       f"states in the order the first_part call recorded them.")
    return self.states[start:start + n]

  def record_new_states(self, new_states) -> None:
    self.new_states.extend(new_states)

  def record_constant_state(self, s) -> None:
    self.constant_states.append(s)

  def get_constant_state(self):
    ret = self.constant_states[self.next_constant_state]
    self.next_constant_state += 1
    return ret

  def get_position(self):
    """The position of each token: a range over length_dim when positions are the default."""
    if self.position_is_default:
      return mtf.range(self.mesh, self.length_dim, tf.int32)
    return self.position
