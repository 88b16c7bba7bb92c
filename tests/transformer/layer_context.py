"""Helpers for transformer-layer tests: a hand-built Context and TF reference pieces.

Layers only read a few model attributes (model_dim, ensemble dims, fully_autoregressive,
layout/mesh_shape, output_vocab_dim), so tests pass a small stand-in model instead of a
Unitransformer.
"""

from __future__ import annotations

import types

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import transformer

VARIABLE_DTYPE = mtf.VariableDType(tf.float32, tf.float32, tf.float32)
NEG = -1e9


def model_stub(d_model: int, fully_autoregressive: bool = True, output_vocab_size=None, layout=None,
               mesh_shape=None):
  """layout/mesh_shape: what a model built for that mesh knows (MoE grouping, 2-D attention sharding)."""
  return types.SimpleNamespace(
      model_dim=mtf.Dimension("d_model", d_model), ensemble_dims=[], ensemble_dim=None,
      fully_autoregressive=fully_autoregressive, layout=layout, mesh_shape=mesh_shape,
      output_vocab_dim=mtf.Dimension("vocab", output_vocab_size) if output_vocab_size else None)


def make_context(x: mtf.Tensor, model, mode: str = "eval", causal: bool = True,
                 **kwargs) -> transformer.Context:
  """A Context for x [batch, length, d_model]: default positions, causal priorities if asked."""
  batch_dim, length_dim = x.shape.dims[0], x.shape.dims[1]
  position = mtf.range(x.mesh, length_dim, tf.int32)
  priority = position if causal else None
  args = dict(read_priority=priority, write_priority=priority, states=[], new_states=[], constant_states=[],
              losses=[])
  args.update(kwargs)
  return transformer.Context(model=model, mesh=x.mesh, batch_dims=[batch_dim], length_dim=length_dim,
                             variable_dtype=VARIABLE_DTYPE, mode=mode, position=position, **args)


def call_layer(layer, context, x: mtf.Tensor, scope: str = "layer") -> mtf.Tensor:
  """Calls the layer in a variable scope (re-entering it reuses the layer's variables)."""
  with tf.variable_scope(scope):
    return layer.call(context, x)


def tf_attention(q, k, v, bias=None):
  """softmax(q.k + bias) v for q [b, l, h, d], k/v [b, m, h, d], bias broadcastable to [b, h, l, m]."""
  logits = tf.einsum("blhd,bmhd->bhlm", q, k)
  if bias is not None:
    logits += bias
  return tf.einsum("bhlm,bmhd->blhd", tf.nn.softmax(logits), v)


def tf_project_heads(x, w, heads: int):
  """x [b, l, d_model] times a combined [d_model, heads * d] kernel -> [b, l, heads, d]."""
  y = tf.einsum("bld,de->ble", x, w)
  return tf.reshape(y, [tf.shape(x)[0], tf.shape(x)[1], heads, -1])


def tf_multihead_attention(x, memory, variables: dict, prefix: str, heads: int, bias=None):
  """Multi-head attention with the combined q/k/v/o variables `<prefix>/q` ... `<prefix>/o`."""
  q = tf_project_heads(x, variables[prefix + "/q"], heads)
  k = tf_project_heads(memory, variables[prefix + "/k"], heads)
  v = tf_project_heads(memory, variables[prefix + "/v"], heads)
  o = tf_attention(q, k, v, bias)
  wo = variables[prefix + "/o"]
  return tf.einsum("blhd,hde->ble", o, tf.reshape(wo, [heads, -1, wo.shape[-1]]))


def visibility_bias(visible: np.ndarray) -> np.ndarray:
  return np.where(visible, 0.0, NEG).astype(np.float32)


def causal_bias(length: int) -> np.ndarray:
  """[length (query), length (memory)]: a query sees memory positions up to its own."""
  position = np.arange(length)
  return visibility_bias(position[:, None] >= position[None, :])


def segment_bias(query_ids: np.ndarray, memory_ids: np.ndarray) -> np.ndarray:
  """[batch, 1, length, memory_length]: equal segment ids only."""
  return visibility_bias(query_ids[:, None, :, None] == memory_ids[:, None, None, :])
