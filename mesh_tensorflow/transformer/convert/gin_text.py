"""The operative gin configuration of a T5Spec: what from_hf writes beside the checkpoint."""

from __future__ import annotations

from mesh_tensorflow.transformer.convert.spec import T5Spec


def model_bindings(spec: T5Spec) -> list:
  """Gin bindings that make utils.run (and T5's MtfModel) build the T5 `spec` describes."""
  activation = spec.activation if isinstance(spec.activation, str) else list(spec.activation)
  relative = "'bias_shared'" if spec.relative_bias else "None"
  return [
      "utils.run.model_type = 'bitransformer'",
      "Bitransformer.shared_embedding = True",
      f"Unitransformer.d_model = {spec.d_model}",
      "Unitransformer.positional_embedding = False",
      # T5 has no position table; this only bounds the sequence length (T5's own configs say 512).
      "Unitransformer.max_length = 512",
      # Any vocabulary up to vocab_size pads to exactly the checkpoint's vocab_size rows.
      f"Unitransformer.vocab_divisor = {spec.vocab_size}",
      f"decoder/Unitransformer.shared_embedding_and_softmax_weights = {spec.tied_logits}",
      "encoder/make_layer_stack.layers = [@transformer_layers.SelfAttention, "
      "@transformer_layers.DenseReluDense]",
      "decoder/make_layer_stack.layers = [@transformer_layers.SelfAttention, "
      "@transformer_layers.EncDecAttention, @transformer_layers.DenseReluDense]",
      f"encoder/make_layer_stack.num_layers = {spec.num_layers}",
      f"decoder/make_layer_stack.num_layers = {spec.num_decoder_layers}",
      f"SelfAttention.num_heads = {spec.num_heads}",
      f"SelfAttention.key_value_size = {spec.d_kv}",
      f"SelfAttention.relative_attention_type = {relative}",
      f"SelfAttention.relative_attention_num_buckets = {spec.relative_attention_num_buckets}",
      f"EncDecAttention.num_heads = {spec.num_heads}",
      f"EncDecAttention.key_value_size = {spec.d_kv}",
      "EncDecAttention.relative_attention_type = None",
      f"DenseReluDense.hidden_size = {spec.d_ff}",
      f"DenseReluDense.activation = {activation!r}",
      f"sublayer_rms_norm.epsilon = {spec.layer_norm_epsilon!r}",
      # The checkpoint holds float32 weights (HF's); a bfloat16 master would not restore them.
      "utils.get_variable_dtype.master_dtype = 'float32'",
  ]
