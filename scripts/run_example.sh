#!/usr/bin/env bash
# The main job: the bundled Transformer example -- a byte-level language model trained through
# utils.run on CPython's documentation text, over 8 virtual CPU devices (mesh batch:2,model:4).
# Arguments go to examples/transformer/train.py (e.g. --train_steps 2000, --task reverse).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m pip install -qq -e '.[examples]' || echo "matplotlib could not be installed: no loss-curve picture"
exec .venv/bin/python -m examples.transformer.train "$@"
