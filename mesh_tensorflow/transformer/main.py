r"""Command-line driver: `python -m mesh_tensorflow.transformer.main --gin_file=... --model_dir=...`.

Parses the packaged gin defaults, then --gin_file / --gin_param, and calls `utils.run` in the
configured mode. The command line goes to `model_dir/command` (`command.1`, ... on later runs) and
the operative gin configuration to `model_dir/operative_config.gin`. TensorFlow's start-up and
info lines are hidden unless --verbose. An error ends the run with one line `Error (Type): message`
and exit status 1 (--traceback adds the traceback); --restore_fallback resumes past an unreadable
latest checkpoint; --max_restarts K restarts a failed run by itself (as `launch --max_restarts`).

Example, from the repository root (docs/transformer.md): the bundled byte-level language model on
8 virtual CPU devices, with the shipped layout layouts/cpu8_dp_mp.gin (mesh batch:2,model:4):

    python -m mesh_tensorflow.transformer.main --model_dir=/tmp/mtf_main_lm \
      --gin_file=examples/transformer/gin/lm_pydoc.gin --gin_file=layouts/cpu8_dp_mp.gin
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
import warnings
from collections.abc import Sequence

from absl import app, flags, logging

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import utils
from mesh_tensorflow.transformer._utils import gin_config
from mesh_tensorflow.transformer._utils.gin_config import gin_search_path, resolve_gin_files

flags.adopt_module_key_flags(gin_config)  # --help lists --gin_file, --gin_param, --gin_location_prefix

flags.DEFINE_string("tpu_job_name", None, "Name of the TPU worker job (TPUs: see utils.run).")
flags.DEFINE_string("model_dir", "/tmp/transformer_standalone", "Directory of checkpoints, logs and config.")
flags.DEFINE_string("tpu", None, "Cloud TPU to train on: a TPU name or grpc://HOST:8470 (docs/tpu.md).")
flags.DEFINE_string("gcp_project", None, "Cloud project of the TPU.")
flags.DEFINE_string("tpu_zone", None, "Zone of the TPU.")
flags.DEFINE_multi_string("module_import", None, "Modules to import first (e.g. with gin configurables).")
flags.DEFINE_integer("num_cpu_devices", 8, "Virtual CPU devices to split the host CPU into (cpu:N meshes).")
flags.DEFINE_boolean("verbose", False, "Show TensorFlow's own log lines and warnings.")
flags.DEFINE_boolean("traceback", False, "On an error, also show the Python traceback.")
flags.DEFINE_integer("max_restarts", 0,
                     "Run the command in a child process and start it again (it resumes from the latest "
                     "checkpoint) when it fails, at most this many times; never when it failed before "
                     "its first step.")
flags.DEFINE_boolean("restore_fallback", False,
                     "Resume from the newest readable checkpoint when the latest cannot be read (gin: "
                     "restore_fallback.enabled); off: such a run stops, naming the file.")
FLAGS = flags.FLAGS


def configure_logging(verbose: bool) -> None:
  """Keeps TensorFlow's per-step Python warnings and info lines out of the default output."""
  import tensorflow.compat.v1 as tf
  if verbose:
    logging.set_verbosity(logging.INFO)
    tf.logging.set_verbosity(tf.logging.INFO)
    return
  warnings.filterwarnings("ignore")
  warnings.filterwarnings("default", category=mtf.LayoutRuleWarning)  # a likely typo in the layout
  logging.set_verbosity(logging.ERROR)
  tf.logging.set_verbosity(tf.logging.ERROR)


def configure_virtual_cpus(num_devices: int) -> None:
  """Splits the host CPU into num_devices logical devices (mesh_devices "cpu:0".."cpu:N-1")."""
  import tensorflow as tf2
  cpus = tf2.config.list_physical_devices("CPU")
  if num_devices > 1 and not tf2.config.get_logical_device_configuration(cpus[0]):
    tf2.config.set_logical_device_configuration(
        cpus[0], [tf2.config.LogicalDeviceConfiguration()] * num_devices)


def write_command_line(model_dir: str, args: Sequence[str]) -> str:
  """Saves the command line to model_dir/command (command.N if earlier runs left one), shell-quoted.

  args are the arguments after the program (sys.argv[1:], flags included: absl strips flags from the
  argv it hands to main), so the file's line can be pasted back into a shell to rerun the job.
  """
  os.makedirs(model_dir, exist_ok=True)
  path, n = os.path.join(model_dir, "command"), 0
  while os.path.exists(path):
    n += 1
    path = os.path.join(model_dir, "command.%d" % n)
  with open(path, "w") as f:
    f.write(shlex.join([sys.executable, "-m", "mesh_tensorflow.transformer.main", *args]) + "\n")
  return path


def without_max_restarts(args: Sequence[str]) -> list:
  """args less --max_restarts and its value: the command line a supervised child runs."""
  kept, skip_next = [], False
  for arg in args:
    if skip_next:
      skip_next = False
    elif arg.startswith("--max_restarts="):
      continue
    elif arg == "--max_restarts":
      skip_next = True
    else:
      kept.append(arg)
  return kept


def supervise(args: Sequence[str], max_restarts: int, model_dir: str) -> int:
  """Runs this command line without --max_restarts as a child, restarted as the launcher does."""
  from mesh_tensorflow.launch import Launch
  command = [sys.executable, "-m", "mesh_tensorflow.transformer.main", *without_max_restarts(args)]
  return Launch(command, 1, max_restarts=max_restarts, checkpoint_dir=model_dir).run()


def main(argv) -> None:
  if FLAGS.max_restarts:
    sys.exit(supervise(sys.argv[1:], FLAGS.max_restarts, FLAGS.model_dir))
  configure_logging(FLAGS.verbose)
  configure_virtual_cpus(FLAGS.num_cpu_devices)
  for module in FLAGS.module_import or []:
    importlib.import_module(module)
  try:
    FLAGS.gin_file = resolve_gin_files(FLAGS.gin_file, gin_search_path())
  except app.UsageError as e:
    sys.exit(f"Error: {e}")  # alone: absl would print the whole usage text before it
  write_command_line(FLAGS.model_dir, sys.argv[1:])
  if FLAGS.restore_fallback:
    FLAGS.gin_param = list(FLAGS.gin_param or []) + ["restore_fallback.enabled = True"]
  try:
    utils.parse_gin_defaults_and_flags()
    utils.run(tpu_job_name=FLAGS.tpu_job_name, tpu=FLAGS.tpu, gcp_project=FLAGS.gcp_project,
              tpu_zone=FLAGS.tpu_zone, model_dir=FLAGS.model_dir)
  except Exception as e:  # every library error ends as one line (--traceback: with its traceback)
    if FLAGS.traceback:
      raise
    sys.exit(one_line_error(e))


def one_line_error(error: Exception) -> str:
  """`Error (Type): message` without the lines gin adds (`In call to configurable ...`)."""
  lines = [line for line in str(error).splitlines()
           if line.strip() and not line.lstrip().startswith("In call to configurable")]
  return f"Error ({type(error).__name__}): {' '.join(lines)} (--traceback shows where it was raised)"


HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def parse_flags(argv: list) -> list:
  """absl's flag parsing, except that asking for --help exits 0 (absl exits 1 after printing it)."""
  try:
    return app.parse_flags_with_usage(argv)
  except SystemExit as e:
    if e.code == 1 and any(arg.split("=")[0] in HELP_FLAGS for arg in argv[1:]):
      raise SystemExit(0) from None
    raise


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
