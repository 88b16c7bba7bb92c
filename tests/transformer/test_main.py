"""The command-line driver's helpers: gin file lookup, command files, log noise control."""

from __future__ import annotations

import logging as std_logging
import os
import shlex
import subprocess
import sys

import gin

import pytest
import tensorflow.compat.v1 as tf
from absl import app

from mesh_tensorflow import _cli_quiet
from mesh_tensorflow.transformer import main, utils
from mesh_tensorflow.transformer._utils.gin_config import packaged_gin_dir
from tests.transformer import tiny_run


def test_a_missing_gin_file_is_named_with_the_places_searched(tmp_path):
  with pytest.raises(app.UsageError, match=r"--gin_file=models/nope.gin: no such file \(looked in the "
                                           r"current directory and in .*\); .*--gin_location_prefix"):
    main.resolve_gin_files(["models/nope.gin"], [str(tmp_path), packaged_gin_dir()])
  assert main.resolve_gin_files(["layouts/single.gin"], [str(tmp_path), packaged_gin_dir()]) == [
      os.path.join(packaged_gin_dir(), "layouts", "single.gin")]


def test_each_run_keeps_its_own_command_file(tmp_path):
  first = main.write_command_line(str(tmp_path), ["--gin_param=a = 1"])
  second = main.write_command_line(str(tmp_path), ["--gin_param=a = 2"])
  assert [os.path.basename(first), os.path.basename(second)] == ["command", "command.1"]
  assert open(second).read().endswith("-m mesh_tensorflow.transformer.main '--gin_param=a = 2'\n")


def test_the_saved_command_pastes_back_to_the_same_configuration(tmp_path):
  files, bindings = tiny_run.tiny_bindings(str(tmp_path / "*.txt"))
  args = ([f"--model_dir={tmp_path}"] + [f"--gin_file={f}" for f in files]
          + [f"--gin_param={b}" for b in bindings])  # quotes, spaces and braces to survive the shell
  saved = shlex.split(open(main.write_command_line(str(tmp_path), args)).read())
  assert saved == [sys.executable, "-m", "mesh_tensorflow.transformer.main"] + args
  configs = []
  for argv in (["main"] + args, ["main"] + saved[3:]):  # as run, then as pasted back from the file
    gin.clear_config()
    utils.FLAGS.unparse_flags()
    utils.FLAGS(argv, known_only=True)
    utils.parse_gin_defaults_and_flags(finalize_config=False)
    configs.append(gin.config_str())
  gin.clear_config()
  assert configs[0] == configs[1]
  assert "run.batch_size = 8" in configs[1] and "d_model = 16" in configs[1]


def test_verbose_brings_tensorflow_logging_back():
  saved = tf.logging.get_verbosity()
  try:
    main.configure_logging(verbose=False)
    assert tf.logging.get_verbosity() == tf.logging.ERROR
    main.configure_logging(verbose=True)
    assert tf.logging.get_verbosity() == tf.logging.INFO
  finally:
    tf.logging.set_verbosity(saved)
    std_logging.getLogger("absl").setLevel(std_logging.NOTSET)


@pytest.mark.parametrize("argv, env, quiet", [
    (["-m", "--model_dir=/tmp/x"], {}, True),               # python -m mesh_tensorflow.transformer.main
    (["-m", "--verbose"], {}, False),
    (["script.py"], {"MTF_QUIET": "1"}, True),
    (["-m"], {"MTF_QUIET": "0"}, False),
    (["pytest"], {}, False),
])
def test_tensorflow_start_up_lines_are_muted_only_for_command_line_entry_points(monkeypatch, argv, env,
                                                                                quiet):
  monkeypatch.setattr("sys.argv", argv)
  monkeypatch.delenv("MTF_QUIET", raising=False)
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  assert _cli_quiet._wanted() == quiet


@pytest.mark.slow  # launches the driver (about 6 s)
def test_help_exits_0_and_lists_the_flags():
  done = subprocess.run([sys.executable, "-m", "mesh_tensorflow.transformer.main", "--help"],
                        capture_output=True, text=True, timeout=120, cwd=tiny_run.ROOT)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "--model_dir: Directory of checkpoints" in done.stdout and "--gin_param" in done.stdout


def test_a_bad_flag_still_exits_1_after_help_is_made_to_exit_0():
  with pytest.raises(SystemExit) as raised:
    main.parse_flags(["main", "--no_such_flag=1"])
  assert raised.value.code == 1


def test_a_supervised_child_runs_the_command_line_without_max_restarts():
  args = ["--model_dir=/tmp/m", "--max_restarts=2", "--gin_param=a = 1", "--max_restarts", "3", "--verbose"]
  assert main.without_max_restarts(args) == ["--model_dir=/tmp/m", "--gin_param=a = 1", "--verbose"]


def test_a_library_error_is_one_line_without_the_lines_gin_adds():
  error = ValueError("Checkpoint x cannot be read: bad.\n  In call to configurable 'run' (<function run>)")
  assert main.one_line_error(error) == ("Error (ValueError): Checkpoint x cannot be read: bad. "
                                        "(--traceback shows where it was raised)")
