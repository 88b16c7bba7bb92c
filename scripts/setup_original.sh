#!/usr/bin/env bash
# Installs the original Mesh TensorFlow 0.1.21 into .original/ (ignored by git), apart from our
# package, for the differential tests (tests/differential/). Nothing else is installed: the
# original runs under .venv's TensorFlow in a subprocess whose PYTHONPATH is .original/ plus the
# import shim in tests/differential/shim/. Set MTF_ORIGINAL_WHEEL to a downloaded wheel's path to
# install without the network.
set -euo pipefail
cd "$(dirname "$0")/.."
SOURCE="${MTF_ORIGINAL_WHEEL:-mesh-tensorflow==0.1.21}"
rm -rf .original
.venv/bin/python -m pip install -q --no-deps --no-compile --target .original "$SOURCE"
.venv/bin/python - <<'PY'
import pathlib

found = [p.name for p in pathlib.Path(".original").glob("mesh_tensorflow-*.dist-info")]
assert found == ["mesh_tensorflow-0.1.21.dist-info"], f"expected 0.1.21 in .original/, found {found}"
print("installed the original mesh_tensorflow 0.1.21 into .original/")
PY
