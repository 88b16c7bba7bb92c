#!/usr/bin/env bash
# Installs everything, lints, and runs the whole test suite (2 workers), listing its 25 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -n 2 -q --durations=25 "$@"
