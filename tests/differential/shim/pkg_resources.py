"""Stand-in for setuptools' pkg_resources, which setuptools 81 and later no longer ship (installing
the `hf` extra brings such a setuptools): the original's transformer/utils.py imports it only for
resource_filename, to find its default gin config beside the module."""

import importlib
import os


def resource_filename(package: str, resource: str) -> str:
  return os.path.join(os.path.dirname(importlib.import_module(package).__file__), resource)
