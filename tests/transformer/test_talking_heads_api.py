"""Talking-heads / general bilinear layers take 0.1.21's constructor calls."""

from __future__ import annotations

import pytest

from mesh_tensorflow.transformer import transformer_layers


@pytest.mark.parametrize("cls,kwargs", [
    (transformer_layers.TalkingHeadsEncDecAttention, {"key_heads_dims": [("heads", 2)], "key_size": 4}),
    (transformer_layers.GeneralBilinearEncDecAttention, {"heads_dims": [("heads", 2)], "dropout_rate": 0.5}),
], ids=["talking_heads", "general_bilinear"])
def test_enc_dec_constructors_take_relative_attention_type_first_and_the_rest_by_keyword(cls, kwargs):
  layer = cls("bias", relative_attention_num_buckets=8, **kwargs)
  assert layer.relative_attention_type == "bias" and layer.relative_attention_num_buckets == 8
  assert [(d.name, d.size) for d in layer.key_heads_dims] == [("heads", 2)]
  if "key_size" in kwargs:
    assert layer.key_size == 4
  else:
    assert layer.dropout_rate == 0.5 and layer.heads_dims == layer.key_heads_dims
  with pytest.raises(TypeError):
    cls("bias", "extra positional")
