"""tests/warm_python.py runs a program as a fresh `python ARGS` would: what the program can observe of
its start (argv, working directory, sys.path, environment, __main__, signal handlers) and of its end
(exit status, atexit, threads, output) is compared with a real fresh interpreter's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests import warm_python

PROBE = """\
import json, os, signal, sys
import __main__
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path, "name": __name__,
    "main_file": getattr(__main__, "__file__", None), "env": dict(os.environ),
    "sigint": str(signal.getsignal(signal.SIGINT)), "sigterm": str(signal.getsignal(signal.SIGTERM)),
    "stdin": sys.stdin.read()}))
"""


def _both(args: list, cwd, env: dict) -> tuple:
  fresh = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=60)
  warm = warm_python.run(args, cwd=cwd, env=env, timeout=60)
  return fresh, warm


@pytest.mark.parametrize("form", ["script", "module", "code"])
def test_a_program_starts_with_the_argv_cwd_path_environment_and_handlers_of_a_fresh_one(form, tmp_path):
  (tmp_path / "probe_mod.py").write_text(PROBE)   # `-m probe_mod` finds it in the working directory
  args = {"script": [str(tmp_path / "probe_mod.py"), "a", "--b=1"],
          "module": ["-m", "probe_mod", "a", "--b=1"],
          "code": ["-c", PROBE, "a", "--b=1"]}[form]
  fresh, warm = _both(args, tmp_path, dict(os.environ))   # this environment's warm interpreter
  assert fresh.returncode == warm.returncode == 0, (fresh.stderr, warm.stderr)
  assert json.loads(warm.stdout) == json.loads(fresh.stdout)


@pytest.mark.parametrize("program,status,last_line", [
    ("import sys; sys.exit(3)", 3, None),
    ("import sys; sys.exit('bad input')", 1, "bad input"),
    ("def f():\n  raise ValueError('boom')\nf()", 1, "ValueError: boom"),
    ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM, None),
])
def test_a_program_ends_with_the_status_and_report_of_a_fresh_one(program, status, last_line, tmp_path):
  fresh, warm = _both(["-c", program], tmp_path, dict(os.environ))
  assert fresh.returncode == warm.returncode == status
  assert warm.stderr == fresh.stderr   # the same traceback, from the program's first frame
  if last_line is not None:
    assert warm.stderr.strip().splitlines()[-1] == last_line


def test_threads_are_joined_atexit_functions_run_and_output_is_flushed_at_the_end(tmp_path):
  program = ("import atexit, sys, threading, time\n"
             "atexit.register(lambda: print('atexit ran'))\n"
             "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
             "sys.stdout.write('no newline')\n"
             "print('to stderr', file=sys.stderr)\n")
  fresh, warm = _both(["-c", program], tmp_path, dict(os.environ))
  assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
  assert warm.stdout == "no newlinethread done\natexit ran\n"


def test_a_program_past_its_timeout_is_killed_and_the_next_one_runs(tmp_path):
  with pytest.raises(subprocess.TimeoutExpired):
    warm_python.run(["-c", "import time; time.sleep(60)"], cwd=tmp_path, timeout=1)
  assert warm_python.run(["-c", "print('next')"], cwd=tmp_path).stdout == "next\n"


def test_each_program_starts_with_tensorflow_imported_but_never_initialized(tmp_path):
  """The point of the warm interpreter, and its limit: TF is loaded, its context is not (a program
  can still configure devices), and nothing one program did is seen by the next."""
  program = ("import sys\n"
             "assert 'tensorflow' in sys.modules and 'mesh_tensorflow' in sys.modules\n"
             "import tensorflow as tf\n"
             "cpu = tf.config.list_physical_devices('CPU')[0]\n"
             "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)\n"
             "print(len(tf.config.list_logical_devices('CPU')), tf.executing_eagerly())\n"
             "tf.compat.v1.disable_eager_execution()\n")
  for _ in range(2):
    result = warm_python.run(["-c", program], cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "3 True\n"), result.stderr
