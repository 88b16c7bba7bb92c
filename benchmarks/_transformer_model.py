"""The benchmark Transformer training step, written once in mtf and once in plain TensorFlow.

Both versions compute the same math from the same initial values (NumPy, one seed): token
embedding, `num_layers` pre-norm blocks of causal multi-head self-attention and a ReLU
feed-forward layer, an RMS norm, a vocabulary projection, mean cross-entropy and one SGD update.
With `dropout_rate`, dropout follows the attention weights, the ReLU and each block's output (as
the Transformer package's layers place it); the two versions then draw different masks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf


@dataclasses.dataclass(frozen=True)
class Config:
  """The issue's model: 2 layers, d_model 256, d_ff 1024, 4 heads, length 64, batch 16, vocab 1024."""

  num_layers: int = 2
  d_model: int = 256
  d_ff: int = 1024
  heads: int = 4
  length: int = 64
  batch: int = 16
  vocab: int = 1024
  learning_rate: float = 0.01
  dropout_rate: float = 0.0

  @property
  def d_kv(self) -> int:
    return self.d_model // self.heads


def initial_values(cfg: Config, seed: int = 0) -> dict:
  """Name -> float32 array; attention weights are [d_model, heads, d_kv] (wo: [heads, d_kv, d_model])."""
  rng = np.random.RandomState(seed)

  def normal(shape, fan_in):
    return (rng.randn(*shape) / np.sqrt(fan_in)).astype(np.float32)

  values = {"embedding": normal([cfg.vocab, cfg.d_model], 1.0),
            "softmax": normal([cfg.d_model, cfg.vocab], cfg.d_model),
            "final_norm": np.ones([cfg.d_model], np.float32)}
  for i in range(cfg.num_layers):
    for w in ("wq", "wk", "wv"):
      values[f"layer_{i}/{w}"] = normal([cfg.d_model, cfg.heads, cfg.d_kv], cfg.d_model)
    values[f"layer_{i}/wo"] = normal([cfg.heads, cfg.d_kv, cfg.d_model], cfg.d_model)
    values[f"layer_{i}/wi"] = normal([cfg.d_model, cfg.d_ff], cfg.d_model)
    values[f"layer_{i}/wo_ff"] = normal([cfg.d_ff, cfg.d_model], cfg.d_ff)
    values[f"layer_{i}/norm_att"] = np.ones([cfg.d_model], np.float32)
    values[f"layer_{i}/norm_ff"] = np.ones([cfg.d_model], np.float32)
  return values


def batch_of_tokens(cfg: Config, step: int) -> tuple:
  """(inputs, targets), int32 [batch, length]: a random sequence and itself shifted by one."""
  rng = np.random.RandomState(1000 + step)
  seq = rng.randint(0, cfg.vocab, size=[cfg.batch, cfg.length + 1]).astype(np.int32)
  return seq[:, :-1], seq[:, 1:]


# ---------------------------------------------------------------------------------------------
# plain TensorFlow


def plain_tf_loss(cfg: Config, inputs, targets, r: dict, dtype=tf.float32):
  """The mean cross-entropy of `inputs` -> `targets` in plain TF, with weights `r` (in `dtype`)."""

  def norm(x, scale):
    return x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), -1, keepdims=True) + 1e-6) * scale

  def dropout(x):
    return tf.nn.dropout(x, rate=cfg.dropout_rate) if cfg.dropout_rate else x

  length = inputs.shape[1]
  x = tf.gather(r["embedding"], inputs)
  pos = tf.range(length)
  mask = tf.cast(pos[None, :] > pos[:, None], dtype) * -1e9  # [query, memory]
  for i in range(cfg.num_layers):
    p = f"layer_{i}/"
    h = norm(x, r[p + "norm_att"])
    q = tf.einsum("bld,dhk->blhk", h, r[p + "wq"])
    k = tf.einsum("bmd,dhk->bmhk", h, r[p + "wk"])
    v = tf.einsum("bmd,dhk->bmhk", h, r[p + "wv"])
    logits = tf.einsum("blhk,bmhk->bhlm", q, k) + mask
    weights = dropout(tf.nn.softmax(logits, -1))
    o = tf.einsum("bhlm,bmhk->blhk", weights, v)
    x += dropout(tf.einsum("blhk,hkd->bld", o, r[p + "wo"]))
    h = norm(x, r[p + "norm_ff"])
    hidden = dropout(tf.nn.relu(tf.einsum("bld,df->blf", h, r[p + "wi"])))
    x += dropout(tf.einsum("blf,fd->bld", hidden, r[p + "wo_ff"]))
  logits = tf.einsum("bld,dv->blv", norm(x, r["final_norm"]), r["softmax"])
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=targets, logits=tf.cast(logits, tf.float32)))


def _variables(values: dict) -> dict:
  return {name: tf.get_variable(name, initializer=value) for name, value in values.items()}


def plain_tf_train_step(cfg: Config, inputs, targets, values: dict, dtype=tf.float32):
  """(loss, train_op) in plain TF on the current device; activations in `dtype`."""
  w = _variables(values)
  loss = plain_tf_loss(cfg, inputs, targets, {n: tf.cast(v, dtype) for n, v in w.items()}, dtype)
  train = tf.train.GradientDescentOptimizer(cfg.learning_rate).minimize(loss, var_list=list(w.values()))
  return loss, train


