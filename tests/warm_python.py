"""Runs Python programs as `python ARGS` would, in forks of a warm interpreter.

A fresh interpreter spends ~5 s of CPU importing TensorFlow before a program's first line; the test
suite starts dozens of programs (every documented example and command, the command-line tools). A
warm interpreter has imported `tensorflow` and `mesh_tensorflow` once and forks a child per program,
which then runs exactly as a new interpreter would from there: its own argv, working directory,
environment, `sys.path` (the script's folder or the working directory first, then what the
interpreter was started with), default signal handlers, its stdout/stderr in files, and a normal
interpreter exit (atexit handlers, threads joined) with the program's exit status. Nothing else has
run in the warm interpreter, so the child holds no TF context, graph, devices or configuration.

What a fork cannot reproduce is what happens while TensorFlow is imported, which reads some
environment variables then (TF_CPP_MIN_LOG_LEVEL, TF_ENABLE_ONEDNN_OPTS, PYTHONPATH): a warm
interpreter serves only programs run with the environment it was started with; `run` keeps one
per environment. Tests of import itself (what importing loads, import-time switches) start a fresh
interpreter instead.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time

_SERVER = __file__
_warm: dict = {}   # frozenset(environment items) -> the warm interpreter's Popen
# Set by pytest for each test, or by a test for its program; TensorFlow's import never reads them.
_PER_TEST = {"PYTEST_CURRENT_TEST", "TMPDIR"}


def run(args: list, cwd, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
  """`subprocess.run([sys.executable] + args, cwd, env, capture_output=True, text=True, timeout)`,
  started in milliseconds: args are the interpreter's (`script.py ...`, `-m module ...`, `-c code`)."""
  env = dict(os.environ if env is None else env)
  server = _warm_interpreter(env)
  with tempfile.TemporaryDirectory(prefix="warm_python_") as folder:
    out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
    request = {"args": list(args), "cwd": os.fspath(cwd), "env": env, "stdout": out, "stderr": err}
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()
    pid = int(_reply(server))
    try:
      status = _reply(server, timeout)
    except subprocess.TimeoutExpired:
      os.kill(pid, 9)
      _reply(server)
      raise subprocess.TimeoutExpired([sys.executable, *args], timeout) from None
    printed = [open(path, encoding="utf-8", errors="replace").read() for path in (out, err)]
    return subprocess.CompletedProcess([sys.executable, *args], int(status), *printed)


def _warm_interpreter(env: dict) -> subprocess.Popen:
  key = frozenset((k, v) for k, v in env.items() if k not in _PER_TEST)
  server = _warm.get(key)
  if server is None or server.poll() is not None:
    server = subprocess.Popen([sys.executable, _SERVER], env=env, text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    _warm[key] = server
  return server


def _reply(server: subprocess.Popen, timeout: float | None = None) -> str:
  """The server's next line, read unbuffered so that a timeout can wait on the pipe itself; the
  server's exit is an error (it died: a crash in the fork, or in its start)."""
  fd, line = server.stdout.fileno(), b""
  deadline = None if timeout is None else time.monotonic() + timeout
  while not line.endswith(b"\n"):
    if deadline is not None and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
      raise subprocess.TimeoutExpired(server.args, timeout)
    byte = os.read(fd, 1)
    if not byte:
      raise RuntimeError(f"the warm interpreter exited with status {server.wait()}")
    line += byte
  return line.decode().strip()


@atexit.register
def _close_all() -> None:
  for server in _warm.values():
    if server.poll() is None:
      server.stdin.close()
      server.wait(timeout=30)


# ---- the warm interpreter (this file run as a script) ----

def _serve() -> None:
  """Reads one request a line from stdin; forks a child per request; writes its pid, then its status."""
  import signal
  handled = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}

  import tensorflow  # noqa: F401  (the point: imported once, before any fork)

  import mesh_tensorflow  # noqa: F401
  base_path = sys.path[1:]   # sys.path[0] is this file's folder, which no program should see
  replies = sys.stdout
  for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
      _become_program(request, base_path, handled)   # never returns: the child exits as the program does
    replies.write(f"{pid}\n")
    replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(f"{os.waitstatus_to_exitcode(status)}\n")
    replies.flush()


def _become_program(request: dict, base_path: list, inherited_handlers: dict) -> None:
  """In the forked child: set up the process as `python ARGS` would and run the program."""
  import runpy
  import signal
  import types
  sys.stdin.close()
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
  sys.stdin = open(0, closefd=False)
  sys.stdout = open(1, "w", closefd=False)
  sys.stderr = open(2, "w", closefd=False)
  for signum, handler in inherited_handlers.items():   # as the warm interpreter found them, like a fresh one
    signal.signal(signum, handler)
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  tempfile.tempdir = None   # a fresh interpreter finds its temp dir from TMPDIR when first asked
  args = request["args"]
  if args[0] == "-m":
    sys.argv, first_path = [args[1], *args[2:]], os.getcwd()
  elif args[0] == "-c":
    sys.argv, first_path = ["-c", *args[2:]], ""
  else:
    sys.argv, first_path = list(args), os.path.dirname(os.path.abspath(args[0]))
  sys.path[:] = [first_path, *base_path]
  try:
    if args[0] == "-m":
      runpy._run_module_as_main(args[1])   # what `python -m` itself calls  # noqa: SLF001
    elif args[0] == "-c":
      main = sys.modules["__main__"] = types.ModuleType("__main__")
      exec(compile(args[1], "<string>", "exec"), main.__dict__)
    else:
      runpy.run_path(args[0], run_name="__main__")
    status = 0
  except SystemExit as exit_:
    status = _exit_status(exit_.code)
  except BaseException as error:   # the interpreter's own report of an uncaught exception, and its status
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_frame.f_code.co_filename == __file__:
      traceback = traceback.tb_next   # from the program's first frame, as a fresh interpreter shows it
    sys.excepthook(type(error), error.with_traceback(traceback), traceback)
    status = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
  _exit(status)


def _exit_status(code) -> int:
  """sys.exit(code)'s status, as the interpreter computes it (a message is printed, status 1)."""
  if code is None or isinstance(code, int):
    return code or 0
  print(code, file=sys.stderr)
  return 1


def _exit(status: int) -> None:
  """What an interpreter does at exit that a program can observe: join its threads, run its atexit
  functions, flush its streams. Freeing every module of TensorFlow one by one (seconds) it skips."""
  import atexit
  import signal
  import threading
  threading._shutdown()   # noqa: SLF001  (the interpreter's own call: waits for non-daemon threads)
  atexit._run_exitfuncs()   # noqa: SLF001
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  if status == -signal.SIGINT:   # an uncaught KeyboardInterrupt: the interpreter dies by the signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
  os._exit(status)


if __name__ == "__main__":
  _serve()
