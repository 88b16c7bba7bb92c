#!/usr/bin/env bash
# Installs everything, lints, and runs the whole test suite (2 workers), listing its 25 slowest tests
# and ending with a line that gives the time. `--quick` leaves out the tests marked slow (launched
# processes, end-to-end training: docs/testing.md) and draws 6 examples per property test instead of
# 12; CI runs the whole suite. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
selection=(-m "")
what="the whole suite"
if [ "${1:-}" = "--quick" ]; then
  shift
  selection=(-m "not slow")
  what="the quick subset (not slow)"
  export MTF_HYPOTHESIS_EXAMPLES="${MTF_HYPOTHESIS_EXAMPLES:-6}"   # property tests draw 6 examples, not 12
fi
bash scripts/setup_env.sh
.venv/bin/ruff check .
tests_started=$SECONDS
status=0
.venv/bin/python -m pytest -n 2 --dist loadgroup -q --durations=25 "${selection[@]}" "$@" || status=$?
tests=$((SECONDS - tests_started))
echo "run_tests.sh: $what ran in $((tests / 60)) min $((tests % 60)) s on $(nproc) cores, $((SECONDS / 60)) min" \
     "$((SECONDS % 60)) s with the install and lint (exit status $status)"
exit "$status"
