"""The estimator-free model function: TF feature tensors -> mtf graph on mesh "my_mesh" -> TF ops.

`build_model_graph` does what upstream's `tpu_estimator_model_fn` did for one mode: imports the
features with dims `batch` and `length`, calls the Transformer's `call_simple` (or its decoder),
and lowers the graph. Training adds `mtf.gradients`, the optimizer's updates and a global-step
increment. The mesh implementation is `PlacementMeshImpl` over `mesh_devices` on CPUs/GPUs (with
sliced masters: no device holds more variable bytes than its slices) and `SimdMeshImpl` on TPUs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional, Sequence

import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer
from mesh_tensorflow.transformer._train import nonfinite

MESH_NAME = "my_mesh"
MODES = ("train", "eval", "infer")


@dataclasses.dataclass
class LoweredModel:
  """What the session loop runs: named TF output tensors, the train op, and the lowering."""
  lowering: mtf.Lowering
  outputs: dict
  train_op: Optional[tf.Operation] = None


def mesh_devices_or_default(mesh_shape, mesh_devices: Optional[Sequence[str]]) -> list:
  """One device string per processor; "" (TF's default placement) for each when none are given."""
  size = mtf.convert_to_shape(mesh_shape).size
  if mesh_devices is None:
    return [""] * size
  devices = list(mesh_devices)
  if len(devices) != size:
    raise ValueError(
        f"mesh_shape {mtf.convert_to_shape(mesh_shape)} has {size} processors but mesh_devices lists "
        f"{len(devices)} devices ({devices}). Give one device per processor (utils.run.mesh_devices) "
        f"or pick a mesh of {len(devices)} processors (utils.run.mesh_shape, e.g. a gin/layouts file).")
  return devices


def make_mesh_impl(mesh_shape, layout_rules, mesh_devices: Optional[Sequence[str]] = None,
                   device_assignment=None, logical_to_physical=None, masters: str = "sliced"):
  """PlacementMeshImpl on CPUs/GPUs; SimdMeshImpl when a TPU device_assignment is given.

  On CPUs/GPUs the variables have no whole masters by default (`masters="sliced"`): their slices
  are checkpointed as parts of the whole variables, so checkpoints are the same as with whole
  masters ("whole") and no device holds a copy of every variable.
  """
  if device_assignment is not None:
    return mtf.simd_mesh_impl.SimdMeshImpl(mesh_shape, layout_rules, device_assignment=device_assignment,
                                           logical_to_physical=logical_to_physical)
  return mtf.placement_mesh_impl.PlacementMeshImpl(
      mesh_shape, layout_rules, mesh_devices_or_default(mesh_shape, mesh_devices), masters=masters)


def session_config(mesh_devices: Optional[Sequence[str]]) -> tf.ConfigProto:
  """A session config for mesh_devices: as many (virtual) CPU devices as they name, and threads
  per kernel as `mtf.placement_mesh_impl.session_config_for_devices` chooses."""
  return mtf.placement_mesh_impl.session_config_for_devices(
      list(mesh_devices or []), tf.ConfigProto(allow_soft_placement=False))


def check_layout_divides(graph, mesh_impl) -> None:
  """Raises before lowering if a layout rule splits a dimension its mesh dimension does not divide."""
  for op in graph.operations:
    for tensor in op.outputs:
      for dim in tensor.shape.dims:
        axis = mesh_impl.tensor_dimension_to_mesh_axis(dim)
        if axis is not None and dim.size % mesh_impl.shape[axis].size:
          mesh_dim = mesh_impl.shape[axis]
          raise ValueError(
              f"Layout rule {dim.name}:{mesh_dim.name} splits dimension {dim.name!r} (size {dim.size}, "
              f"e.g. in tensor {tensor.name!r}) {mesh_dim.size} ways, which does not divide it. Change "
              f"utils.run.layout_rules or the model's {dim.name!r} size to a multiple of {mesh_dim.size}.")


def _import_features(mesh, features: dict, outer_batch_size: int = 1) -> dict:
  """Each [batch, length] int feature as an mtf Tensor with dims `batch` and `length`; with
  outer_batch_size > 1, dims `outer_batch`, `batch` (batch / outer_batch_size) and `length`."""
  mtf_features = {}
  for key, value in sorted(features.items()):
    batch_size, length = value.shape.as_list()
    batch_dims = [mtf.Dimension("batch", batch_size)]
    if outer_batch_size > 1:
      if batch_size % outer_batch_size:
        raise ValueError(f"outer_batch_size {outer_batch_size} (tpu_estimator_model_fn.outer_batch_size) "
                         f"does not divide the batch size {batch_size}: pick a divisor of it.")
      batch_dims = [mtf.Dimension("outer_batch", outer_batch_size),
                    mtf.Dimension("batch", batch_size // outer_batch_size)]
    shape = mtf.Shape(batch_dims + [mtf.Dimension("length", length)])
    value = tf.reshape(tf.cast(value, tf.int32), shape.to_integer_list)
    mtf_features[key] = mtf.import_tf_tensor(mesh, value, shape, name=key)
  return mtf_features


def is_unitransformer(model) -> bool:
  return isinstance(model, transformer.Unitransformer)


def _call_model(model, mtf_features: dict, mode: str, variable_dtype, compute_loss: bool):
  """Runs the model forward on the features: returns (logits, loss or None)."""
  targets = mtf_features["targets"]
  if is_unitransformer(model):
    kwargs = dict(sequence_id=mtf_features.get("targets_segmentation"),
                  position=mtf_features.get("targets_position"))
    if model.autoregressive:
      inputs = transformer.autoregressive_inputs(targets, sequence_id=kwargs["sequence_id"])
    else:
      inputs = mtf_features["inputs"]
  else:
    inputs = mtf_features["inputs"]
    kwargs = dict(encoder_sequence_id=mtf_features.get("inputs_segmentation"),
                  decoder_sequence_id=mtf_features.get("targets_segmentation"),
                  decoder_subsequence_id=mtf_features.get("targets_subsegmentation"),
                  encoder_position=mtf_features.get("inputs_position"),
                  decoder_position=mtf_features.get("targets_position"))
  return model.call_simple(inputs=inputs, targets=targets, compute_loss=compute_loss, mode=mode,
                           variable_dtype=variable_dtype, **kwargs)


def _eval_outputs(logits, targets, vocab_dim, token_outputs: bool) -> dict:
  """Per example: log_likelihood (sum of log p(target) over non-padding targets) and num_tokens;
  with token_outputs also per token: cross_entropy, predictions (argmax), targets and weights."""
  logits = mtf.cast(logits, tf.float32)
  weights = mtf.cast(mtf.greater(targets, 0), tf.float32)
  cross_entropy = mtf.layers.softmax_cross_entropy_with_logits(logits, targets, vocab_dim)
  length_dim = targets.shape.dims[-1]
  outputs = {"log_likelihood": -mtf.reduce_sum(cross_entropy * weights, reduced_dim=length_dim),
             "num_tokens": mtf.reduce_sum(weights, reduced_dim=length_dim)}
  if token_outputs:
    outputs.update(cross_entropy=cross_entropy, weights=weights, targets=targets,
                   predictions=mtf.cast(mtf.argmax(logits, vocab_dim), targets.dtype))
  return outputs


def _variable_predicate(variable_filter) -> Callable:
  """variable_filter as a predicate on mtf Variables: None (all), a regex string searched in the
  variable name (upstream's form), or a callable taking the mtf Variable."""
  if variable_filter is None:
    return lambda v: True
  if isinstance(variable_filter, str):
    pattern = re.compile(variable_filter)
    return lambda v: bool(pattern.search(v.name))
  if callable(variable_filter):
    return variable_filter
  raise ValueError(f"variable_filter {variable_filter!r} must be None, a regex string or a callable taking "
                   f"an mtf.Variable.")


def _decode(model, mtf_features: dict, variable_dtype, predict_fn: Optional[Callable] = None):
  """Samples (Unitransformer: continues `inputs`, which hold the prompt then zeros) or decodes;
  predict_fn(model=, features=, variable_dtype=) replaces both when given."""
  inputs = mtf_features["inputs"]
  if predict_fn is not None:
    return predict_fn(model=model, features=mtf_features, variable_dtype=variable_dtype)
  if is_unitransformer(model):
    return model.sample_autoregressive(inputs, variable_dtype=variable_dtype, remove_partial_sequences=True)
  return model.decode(inputs, variable_dtype=variable_dtype)


def _merge_batch_dims(value: tf.Tensor, mtf_tensor) -> tf.Tensor:
  """[outer_batch, batch, ...] -> [outer_batch * batch, ...]; other tensors unchanged."""
  names = [d.name for d in mtf_tensor.shape.dims]
  if names[:2] != ["outer_batch", "batch"]:
    return value
  shape = value.shape.as_list()
  return tf.reshape(value, [shape[0] * shape[1]] + shape[2:])


def build_model_graph(model, features: dict, mode: str, mesh_impl, variable_dtype, autostack: bool = True,
                      optimizer: Optional[Callable] = None, learning_rate=None,
                      variable_filter=None, variable_placer=None, random_position=None,
                      outer_batch_size: int = 1, predict_fn: Optional[Callable] = None,
                      token_outputs: bool = False, log_file=None,
                      skip_non_finite: bool = False) -> LoweredModel:
  """Builds and lowers one mode's graph on mesh "my_mesh" in the default TF graph.

  Args:
    model: a transformer.Unitransformer, Bitransformer or StudentTeacher.
    features: {name: int tf.Tensor [batch, length]} (`targets`, optionally `inputs`,
      `*_segmentation`, `*_position`); for "infer" only `inputs` (prompts followed by zeros).
    mode: "train" (loss + train op), "eval" (per-example log-likelihoods) or "infer" (decodes).
    mesh_impl: from make_mesh_impl.
    variable_dtype: an mtf.VariableDType.
    optimizer: train only; called as optimizer(learning_rate=...) (a gin-configured class).
    learning_rate: train only; a TF scalar, float or None (the optimizer's default).
    variable_filter: train only; what is trained: None (all), a regex searched in variable names,
      or a predicate on mtf Variables (upstream's forms).
    variable_placer: places the master variables (an mtf.utils.BalancedVariablePlacer over the
      TPU hosts, say); default: all on "cpu:0".
    random_position: the number random ops draw for (mtf.Lowering's argument); train default:
      the global step, so dropout masks follow the step and a resumed run draws what an
      uninterrupted one would have.
    outer_batch_size: splits `batch` into `outer_batch` x `batch` (train and eval).
    predict_fn: replaces decoding (infer) or log-likelihoods (eval): called as
      predict_fn(model=, features=, variable_dtype=), returns a [batch, length] (infer) or
      [batch] (eval) mtf Tensor.
    token_outputs: eval only; also output per-token values (see _eval_outputs).
    log_file: mtf.Lowering's log_file (variable and operation sizes).
    skip_non_finite: train only; a step whose loss, gradient norm or learning rate is not finite
      changes no variable (nonfinite.gate_updates); outputs "gradient_norm" and "finite" (whether
      it was) are added.

  Returns:
    LoweredModel with outputs: train {"loss", "learning_rate", "tokens"} (see skip_non_finite), eval
    {"log_likelihood", "num_tokens"} (per example; token_outputs adds [batch, length] tensors),
    infer {"outputs"} (token ids per example).
  """
  if mode not in MODES:
    raise ValueError(f"Unknown model_fn mode {mode!r}; expected one of {MODES}.")
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, MESH_NAME, variable_placer)
  mtf_features = _import_features(mesh, features, outer_batch_size if mode != "infer" else 1)
  mtf_outputs, update_ops = {}, []
  if mode == "infer":
    mtf_outputs["outputs"] = mtf.anonymize(_decode(model, mtf_features, variable_dtype, predict_fn))
  elif mode == "eval" and predict_fn is not None:
    weights = mtf.cast(mtf.greater(mtf_features["targets"], 0), tf.float32)
    mtf_outputs.update(
        log_likelihood=mtf.anonymize(predict_fn(model=model, features=mtf_features,
                                                variable_dtype=variable_dtype)),
        num_tokens=mtf.anonymize(mtf.reduce_sum(weights, reduced_dim=weights.shape.dims[-1])))
  else:
    logits, loss = _call_model(model, mtf_features, mode, variable_dtype, compute_loss=(mode == "train"))
    if mode == "train":
      mtf_outputs["loss"] = loss
      keep = _variable_predicate(variable_filter)
      trained = [v for v in graph.trainable_variables if keep(v)]
      if not trained:
        names = sorted(v.name for v in graph.trainable_variables)
        raise ValueError(f"utils.run.variable_filter {variable_filter!r} matches none of the model's "
                         f"{len(names)} trainable variables (e.g. {names[:3]}): nothing would train. Fix the "
                         f"pattern (it is searched in each variable name) or drop the binding.")
      grads = mtf.gradients([loss], [v.outputs[0] for v in trained])
      kwargs = {} if learning_rate is None else {"learning_rate": learning_rate}
      update_ops = optimizer(**kwargs).apply_grads(grads, trained)
      if skip_non_finite:
        mtf_outputs["gradient_norm"] = nonfinite.gradient_norm(grads)
        checked = [mtf.cast(loss, tf.float32), mtf_outputs["gradient_norm"]]
        if learning_rate is not None:
          checked.append(mtf.import_tf_tensor(mesh, tf.cast(learning_rate, tf.float32), mtf.Shape([])))
        mtf_outputs["finite"] = nonfinite.all_finite(checked)
        update_ops = nonfinite.gate_updates(update_ops, mtf_outputs["finite"])
    else:
      mtf_outputs.update({k: mtf.anonymize(v) for k, v in _eval_outputs(
          logits, mtf_features["targets"], logits.shape.dims[-1], token_outputs).items()})
  check_layout_divides(graph, mesh_impl)
  if mode == "train" and random_position is None:
    random_position = tf.train.get_or_create_global_step().read_value()
  lowering = mtf.Lowering(graph, {mesh: mesh_impl}, autostack=autostack, random_position=random_position,
                          log_file=log_file)
  outputs = {k: _merge_batch_dims(lowering.export_to_tf_tensor(v), v) for k, v in mtf_outputs.items()}
  train_op = None
  if mode == "train":
    outputs["loss"] = tf.cast(outputs["loss"], tf.float32)
    outputs["learning_rate"] = tf.cast(tf.convert_to_tensor(
        float("nan") if learning_rate is None else learning_rate), tf.float32)
    outputs["tokens"] = tf.reduce_sum(tf.cast(tf.greater(features["targets"], 0), tf.int64))
    global_step = tf.train.get_or_create_global_step()
    with tf.control_dependencies([lowering.lowered_operation(op) for op in update_ops]):
      train_op = tf.assign_add(global_step, 1).op
  return LoweredModel(lowering=lowering, outputs=outputs, train_op=train_op)
