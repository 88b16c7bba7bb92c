"""Builds one gin-configured Transformer with whichever mesh_tensorflow is importable and records
what it computes: run once under the original 0.1.21 and once under ours (see sides.py).

The script uses only the original's public API, so the same lines run unchanged on both packages.
From the checkpoint at --checkpoint (written first, from a seeded initialisation, when --write is
given) it computes, on a fixed batch: the logits and loss (in --mode), the gradient of
every trainable variable, every checkpointed variable (optimizer slots included) as restored and
after one optimizer step, and greedy (and for encoder-decoders beam-search) decodes. Everything
goes to the .npz file --out, keyed "logits", "loss", "grad/<var>", "init/<var>" (as restored),
"step/<var>", "decode/<kind>".

Run as a script in a subprocess only (never imported): it is the client code both packages get.
"""

import argparse
import os

import gin
import numpy as np
import tensorflow as tf2
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import utils

BATCH, LENGTH, VOCAB = 4, 8, 20
OPTIMIZERS = {
    "adafactor": lambda: mtf.optimize.AdafactorOptimizer(),
    "adam": lambda: mtf.optimize.AdamWeightDecayOptimizer(learning_rate=0.01, weight_decay_rate=0.01),
    "sgd": lambda: mtf.optimize.SgdOptimizer(0.1),
}


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--gin_file", action="append", default=[], help="model .gin files, in order")
  parser.add_argument("--gin_param", action="append", default=[], help="gin bindings, after the files")
  parser.add_argument("--checkpoint", required=True, help="checkpoint prefix to restore from")
  parser.add_argument("--write", action="store_true", help="first write --checkpoint from a seeded init")
  parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adafactor")
  parser.add_argument("--mode", choices=["train", "eval"], default="train", help="of the loss and gradients")
  parser.add_argument("--mesh_shape", default="", help='e.g. "batch:2;model:2"; "" is one processor')
  parser.add_argument("--layout", default="batch:batch;d_ff:model;heads:model;vocab:model;experts:batch")
  parser.add_argument("--vocab_size", type=int, default=VOCAB,
                      help="the model's vocabulary (the batch's ids stay below VOCAB)")
  parser.add_argument("--out", required=True, help=".npz file for the results")
  return parser.parse_args()


def batch_ids() -> dict:
  """Fixed int32 inputs and targets, [BATCH, LENGTH], with padding (0) and EOS (1) at row ends."""
  rng = np.random.RandomState(7)
  inputs = rng.randint(2, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)
  targets = rng.randint(2, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)
  for row, used in enumerate([LENGTH, LENGTH - 2, LENGTH - 3, 4]):
    inputs[row, used - 1:] = 0
    inputs[row, used - 1] = 1
    targets[row, used - 1:] = 0
    targets[row, used - 1] = 1
  return {"inputs": inputs, "targets": targets}


