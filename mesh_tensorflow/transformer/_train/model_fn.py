"""The estimator-free model function: TF feature tensors -> mtf graph on mesh "my_mesh" -> TF ops.

`build_model_graph` does what upstream's `tpu_estimator_model_fn` did for one mode: imports the
features with dims `batch` and `length`, calls the Transformer's `call_simple` (or its decoder),
and lowers the graph. Training adds `mtf.gradients`, the optimizer's updates and a global-step
increment. The mesh implementation is `PlacementMeshImpl` over `mesh_devices` on CPUs/GPUs (with
sliced masters: no device holds more variable bytes than its slices) and `SimdMeshImpl` on TPUs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer

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


def _import_features(mesh, features: dict) -> dict:
  """Each [batch, length] int feature as an mtf Tensor with dims `batch` and `length`."""
  mtf_features = {}
  for key, value in sorted(features.items()):
    batch_size, length = value.shape.as_list()
    shape = mtf.Shape([mtf.Dimension("batch", batch_size), mtf.Dimension("length", length)])
    mtf_features[key] = mtf.import_tf_tensor(mesh, tf.cast(value, tf.int32), shape, name=key)
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


def _example_log_likelihoods(logits, targets, vocab_dim):
  """Per example: (sum of log p(target) over non-padding targets, number of such targets)."""
  logits = mtf.cast(logits, tf.float32)
  weights = mtf.cast(mtf.greater(targets, 0), tf.float32)
  nll = mtf.layers.softmax_cross_entropy_with_logits(logits, targets, vocab_dim) * weights
  length_dim = targets.shape.dims[-1]
  return -mtf.reduce_sum(nll, reduced_dim=length_dim), mtf.reduce_sum(weights, reduced_dim=length_dim)


def _decode(model, mtf_features: dict, variable_dtype):
  """Samples (Unitransformer: continues `inputs`, which hold the prompt then zeros) or decodes."""
  inputs = mtf_features["inputs"]
  if is_unitransformer(model):
    return model.sample_autoregressive(inputs, variable_dtype=variable_dtype, remove_partial_sequences=True)
  return model.decode(inputs, variable_dtype=variable_dtype)


def build_model_graph(model, features: dict, mode: str, mesh_impl, variable_dtype, autostack: bool = True,
                      optimizer: Optional[Callable] = None, learning_rate=None,
                      variable_filter: Optional[Callable] = None, variable_placer=None,
                      random_position=None) -> LoweredModel:
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
    variable_filter: train only; a predicate on variable names selecting what is trained.
    variable_placer: places the master variables (an mtf.utils.BalancedVariablePlacer over the
      TPU hosts, say); default: all on "cpu:0".
    random_position: the number random ops draw for (mtf.Lowering's argument); train default:
      the global step, so dropout masks follow the step and a resumed run draws what an
      uninterrupted one would have.

  Returns:
    LoweredModel with outputs: train {"loss", "learning_rate", "tokens"}, eval {"log_likelihood",
    "num_tokens"} (per example), infer {"outputs"} (token ids per example).
  """
  if mode not in MODES:
    raise ValueError(f"Unknown model_fn mode {mode!r}; expected one of {MODES}.")
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, MESH_NAME, variable_placer)
  mtf_features = _import_features(mesh, features)
  mtf_outputs, update_ops = {}, []
  if mode == "infer":
    mtf_outputs["outputs"] = mtf.anonymize(_decode(model, mtf_features, variable_dtype))
  else:
    logits, loss = _call_model(model, mtf_features, mode, variable_dtype, compute_loss=(mode == "train"))
    if mode == "train":
      mtf_outputs["loss"] = loss
      trained = [v for v in graph.trainable_variables if variable_filter is None or variable_filter(v.name)]
      if not trained:
        names = sorted(v.name for v in graph.trainable_variables)
        raise ValueError(f"utils.run.variable_filter {variable_filter!r} matches none of the model's "
                         f"{len(names)} trainable variables (e.g. {names[:3]}): nothing would train. Fix the "
                         f"pattern (it is searched in each variable name) or drop the binding.")
      grads = mtf.gradients([loss], [v.outputs[0] for v in trained])
      kwargs = {} if learning_rate is None else {"learning_rate": learning_rate}
      update_ops = optimizer(**kwargs).apply_grads(grads, trained)
    else:
      log_likelihood, num_tokens = _example_log_likelihoods(
          logits, mtf_features["targets"], logits.shape.dims[-1])
      mtf_outputs.update(log_likelihood=mtf.anonymize(log_likelihood), num_tokens=mtf.anonymize(num_tokens))
  check_layout_divides(graph, mesh_impl)
  if mode == "train" and random_position is None:
    random_position = tf.train.get_or_create_global_step().read_value()
  lowering = mtf.Lowering(graph, {mesh: mesh_impl}, autostack=autostack, random_position=random_position)
  outputs = {k: lowering.export_to_tf_tensor(v) for k, v in mtf_outputs.items()}
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
