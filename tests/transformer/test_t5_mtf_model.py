"""T5's own `MtfModel.finetune` on a converted model_dir, run where T5 is importable and the suite is not.

t5_mtf_model_check.py holds the test. T5 brings jax, which would change every TensorFlow process of the
suite (docs/testing.md), so T5 lives in .t5deps/ (scripts/setup_t5.sh) and this test runs that file
under pytest in a subprocess whose PYTHONPATH adds .t5deps/ to this repository.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import sysconfig

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
T5DEPS = ROOT / ".t5deps"
CHECK = HERE / "t5_mtf_model_check.py"
TIMEOUT_S = 600


def t5deps_path() -> list[str]:
  """The site-packages folders pip's `--prefix .t5deps` wrote (pure and platform ones may differ)."""
  paths = {sysconfig.get_path(kind, vars={"base": str(T5DEPS), "platbase": str(T5DEPS)})
           for kind in ("purelib", "platlib")}
  return sorted(p for p in paths if (pathlib.Path(p) / "t5" / "models").is_dir())


@pytest.mark.slow
def test_mtf_model_finetune_starts_from_the_converted_weights_and_trains_them():
  pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
  path = t5deps_path()
  if not path:
    pytest.skip("needs t5 and seqio in .t5deps/: run `bash scripts/setup_t5.sh` "
                "(scripts/run_tests.sh --all does)")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *path]))
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-p", "no:xdist", str(CHECK)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  output = result.stdout + result.stderr
  # One test, passed: a failure, an error or a skip inside (T5 not importable) all fail this one.
  assert result.returncode == 0, output[-6000:]
  summary = re.findall(r"^=*\s*(\d+ \w+(?:, \d+ \w+)*) in [\d.]+s", output, re.M)
  assert summary and re.fullmatch(r"1 passed(, \d+ warnings?)?", summary[-1]), output[-6000:]
