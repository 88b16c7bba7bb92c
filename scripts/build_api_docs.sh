#!/usr/bin/env bash
# Regenerates the Markdown API reference, docs/api/*.md, from the docstrings (scripts/api_markdown.py).
# Run it after changing public API or a docstring: tests/docs/test_api_reference.py fails until then.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=python3
if [ -x .venv/bin/python ]; then
  PYTHON=.venv/bin/python
fi
PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=3 "$PYTHON" scripts/api_markdown.py
