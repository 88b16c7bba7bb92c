"""Encoder-decoder models: Bitransformer, StudentTeacher distillation, and their gin factories."""

from __future__ import annotations

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer._context import ModeKeys
from mesh_tensorflow.transformer._embedding import (
    get_vocab_embedding_cls,
    sinusoid_positional_embedding_weights,
)
from mesh_tensorflow.transformer._layer_stack import GIN_MODULE, make_layer_stack
from mesh_tensorflow.transformer._targets import autoregressive_inputs
from mesh_tensorflow.transformer._unitransformer import Unitransformer

_rename = mtf.layers.rename_length_to_memory_length


def _check_shareable(encoder, decoder) -> None:
  if encoder.model_dim != decoder.model_dim or encoder.input_vocab_dim != decoder.input_vocab_dim:
    raise ValueError(f"Bitransformer: shared_embedding needs the same d_model and vocabulary in encoder "
                     f"{encoder.name!r} ({encoder.model_dim}, {encoder.input_vocab_dim}) and decoder "
                     f"{decoder.name!r} ({decoder.model_dim}, {decoder.input_vocab_dim}); set "
                     f"shared_embedding=False or make them equal.")


@gin.configurable(module=GIN_MODULE)
class Bitransformer:
  """An encoder Unitransformer and an autoregressive decoder Unitransformer attending to it.

  With shared_embedding, both use one embedding table (scope `shared`), and one positional
  embedding table when their max lengths agree.
  """

  def __init__(self, encoder: Unitransformer, decoder: Unitransformer, shared_embedding: bool = True):
    self.encoder = encoder
    self.decoder = decoder
    self.shared_embedding = shared_embedding

  @property
  def output_vocab_dim(self):
    return self.decoder.output_vocab_dim

  def loss_denominator(self, targets, num_microbatches):
    return self.decoder.loss_denominator(targets, num_microbatches)

  @property
  def z_loss(self):
    return self.decoder.z_loss

  def _shared_params(self, mesh, variable_dtype) -> dict:
    """{"embedding", "positional_embedding"} shared by encoder and decoder (empty if not shared)."""
    shared_params = {}
    if not self.shared_embedding:
      return shared_params
    encoder, decoder = self.encoder, self.decoder
    _check_shareable(encoder, decoder)
    with tf.variable_scope("shared"):
      shared_params["embedding"] = get_vocab_embedding_cls()(
          mesh, encoder.input_vocab_dim, encoder.model_dim, variable_dtype, name="embedding",
          ensemble_dim=encoder.ensemble_dim)
      if (encoder.positional_embedding and decoder.positional_embedding
          and encoder.max_length_dim == decoder.max_length_dim):
        if encoder.sinusoid_positional_embedding and decoder.sinusoid_positional_embedding:
          table = sinusoid_positional_embedding_weights(mesh, encoder.max_length_dim, encoder.model_dim,
                                                        variable_dtype.activation_dtype)
        else:
          table = mtf.layers.embedding_weights(
              mesh, encoder.max_length_dim, encoder.model_dim, variable_dtype, "positional_embedding",
              ensemble_dim=encoder.ensemble_dim)
        shared_params["positional_embedding"] = table
    return shared_params

  def _encode(self, inputs, mode, variable_dtype, encoder_sequence_id, encoder_position, shared_params,
              encoder_layer_outputs, compute_loss, num_microbatches):
    """(encoder output with length renamed memory_length, its sequence id likewise, encoder loss)."""
    encoder_output, encoder_loss = self.encoder.call_simple(
        inputs, None, compute_loss, mode=mode, variable_dtype=variable_dtype, sequence_id=encoder_sequence_id,
        position=encoder_position, shared_params=shared_params, layer_outputs=encoder_layer_outputs,
        num_microbatches=num_microbatches)
    return _rename(encoder_output), _rename(encoder_sequence_id), encoder_loss

  def call_simple(self, inputs, targets, compute_loss, mode=ModeKeys.TRAIN,
                  variable_dtype=mtf.VariableDType(tf.float32), encoder_sequence_id=None,
                  decoder_sequence_id=None, decoder_subsequence_id=None, encoder_position=None,
                  decoder_position=None, num_microbatches: int = 1) -> tuple:
    """Encodes inputs and decodes targets (teacher forcing): returns (logits, loss or None).

    Sequence ids default to min(ids, 1) (1 on tokens, 0 on padding).
    """
    if encoder_sequence_id is None:
      encoder_sequence_id = mtf.minimum(inputs, 1)
    if decoder_sequence_id is None:
      decoder_sequence_id = mtf.minimum(targets, 1)
    encoder_layer_outputs = []
    shared_params = self._shared_params(inputs.mesh, variable_dtype)
    encoder_output, memory_sequence_id, encoder_loss = self._encode(
        inputs, mode, variable_dtype, encoder_sequence_id, encoder_position, shared_params,
        encoder_layer_outputs, compute_loss, num_microbatches)
    logits, loss = self.decoder.call_simple(
        autoregressive_inputs(targets, sequence_id=decoder_sequence_id), targets, compute_loss, mode=mode,
        variable_dtype=variable_dtype, sequence_id=decoder_sequence_id, subsequence_id=decoder_subsequence_id,
        encoder_output=encoder_output, encoder_sequence_id=memory_sequence_id,
        encoder_inputs=_rename(inputs), position=decoder_position, shared_params=shared_params,
        encoder_layer_outputs=encoder_layer_outputs, num_microbatches=num_microbatches)
    if loss is not None and encoder_loss is not None:
      loss += encoder_loss
    return logits, loss

  @gin.configurable(module="Bitransformer")
  def decode(self, inputs, variable_dtype=mtf.VariableDType(tf.float32), beam_size=1, alpha=0.6,
             temperature=0.0, sampling_keep_top_k=-1, decode_length_multiplier=1.5, decode_length_constant=10,
             max_decode_length=None) -> mtf.Tensor:
    """Decodes [batch..., length] outputs for inputs: sampling (beam_size 1) or beam search.

    Beam search decodes at most max_input_length * decode_length_multiplier +
    decode_length_constant positions; max_decode_length sets the output length (default: the
    input length).
    """
    if beam_size > 1 and (temperature != 0 or sampling_keep_top_k != -1):
      raise ValueError(f"Bitransformer.decode: beam search is deterministic; use temperature=0 and "
                       f"sampling_keep_top_k=-1 with beam_size={beam_size}.")
    encoder_sequence_id = mtf.minimum(inputs, 1)
    encoder_layer_outputs = []
    shared_params = self._shared_params(inputs.mesh, variable_dtype)
    encoder_output, memory_sequence_id, _ = self._encode(
        inputs, ModeKeys.PREDICT, variable_dtype, encoder_sequence_id, None, shared_params,
        encoder_layer_outputs, False, 1)
    batch_dims = inputs.shape.dims[:-1]
    length_dim = inputs.shape.dims[-1]
    decode_length_dim = (length_dim if max_decode_length is None
                         else mtf.Dimension("length", max_decode_length))
    common = dict(variable_dtype=variable_dtype, encoder_output=encoder_output,
                  encoder_sequence_id=memory_sequence_id, shared_params=shared_params,
                  encoder_layer_outputs=encoder_layer_outputs)
    if beam_size == 1:
      partial_sequences = mtf.zeros(inputs.mesh, mtf.Shape(batch_dims + [decode_length_dim]), dtype=tf.int32)
      return self.decoder.sample_autoregressive(
          partial_sequences, temperature=temperature, sampling_keep_top_k=sampling_keep_top_k,
          encoder_inputs=_rename(inputs), has_partial_sequences=False, **common)
    beam_dim = mtf.Dimension("beam", beam_size)
    partial_sequences = mtf.zeros(inputs.mesh, mtf.Shape(batch_dims + [beam_dim, decode_length_dim]),
                                  dtype=tf.int32)
    input_length = mtf.reduce_sum(mtf.to_float(mtf.not_equal(inputs, 0)), reduced_dim=length_dim)
    decode_length = mtf.cast(mtf.reduce_max(input_length) * decode_length_multiplier + decode_length_constant,
                             tf.int32)
    return self.decoder.beam_search(partial_sequences, decode_length, encoder_inputs=_rename(inputs),
                                    alpha=alpha, **common)


