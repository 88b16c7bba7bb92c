"""python -m mesh_tensorflow.launch: TF_CONFIG per task, rank prefixes, exit status, clean-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mesh_tensorflow.launch import main, tf_configs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(*args, env=None, timeout=60):
  env = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, "-m", "mesh_tensorflow.launch", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def _without_tf_config():
  env = dict(os.environ)
  env.pop("TF_CONFIG", None)
  return env


def test_every_task_gets_its_tf_config_and_every_line_its_rank_prefix():
  script = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
            "print(c['task']['index'], len(c['cluster']['worker']), os.environ['MTF_DEVICES_PER_PROCESS']); "
            "print('second line')")
  result = _launch("--num_processes", "3", "--devices_per_process", "2", "--", sys.executable, "-c", script,
                   env=_without_tf_config())
  assert result.returncode == 0, result.stdout
  lines = result.stdout.splitlines()
  for rank in range(3):
    assert f"[{rank}] {rank} 3 2" in lines
    assert f"[{rank}] second line" in lines


def test_failing_task_stops_the_others_and_its_status_is_the_launchers(tmp_path):
  pid_file = tmp_path / "sleeper.pid"
  script = ("import json, os, sys, time; rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
            f"if rank == 0: open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)\n"
            "else:\n  while not os.path.exists(" + repr(str(pid_file)) + "): time.sleep(0.05)\n"
            "  sys.exit(7)")
  start = time.monotonic()
  result = _launch("--num_processes", "2", "--", sys.executable, "-c", script, env=_without_tf_config())
  assert result.returncode == 7
  assert "[launch] task 1 exited with status 7; stopping the other tasks" in result.stdout
  assert time.monotonic() - start < 30
  sleeper = int(pid_file.read_text())
  with pytest.raises(ProcessLookupError):  # stopped and reaped: no such process any more
    os.kill(sleeper, 0)


def test_scheduler_tf_config_runs_the_command_once_as_that_task():
  config = tf_configs(4, ports=[1, 2, 3, 4])[2]
  env = dict(os.environ, TF_CONFIG=json.dumps(config))
  result = _launch("--num_processes", "4", "--", sys.executable, "-c",
                   "import os; print(os.environ['TF_CONFIG'])", env=env)
  assert result.returncode == 0
  lines = result.stdout.splitlines()
  assert len(lines) == 1 and json.loads(lines[0].split(" ", 1)[1]) == config
  assert lines[0].startswith("[2] ")


def test_missing_command_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["--num_processes", "2"])
  assert exit_info.value.code == 2
  assert "no command: put it after '--'" in capsys.readouterr().err


def test_terminated_launcher_stops_its_tasks(tmp_path):
  pid_file = tmp_path / "task.pid"
  script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
  launcher = subprocess.Popen([sys.executable, "-m", "mesh_tensorflow.launch", "--num_processes", "1", "--",
                               sys.executable, "-c", script], cwd=ROOT,
                              env=dict(_without_tf_config(), PYTHONPATH=ROOT), stdout=subprocess.DEVNULL)
  task, stopped = None, False
  try:
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
      time.sleep(0.05)
    task = int(pid_file.read_text())
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):  # stopped and reaped: no such process any more
      os.kill(task, 0)
    stopped = True
  finally:
    launcher.kill()
    launcher.wait()
    if task is not None and not stopped:  # the test failed with the task running: stop it here
      try:
        os.kill(task, signal.SIGKILL)
      except ProcessLookupError:
        pass
