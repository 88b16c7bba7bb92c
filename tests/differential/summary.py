"""The run's last lines say how many differential tests ran (a pytest hook, imported by conftest.py).

They skip when the original is not installed (sides.NOT_INSTALLED), so a run's log must show
whether they ran: one line counts the tests of tests/differential/ by outcome, and another the
original's own test files that test_upstream_suite.py ran against this package (its test records
the counts as user properties, which pytest-xdist brings back from the workers).
"""

from __future__ import annotations

import collections

FOLDER = "tests/differential/"
UPSTREAM_COUNTS = ("upstream_passed", "upstream_known_failures")


def pytest_terminal_summary(terminalreporter) -> None:
  outcomes, upstream = collections.Counter(), collections.Counter()
  for category in ("passed", "failed", "skipped", "error"):
    for report in terminalreporter.stats.get(category, []):
      if getattr(report, "nodeid", "").startswith(FOLDER) and (report.when == "call" or category != "passed"):
        outcomes[category] += 1
        upstream.update({k: v for k, v in getattr(report, "user_properties", ()) if k in UPSTREAM_COUNTS})
  if not outcomes:
    return
  counts = ", ".join(f"{outcomes[c]} {c}" for c in ("passed", "failed", "skipped", "error") if outcomes[c])
  terminalreporter.write_line(f"differential tests (against mesh-tensorflow 0.1.21): {counts}")
  if upstream:
    terminalreporter.write_line(
        f"  of them, the original's own test files: {upstream['upstream_passed']} of its tests passed "
        f"against this package, {upstream['upstream_known_failures']} known failures")
