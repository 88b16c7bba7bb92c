"""python -m mesh_tensorflow.launch: TF_CONFIG per task, rank prefixes, exit status, clean-up.

The launcher's `main` runs in the test's own process (its tasks are plain Python programs that do
not import TensorFlow): a launcher process would spend ~5 s of CPU importing it. A signal to the
launcher is then a signal to this process, which `main` handles while its tasks run.
docs/multi_process.md runs the launcher's command line itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import pytest

from mesh_tensorflow.launch import main, tf_configs


@pytest.fixture
def no_tf_config(monkeypatch):
  """Not under a scheduler: the launcher starts every task itself."""
  monkeypatch.delenv("TF_CONFIG", raising=False)


def test_every_task_gets_its_tf_config_and_every_line_its_rank_prefix(no_tf_config, capsys):
  script = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
            "print(c['task']['index'], len(c['cluster']['worker']), os.environ['MTF_DEVICES_PER_PROCESS']); "
            "print('second line')")
  status = main(["--num_processes", "3", "--devices_per_process", "2", "--", sys.executable, "-c", script])
  stdout = capsys.readouterr().out
  assert status == 0, stdout
  lines = stdout.splitlines()
  for rank in range(3):
    assert f"[{rank}] {rank} 3 2" in lines
    assert f"[{rank}] second line" in lines


def test_failing_task_stops_the_others_and_its_status_is_the_launchers(no_tf_config, tmp_path, capsys):
  pid_file = tmp_path / "sleeper.pid"
  script = ("import json, os, sys, time; rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
            f"if rank == 0: open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)\n"
            "else:\n  while not os.path.exists(" + repr(str(pid_file)) + "): time.sleep(0.05)\n"
            "  sys.exit(7)")
  start = time.monotonic()
  status = main(["--num_processes", "2", "--", sys.executable, "-c", script])
  assert status == 7
  assert "[launch] task 1 exited with status 7; stopping the other tasks" in capsys.readouterr().out
  assert time.monotonic() - start < 30
  sleeper = int(pid_file.read_text())
  with pytest.raises(ProcessLookupError):  # stopped and reaped: no such process any more
    os.kill(sleeper, 0)


def test_a_task_stopped_mid_line_gets_its_line_ended_before_the_launchers_line(no_tf_config, capsys):
  script = "import sys; sys.stdout.write('half a line'); sys.stdout.flush(); sys.exit(3)"
  status = main(["--num_processes", "1", "--", sys.executable, "-c", script])
  lines = capsys.readouterr().out.splitlines()
  assert status == 3
  assert lines == ["[0] half a line", "[launch] task 0 exited with status 3; stopping the other tasks"]


def test_scheduler_tf_config_runs_the_command_once_as_that_task(monkeypatch, capsys):
  config = tf_configs(4, ports=[1, 2, 3, 4])[2]
  monkeypatch.setenv("TF_CONFIG", json.dumps(config))
  status = main(["--num_processes", "4", "--", sys.executable, "-c",
                 "import os; print(os.environ['TF_CONFIG'])"])
  assert status == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 1 and json.loads(lines[0].split(" ", 1)[1]) == config
  assert lines[0].startswith("[2] ")


def test_missing_command_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["--num_processes", "2"])
  assert exit_info.value.code == 2
  assert "no command: put it after '--'" in capsys.readouterr().err


def test_terminated_launcher_stops_its_tasks(no_tf_config, tmp_path):
  pid_file = tmp_path / "task.pid"
  script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"

  def terminate_the_launcher_once_the_task_runs():
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
      if time.monotonic() > deadline:
        return  # the test fails below: the launcher then stops its task when the task ends
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher handles it from the task's start until it returns

  sender = threading.Thread(target=terminate_the_launcher_once_the_task_runs)
  sender.start()
  try:
    with pytest.raises(SystemExit) as exit_info:
      main(["--num_processes", "1", "--", sys.executable, "-c", script])
  finally:
    sender.join()
  assert exit_info.value.code == 128 + signal.SIGTERM
  task = int(pid_file.read_text())
  with pytest.raises(ProcessLookupError):  # stopped and reaped: no such process any more
    os.kill(task, 0)


def test_max_restarts_starts_every_task_again_and_gives_up_after_k(no_tf_config, tmp_path, capsys):
  # Each attempt counts itself in a file; task 1 prints a step line, then fails.
  count = tmp_path / "attempts"
  script = ("import json, os, sys; rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
            f"if rank == 1: open({str(count)!r}, 'a').write('x')\n"
            "print('step 5 loss 1.0', flush=True)\n"
            "sys.exit(3 if rank == 1 else 0)")
  status = main(["--num_processes", "2", "--max_restarts", "2", "--checkpoint_dir", str(tmp_path), "--",
                 sys.executable, "-c", script])
  out = capsys.readouterr().out
  assert status == 3
  assert count.read_text() == "xxx"  # the first try and 2 restarts
  assert "[launch] task 1 exited with status 3 at step 5; restart 1 of 2 from its latest checkpoint" in out
  assert "[launch] task 1 exited with status 3 at step 5; restart 2 of 2 from its latest checkpoint" in out
  assert out.strip().splitlines()[-1] == ("[launch] giving up after 2 restarts (--max_restarts): task 1 "
                                          "exited with status 3; its last line: step 5 loss 1.0")
