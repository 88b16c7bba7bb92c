"""Package wiring: importing needs only the declared dependencies; gin files ship as package data."""

from __future__ import annotations

import ast
import fnmatch
import glob
import os
import subprocess
import sys
import textwrap

import pytest

from mesh_tensorflow.transformer._utils.gin_config import packaged_gin_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs in a fresh interpreter in which the optional packages cannot be imported.
_BLOCKED_IMPORT_SCRIPT = textwrap.dedent("""
    import sys

    class Blocker:
      BLOCKED = ("tensorflow_datasets", "t5", "tensor2tensor", "sentencepiece", "tensorflow_estimator")

      def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BLOCKED:
          raise ImportError("blocked for the test: " + name)
        return None

    sys.meta_path.insert(0, Blocker())
    import mesh_tensorflow.transformer as t
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in Blocker.BLOCKED)
    assert not loaded, loaded
    for fn, kwargs in ((t.dataset.pretokenized_tfds_dataset, dict(vocabulary=None)),
                       (t.dataset.untokenized_tfds_dataset, dict(vocabulary=None, pack=True)),
                       (t.vocabulary.get_tfds_vocabulary, {})):
      try:
        if kwargs:
          fn("lm1b", text2self=True, tfds_data_dir=None, dataset_split="train", sequence_length=8, **kwargs)
        else:
          fn("lm1b")
      except ImportError as e:
        assert "pip install tensorflow-datasets" in str(e), e
      else:
        raise AssertionError(fn.__name__ + " did not raise")
    print("ok")
""")


@pytest.mark.slow
def test_import_needs_no_optional_package_and_tfds_functions_name_it():
  result = subprocess.run([sys.executable, "-c", _BLOCKED_IMPORT_SCRIPT], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("ok")


def _setup_package_data() -> list:
  tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
  for node in ast.walk(tree):
    if isinstance(node, ast.keyword) and node.arg == "package_data":
      return ast.literal_eval(node.value)["mesh_tensorflow.transformer"]
  raise AssertionError("setup.py has no package_data")


def test_every_gin_file_is_package_data_found_through_importlib_resources():
  gin_dir = packaged_gin_dir()
  assert os.path.isfile(os.path.join(gin_dir, "defaults.gin"))
  patterns = _setup_package_data()
  files = [os.path.relpath(p, os.path.dirname(gin_dir)).replace(os.sep, "/")
           for p in glob.glob(os.path.join(gin_dir, "**", "*.gin"), recursive=True)]
  assert len(files) > 30
  unshipped = [f for f in files if not any(fnmatch.fnmatch(f, p) and f.count("/") == p.count("/")
                                           for p in patterns)]
  assert not unshipped, f"add patterns to setup.py package_data for {unshipped}"
  assert os.path.isfile(os.path.join(gin_dir, "__init__.py"))  # a package: found by find_packages
