"""Tiny T5 variants for the converter tests: random checkpoints of ours and of HF's, our logits and decodes.

A checkpoint is written straight from the model's variable list (random values, no training), so
making one costs no TF session; our side's numbers come from the model built by the package from
the model_dir's operative_config.gin, lowered on one device, the checkpoint restored.
"""

from __future__ import annotations

import getpass
import os
import tempfile

import gin
import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer.convert import gin_model, mtf_checkpoints

# torch makes its compile cache in the temp dir when imported; keep it in pytest's own folder, which the
# suite's temp-dir check (tests/temp_dir_guard.py) leaves alone, as pytest keeps its tmp_path folders there.
# Set on importing this module, so that the tests importing it before torch get it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    os.environ.get("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir()), f"pytest-of-{getpass.getuser()}",
    "torchinductor"))
VOCAB = 64
# T5 v1.0 (ReLU, logits tied to the embedding, scaled by d_model**-0.5), at d_model 16, 2 + 2 layers.
V1_0 = [
    "utils.run.model_type = 'bitransformer'",
    "Bitransformer.shared_embedding = True",
    "Unitransformer.d_model = 16",
    "Unitransformer.positional_embedding = False",
    "Unitransformer.vocab_divisor = 64",
    "decoder/Unitransformer.shared_embedding_and_softmax_weights = True",
    "encoder/make_layer_stack.layers = [@transformer_layers.SelfAttention, "
    "@transformer_layers.DenseReluDense]",
    "decoder/make_layer_stack.layers = [@transformer_layers.SelfAttention, "
    "@transformer_layers.EncDecAttention, "
    "@transformer_layers.DenseReluDense]",
    "make_layer_stack.num_layers = 2",
    "SelfAttention.num_heads = 2",
    "SelfAttention.key_value_size = 8",
    "SelfAttention.relative_attention_type = 'bias_shared'",
    "EncDecAttention.num_heads = 2",
    "EncDecAttention.key_value_size = 8",
    "EncDecAttention.relative_attention_type = None",
    "DenseReluDense.hidden_size = 32",
    "DenseReluDense.activation = 'relu'",
]
# T5 v1.1 / mT5 / ByT5: gated GELU, untied logits.
V1_1 = V1_0 + ["decoder/Unitransformer.shared_embedding_and_softmax_weights = False",
               "DenseReluDense.activation = ['gelu', 'linear']"]
VARIANTS = {
    "v1_0": V1_0,
    "v1_1": V1_1,
    # 3 encoder and 2 decoder layers; 3 heads x 4 = 12 != d_model 16; 16 buckets; gated ReLU.
    "uneven": V1_1 + ["encoder/make_layer_stack.num_layers = 3", "decoder/make_layer_stack.num_layers = 2",
                      "SelfAttention.num_heads = 3", "SelfAttention.key_value_size = 4",
                      "EncDecAttention.num_heads = 3", "EncDecAttention.key_value_size = 4",
                      "SelfAttention.relative_attention_num_buckets = 16",
                      "DenseReluDense.activation = ['relu', 'linear']"],
    # No relative attention bias at all (HF gets zero biases); the legacy norm scope names, epsilon 1e-5.
    "no_bias_legacy_norm": V1_0 + ["SelfAttention.relative_attention_type = None",
                                   "LayerStack.dropout_rate = 0.0", "LayerStack.norm_epsilon = 1e-5"],
}
SLOTS = ("_slot_vr", "_slot_vc")


def write_checkpoint(model_dir: str, bindings, seed: int = 0, dtype=np.float32,
                     with_slots: bool = True) -> str:
  """Writes operative_config.gin and a random checkpoint model.ckpt-7 (with Adafactor-like slots)."""
  os.makedirs(model_dir, exist_ok=True)
  with open(os.path.join(model_dir, "operative_config.gin"), "w") as f:
    f.write("\n".join(bindings) + "\n")
  gin_model.parse_config([], bindings)
  shapes = gin_model.variables(gin_model.build_model(VOCAB))
  gin.clear_config()
  rng = np.random.default_rng(seed)
  values = {name: (rng.standard_normal(shape) * (0.5 if len(shape) > 1 else 0.2) + (len(shape) == 1))
            .astype(dtype) for name, shape in shapes.items()}
  if with_slots:
    for name in list(shapes):
      values.update({name + slot: np.zeros(shapes[name][-1:], np.float32) for slot in SLOTS})
  prefix = os.path.join(model_dir, "model.ckpt-7")
  mtf_checkpoints.write(prefix, sorted(values), values.__getitem__, step=7)
  return prefix


def hf_native_model(hf_dir, tie: bool, proj: str, **sizes) -> None:
  """A randomly initialised Hugging Face T5 saved to hf_dir, made by transformers itself (the hf extra)."""
  import torch
  import transformers
  options = dict(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
                 decoder_start_token_id=0)
  config = transformers.T5Config(**{**options, **sizes}, feed_forward_proj=proj, tie_word_embeddings=tie)
  torch.manual_seed(0)
  model = transformers.T5ForConditionalGeneration(config)
  with torch.no_grad():  # HF's init leaves norms at 1 and the bias tiny: make every weight matter
    for parameter in model.parameters():
      parameter.add_(0.3 * torch.randn_like(parameter))
  model.save_pretrained(str(hf_dir))


def batch(seed: int = 1, batch_size: int = 2, length: int = 6) -> dict:
  """Inputs and targets ids in [2, VOCAB) (no padding, no EOS)."""
  rng = np.random.default_rng(seed)
  return {k: rng.integers(2, VOCAB, (batch_size, length)).astype(np.int32) for k in ("inputs", "targets")}


def ours(model_dir: str, ids: dict, decode_length: int = 0) -> dict:
  """Our teacher-forced logits [batch, length, vocab] (and greedy decodes) from model_dir's latest "
    "checkpoint."""
  gin_model.parse_config([os.path.join(model_dir, "operative_config.gin")])
  try:
    with tf.Graph().as_default():
      graph = mtf.Graph()
      mesh = mtf.Mesh(graph, "mesh")
      model = gin_model.build_model(VOCAB)
      batch_dim = mtf.Dimension("batch", ids["inputs"].shape[0])
      length_dim = mtf.Dimension("length", ids["inputs"].shape[1])

      def imported(array):
        return mtf.import_tf_tensor(mesh, tf.constant(array), mtf.Shape([batch_dim, length_dim]))

      variable_dtype = mtf.VariableDType(tf.float32, tf.float32, tf.float32)
      logits, _ = model.call_simple(imported(ids["inputs"]), imported(ids["targets"]), compute_loss=False,
                                    mode="eval", variable_dtype=variable_dtype)
      fetches = {"logits": logits}
      if decode_length:
        fetches["greedy"] = model.decode(imported(ids["inputs"]), variable_dtype=variable_dtype,
                                         temperature=0.0, max_decode_length=decode_length)
      mesh_impl = mtf.placement_mesh_impl.PlacementMeshImpl(mtf.convert_to_shape(""), [], [""])
      lowering = mtf.Lowering(graph, {mesh: mesh_impl})
      tf_fetches = {k: lowering.export_to_tf_tensor(v) for k, v in fetches.items()}
      saver = tf.train.Saver([v for v in tf.global_variables() if v.op.name in
                              {mv.name for mv in graph.all_variables}])
      with tf.Session() as sess:
        saver.restore(sess, tf.train.latest_checkpoint(model_dir))
        sess.run(lowering.copy_masters_to_slices())
        return sess.run(tf_fetches)
  finally:
    gin.clear_config()