@gin.configurable(module=GIN_MODULE)
class StudentTeacher:
  """Distillation: the student's loss mixes the hard-target loss with cross-entropy to the teacher.

  loss = fraction_soft * temperature^2 * CE(softmax(teacher / T), student / T)
         + (1 - fraction_soft) * hard loss, with fraction_soft 0 until distill_start_step.
  The teacher's variables (scope `teacher/`) are not trained; `initialize()` loads them (and,
  with initialize_student_weights, the student's) from teacher_checkpoint.
  """

  def __init__(self, student, teacher, temperature=None, fraction_soft=None, distill_start_step=0,
               teacher_checkpoint=None, initialize_student_weights=False):
    self.student = student
    self.teacher = teacher
    self.temperature = temperature
    self.fraction_soft = fraction_soft
    self.distill_start_step = distill_start_step
    self.teacher_checkpoint = teacher_checkpoint
    self.initialize_student_weights = initialize_student_weights

  def call_simple(self, inputs, targets, compute_loss, variable_dtype=mtf.VariableDType(tf.float32),
                  num_microbatches=1, **kwargs):
    """(student logits, distillation loss), or the student logits alone without compute_loss."""
    with tf.variable_scope("student"):
      student_logits, hard_loss = self.student.call_simple(
          inputs, targets, compute_loss=True, variable_dtype=variable_dtype,
          num_microbatches=num_microbatches, **kwargs)
    if not compute_loss:
      return student_logits
    if self.fraction_soft == 0.0:
      return student_logits, hard_loss  # no teacher needed
    if self.temperature is None or self.fraction_soft is None:
      raise ValueError(f"StudentTeacher: set temperature and fraction_soft to distill (got "
                       f"temperature={self.temperature!r}, fraction_soft={self.fraction_soft!r}).")
    if self.student.output_vocab_dim != self.teacher.output_vocab_dim:
      raise ValueError(f"StudentTeacher: student vocabulary {self.student.output_vocab_dim} differs from the "
                       f"teacher's {self.teacher.output_vocab_dim}.")
    vocab_dim = self.student.output_vocab_dim
    graph = inputs.mesh.graph
    with tf.variable_scope("teacher"):
      teacher_logits, _ = self.teacher.call_simple(
          inputs, targets, compute_loss=True, variable_dtype=variable_dtype,
          num_microbatches=num_microbatches, **kwargs)
    graph.make_variables_untrainable([v for v in graph.trainable_variables if v.name.startswith("teacher/")])
    soft_targets = mtf.stop_gradient(mtf.softmax(teacher_logits / self.temperature, vocab_dim))
    soft_loss = mtf.layers.softmax_cross_entropy_with_logits(
        student_logits / self.temperature, soft_targets, vocab_dim, z_loss=self.student.z_loss)
    weights = mtf.layers.weights_nonzero(targets, dtype=variable_dtype.activation_dtype)
    soft_loss = mtf.reduce_sum(soft_loss * weights) / self.student.loss_denominator(targets, num_microbatches)
    soft_loss *= self.temperature ** 2
    step = tf.cast(tf.train.get_or_create_global_step(), tf.int64)
    fraction = tf.where(tf.greater_equal(step, self.distill_start_step), float(self.fraction_soft), 0.0)
    fraction = mtf.import_fully_replicated(inputs.mesh, tf.cast(fraction, soft_loss.dtype), mtf.Shape([]))
    return student_logits, soft_loss * fraction + hard_loss * (1. - fraction)

  def decode(self, *args, **kwargs):
    with tf.variable_scope("student"):
      return self.student.decode(*args, **kwargs)

  def initialize(self):
    """Sets the teacher's (and optionally the student's) initial values from teacher_checkpoint.

    teacher_checkpoint holds a model trained on its own (variables without the `teacher/`
    prefix). Call after building the model and before lowering and initialising variables;
    no-op without a checkpoint.
    """
    if not self.teacher_checkpoint:
      return
    for scope in ["teacher/"] + (["student/"] if self.initialize_student_weights else []):
      tf.train.init_from_checkpoint(self.teacher_checkpoint, {"/": scope})


