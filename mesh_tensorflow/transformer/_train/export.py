"""SavedModel export (export_infer / export_score): strings in, decodes or scores out.

The exported graph tokenizes with the vocabulary's `encode_tf`, runs the lowered mesh graph and
detokenizes with `decode_tf`. It holds the master variables; its main op copies them to the
per-device slices when the SavedModel is loaded. Signature `serving_default`: inputs `inputs`
(and `targets` for scoring), a [batch_size] string tensor; output `outputs` (strings) or `scores`.
"""

from __future__ import annotations

import os

import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import vocabulary as vocabulary_lib
from mesh_tensorflow.transformer._train import decode, eval as eval_lib, loop, model_fn


def _encode_batch(vocabulary, texts, length: int, append_eos: bool, is_prompt: bool):
  """[batch] strings -> [batch, length] int32 ids, zero padded, cut by decode.fit_to_length."""
  def encode_one(text):
    ids = vocabulary.encode_tf(text)
    if append_eos:
      ids = tf.concat([ids, [decode.EOS_ID]], 0)
    ids = decode.fit_to_length(ids, length, is_prompt)
    return tf.pad(ids, [[0, length - tf.shape(ids)[0]]])
  ids = tf.map_fn(encode_one, texts, fn_output_signature=tf.int32)
  return tf.reshape(ids, [texts.shape[0], length])


def export_model(runner: loop.ModelRunner, vocabulary, checkpoint: str, export_dir: str, score: bool) -> str:
  """Writes a SavedModel of the checkpoint to `export_dir/<step>`; returns that directory."""
  if not checkpoint or not tf.io.gfile.exists(checkpoint + ".index"):
    raise ValueError(f"No checkpoint {checkpoint!r} to export; train first or set export_checkpoint_step.")
  inputs_vocab = vocabulary_lib.inputs_vocabulary(vocabulary)
  targets_vocab = vocabulary_lib.targets_vocabulary(vocabulary)
  path = os.path.join(export_dir, str(loop.checkpoint_step(checkpoint)))
  lm = model_fn.is_unitransformer(runner.model)
  with tf.Graph().as_default():
    loop.set_random_seed(runner.random_seed)
    texts = {"inputs": tf.placeholder(tf.string, [runner.batch_size], name="inputs")}
    if score:
      texts["targets"] = tf.placeholder(tf.string, [runner.batch_size], name="targets")
      lengths = eval_lib.model_feature_lengths(runner.model, runner.sequence_length)
      features = {k: _encode_batch(inputs_vocab if k == "inputs" else targets_vocab, texts[k], n, True, False)
                  for k, n in lengths.items()}
      mode = "eval"
    else:
      length = runner.sequence_length["targets" if lm else "inputs"]
      features = {"inputs": _encode_batch(inputs_vocab, texts["inputs"], length, not lm, lm)}
      mode = "infer"
    mesh_impl = model_fn.make_mesh_impl(runner.mesh_shape, runner.layout_rules, runner.mesh_devices)
    built = model_fn.build_model_graph(runner.model, features, mode, mesh_impl, runner.variable_dtype,
                                       runner.autostack)
    if score:
      outputs = {"scores": built.outputs["log_likelihood"]}
    else:
      outputs = {"outputs": tf.map_fn(targets_vocab.decode_tf, built.outputs["outputs"],
                                      fn_output_signature=tf.string)}
    copy_in = built.lowering.copy_masters_to_slices()
    with tf.Session(config=model_fn.session_config(runner.mesh_devices)) as session:
      loop.initialize_and_restore(session, built.lowering, checkpoint)
      builder = tf.saved_model.Builder(path)
      signature = tf.saved_model.predict_signature_def(texts, outputs)
      builder.add_meta_graph_and_variables(
          session, [tf.saved_model.SERVING], signature_def_map={"serving_default": signature},
          main_op=copy_in, strip_default_attrs=True)
      builder.save()
  return path
