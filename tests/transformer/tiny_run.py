"""A tiny byte-level language model for driver tests: gin bindings, corpus and command line."""

from __future__ import annotations

import os
import sys

import gin

from mesh_tensorflow.transformer import utils
from mesh_tensorflow.transformer._utils.gin_config import packaged_gin_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_GIN = os.path.join(ROOT, "examples", "transformer", "gin", "lm_pydoc.gin")

TINY = [
    "utils.run.sequence_length = {'inputs': 16, 'targets': 16}",
    "utils.run.batch_size = 8",
    "utils.run.train_steps = 6",
    "utils.run.iterations_per_loop = 1",
    "utils.run.save_checkpoints_steps = 3",
    "utils.run.keep_checkpoint_max = None",
    "utils.run.perplexity_eval_steps = 2",
    "Unitransformer.max_length = 16",
    "num_layers = 1",
    "d_model = 16",
    "d_ff = 32",
    "num_heads = 4",
    "d_kv = 4",
]


# Two processors are enough where the mesh is not the subject (lowering onto 8 costs 4x more).
TWO_DEVICES = ["utils.run.mesh_shape = 'batch:2'", "utils.run.layout_rules = 'batch:batch'",
               "utils.run.mesh_devices = ['cpu:0', 'cpu:1']"]


def write_corpus(directory: str) -> str:
  """A small text file (about 2 KB) and the glob naming it."""
  path = os.path.join(directory, "corpus.txt")
  with open(path, "w") as f:
    f.write("".join("line %d: the quick brown fox jumps over the lazy dog.\n" % i for i in range(40)))
  return os.path.join(directory, "*.txt")


def tiny_bindings(corpus_glob: str, layout: str = "layouts/cpu8_dp_mp.gin") -> tuple:
  """(gin files, gin bindings) of the tiny model on the corpus under a packaged layout."""
  files = [EXAMPLE_GIN, os.path.join(packaged_gin_dir(), layout)]
  return files, TINY + [f"data.text_lm_dataset.text_files = '{corpus_glob}'"]


def configure_gin(corpus_glob: str, extra_bindings=(), layout: str = "layouts/cpu8_dp_mp.gin") -> None:
  """Clears gin, then parses the package defaults, the tiny configuration and extra bindings."""
  files, bindings = tiny_bindings(corpus_glob, layout)
  gin.clear_config()
  argv = ["test"] + [f"--gin_file={f}" for f in files]
  argv += [f"--gin_param={b}" for b in list(bindings) + list(extra_bindings)]
  utils.FLAGS.unparse_flags()
  utils.FLAGS(argv, known_only=True)
  utils.parse_gin_defaults_and_flags(finalize_config=False)


def main_command(model_dir: str, corpus_glob: str, extra_bindings=()) -> list:
  """The `python -m mesh_tensorflow.transformer.main` command line of the tiny configuration."""
  files, bindings = tiny_bindings(corpus_glob)
  return ([sys.executable, "-m", "mesh_tensorflow.transformer.main", f"--model_dir={model_dir}"]
          + [f"--gin_file={f}" for f in files]
          + [f"--gin_param={b}" for b in list(bindings) + list(extra_bindings)])


def run(model_dir, mode: str, **kwargs):
  """utils.run in `mode` on model_dir, with no TPU, under the gin configuration parsed before."""
  return utils.run(tpu_job_name=None, tpu=None, gcp_project=None, tpu_zone=None, model_dir=str(model_dir),
                   mode=mode, **kwargs)
