"""The training graph of a gin-configured Transformer (package gin files + bindings)."""

from __future__ import annotations

import inspect
import os
from typing import Sequence

import numpy as np
import tensorflow.compat.v1 as tf


def build_transformer_graph(
  gin_files: Sequence[str],
  gin_bindings: Sequence[str] = (),
  batch: int = 8,
  length: int = 32,
  vocab_size: int = 256,
  tf_graph=None,
  outer_batch_size: int = 1,
) -> tuple:
  """(mtf Graph, loss) of one training step (loss, gradients, optimizer updates) of a gin Transformer.

  The optimizer is the gin-configured `utils.run.optimizer` (Adafactor in defaults.gin), so its
  slots count toward memory as training keeps them; `LayerStack.recompute_grads = True` among the
  bindings rematerialises every layer on the backward pass.

  Args:
    gin_files: gin files parsed after the package's defaults.gin; relative paths are looked up
      in the package's gin directory first (e.g. "models/lm_base.gin").
    gin_bindings: extra gin bindings, e.g. ["num_layers = 2", "d_model = 64"].
    batch, length, vocab_size: the features' batch size, sequence length and vocabulary.
    tf_graph: the TF graph holding the master variables and features (default: a new one); pass
      the graph a real lowering of the step will be built in.
    outer_batch_size: > 1 splits the features' batch into `outer_batch` x `batch` dimensions, as
      tpu_estimator_model_fn.outer_batch_size does (a pipeline's microbatches, say).
  """
  import gin

  import mesh_tensorflow as mtf
  from mesh_tensorflow.transformer import utils
  from mesh_tensorflow.transformer._train import model_fn
  from mesh_tensorflow.transformer._train import run as _run  # noqa: F401  (registers utils.run)

  _parse_gin(gin_files, gin_bindings)
  try:
    model_type = gin.query_parameter("utils.run.model_type")
  except ValueError:
    model_type = "bitransformer"
  model = utils.build_model(model_type, input_vocab_size=vocab_size, output_vocab_size=vocab_size)
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, "my_mesh")
  ids = np.random.RandomState(0).randint(2, vocab_size, size=(batch, length)).astype(np.int32)
  with (tf_graph or tf.Graph()).as_default():
    features = model_fn._import_features(
      mesh, {"inputs": tf.constant(ids), "targets": tf.constant(np.roll(ids, 1, axis=1))}, outer_batch_size)
    _, loss = model_fn._call_model(model, features, "train", utils.get_variable_dtype(), compute_loss=True)
    variables = graph.trainable_variables
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    _optimizer().apply_grads(grads, variables)
  return graph, loss


def configured_num_layers(gin_files: Sequence[str], gin_bindings: Sequence[str] = ()) -> int:
  """The `num_layers` macro the gin files and bindings set (defaults.gin: 6)."""
  import gin

  _parse_gin(gin_files, gin_bindings)
  return int(gin.query_parameter("%num_layers"))


def _parse_gin(gin_files: Sequence[str], gin_bindings: Sequence[str]) -> None:
  """Parses defaults.gin, then `gin_files` (package gin directory first), then `gin_bindings`."""
  import gin

  from mesh_tensorflow.transformer._utils.gin_config import packaged_gin_dir

  gin_dir = packaged_gin_dir()
  with gin.unlock_config():
    gin.parse_config_file(os.path.join(gin_dir, "defaults.gin"))
    for f in gin_files:
      packaged = os.path.join(gin_dir, f)
      gin.parse_config_file(packaged if os.path.exists(packaged) else f)
    gin.parse_config("\n".join(gin_bindings))


def _optimizer():
  """The gin-bound `utils.run.optimizer` (defaults.gin: Adafactor), or SGD when none is bound.

  Schedules that follow the training step (Adafactor's default learning and decay rates) become
  constants: they are scalars, so they change no shape, byte or collective, and a dry run, which
  lowers in a TF graph of its own, could not read a step tensor made here.
  """
  import gin

  import mesh_tensorflow as mtf

  try:
    reference = gin.query_parameter("utils.run.optimizer")
  except ValueError:
    return mtf.optimize.SgdOptimizer(0.01)
  parameters = inspect.signature(reference.configurable.wrapped).parameters
  constants = {
    name: value
    for name, value in {"learning_rate": 0.01, "decay_rate": 0.8}.items()
    if name in parameters and parameters[name].default is None
  }
  return reference.scoped_configurable_fn(**constants)