@gin.configurable(module=GIN_MODULE)
def make_bitransformer(input_vocab_size=gin.REQUIRED, output_vocab_size=gin.REQUIRED, layout=None,
                       mesh_shape=None, encoder_name="encoder", decoder_name="decoder",
                       bitransformer_cls=Bitransformer):
  """A Bitransformer whose encoder/decoder take their settings from the gin scopes encoder/ and decoder/."""
  with gin.config_scope("encoder"):
    encoder = Unitransformer(layer_stack=make_layer_stack(), input_vocab_size=input_vocab_size,
                             output_vocab_size=None, autoregressive=False, name=encoder_name, layout=layout,
                             mesh_shape=mesh_shape)
  with gin.config_scope("decoder"):
    decoder = Unitransformer(layer_stack=make_layer_stack(), input_vocab_size=output_vocab_size,
                             output_vocab_size=output_vocab_size, autoregressive=True, name=decoder_name,
                             layout=layout, mesh_shape=mesh_shape)
  return bitransformer_cls(encoder, decoder)


@gin.configurable(module=GIN_MODULE)
def make_bi_student_teacher(input_vocab_size=gin.REQUIRED, output_vocab_size=gin.REQUIRED, layout=None,
                            mesh_shape=None):
  """A StudentTeacher of two Bitransformers configured in the gin scopes student/ and teacher/."""
  with gin.config_scope("student"):
    student = make_bitransformer(input_vocab_size=input_vocab_size, output_vocab_size=output_vocab_size,
                                 layout=layout, mesh_shape=mesh_shape)
  with gin.config_scope("teacher"):
    teacher = make_bitransformer(input_vocab_size=input_vocab_size, output_vocab_size=output_vocab_size,
                                 layout=layout, mesh_shape=mesh_shape)
  return StudentTeacher(student=student, teacher=teacher)
