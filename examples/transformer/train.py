r"""The bundled Transformer example, run through `utils.run` with gin files.

Task "lm" (default): a byte-level decoder-only language model on CPython's documentation text
(pydoc_data.topics), on 8 virtual CPU devices with the mesh and layout of a gin layout file
(default `layouts/cpu8_dp_mp.gin`: mesh batch:2,model:4 over cpu:0..cpu:7). It trains, reports
held-out bits per byte (perplexity_eval), continues a few held-out prompts greedily and by
sampling (infer), and draws the loss curve to model_dir/loss_curve.png (if matplotlib is installed).

Task "reverse": an encoder-decoder (Bitransformer) learning to reverse digit strings, scored by
exact match of its greedy decodes on held-out strings (eval mode).

    python -m examples.transformer.train [--task lm|reverse] [--model_dir DIR] [--train_steps N]
        [--layout layouts/single.gin] [--gin_file F] [--gin_param 'utils.run.batch_size = 32']

Rerunning the same command resumes from the last checkpoint in model_dir. With
`--compare_layouts N` it instead trains N steps from the same initial weights under a
data-parallel, a model-parallel and a 2-D layout and prints how far their losses are apart.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import time

if "--verbose" not in sys.argv:
  os.environ.setdefault("MTF_QUIET", "1")  # before TensorFlow loads: no start-up noise

import mesh_tensorflow  # noqa: E402,F401  (first: it loads TensorFlow quietly)

import gin  # noqa: E402

from examples.transformer import data  # noqa: E402
from mesh_tensorflow.transformer import utils  # noqa: E402
from mesh_tensorflow.transformer import vocabulary as vocabulary_lib  # noqa: E402
from mesh_tensorflow.transformer._train import inputs, progress  # noqa: E402
from mesh_tensorflow.transformer._utils.gin_config import packaged_gin_dir  # noqa: E402
from mesh_tensorflow.transformer.main import (  # noqa: E402
    configure_logging, configure_virtual_cpus, resolve_gin_files)

HERE = os.path.dirname(os.path.abspath(__file__))
TASK_GIN = {"lm": "lm_pydoc.gin", "reverse": "reverse.gin"}
NUM_PROMPTS = 3
PROMPT_BYTES = 40
CPU_DEVICES = "[%s]" % ", ".join('"cpu:%d"' % i for i in range(8))
# name -> (mesh shape, layout rules), all over the 8 virtual CPU devices.
LAYOUTS = {
    "data-parallel": ("batch:8", "batch:batch"),
    "model-parallel": ("model:8", "d_ff:model,heads:model,vocab:model"),
    "2-D": ("batch:2,model:4", "batch:batch,d_ff:model,heads:model,vocab:model"),
}


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m examples.transformer.train",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--task", choices=sorted(TASK_GIN), default="lm",
                      help="lm: byte-level language model on Python's docs; reverse: an encoder-decoder "
                           "reversing digit strings (default: lm)")
  parser.add_argument("--model_dir", default=None,
                      help="directory of checkpoints, logs and the loss curve; rerunning with the same one "
                           "resumes (default: /tmp/mtf_example_<task>)")
  parser.add_argument("--train_steps", type=int, default=None, help="default: the task's gin file")
  parser.add_argument("--layout", default="layouts/cpu8_dp_mp.gin",
                      help="a gin layout file (a path, or one under the package's gin directory)")
  parser.add_argument("--gin_file", action="append", default=[], help="more gin files")
  parser.add_argument("--gin_param", action="append", default=[], help="more gin bindings")
  parser.add_argument("--gin_location_prefix", action="append", default=[], help="gin search path")
  parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
  parser.add_argument("--compare_layouts", type=int, default=0, metavar="STEPS",
                      help="train STEPS steps under three layouts and compare their losses")
  parser.add_argument("--verbose", action="store_true", help="show TensorFlow's log lines")
  return parser.parse_args(argv)


def configure_gin(args, extra_params=()) -> None:
  """The package defaults, the task's gin file, the layout, then the user's files and bindings."""
  gin.clear_config()
  utils.FLAGS.unparse_flags()
  params = list(args.gin_param) + list(extra_params)
  if args.train_steps is not None:
    params.append(f"utils.run.train_steps = {args.train_steps}")
  search_path = args.gin_location_prefix + [packaged_gin_dir()]
  gin_files = resolve_gin_files([os.path.join(HERE, "gin", TASK_GIN[args.task]), args.layout] + args.gin_file,
                                search_path)
  flag_argv = ["train"] + [f"--gin_file={f}" for f in gin_files] + [f"--gin_param={p}" for p in params]
  flag_argv += [f"--gin_location_prefix={p}" for p in args.gin_location_prefix]
  utils.FLAGS(flag_argv, known_only=True)
  utils.parse_gin_defaults_and_flags()


def run(mode: str, model_dir: str, **kwargs):
  return utils.run(tpu_job_name=None, tpu=None, gcp_project=None, tpu_zone=None, model_dir=model_dir,
                   mode=mode, **kwargs)


def heldout_prompts(model_dir: str) -> list:
  """The first PROMPT_BYTES bytes of a few held-out windows, also written one per line to a file."""
  vocabulary = vocabulary_lib.ByteVocabulary()
  windows = [e["targets"] for e in inputs.iterate_examples(
      lambda: data.text_lm_dataset({"targets": 128}, vocabulary, "validation", shuffle=False))]
  prompts = [vocabulary.decode(w.tolist()).replace("\n", " ")[:PROMPT_BYTES]
             for w in windows[::max(1, len(windows) // NUM_PROMPTS)][:NUM_PROMPTS]]
  with open(os.path.join(model_dir, "prompts.txt"), "w") as f:
    f.write("".join(p + "\n" for p in prompts))
  return prompts


def sample(model_dir: str, temperature: float) -> list:
  """Continuations of the prompts file at `temperature` (0: greedy)."""
  with gin.unlock_config():
    gin.bind_parameter("Unitransformer.sample_autoregressive.temperature", temperature)
    gin.bind_parameter("utils.decode_from_file.input_filename", os.path.join(model_dir, "prompts.txt"))
    gin.bind_parameter("utils.decode_from_file.output_filename",
                       os.path.join(model_dir, "decodes_t%g" % temperature))
  return list(run("infer", model_dir, eval_checkpoint_step=-1).values())[0]


HELDOUT_DIR, HELDOUT_TAG = "validation_eval", "heldout/loss"   # where perplexity_eval writes its loss


def loss_curve_series(model_dir: str) -> dict:
  """[(step, loss)] of training (every step) and of the held-out text (each evaluation)."""
  return {"training": progress.read_scalars(model_dir, "loss"),
          "held-out": progress.read_scalars(os.path.join(model_dir, HELDOUT_DIR), HELDOUT_TAG)}


def draw_loss_curve(model_dir: str) -> str:
  """model_dir/loss_curve.png: the training loss, and the held-out loss at each evaluation."""
  series = loss_curve_series(model_dir)
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib is not installed (pip install matplotlib): no loss-curve picture"
  fig, ax = plt.subplots(figsize=(6, 4))
  training, heldout = series["training"], series["held-out"]
  ax.plot([s for s, _ in training], [v for _, v in training], marker=".", label="training (each step)")
  ax.plot([s for s, _ in heldout], [v for _, v in heldout], "o", color="tab:red", markersize=7,
          label="held-out (each evaluation)")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per token)")
  ax.set_title(os.path.basename(os.path.normpath(model_dir)))
  ax.grid(True, alpha=0.3)
  ax.legend()
  path = os.path.join(model_dir, "loss_curve.png")
  fig.savefig(path, dpi=100, bbox_inches="tight")
  plt.close(fig)
  return f"loss curve: {path} ({len(heldout)} held-out point{'s' * (len(heldout) != 1)})"


def compare_layouts(args, model_dir: str) -> dict:
  """Trains args.compare_layouts steps under each of LAYOUTS (fresh model_dirs); prints the losses."""
  steps, curves = args.compare_layouts, {}
  for name, (mesh_shape, layout_rules) in LAYOUTS.items():
    directory = os.path.join(model_dir, "compare_" + name)
    shutil.rmtree(directory, ignore_errors=True)
    configure_gin(args, [
        f"utils.run.mesh_shape = '{mesh_shape}'", f"utils.run.layout_rules = '{layout_rules}'",
        f"utils.run.mesh_devices = {CPU_DEVICES}", f"utils.run.train_steps = {steps}",
        "utils.run.iterations_per_loop = 1", f"utils.run.save_checkpoints_steps = {steps}"])
    with contextlib.redirect_stdout(io.StringIO()):  # the per-step lines; the table below has them
      run("train", directory)
    curves[name] = [v for _, v in progress.read_scalars(directory, "loss")]
  names = list(LAYOUTS)
  print("step  " + "  ".join(f"{n:>15s}" for n in names))
  for step in range(steps):
    print(f"{step + 1:4d}  " + "  ".join(f"{curves[n][step]:15.6f}" for n in names))
  worst = max(abs(curves[n][s] - curves[names[0]][s]) for n in names for s in range(steps))
  print(f"largest loss difference between layouts over {steps} steps: {worst:.2e}")
  return {"curves": curves, "max_difference": worst}


def main(argv=None) -> dict:
  args = parse_args(argv)
  started = time.time()
  configure_logging(args.verbose)
  configure_virtual_cpus(8)
  model_dir = args.model_dir or f"/tmp/mtf_example_{args.task}"
  if args.compare_layouts:
    return compare_layouts(args, model_dir)
  configure_gin(args)
  print(f"task {args.task}: mesh {gin.query_parameter('utils.run.mesh_shape')!r}, layout "
        f"{gin.query_parameter('utils.run.layout_rules')!r}, model_dir {model_dir}", flush=True)
  trained = run("train", model_dir)
  summary = {"train": trained, "train_seconds": time.time() - started}
  if args.task == "lm":
    [result] = run("perplexity_eval", model_dir, dataset_split="validation", eval_checkpoint_step=-1)
    summary["bits_per_byte"] = result["bits_per_token"]
    prompts = heldout_prompts(model_dir)
    greedy, sampled = sample(model_dir, 0.0), sample(model_dir, args.temperature)
    print(f"\nheld-out bits per byte: {result['bits_per_token']:.3f} (step {result['step']}, "
          f"{result['tokens']:,} held-out bytes)")
    for prompt, g, s in zip(prompts, greedy, sampled):
      print(f"\nprompt:  {prompt!r}\ngreedy:  {g[:80]!r}\n"
            f"sampled: {s[:80]!r} (temperature {args.temperature})")
    print("\n" + draw_loss_curve(model_dir))
  else:
    metrics = list(run("eval", model_dir, dataset_split="validation", eval_checkpoint_step=-1).values())[0]
    summary["exact_match"] = metrics["transduction"]["exact_match"]
    print(f"\nheld-out exact match: {summary['exact_match']:.3f}")
  summary["total_seconds"] = time.time() - started
  first_step = trained["first_step_seconds"]
  print(f"done in {summary['total_seconds']:.0f}s (" + (f"first training step after {first_step:.0f}s)"
                                                        if first_step is not None else "already trained)"))
  return summary


if __name__ == "__main__":
  main()