class Built:
  """One mtf graph on one mesh, lowered: the model, its tf outputs by name, the lowering."""

  def __init__(self, args, model_type: str, train: bool):
    ids = batch_ids()
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    mesh_shape = mtf.convert_to_shape(args.mesh_shape)
    layout = mtf.convert_to_layout_rules(args.layout)
    model = utils.build_model(model_type=model_type, input_vocab_size=args.vocab_size,
                              output_vocab_size=args.vocab_size,
                              layout_rules=layout, mesh_shape=mesh_shape)
    batch_dim, length_dim = mtf.Dimension("batch", BATCH), mtf.Dimension("length", LENGTH)

    def imported(array):
      return mtf.import_tf_tensor(mesh, tf.constant(array), mtf.Shape([batch_dim, length_dim]))

    variable_dtype = mtf.VariableDType(tf.float32, tf.float32, tf.float32)
    fetches = {}
    if train:
      targets = imported(ids["targets"])
      if model_type == "lm":
        shifted = np.concatenate([np.zeros((BATCH, 1), np.int32), ids["targets"][:, :-1]], axis=1)
        logits, loss = model.call_simple(inputs=imported(shifted), targets=targets, compute_loss=True,
                                         mode=args.mode, variable_dtype=variable_dtype)
      else:
        logits, loss = model.call_simple(inputs=imported(ids["inputs"]), targets=targets,
                                         compute_loss=True, mode=args.mode, variable_dtype=variable_dtype)
      fetches["logits"], fetches["loss"] = logits, loss
      variables = graph.trainable_variables
      grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
      for var, grad in zip(variables, grads):
        if grad is not None:
          fetches["grad/" + var.name] = grad
      update_ops = OPTIMIZERS[args.optimizer]().apply_grads(grads, variables)
    elif model_type == "lm":
      prefix = ids["targets"].copy()
      prefix[:, 2:] = 0
      fetches["decode/greedy"] = model.sample_autoregressive(
          imported(prefix), temperature=0.0, variable_dtype=variable_dtype)
    else:
      inputs = imported(ids["inputs"])
      fetches["decode/greedy"] = model.decode(inputs, variable_dtype=variable_dtype, temperature=0.0)
      fetches["decode/beam2"] = model.decode(inputs, variable_dtype=variable_dtype, beam_size=2, alpha=0.6)
    devices = ["cpu:%d" % i for i in range(mesh_shape.size)] if mesh_shape.size > 1 else [""]
    mesh_impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, devices)
    self.lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    self.fetches = {k: self.lowering.export_to_tf_tensor(v) for k, v in fetches.items()}
    self.train_op = None
    if train:
      global_step = tf.train.get_or_create_global_step()
      with tf.control_dependencies([self.lowering.lowered_operation(op) for op in update_ops]):
        self.train_op = tf.assign_add(global_step, 1)


def master_values(sess) -> dict:
  """The values of the checkpointed (master) variables, optimizer slots included, by name (the
  masters keep the model's own names also where the lowering stacks variables)."""
  masters = {v.op.name: v for v in tf.global_variables() if v.op.name != "global_step"}
  return dict(zip(masters, sess.run(list(masters.values()))))


def run_graph(args, model_type: str, train: bool, session_config) -> dict:
  """Builds a fresh graph, restores (or first writes) the checkpoint, runs; returns the results."""
  results = {}
  with tf.Graph().as_default():
    tf.set_random_seed(1234)
    built = Built(args, model_type, train)
    if train:
      tf.train.get_or_create_global_step()
    saver = tf.train.Saver()
    with tf.Session(config=session_config) as sess:
      if args.write and train:
        sess.run(tf.global_variables_initializer())
        saver.save(sess, args.checkpoint, write_meta_graph=False)
      saver.restore(sess, args.checkpoint)
      sess.run(built.lowering.copy_masters_to_slices())
      results.update(sess.run(built.fetches))
      if train:
        restored = master_values(sess)
        results.update({"init/" + name: value for name, value in restored.items()})
        sess.run(built.train_op)
        sess.run(built.lowering.copy_slices_to_masters())
        stepped = master_values(sess)
        results.update({"step/" + name: value for name, value in stepped.items()})
  return results


def main():
  args = parse_args()
  mesh_size = mtf.convert_to_shape(args.mesh_shape).size
  if mesh_size > 1:
    cpus = tf2.config.list_physical_devices("CPU")
    tf2.config.set_logical_device_configuration(
        cpus[0], [tf2.config.LogicalDeviceConfiguration()] * mesh_size)
  tf.disable_eager_execution()
  defaults = os.path.join(os.path.dirname(utils.__file__), "gin", "defaults.gin")
  gin.parse_config_files_and_bindings([defaults] + args.gin_file, args.gin_param)
  model_type = gin.query_parameter("utils.run.model_type")
  session_config = tf.ConfigProto(device_count={"CPU": max(mesh_size, 1)})
  results = run_graph(args, model_type, True, session_config)
  results.update(run_graph(args, model_type, False, session_config))
  np.savez(args.out, **{k: np.asarray(v) for k, v in results.items()})
  print("package:", os.path.dirname(mtf.__file__))


if __name__ == "__main__":
  main()
