#!/usr/bin/env bash
# Builds the HTML API reference from the docstrings with pdoc (pip install -e '.[docs]').
# Usage: bash scripts/build_api_docs.sh [output folder, default build/api]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-build/api}"
PYTHON=python3
if [ -x .venv/bin/python ]; then
  PYTHON=.venv/bin/python
fi
TF_CPP_MIN_LOG_LEVEL=2 "$PYTHON" - "$OUT" <<'PY'
"""pdoc documents a module's own members, or those in its __all__. The public modules are
facades that re-export from underscored packages without an __all__ (mtf.ops must not have one:
`import *` has to see every name), so each gets one here, listing the mesh_tensorflow classes and
functions it exposes. Underscored packages are implementation and are not documented."""
import importlib
import inspect
import pathlib
import pkgutil
import sys

import pdoc
import pdoc.render

import mesh_tensorflow

# mtf.ops and mtf.ops_with_redefined_builtins expose the same names as mesh_tensorflow itself.
SAME_AS_TOP = ("mesh_tensorflow.ops", "mesh_tensorflow.ops_with_redefined_builtins")


def public_modules():
  yield "mesh_tensorflow"
  for info in pkgutil.walk_packages(mesh_tensorflow.__path__, "mesh_tensorflow."):
    if not any(part.startswith("_") for part in info.name.split(".")) and info.name not in SAME_AS_TOP:
      yield info.name


def exported_names(module):
  return sorted(name for name, value in vars(module).items()
                if not name.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value))
                and getattr(value, "__module__", "").startswith("mesh_tensorflow"))


names = list(public_modules())
for name in names:
  module = importlib.import_module(name)
  if not hasattr(module, "__all__"):
    module.__all__ = exported_names(module)
pdoc.render.configure(docformat="google", footer_text="mesh_tensorflow API reference")
pdoc.pdoc(*names, output_directory=pathlib.Path(sys.argv[1]))
PY
echo "API reference written to $OUT/index.html"
