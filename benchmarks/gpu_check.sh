#!/usr/bin/env bash
# The GPU check of issue #37 in one table: the benchmark Transformer on one GPU, plain TF against
# mtf (XLA off and on), and the placement and collective backends over 2 and 4 logical GPUs carved
# out of it. About 8 minutes at most on one GPU; `--dry` runs it on virtual CPUs with a tiny model.
#   bash benchmarks/gpu_check.sh [--dry] [more benchmarks/gpu_check.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [[ " $* " == *" --dry "* ]]; then
  exec timeout 120 "$PYTHON" benchmarks/gpu_check.py --reps 1 --steps 2 "$@"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec timeout 480 "$PYTHON" benchmarks/gpu_check.py "$@"
