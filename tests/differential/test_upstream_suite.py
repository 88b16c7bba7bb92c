"""The original's own test-suite (the *_test.py files of mesh-tensorflow 0.1.21) run against ours.

The test files come from the installed original (.original/, scripts/setup_original.sh) and run
unchanged, in a subprocess whose `mesh_tensorflow` is this repository. TensorFlow 2.21 lacks some
of what they import, so shim/ (test-only) stands in: `tf.compat.v1.estimator.ModeKeys`, and
tensorflow_probability and tensorflow_datasets, whose stand-ins raise when used. Left out:
`experimental/` (0.1.21's data-augmentation and input-reader helpers, outside the API we
reproduce). Every test must pass but the ones below, each failing for the reason given.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from tests.differential import sides

sides.skip_unless_installed()

KNOWN_FAILURES = {
  # They compare with tfp.stats.correlation: tensorflow_probability is not installed here.
  "layers_test.py::LayersTest::testCorr2DInput": "tensorflow_probability",
  "layers_test.py::LayersTest::testCorr3DInput": "tensorflow_probability",
  # They read the packed dataset with tfds.as_numpy: tensorflow_datasets is not installed here.
  "transformer/dataset_test.py::DatasetTest::test_pack_dataset0": "tensorflow_datasets",
  "transformer/dataset_test.py::DatasetTest::test_pack_dataset_long_seq0": "tensorflow_datasets",
  "transformer/dataset_test.py::DatasetTest::test_pack_dataset_no_eos0": "tensorflow_datasets",
}


def _copy_upstream_tests(folder):
  """The original's test files under folder/upstream_tests (a package), but for experimental/."""
  source = sides.ORIGINAL / "mesh_tensorflow"
  target = folder / "upstream_tests"
  for path in source.rglob("*_test.py"):
    relative = path.relative_to(source)
    if relative.parts[0] == "experimental":
      continue
    (target / relative).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, target / relative)
  for package in [target, *(p for p in target.rglob("*") if p.is_dir())]:
    (package / "__init__.py").touch()
  return target


def test_the_originals_own_tests_pass_against_this_package_but_the_known_few(tmp_path, record_property):
  tests = _copy_upstream_tests(tmp_path)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(sides.ROOT), str(sides.SHIM)]),
             TF_CPP_MIN_LOG_LEVEL="3")
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:xdist",
       str(tests.name)],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=sides.TIMEOUT_S)
  output = result.stdout + result.stderr
  failed = set(re.findall(r"^(?:SUB)?FAILED(?:\[\w+\])? upstream_tests/(\S+)", output, re.M))
  errors = set(re.findall(r"^ERROR upstream_tests/(\S+)", output, re.M))
  assert not errors, output[-6000:]
  assert failed == set(KNOWN_FAILURES), output[-6000:]
  passed = int(re.search(r"(\d+) passed", output).group(1))
  assert passed >= 160, output[-3000:]   # every test of the files, but the known failures
  record_property("upstream_passed", passed)   # for the run's summary line (tests/differential/summary.py)
  record_property("upstream_known_failures", len(failed))
