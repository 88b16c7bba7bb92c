"""Conversion time and peak memory of a random ~1B-parameter T5 v1.1, to Hugging Face and back.

Writes a random checkpoint (one variable at a time), then runs `convert to_hf` and `convert from_hf`
each in a process of its own and reports its wall time and peak RSS against the size of the
largest variable: the converters hold about one variable at a time, so their private memory
should be the process's base (Python with TensorFlow and the converter imported, measured alone)
plus a small multiple of the largest variable, not the whole model. Peak RSS also counts the pages
of memory-mapped files (to_hf stages each tensor in one, and safetensors reads a shard's maps as it
writes), which the kernel can drop; the anonymous RSS (RssAnon, sampled) is what it cannot.

    python benchmarks/bench_convert.py            # ~1B parameters, ~4 GB per copy on disk
    python benchmarks/bench_convert.py --layers 2 # a quick look
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import gin
import numpy as np

from mesh_tensorflow.transformer.convert import gin_model, mtf_checkpoints


def bindings(args) -> list:
  """A T5 v1.1 (gated GELU, untied logits) of the given sizes."""
  return [
      "utils.run.model_type = 'bitransformer'", "Bitransformer.shared_embedding = True",
      f"Unitransformer.d_model = {args.d_model}", "Unitransformer.positional_embedding = False",
      f"Unitransformer.vocab_divisor = {args.vocab}", "Unitransformer.max_length = 512",
      "decoder/Unitransformer.shared_embedding_and_softmax_weights = False",
      "encoder/make_layer_stack.layers = [@transformer_layers.SelfAttention, "
      "@transformer_layers.DenseReluDense]",
      "decoder/make_layer_stack.layers = [@transformer_layers.SelfAttention, "
      "@transformer_layers.EncDecAttention, @transformer_layers.DenseReluDense]",
      f"make_layer_stack.num_layers = {args.layers}",
      f"SelfAttention.num_heads = {args.heads}", f"SelfAttention.key_value_size = {args.d_kv}",
      "SelfAttention.relative_attention_type = 'bias_shared'",
      f"EncDecAttention.num_heads = {args.heads}", f"EncDecAttention.key_value_size = {args.d_kv}",
      "EncDecAttention.relative_attention_type = None",
      f"DenseReluDense.hidden_size = {args.d_ff}", "DenseReluDense.activation = ['gelu', 'linear']",
  ]


def write_random_checkpoint(model_dir: str, lines: list, vocab: int) -> dict:
  """operative_config.gin and a random model.ckpt-1 of the model; returns {name: shape}."""
  os.makedirs(model_dir)
  with open(os.path.join(model_dir, "operative_config.gin"), "w") as f:
    f.write("\n".join(lines) + "\n")
  gin_model.parse_config([], lines)
  shapes = gin_model.variables(gin_model.build_model(vocab))
  gin.clear_config()
  rng = np.random.default_rng(0)
  mtf_checkpoints.write(os.path.join(model_dir, "model.ckpt-1"), sorted(shapes),
                        lambda name: rng.standard_normal(shapes[name], np.float32), step=1)
  return shapes


def _anonymous_bytes(pid: int) -> int:
  """The process's private (anonymous) resident memory now: what the kernel cannot reclaim."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
  except (OSError, StopIteration):
    return 0


def timed(argv: list) -> tuple:
  """(wall seconds, peak RSS bytes, peak anonymous RSS bytes, sampled every 10 ms) of `argv`."""
  with tempfile.TemporaryFile("w+") as log:
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    peak_anonymous = 0
    while True:
      pid, status, usage = os.wait4(process.pid, os.WNOHANG)
      if pid:
        break
      peak_anonymous = max(peak_anonymous, _anonymous_bytes(process.pid))
      time.sleep(0.01)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
      log.seek(0)
      raise RuntimeError(f"{argv} failed: {log.read()[-2000:]}")
  return seconds, usage.ru_maxrss * 1024, peak_anonymous  # ru_maxrss is in KiB on Linux


def convert(*args) -> list:
  return [sys.executable, "-m", "mesh_tensorflow.transformer.convert", *args]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=16, help="encoder and decoder layers each")
  parser.add_argument("--d_model", type=int, default=1536)
  parser.add_argument("--d_ff", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--d_kv", type=int, default=64)
  parser.add_argument("--vocab", type=int, default=32128)
  args = parser.parse_args()
  work = tempfile.mkdtemp(prefix="bench_convert_")
  try:
    ours, hf, back = (os.path.join(work, name) for name in ("ours", "hf", "back"))
    started = time.perf_counter()
    shapes = write_random_checkpoint(ours, bindings(args), args.vocab)
    parameters = sum(int(np.prod(s)) for s in shapes.values())
    largest = max(4 * int(np.prod(s)) for s in shapes.values())
    print(f"random T5 v1.1: {parameters / 1e9:.2f}B parameters ({4 * parameters / 1e9:.1f} GB float32), "
          f"largest variable {largest / 1e6:.0f} MB; written in {time.perf_counter() - started:.0f} s")
    _, base, base_anonymous = timed([sys.executable, "-c", "import mesh_tensorflow.transformer.convert"])
    print(f"process base (Python, TensorFlow, the converter imported): peak RSS {base / 1e9:.2f} GB, "
          f"anonymous {base_anonymous / 1e9:.2f} GB")
    print("| direction | wall time | peak RSS | peak anonymous RSS | (anonymous - base) / largest variable |")
    print("|---|---|---|---|---|")
    for name, argv in (("to_hf", convert("to_hf", "--model_dir", ours, "--output_dir", hf)),
                       ("from_hf", convert("from_hf", "--hf_dir", hf, "--model_dir", back))):
      seconds, peak, anonymous = timed(argv)
      print(f"| {name} | {seconds:.1f} s | {peak / 1e9:.2f} GB | {anonymous / 1e9:.2f} GB | "
            f"{(anonymous - base_anonymous) / largest:.1f}x |")
  finally:
    shutil.rmtree(work, ignore_errors=True)
  usage = resource.getrusage(resource.RUSAGE_SELF)
  print(f"(this process, which wrote the random checkpoint: {usage.ru_maxrss * 1024 / 1e9:.2f} GB peak RSS)")


if __name__ == "__main__":
  main()