def plain_tf_data_parallel_train_step(cfg: Config, inputs, targets, values: dict, devices: list):
  """(loss, train_op): hand-written data parallelism in plain TF, the floor for a lowered mesh.

  Variables on devices[0]; each device computes the loss and gradients of its share of the
  batch; the gradients are summed with one add_n on devices[0] (the fastest in-process
  allreduce measured, benchmarks/bench_collectives.py) and applied there.
  """
  with tf.device(devices[0]):
    w = _variables(values)
  names = list(w)
  shares = zip(tf.split(inputs, len(devices)), tf.split(targets, len(devices)))
  losses, grads = [], []
  for device, (x, y) in zip(devices, shares):
    with tf.device(device):
      losses.append(plain_tf_loss(cfg, x, y, {n: tf.identity(w[n]) for n in names}))
      grads.append(tf.gradients(losses[-1], [w[n] for n in names]))
  with tf.device(devices[0]):
    scale = 1.0 / len(devices)
    mean_grads = [tf.add_n([g[i] for g in grads]) * scale for i in range(len(names))]
    train = tf.train.GradientDescentOptimizer(cfg.learning_rate).apply_gradients(
        zip(mean_grads, [w[n] for n in names]))
    return tf.add_n(losses) * scale, train


# ---------------------------------------------------------------------------------------------
# mtf


def mtf_train_step(cfg: Config, mesh, inputs, targets, values: dict, slice_dtype=tf.float32,
                   activation_dtype=tf.float32):
  """(loss, update ops) in mtf: the same math as plain_tf_train_step."""
  batch, length = mtf.Dimension("batch", cfg.batch), mtf.Dimension("length", cfg.length)
  memory = mtf.Dimension("memory", cfg.length)
  d_model, d_ff = mtf.Dimension("d_model", cfg.d_model), mtf.Dimension("d_ff", cfg.d_ff)
  heads, d_kv = mtf.Dimension("heads", cfg.heads), mtf.Dimension("d_kv", cfg.d_kv)
  vocab = mtf.Dimension("vocab", cfg.vocab)
  dims = {"embedding": [vocab, d_model], "softmax": [d_model, vocab], "final_norm": [d_model],
          "wq": [d_model, heads, d_kv], "wk": [d_model, heads, d_kv], "wv": [d_model, heads, d_kv],
          "wo": [heads, d_kv, d_model], "wi": [d_model, d_ff], "wo_ff": [d_ff, d_model],
          "norm_att": [d_model], "norm_ff": [d_model]}
  dtype = mtf.VariableDType(tf.float32, slice_dtype, activation_dtype)
  r = {name: mtf.get_variable(mesh, name, dims[name.split("/")[-1]], dtype=dtype,
                              initializer=tf.constant_initializer(value))
       for name, value in values.items()}

  def norm(x, scale):
    return x * mtf.rsqrt(mtf.reduce_mean(mtf.square(x), reduced_dim=d_model) + 1e-6) * scale

  def dropout(x):
    return mtf.dropout(x, rate=cfg.dropout_rate) if cfg.dropout_rate else x

  x = mtf.gather(r["embedding"], mtf.import_tf_tensor(mesh, inputs, [batch, length]), vocab)
  mask = mtf.cast(mtf.greater(mtf.range(mesh, memory, tf.int32), mtf.range(mesh, length, tf.int32)),
                  activation_dtype) * -1e9
  for i in range(cfg.num_layers):
    p = f"layer_{i}/"
    h = norm(x, r[p + "norm_att"])
    q = mtf.einsum([h, r[p + "wq"]], [batch, length, heads, d_kv])
    hm = mtf.rename_dimension(h, "length", "memory")
    k = mtf.einsum([hm, r[p + "wk"]], [batch, memory, heads, d_kv])
    v = mtf.einsum([hm, r[p + "wv"]], [batch, memory, heads, d_kv])
    logits = mtf.einsum([q, k], [batch, heads, length, memory]) + mask
    weights = dropout(mtf.softmax(logits, memory))
    o = mtf.einsum([weights, v], [batch, length, heads, d_kv])
    x += dropout(mtf.einsum([o, r[p + "wo"]], [batch, length, d_model]))
    h = norm(x, r[p + "norm_ff"])
    hidden = dropout(mtf.relu(mtf.einsum([h, r[p + "wi"]], [batch, length, d_ff])))
    x += dropout(mtf.einsum([hidden, r[p + "wo_ff"]], [batch, length, d_model]))
  logits = mtf.einsum([norm(x, r["final_norm"]), r["softmax"]], [batch, length, vocab])
  logits = mtf.cast(logits, tf.float32)
  loss = mtf.reduce_mean(mtf.layers.softmax_cross_entropy_with_logits(
      logits, mtf.import_tf_tensor(mesh, targets, [batch, length]), vocab))
  variables = mesh.graph.trainable_variables
  grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
  updates = mtf.optimize.SgdOptimizer(cfg.learning_rate).apply_grads(grads, variables)
  return loss, updates
