"""SavedModel export (export_infer / export_score): strings in, decodes or scores out, servable
without mesh_tensorflow (tf.saved_model.load, a TF1 session, TF Serving).

The graph tokenizes with the vocabulary's `encode_tf`, runs the lowered mesh graph and
detokenizes with `decode_tf`; requests of 1 to batch_size strings are padded to the batch and
sliced back (serving_io). It holds the master variables; its main op copies them to the slices
when the SavedModel is loaded. By default the graph is lowered on one processor and carries no
device names, so it loads on whatever device the server has; `devices="mesh"` keeps the run's mesh
and devices. Decoding is incremental (each layer's key/value states are kept between positions).

Signatures (string tensors [n], 1 <= n <= batch_size):
  export_infer:  serving_default {inputs} -> {outputs}: decodes as the `infer` mode does (the
                 gin-configured temperature; fresh random draws per call when it is above 0);
                 sample {inputs, temperature (float32 scalar), seed (int64 scalar)} -> {outputs}:
                 temperature 0 is greedy, the same seed gives the same draws.
  export_score:  serving_default {targets} (language models) or {inputs, targets}
                 (encoder-decoders) -> {scores} (float32 [n], log-likelihood of each target).
"""

from __future__ import annotations

import os

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._lowering import random_stream
from mesh_tensorflow.transformer import vocabulary as vocabulary_lib
from mesh_tensorflow.transformer._train import eval as eval_lib, loop, model_fn, serving_io
from mesh_tensorflow.transformer._utils import GIN_MODULE

DEVICES = ("one", "mesh")


def _check_servable_vocabulary(vocabulary, role: str) -> None:
  """Refuses vocabularies whose encode_tf/decode_tf call back into Python (py_function): a
  SavedModel holding them runs only inside the exporting process."""
  cls = type(vocabulary)
  if (cls.encode_tf is vocabulary_lib.Vocabulary.encode_tf
      or cls.decode_tf is vocabulary_lib.Vocabulary.decode_tf):
    raise ValueError(
        f"The {role} vocabulary {cls.__name__} encodes/decodes with Python (tf.py_function), which a "
        f"SavedModel cannot carry to another process or TF Serving. Export with a vocabulary whose "
        f"encode_tf and decode_tf are TF ops (e.g. vocabulary.ByteVocabulary), or override them.")


def _configured(parameter: str, default):
  """The gin binding of `parameter` (as the infer mode reads it), else the function's default."""
  try:
    return gin.query_parameter(parameter)
  except ValueError:
    return default


def _decode_with_temperature(model, inputs, variable_dtype, temperature):
  """Decodes as model_fn's infer mode does, with `temperature` (an mtf scalar) for sampling."""
  if model_fn.is_unitransformer(model):
    return model.sample_autoregressive(inputs, variable_dtype=variable_dtype, remove_partial_sequences=True,
                                       temperature=temperature)
  return model.decode(inputs, variable_dtype=variable_dtype, temperature=temperature)


def _samples(model) -> bool:
  """Whether the model decodes by sampling (the `sample` signature applies) rather than beam search."""
  return model_fn.is_unitransformer(model) or _configured("Bitransformer.decode.beam_size", 1) == 1


def _default_temperature(model) -> float:
  if model_fn.is_unitransformer(model):
    return float(_configured("Unitransformer.sample_autoregressive.temperature", 0.0))
  return float(_configured("Bitransformer.decode.temperature", 0.0))


def _infer_graph(runner: loop.ModelRunner, ids: tf.Tensor, mesh_impl):
  """Lowers the decoder on ids [batch, length]: returns (lowering, output ids, extra signature inputs)."""
  model = runner.model
  if not _samples(model):  # beam search: deterministic, as model_fn builds it
    built = model_fn.build_model_graph(model, {"inputs": ids}, "infer", mesh_impl, runner.variable_dtype,
                                       runner.autostack)
    return built.lowering, built.outputs["outputs"], {}
  temperature = tf.placeholder_with_default(_default_temperature(model), [], name="temperature")
  seed = tf.placeholder_with_default(random_stream.next_position(tf.get_default_graph()), [], name="seed")
  graph = mtf.Graph()
  mesh = mtf.Mesh(graph, model_fn.MESH_NAME)
  batch_size, length = ids.shape.as_list()
  shape = mtf.Shape([mtf.Dimension("batch", batch_size), mtf.Dimension("length", length)])
  mtf_ids = mtf.import_tf_tensor(mesh, ids, shape, name="inputs")
  mtf_temperature = mtf.import_fully_replicated(mesh, temperature, mtf.Shape([]), name="temperature")
  outputs = mtf.anonymize(_decode_with_temperature(model, mtf_ids, runner.variable_dtype, mtf_temperature))
  model_fn.check_layout_divides(graph, mesh_impl)
  lowering = mtf.Lowering(graph, {mesh: mesh_impl}, autostack=runner.autostack, random_position=seed)
  return lowering, lowering.export_to_tf_tensor(outputs), {"temperature": temperature, "seed": seed}


