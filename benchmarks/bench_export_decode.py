"""Decoding speed of an export_infer SavedModel against the in-process `infer` mode's graph.

The example language model's shape (examples/transformer/gin/lm_pydoc.gin: 2 layers, d_model 128,
d_ff 512, 8 heads, byte vocabulary), trained for one step on one device, decodes greedily with
`never_end` (every sequence runs to the full length, so both sides generate the same number of
tokens). Two cases: one prompt (batch size 1) and 32 prompts (batch size 32). "infer" is the
graph the `infer` mode decodes with (model_fn.build_model_graph in "infer" mode, restored into a
session by loop.restored_session; ids in and out); "export" is the SavedModel (strings in and out)
loaded into a TF1 session with the default config, as a server runs it, and called through its
serving_default signature. Each is timed after a warm-up call (graph building, restore and loading
excluded), medians of interleaved repetitions; tokens/s counts generated tokens of the
real prompts only. Both decode incrementally (one position per step, each layer's keys and values
kept); a step still attends over, and writes into, the whole length's cache, so its time grows
with the length (`--lengths 64,128`).

    python benchmarks/bench_export_decode.py [--reps 5] [--lengths 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import gin
import numpy as np
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mesh_tensorflow.transformer import utils  # noqa: E402
from mesh_tensorflow.transformer import vocabulary as vocabulary_lib  # noqa: E402
from mesh_tensorflow.transformer._train import checkpoints, decode, export, loop  # noqa: E402
from mesh_tensorflow.transformer._utils.gin_config import packaged_gin_dir  # noqa: E402
from mesh_tensorflow.transformer._utils.models import build_model  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PROMPT = "The quick"


def configure(length: int, batch_size: int) -> None:
  gin.clear_config()
  gin.parse_config_files_and_bindings(
      [os.path.join(packaged_gin_dir(), "defaults.gin"), os.path.join(ROOT, "examples", "transformer", "gin",
                                                                       "lm_pydoc.gin"),
       os.path.join(packaged_gin_dir(), "layouts", "single.gin")],
      [f"utils.run.sequence_length = {{'inputs': {length}, 'targets': {length}}}",
       f"Unitransformer.max_length = {length}", f"utils.run.batch_size = {batch_size}",
       "utils.run.train_steps = 1", "Unitransformer.sample_autoregressive.never_end = True"],
      skip_unknown=False)


def runner_for(length: int, batch_size: int) -> loop.ModelRunner:
  """The run's model on one device, as utils.run builds it for the infer and export modes."""
  vocabulary = vocabulary_lib.ByteVocabulary()
  model = build_model(model_type="lm", input_vocab_size=vocabulary.vocab_size,
                      output_vocab_size=vocabulary.vocab_size, layout_rules="", mesh_shape="")
  return loop.ModelRunner(model=model, mesh_shape="", layout_rules="", batch_size=batch_size,
                          sequence_length={"inputs": length, "targets": length},
                          variable_dtype=utils.get_variable_dtype())


def time_interleaved(cases: dict, reps: int) -> dict:
  for call in cases.values():
    call()  # warm-up
  times = {name: [] for name in cases}
  for _ in range(reps):
    for name, call in cases.items():
      start = time.perf_counter()
      call()
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def _serving_session(path: str):
  """A function of a [n] strings array running the SavedModel's serving_default in a TF1 session
  (default config, as a server would)."""
  graph = tf.Graph()
  session = tf.Session(graph=graph)
  with graph.as_default():
    signature = tf.saved_model.loader.load(session, [tf.saved_model.SERVING], path).signature_def
  signature = signature["serving_default"]
  output, texts_input = signature.outputs["outputs"].name, signature.inputs["inputs"].name
  return lambda texts: session.run(output, {texts_input: texts})


def bench_case(directory: str, length: int, batch_size: int, reps: int) -> dict:
  """Seconds per call and tokens/s of infer and export for batch_size prompts."""
  configure(length, batch_size)
  model_dir = os.path.join(directory, f"model_{length}_{batch_size}")
  utils.run(tpu_job_name=None, tpu=None, gcp_project=None, tpu_zone=None, model_dir=model_dir, mode="train")
  checkpoint = checkpoints.latest_checkpoint(model_dir)
  runner = runner_for(length, batch_size)
  vocabulary = vocabulary_lib.ByteVocabulary()
  path = export.export_model(runner, vocabulary, checkpoint, model_dir + "_export", score=False)
  serving = _serving_session(path)
  prompts = np.array([PROMPT] * batch_size, object)
  ids = np.zeros([batch_size, length], np.int32)
  prompt_ids = vocabulary.encode(PROMPT)
  ids[:, :len(prompt_ids)] = prompt_ids
  with loop.restored_session(runner, "infer", {"inputs": length}, checkpoint) as (session, placeholders, out):
    infer_ids = session.run(out["outputs"], {placeholders["inputs"]: ids})
    expected = [vocabulary.decode(decode.clean_ids(r)) for r in infer_ids]
    assert [s.decode("utf-8", errors="ignore") for s in serving(prompts)] == expected, "export differs"
    seconds = time_interleaved({
        "infer": lambda: session.run(out["outputs"], {placeholders["inputs"]: ids}),
        "export": lambda: serving(prompts)}, reps)
  new_tokens = batch_size * (length - len(prompt_ids))
  return {name: (s, new_tokens / s) for name, s in seconds.items()}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--lengths", default="128", help="comma-separated sequence lengths")
  args = parser.parse_args(argv)
  print(f"{'case':<28}{'infer s/call':>14}{'export s/call':>15}{'infer tok/s':>13}{'export tok/s':>14}"
        f"{'export/infer':>14}")
  with tempfile.TemporaryDirectory() as directory:
    for length in [int(n) for n in args.lengths.split(",")]:
      for batch_size, label in ((1, "one prompt"), (32, "32 prompts")):
        result = bench_case(directory, length, batch_size, args.reps)
        (infer_s, infer_tps), (export_s, export_tps) = result["infer"], result["export"]
        print(f"{label + f', length {length}':<28}{infer_s:>14.3f}{export_s:>15.3f}{infer_tps:>13.0f}"
              f"{export_tps:>14.0f}{export_tps / infer_tps:>14.2f}", flush=True)


if __name__ == "__main__":
  main()
