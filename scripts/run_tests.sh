#!/usr/bin/env bash
# Installs everything, lints, and runs the tests on 2 workers, listing the 25 slowest and ending with
# a line that gives the time. By default it leaves out the tests marked slow (launched processes,
# end-to-end training: docs/testing.md) and draws 6 examples per property test. `--all` runs the
# whole suite with 12 examples each, as CI does. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--all" ]; then
  shift
  selection=(-m "")
  what="the whole suite"
else
  selection=(-m "not slow")
  what="the tests not marked slow"
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