def _saver_of_collection_variables() -> tf.train.Saver:
  """The SavedModel's saver, over the graph's variables; then drops from the variable collections
  what a MetaGraphDef cannot list (sliced masters' saveable parts, e.g. a float32 part checkpointed
  as bfloat16), which the saver still writes and restores."""
  saver = tf.train.Saver(sharded=True, allow_empty=True)
  for key in (tf.GraphKeys.GLOBAL_VARIABLES, tf.GraphKeys.TRAINABLE_VARIABLES):
    listed = tf.get_collection_ref(key)
    listed[:] = [v for v in listed if isinstance(v, tf.Variable)]
  return saver


def _serving_mesh(runner: loop.ModelRunner, devices: str):
  """(mesh_impl, session config) of the exported graph: one processor, or the run's mesh."""
  if devices == "mesh":
    return (model_fn.make_mesh_impl(runner.mesh_shape, runner.layout_rules, runner.mesh_devices),
            model_fn.session_config(runner.mesh_devices))
  return model_fn.make_mesh_impl(mtf.Shape([]), mtf.LayoutRules([])), model_fn.session_config(None)


@gin.configurable("export_serving", module=GIN_MODULE, allowlist=["devices"])
def export_model(runner: loop.ModelRunner, vocabulary, checkpoint: str, export_dir: str, score: bool,
                 devices: str = "one") -> str:
  """Writes a SavedModel of the checkpoint to `export_dir/<step>`; returns that directory.

  Args:
    runner: the model, mesh, batch size and sequence lengths of the run.
    vocabulary: a vocabulary or (inputs, targets) pair with TF-op encode_tf/decode_tf.
    checkpoint: the checkpoint path to export.
    export_dir: the SavedModel goes to export_dir/<the checkpoint's step>.
    score: export_score (log-likelihoods) instead of export_infer (decodes).
    devices: "one" (gin `utils.export_serving.devices`): lowered on a single processor, with no
      device names, for any one-device server; "mesh": the run's mesh_shape, layout_rules and
      mesh_devices, kept in the graph (the server must have those devices).
  """
  if devices not in DEVICES:
    raise ValueError(f"utils.export_serving.devices = {devices!r}; expected one of {DEVICES}.")
  inputs_vocab = vocabulary_lib.inputs_vocabulary(vocabulary)
  targets_vocab = vocabulary_lib.targets_vocabulary(vocabulary)
  lm = model_fn.is_unitransformer(runner.model)
  _check_servable_vocabulary(targets_vocab, "targets")
  if not (lm and score):
    _check_servable_vocabulary(inputs_vocab, "inputs")
  if not checkpoint or not tf.io.gfile.exists(checkpoint + ".index"):
    raise ValueError(f"No checkpoint {checkpoint!r} to export; train first or set export_checkpoint_step.")
  path = os.path.join(export_dir, str(loop.checkpoint_step(checkpoint)))
  if tf.io.gfile.exists(path):
    raise ValueError(f"{path} already exists (an export of this checkpoint step): remove it, or export to "
                     f"another directory (utils.run.export_path).")
  batch = runner.batch_size
  with tf.Graph().as_default():
    loop.set_random_seed(runner.random_seed)
    mesh_impl, config = _serving_mesh(runner, devices)
    if score:
      lengths = eval_lib.model_feature_lengths(runner.model, runner.sequence_length)
      texts = {k: tf.placeholder(tf.string, [None], name=k) for k in lengths}
      count = serving_io.request_size(texts["targets"], batch, texts.get("inputs"))
      features = {k: serving_io.encode_batch(inputs_vocab if k == "inputs" else targets_vocab,
                                             serving_io.pad_to_batch(texts[k], count, batch), n, True, False)
                  for k, n in lengths.items()}
      built = model_fn.build_model_graph(runner.model, features, "eval", mesh_impl, runner.variable_dtype,
                                         runner.autostack)
      lowering, signatures = built.lowering, {"serving_default": (texts, {
          "scores": tf.identity(built.outputs["log_likelihood"][:count], name="scores")})}
    else:
      texts = {"inputs": tf.placeholder(tf.string, [None], name="inputs")}
      count = serving_io.request_size(texts["inputs"], batch)
      length = runner.sequence_length["targets" if lm else "inputs"]
      ids = serving_io.encode_batch(inputs_vocab, serving_io.pad_to_batch(texts["inputs"], count, batch),
                                    length, not lm, lm)
      lowering, output_ids, sampling = _infer_graph(runner, ids, mesh_impl)
      outputs = {"outputs": serving_io.decode_batch(targets_vocab, output_ids, count)}
      signatures = {"serving_default": (texts, outputs)}
      if sampling:
        signatures["sample"] = ({**texts, **sampling}, outputs)
    copy_in = lowering.copy_masters_to_slices()
    with tf.Session(config=config) as session:
      loop.initialize_and_restore(session, lowering, checkpoint)
      saver = _saver_of_collection_variables()
      builder = tf.saved_model.Builder(path)
      builder.add_meta_graph_and_variables(
          session, [tf.saved_model.SERVING], main_op=copy_in, strip_default_attrs=True,
          clear_devices=(devices == "one"), saver=saver,
          signature_def_map={name: tf.saved_model.predict_signature_def(ins, outs)
                             for name, (ins, outs) in signatures.items()})
      builder.save()
  return path
