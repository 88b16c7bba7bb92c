#!/usr/bin/env bash
# Creates .venv (if missing) and installs mesh_tensorflow with TensorFlow (CPU) and test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# -qq: errors only; setuptools' notice about editable installs of a flat layout is not one.
.venv/bin/python -m pip install -qq -e '.[cpu,test]'
