"""The test suite leaves the system temp dir as it found it (pytest hooks, imported by conftest.py).

At the start of a run (in the controlling process: with pytest-xdist, before the workers start) the
entries of the system temp dir (`tempfile.gettempdir()`, which honours TMPDIR) are noted, and a
private folder is made in it and made the temp dir of the run: TMPDIR and `tempfile.tempdir` point
to it, so the workers, and every process a test launches, put their temporary files there
(PYTEST_DEBUG_TEMPROOT keeps pytest's tmp_path folders where pytest puts them by default). At the
end of the run, once the workers have exited, that folder must be empty (but for TensorFlow's
autograph modules, which it never removes) and the system temp dir must
hold no new entry: each one left is listed and the run fails (exit status 1). pytest's own
`pytest-of-<user>` folder is not one (pytest keeps the last runs' tmp_path folders there); nor is
anything another program on the machine writes there during the run, which this cannot tell apart:
on a shared machine, run the suite with TMPDIR set to a folder of its own.
"""

from __future__ import annotations

import getpass
import os
import pathlib
import re
import shutil
import tempfile

import pytest

_RUN_TEMP_PREFIX = "mtf-tests-tmp-"
# TensorFlow's autograph writes each function it converts as a module in the temp dir and never
# removes it from a pytest-xdist worker; in the run's own folder (removed below) they reach no one.
_AUTOGRAPH_MODULE = re.compile(r"^__autograph_generated_file\w+\.py$")
_SET = ("TMPDIR", "PYTEST_DEBUG_TEMPROOT")   # the environment variables the run sets, restored at its end


def _controlling(config) -> bool:
  return not hasattr(config, "workerinput")   # pytest-xdist gives its workers a workerinput


def pytest_configure(config) -> None:
  if not _controlling(config):
    return
  system = pathlib.Path(tempfile.gettempdir())
  config.stash[_SYSTEM] = system, set(os.listdir(system))
  run_temp = tempfile.mkdtemp(prefix=_RUN_TEMP_PREFIX, dir=system)
  config.stash[_RUN_TEMP] = pathlib.Path(run_temp), {name: os.environ.get(name) for name in _SET}
  os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", str(system))   # tmp_path stays where pytest keeps it
  os.environ["TMPDIR"] = tempfile.tempdir = run_temp


@pytest.hookimpl(trylast=True)   # after pytest-xdist's own, which waits for the workers to exit
def pytest_sessionfinish(session) -> None:
  config = session.config
  if not _controlling(config) or _SYSTEM not in config.stash:
    return
  left = left_behind(config)
  if left:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    lines = ["the tests left these in the temp dir (use pytest's tmp_path or tmp_path_factory):",
             *(f"  {path}" for path in left)]
    if reporter is not None:
      reporter.ensure_newline()
      reporter.write_sep("=", "temp dir not left as found", red=True)
      for line in lines:
        reporter.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def left_behind(config) -> list:
  """What the run added to the system temp dir and its own temp folder, which it then removes."""
  system, before = config.stash[_SYSTEM]
  run_temp, environment = config.stash[_RUN_TEMP]
  ignored = {run_temp.name, f"pytest-of-{getpass.getuser()}"}
  left = sorted(str(system / name) for name in set(os.listdir(system)) - before - ignored)
  left += sorted(str(path) for path in run_temp.iterdir() if not _AUTOGRAPH_MODULE.match(path.name))
  shutil.rmtree(run_temp, ignore_errors=True)
  for name, value in environment.items():
    if value is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = value
  tempfile.tempdir = None
  return left


_SYSTEM = pytest.StashKey[tuple]()
_RUN_TEMP = pytest.StashKey[tuple]()
