"""tests/temp_dir_guard.py fails a run that leaves anything in the system temp dir, and names it."""

from __future__ import annotations

import getpass
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

LEAKING_TESTS = '''
import os
import tempfile


def test_leaves_a_folder_through_tempfile():
  tempfile.mkdtemp(prefix="leaked-by-tempfile-")


def test_leaves_a_file_at_a_fixed_path_in_the_system_temp_dir():
  system = os.path.dirname(tempfile.gettempdir())   # the run's own temp folder is made in it
  open(os.path.join(system, "leaked-at-a-fixed-path"), "w").close()


def test_a_launched_process_gets_the_runs_temp_dir():
  import subprocess, sys
  code = "import tempfile; print(tempfile.mkdtemp(prefix='leaked-by-a-child-'))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  assert os.path.dirname(out.strip()) == tempfile.gettempdir()
'''

CLEAN_TESTS = '''
def test_uses_tmp_path(tmp_path):
  (tmp_path / "checkpoint").write_text("kept by pytest, not in the temp dir")
'''


def _run_pytest(folder: pathlib.Path, tests: str, system_temp: pathlib.Path, workers: int):
  (folder / "conftest.py").write_text(
      "from tests.temp_dir_guard import pytest_configure, pytest_sessionfinish  # noqa: F401\n")
  (folder / "test_inner.py").write_text(tests)
  env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(system_temp))
  env.pop("PYTEST_DEBUG_TEMPROOT", None)   # set by this run's guard
  args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
          f"--rootdir={folder}", str(folder)] + (["-n", str(workers)] if workers else [])
  return subprocess.run(args, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_a_run_that_leaves_files_in_the_temp_dir_fails_naming_each_with_xdist_workers(tmp_path):
  system_temp = tmp_path / "system_temp"
  system_temp.mkdir()
  (system_temp / "there-before").mkdir()
  (tmp_path / "suite").mkdir()
  result = _run_pytest(tmp_path / "suite", LEAKING_TESTS, system_temp, workers=2)
  output = result.stdout + result.stderr
  assert result.returncode == 1, output
  assert "3 passed" in output, output
  assert "temp dir not left as found" in output, output
  left = [line.strip() for line in output.splitlines() if line.strip().startswith(str(system_temp))]
  assert len(left) == 3, output
  assert str(system_temp / "leaked-at-a-fixed-path") in left
  assert any(os.path.basename(path).startswith("leaked-by-tempfile-") for path in left), left
  assert any(os.path.basename(path).startswith("leaked-by-a-child-") for path in left), left
  # The run's own temp folder is removed; pytest's tmp_path folders stay where pytest keeps them.
  assert sorted(os.listdir(system_temp)) == ["leaked-at-a-fixed-path", f"pytest-of-{getpass.getuser()}",
                                             "there-before"]


def test_a_run_that_uses_tmp_path_passes_and_leaves_the_temp_dir_as_found(tmp_path):
  system_temp = tmp_path / "system_temp"
  system_temp.mkdir()
  (tmp_path / "suite").mkdir()
  result = _run_pytest(tmp_path / "suite", CLEAN_TESTS, system_temp, workers=0)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "temp dir not left as found" not in result.stdout
  assert os.listdir(system_temp) == [f"pytest-of-{getpass.getuser()}"]   # pytest's own tmp_path folders
