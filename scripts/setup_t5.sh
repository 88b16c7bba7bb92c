#!/usr/bin/env bash
# Installs T5 0.9.4 and seqio 0.0.20, and what `import t5.models` needs, into .t5deps/ (ignored by
# git), apart from .venv, for the one test of T5's own MtfModel (tests/transformer/test_t5_mtf_model.py).
# They stay out of .venv because they bring jax: with jax importable, every TensorFlow import loads
# it (tensorflow.lite does) and jax sets TF_CPP_MIN_LOG_LEVEL for every process a test starts. The
# test runs T5 in a subprocess whose PYTHONPATH adds .t5deps/. What to install is the `t5` extra of
# setup.py, read from .venv's metadata of this package; `--prefix` reuses what .venv has (TensorFlow,
# numpy, torch and transformers from the `hf` extra). t5, seqio and tensorflow-text go in with
# --no-deps: t5 would pull the original mesh-tensorflow, tensorflow-text a second TensorFlow.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t T5_IMPORTS < <(.venv/bin/python -c '
import importlib.metadata
for requirement in importlib.metadata.requires("mesh-tensorflow"):
  name, _, marker = requirement.partition(";")
  if marker.strip() == "extra == \"t5\"":
    print(name.strip())')
NO_DEPS=(t5==0.9.4 seqio==0.0.20 tensorflow-text==2.21.1)   # tensorflow-text follows TensorFlow's version
rm -rf .t5deps
.venv/bin/python -m pip install -qq --prefix .t5deps "${T5_IMPORTS[@]}"
.venv/bin/python -m pip install -qq --prefix .t5deps --no-deps "${NO_DEPS[@]}"
echo "installed t5 0.9.4 and seqio 0.0.20 into .t5deps/"
