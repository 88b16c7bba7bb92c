#!/usr/bin/env bash
# Installs everything, lints, and runs the tests on 2 workers, listing the 25 slowest and ending with
# a line that gives the time. By default it leaves out the tests marked slow (launched processes,
# end-to-end training: docs/testing.md) and draws 6 examples per property test. `--all` runs the
# whole suite with 12 examples each, as CI does, and first installs what the optional tests need:
# the original mesh-tensorflow 0.1.21 for the differential tests (scripts/setup_original.sh), the
# `hf` extra for the Hugging Face converter tests, and T5 with seqio in .t5deps/ for the test of
# T5's own MtfModel (scripts/setup_t5.sh: apart from .venv, since T5 brings jax); each says so and
# its tests skip if it cannot be installed. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [ "${1:-}" = "--all" ]; then
  shift
  selection=(-m "")
  what="the whole suite"
  started=$SECONDS
  bash scripts/setup_original.sh || echo "run_tests.sh: the original could not be installed: the differential tests skip"
  original=$((SECONDS - started))
  started=$SECONDS
  .venv/bin/python -m pip install -qq -e '.[hf]' || echo "run_tests.sh: the hf extra could not be installed: its tests skip"
  hf=$((SECONDS - started))
  started=$SECONDS
  bash scripts/setup_t5.sh || echo "run_tests.sh: t5 could not be installed in .t5deps/: its test skips"
  echo "run_tests.sh: installed the original in $original s, the hf extra in $hf s and t5 in $((SECONDS - started)) s"
else
  selection=(-m "not slow")
  what="the tests not marked slow"
  export MTF_HYPOTHESIS_EXAMPLES="${MTF_HYPOTHESIS_EXAMPLES:-6}"   # property tests draw 6 examples, not 12
fi
.venv/bin/ruff check .
tests_started=$SECONDS
status=0
.venv/bin/python -m pytest -n 2 --dist loadgroup -q --durations=25 "${selection[@]}" "$@" || status=$?
tests=$((SECONDS - tests_started))
echo "run_tests.sh: $what ran in $((tests / 60)) min $((tests % 60)) s on $(nproc) cores, $((SECONDS / 60)) min" \
     "$((SECONDS % 60)) s with the install and lint (exit status $status)"
exit "$status"
