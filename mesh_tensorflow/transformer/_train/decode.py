"""Token-id rules shared by decoding, scoring and export: EOS, cleaning decodes, fitting inputs.

A decoder-only model is fed each prompt (its last length - 1 ids) followed by zeros and samples
the rest; an encoder-decoder's inputs keep their first `length` ids. Outputs are cut at the first EOS.
"""

from __future__ import annotations

from typing import Sequence

EOS_ID = 1


def clean_ids(ids: Sequence[int], eos_id: int = EOS_ID) -> list:
  """The ids before the first EOS, without padding zeros."""
  ids = [int(i) for i in ids]
  if eos_id in ids:
    ids = ids[:ids.index(eos_id)]
  return [i for i in ids if i != 0]


def fit_to_length(ids, length: int, is_prompt: bool):
  """A prompt keeps its last length - 1 ids (room to continue it), other inputs their first length.

  Works on lists and on 1-D TF tensors alike.
  """
  return ids[-(length - 1):] if is_prompt else ids[:length]
