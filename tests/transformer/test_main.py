"""The command-line driver's helpers: gin file lookup, command files, log noise control."""

from __future__ import annotations

import logging as std_logging
import os

import pytest
import tensorflow.compat.v1 as tf
from absl import app

from mesh_tensorflow import _cli_quiet
from mesh_tensorflow.transformer import main
from mesh_tensorflow.transformer._utils.gin_config import packaged_gin_dir


def test_a_missing_gin_file_is_named_with_the_places_searched(tmp_path):
  with pytest.raises(app.UsageError, match=r"--gin_file=models/nope.gin: no such file \(looked in the "
                                           r"current directory and in .*\); .*--gin_location_prefix"):
    main.resolve_gin_files(["models/nope.gin"], [str(tmp_path), packaged_gin_dir()])
  assert main.resolve_gin_files(["layouts/single.gin"], [str(tmp_path), packaged_gin_dir()]) == [
      os.path.join(packaged_gin_dir(), "layouts", "single.gin")]


def test_each_run_keeps_its_own_command_file(tmp_path):
  first = main.write_command_line(str(tmp_path), ["main", "--gin_param=a = 1"])
  second = main.write_command_line(str(tmp_path), ["main", "--gin_param=a = 2"])
  assert [os.path.basename(first), os.path.basename(second)] == ["command", "command.1"]
  assert open(second).read().endswith("-m mesh_tensorflow.transformer.main --gin_param=a = 2\n")


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
