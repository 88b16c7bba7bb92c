"""Decoding: continue prompts (language models) or transduce inputs (encoder-decoders).

A decoder-only model is fed each prompt followed by zeros in a [batch, targets length] tensor
and samples the rest (`Unitransformer.sample_autoregressive`, gin-configured temperature); an
encoder-decoder decodes its `inputs` (`Bitransformer.decode`). Outputs are cut at the first EOS.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer._train import inputs, loop, model_fn, progress

EOS_ID = 1


def _input_length(runner: loop.ModelRunner) -> int:
  if model_fn.is_unitransformer(runner.model):
    return runner.sequence_length["targets"]
  return runner.sequence_length["inputs"]


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


def decode_ids(runner: loop.ModelRunner, inputs: Sequence[Sequence[int]], checkpoint: str) -> list:
  """Decoded id lists (cleaned) for each input id list (see fit_to_length), in order."""
  length = _input_length(runner)
  is_prompt = model_fn.is_unitransformer(runner.model)
  outputs = []
  with loop.restored_session(runner, "infer", {"inputs": length}, checkpoint) as (session, placeholders, out):
    for start in range(0, len(inputs), runner.batch_size):
      chunk = inputs[start:start + runner.batch_size]
      batch = np.zeros([runner.batch_size, length], np.int32)
      for i, ids in enumerate(chunk):
        ids = fit_to_length(list(ids), length, is_prompt)
        batch[i, :len(ids)] = ids
      decoded = session.run(out["outputs"], {placeholders["inputs"]: batch})
      outputs.extend(clean_ids(row) for row in decoded[:len(chunk)])
  return outputs


def decode_strings(runner: loop.ModelRunner, inputs_vocabulary, targets_vocabulary, texts: Sequence[str],
                   checkpoint: str, append_eos: bool) -> list:
  """Decodes each text (encoded with inputs_vocabulary) and returns the decoded strings."""
  encoded = [list(inputs_vocabulary.encode(t)) + ([EOS_ID] if append_eos else []) for t in texts]
  return [targets_vocabulary.decode(ids) for ids in decode_ids(runner, encoded, checkpoint)]


def decode_from_file(runner: loop.ModelRunner, inputs_vocabulary, targets_vocabulary, checkpoint: str,
                     input_filename: str, output_filename: str, repeats: int = 1,
                     print_fn: Callable = print) -> list:
  """Decodes each line of input_filename (`repeats` times) into `output_filename-<step>`."""
  with tf.io.gfile.GFile(input_filename) as f:
    texts = [line.rstrip("\n") for line in f]
  if not texts:
    raise ValueError(f"{input_filename} (utils.decode_from_file.input_filename) has no lines to decode: "
                     f"write one input per line.")
  texts = [t for t in texts for _ in range(repeats)]
  decodes = decode_strings(runner, inputs_vocabulary, targets_vocabulary, texts, checkpoint,
                           append_eos=not model_fn.is_unitransformer(runner.model))
  path = "%s-%d" % (output_filename, loop.checkpoint_step(checkpoint))
  with tf.io.gfile.GFile(path, "w") as f:
    f.write("".join(d.replace("\n", " ") + "\n" for d in decodes))
  print_fn(f"Wrote {len(decodes)} decodes to {path}.")
  return decodes


def eval_decodes(runner: loop.ModelRunner, eval_datasets: Sequence, targets_vocabulary, checkpoint: str,
                 summary_dir: str, max_batches: Optional[int] = None, print_fn: Callable = print) -> dict:
  """The "eval" mode: decodes each EvalDataset's inputs and scores them with its metric_fns.

  Returns {dataset name: {metric: value}}; the values also go to TensorBoard under
  `<name>/<metric>` at the checkpoint's step.
  """
  step = loop.checkpoint_step(checkpoint)
  writer = progress.summary_writer(summary_dir)
  results = {}
  limit = None if max_batches is None else max_batches * runner.batch_size
  for eval_dataset in eval_datasets:
    examples = list(itertools.islice(inputs.iterate_examples(eval_dataset.dataset_fn), limit))
    if examples and "inputs" not in examples[0]:
      raise ValueError(f"eval mode decodes each example's `inputs`, and eval dataset {eval_dataset.name!r} "
                       f"has none (features {sorted(examples[0])}); use mode 'perplexity_eval' for it.")
    predictions = [targets_vocabulary.decode(ids)
                   for ids in decode_ids(runner, [e["inputs"] for e in examples], checkpoint)]
    if eval_dataset.postprocess_fn is not None:
      predictions = [eval_dataset.postprocess_fn(p) for p in predictions]
    targets = [e["targets_plaintext"].decode() if "targets_plaintext" in e
               else targets_vocabulary.decode(clean_ids(e["targets"])) for e in examples]
    metrics = {}
    for metric_fn in eval_dataset.metric_fns or []:
      metrics.update(metric_fn(targets, predictions))
    print_fn(f"eval {eval_dataset.name} at step {step}: " +
             "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())) + f"  ({len(examples)} examples)")
    progress.write_scalars(writer, step, {f"{eval_dataset.name}/{k}": v for k, v in metrics.items()
                                          if not math.isnan(v)})
    results[eval_dataset.name] = metrics
  writer.close()
  return results
