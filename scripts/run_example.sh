#!/usr/bin/env bash
# The main job: trains the bundled classifier on 8 virtual CPU devices under three layouts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python examples/classifier.py "$@"
