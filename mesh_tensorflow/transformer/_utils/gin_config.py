"""The --gin_file / --gin_param / --gin_location_prefix flags and parsing of the packaged defaults."""

from __future__ import annotations

import importlib.resources
import os

import gin
from absl import flags


def _define_flags() -> None:
  """Defines the gin flags once (main.py or a second import of utils must not redefine them)."""
  for define, name, default, help_text in (
      (flags.DEFINE_multi_string, "gin_file", None, "Path to a gin file (or one under the search path)."),
      (flags.DEFINE_multi_string, "gin_param", None, "A gin binding, e.g. 'utils.run.mode = \"eval\"'."),
      (flags.DEFINE_list, "gin_location_prefix", [], "Directories searched for gin files and includes."),
  ):
    try:
      define(name, default, help_text)
    except flags.DuplicateFlagError:
      pass


_define_flags()
FLAGS = flags.FLAGS


def packaged_gin_dir() -> str:
  """The directory of the gin files shipped with the package (found via importlib.resources)."""
  return os.fspath(importlib.resources.files("mesh_tensorflow.transformer") / "gin")


def parse_gin_defaults_and_flags(skip_unknown: bool = False, finalize_config: bool = True) -> None:
  """Parses the packaged gin/defaults.gin, then the --gin_file files and --gin_param bindings.

  Relative gin file names are looked up in --gin_location_prefix directories and in the packaged gin
  directory, so `--gin_file=models/bi_base.gin --gin_file=layouts/2x2_dp_mp.gin` works from a wheel.
  The flag values are read as they stand (their defaults, none, if absl has not parsed argv yet).
  """
  for path in list(FLAGS["gin_location_prefix"].value or []) + [packaged_gin_dir()]:
    gin.add_config_file_search_path(path)
  gin.parse_config_file(os.path.join(packaged_gin_dir(), "defaults.gin"), skip_unknown=skip_unknown)
  gin.parse_config_files_and_bindings(FLAGS["gin_file"].value, FLAGS["gin_param"].value,
                                      skip_unknown=skip_unknown, finalize_config=finalize_config)
