"""The --gin_file / --gin_param / --gin_location_prefix flags and parsing of the packaged defaults."""

from __future__ import annotations

import importlib.resources
import os

import gin
from absl import app, flags


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


def gin_search_path() -> list:
  """The --gin_location_prefix directories, then the packaged gin directory."""
  return list(FLAGS["gin_location_prefix"].value or []) + [packaged_gin_dir()]


def resolve_gin_files(gin_files, search_path) -> list:
  """Each --gin_file as an existing path: as given, else under the first search-path directory
  holding it. A name found nowhere is a UsageError naming the places searched."""
  resolved = []
  for name in gin_files or []:
    candidates = [name] + [os.path.join(d, name) for d in search_path]
    found = [c for c in candidates if os.path.exists(c)]
    if not found:
      raise app.UsageError(f"--gin_file={name}: no such file (looked in the current directory and in "
                           f"{', '.join(search_path)}); check the name or add --gin_location_prefix=DIR.")
    resolved.append(os.path.abspath(found[0]))
  return resolved


def parse_gin_defaults_and_flags(skip_unknown: bool = False, finalize_config: bool = True) -> None:
  """Parses the packaged gin/defaults.gin, then the --gin_file files and --gin_param bindings.

  Relative gin file names are looked up in --gin_location_prefix directories and in the packaged gin
  directory, so `--gin_file=models/bi_base.gin --gin_file=layouts/2x2_dp_mp.gin` works from a wheel.
  They are resolved here, not by gin, whose lookup logs `ERROR:root:Path not found` for a name
  that is not under the current directory before finding it on the search path.
  The flag values are read as they stand (their defaults, none, if absl has not parsed argv yet).
  """
  search_path = gin_search_path()
  for path in search_path:
    gin.add_config_file_search_path(path)
  gin.parse_config_file(os.path.join(packaged_gin_dir(), "defaults.gin"), skip_unknown=skip_unknown)
  gin.parse_config_files_and_bindings(resolve_gin_files(FLAGS["gin_file"].value, search_path),
                                      FLAGS["gin_param"].value, skip_unknown=skip_unknown,
                                      finalize_config=finalize_config)
