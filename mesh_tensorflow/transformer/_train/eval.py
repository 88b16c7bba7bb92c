"""Log-likelihood evaluation: perplexity over eval datasets, and scores of given examples.

Both run the "eval" graph (per-example sums of log p(target) over non-padding targets) in a
session restored from a checkpoint; padding examples (all zeros) contribute nothing.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import numpy as np

from mesh_tensorflow.transformer._train import id_checks, inputs, loop, model_fn, progress


def model_feature_lengths(model, sequence_length: dict) -> dict:
  """{feature: length} the eval/score graph is fed: targets (and inputs unless the model is a
  decoder-only language model, which builds its inputs from the targets)."""
  if model_fn.is_unitransformer(model) and model.autoregressive:
    features = ("targets",)
  else:
    features = ("inputs", "targets")
  missing = [f for f in features if f not in sequence_length]
  if missing:
    raise ValueError(
        f"utils.run.sequence_length = {sequence_length!r} has no {' or '.join(map(repr, missing))} key, "
        f"which this {type(model).__name__} needs to evaluate; give a length for each of {list(features)}, "
        f"e.g. {dict.fromkeys(features, 512)!r}.")
  return {f: sequence_length[f] for f in features}


def _log_likelihoods(session, placeholders, outputs, batches) -> tuple:
  """Per real example: (log-likelihood, number of target tokens), as numpy arrays."""
  lls, counts = [np.zeros([0])], [np.zeros([0])]
  for batch, num_real in batches:
    ll, count = session.run([outputs["log_likelihood"], outputs["num_tokens"]],
                            {placeholders[k]: batch[k] for k in placeholders})
    lls.append(ll[:num_real])
    counts.append(count[:num_real])
  return np.concatenate(lls), np.concatenate(counts)


def _eval_batch(name: str, step: int, bad: id_checks.BadBatch) -> str:
  return f"batch {bad.index + 1} of perplexity_eval {name!r} at checkpoint step {step}"


def perplexity_eval(runner: loop.ModelRunner, eval_datasets: Sequence, checkpoint_paths: Sequence[str],
                    summary_dir: str, max_batches: int | None = None, print_fn: Callable = print,
                    vocab_sizes: dict | None = None) -> list:
  """Mean negative log-likelihood per target token of each (name, dataset_fn) at each checkpoint.

  Writes `<name>/loss`, `<name>/perplexity` and `<name>/bits_per_token` scalars to summary_dir and
  returns one dict per (checkpoint, dataset): step, dataset, loss, perplexity, bits_per_token,
  tokens, examples, skipped_bad_id_batches. Batches holding ids outside vocab_sizes ({feature:
  size}) stop the evaluation, or are left out with bad_id_batches.skip (id_checks).
  """
  lengths = model_feature_lengths(runner.model, runner.sequence_length)
  writer = progress.summary_writer(summary_dir)
  results = []
  for path in checkpoint_paths:
    step = loop.checkpoint_step(path)
    with loop.restored_session(runner, "eval", lengths, path) as (session, placeholders, outputs):
      for name, dataset_fn in eval_datasets:
        check = id_checks.IdCheck({k: v for k, v in (vocab_sizes or {}).items() if k in lengths},
                                  functools.partial(_eval_batch, name, step))
        batches = inputs.numpy_batches(dataset_fn, runner.batch_size, lengths, max_batches)
        batches = check.numpy_batches(batches, id_checks.source_of(
            dataset_fn, f"eval dataset {name!r} ({id_checks.function_name(dataset_fn)})"))
        lls, counts = _log_likelihoods(session, placeholders, outputs, batches)
        if counts.sum() == 0:
          raise ValueError(f"Eval dataset {name!r} yielded no target tokens; check its dataset_fn.")
        loss = float(-lls.sum() / counts.sum())
        result = {"step": step, "dataset": name, "loss": loss, "perplexity": math.exp(loss),
                  "bits_per_token": loss / math.log(2), "tokens": int(counts.sum()), "examples": len(lls),
                  "skipped_bad_id_batches": len(check.bad)}
        print_fn(f"perplexity_eval {name} at step {step}: loss {loss:.4f}  perplexity "
                 f"{result['perplexity']:.3f}  bits/token {result['bits_per_token']:.4f}  "
                 f"({result['tokens']:,} tokens in {len(lls)} examples)")
        if check.bad:
          print_fn(check.summary(check.bad))
        progress.write_scalars(writer, step, {f"{name}/{k}": result[k] for k in (
            "loss", "perplexity", "bits_per_token") + (("skipped_bad_id_batches",) if check.bad else ())})
        results.append(result)
  writer.close()
  return results
