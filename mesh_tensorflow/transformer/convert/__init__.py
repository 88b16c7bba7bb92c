"""Mesh TensorFlow T5 checkpoints to and from Hugging Face `transformers` (see docs/converting.md).

`to_hf(model_dir, output_dir)` writes config.json, safetensors weights and the tokenizer files
that T5ForConditionalGeneration.from_pretrained loads; `from_hf(hf_dir, model_dir)` writes a
checkpoint and operative_config.gin that utils.run evaluates, decodes and fine-tunes. Command
line: `python -m mesh_tensorflow.transformer.convert to_hf|from_hf ...`.
"""

from mesh_tensorflow.transformer.convert.errors import ConversionError as ConversionError
from mesh_tensorflow.transformer.convert.reading_hf import from_hf as from_hf
from mesh_tensorflow.transformer.convert.spec import T5Spec as T5Spec
from mesh_tensorflow.transformer.convert.vocab import byte_vocabulary as byte_vocabulary
from mesh_tensorflow.transformer.convert.vocab import sentencepiece_vocabulary as sentencepiece_vocabulary
from mesh_tensorflow.transformer.convert.vocab import SentencePieceVocabulary as SentencePieceVocabulary
from mesh_tensorflow.transformer.convert.writing_hf import to_hf as to_hf
