"""Every Python block and command line in README.md and docs/*.md runs as shown.

Each Python block runs as a program of its own, as `python block.py` would (in a fork of an
interpreter that has only imported TensorFlow and mesh_tensorflow: tests/warm_python.py), saved in a
temporary directory and run from there with only the installed package importable (not the repository), so
it must set up what it needs (graph or eager mode, virtual devices, imports) as the page says; and
it must print no warning or error (TensorFlow's own lines in TOLERATED aside). A block preceded by
`<!-- fragment -->` is an excerpt and is skipped; at most MAX_FRAGMENT_SHARE of the blocks may be.
Command lines (in sh/bash/console blocks, or after a `$ ` prompt) that run a repository script
or module with Python are run with SHORT_SETTINGS appended, and what the page says they print is
checked: the lines shown after a `$ ` prompt (`...` skips lines) and STATED_OUTPUT. Commands that
cannot run here (they install packages, need the network, a TPU or the whole suite) are skipped,
each with its reason from NOT_RUN, after checking that the scripts they name exist. New pages under
docs/ are picked up automatically.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys
from typing import NamedTuple

import pytest

from tests import warm_python

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FRAGMENT_MARK = "<!-- fragment -->"
MAX_FRAGMENT_SHARE = 0.25
SHELL_LANGUAGES = ("sh", "bash", "shell", "console")
PYTHONS = ("python", "python3", ".venv/bin/python")
TIMEOUT_S = 300

# Arguments appended to a documented command (by script path, or module name for `python -m`) so
# that it runs in a few seconds (argparse and absl flags: the last value wins).
SHORT_SETTINGS = {
    "examples/classifier.py": ["--steps", "5"],
    "examples/spatial_conv.py": ["--steps", "2"],
    "benchmarks/bench_classifier.py": ["--steps", "2", "--warmup", "1", "--batch_size", "32",
                                       "--hidden", "32", "--lowering_devices", "1,8"],
    "scripts/lost_peer_loop.py": ["--rounds", "1"],
    # The Transformer example and driver: two steps of a one-layer model of width 16, a progress
    # line (the loss) after each.
    "examples.transformer.train": ["--train_steps", "2", "--gin_param", "num_layers = 1", "--gin_param",
                                   "d_model = 16", "--gin_param", "d_ff = 32", "--gin_param",
                                   "utils.run.perplexity_eval_steps = 1", "--gin_param",
                                   "utils.run.iterations_per_loop = 1", "--gin_param",
                                   "data.transduction_dataset.num_eval_examples = 8"],
    "mesh_tensorflow.transformer.main": ["--gin_param=utils.run.train_steps = 2",
                                         "--gin_param=num_layers = 1", "--gin_param=d_model = 16",
                                         "--gin_param=d_ff = 32",
                                         "--gin_param=utils.run.iterations_per_loop = 1"],
}

# Documented commands this test does not run (it skips them, saying why), by their first words.
NOT_RUN = {
    ("pip", "install"): "installs packages from PyPI: needs the network",
    (".venv/bin/pip", "install"): "installs packages from PyPI: needs the network",
    ("bash", "scripts/setup_env.sh"): "installs packages from PyPI: needs the network",
    ("bash", "scripts/run_tests.sh"): "installs packages (network), then runs the tests, this one "
                                      "included",
    ("bash", "scripts/run_example.sh"): "installs packages (network) first; the example it then runs is the "
                                        "`python -m examples.transformer.train` commands, run here",
    ("bash", "scripts/build_api_docs.sh"): "rewrites docs/api/; tests/docs/test_api_reference.py checks that "
                                           "what it writes is what is committed",
    ("bash", "scripts/setup_original.sh"): "downloads mesh-tensorflow 0.1.21 from PyPI: needs the network",
    (".venv/bin/python", "-m", "pytest", "-q", "-s", "tests/differential"):
        "needs the original from PyPI (scripts/setup_original.sh: network) and runs for minutes",
    (".venv/bin/python", "-m", "pytest"): "runs tests of this suite, which runs them itself",
    ("python", "-m", "mesh_tensorflow.transformer.convert"):
        "converts a model_dir a training run wrote; the page's Python program runs the same conversions "
        "(and tests/transformer/test_convert.py the command line)",
}
# Pages whose Python blocks need an optional extra: they skip, saying so, where it is not installed.
NEEDS_OPTIONAL = {"docs/converting.md": ("torch", "transformers")}
NEEDS_A_TPU = "needs a Cloud TPU (tests/transformer/test_tpu_path.py covers what runs without one)"

# Documented commands that write into the folder they run in: run from a temporary folder.
IN_A_TEMPORARY_FOLDER = {("python3", "-m", "venv")}


def _first_losses_agree(output: str) -> None:
  """bench_transformer.py's table: every case starts from the same first loss (the page: "the
  first losses agree to 4 decimals")."""
  losses = re.findall(r"^\| [^|]+ \|.* \| (\d+\.\d{4}) \|$", output, re.M)
  assert len(losses) >= 2 and set(losses) == {"7.4020"}, losses


def _training_loss_falls(output: str) -> None:
  """The driver's progress lines (one a step at the short settings): the loss falls."""
  losses = [float(loss) for loss in re.findall(r"^step +\d+/\d+  loss (\d+\.\d+)  ", output, re.M)]
  assert len(losses) == 2 and losses[1] < losses[0], f"training losses {losses}"


def _both_tasks_print_the_pages_step_1_loss(output: str) -> None:
  """The launcher's example: "prints lines such as `[0] step 1 loss 1.551979` and `[1] step 1 loss
  1.551979`": each task its rank, the same loss, the page's to float rounding between CPUs."""
  losses = dict(re.findall(r"^\[([01])\] step 1 loss (\d+\.\d{6})$", output, re.M))
  assert sorted(losses) == ["0", "1"] and losses["0"] == losses["1"], output[-3000:]
  assert abs(float(losses["0"]) - 1.551979) < 1e-4, losses


def _stated(*patterns) -> tuple:
  return tuple(re.compile(p, re.M) for p in patterns)


# What a page says a documented command prints, by (page, script or module): regular expressions
# the output must match (at the short settings), or functions of the output that assert.
HELD_OUT_BITS = r"^held-out bits per byte: \d\.\d{3} \(step 2, [\d,]+ held-out bytes\)$"
STATED_OUTPUT = {
    ("README.md", "examples.transformer.train"): _stated(   # "ends with held-out bits per byte, ..."
        HELD_OUT_BITS, r"^greedy: ", r"^sampled: ",
        r"^(loss curve: .*loss_curve\.png|matplotlib is not installed)") + (_training_loss_falls,),
    ("transformer.md", "examples.transformer.train"): _stated(
        r"^task (lm|reverse): mesh 'batch:2,model:4'",
        r"^(held-out bits per byte: \d\.\d{3} \(step 2|held-out exact match: [01]\.\d{3}$)")
    + (_training_loss_falls,),
    ("transformer.md", "mesh_tensorflow.transformer.main"): (_training_loss_falls,),
    ("random_numbers.md", "mesh_tensorflow.transformer.main"): (_training_loss_falls,),
    ("choosing_layouts.md", "mesh_tensorflow.explain"): _stated(
        r"^fits: yes \(0\.00 GB of 34\.36 GB per processor\)$",
        r"^predicted: 87,210 tokens/s, 0\.0% of peak FLOP/s$",
        r"^WARNING: a sequence-split attention layout: the rule length:model makes 49,926 bytes per "
        r"processor"),
    ("multi_process.md", "mesh_tensorflow.launch"): (_both_tasks_print_the_pages_step_1_loss,),
    ("multi_process.md", "scripts/lost_peer_loop.py"): _stated(r"^  1  LostPeerError naming task 1$"),
    ("multi_process.md", "benchmarks/bench_multiprocess.py"): _stated(
        r"^first and last losses of every split and process agree", r"\| 7\.40201 \| [\d.]+ \|$"),
    ("multi_process.md", "benchmarks/bench_collectives.py"): _stated(
        *(rf"^{name} +\d+x\[[\d, ]+\] +(ring|tf_collective|direct) +[\d.]+ +[\d.]+$"
          for name in ("allreduce", "allconcat", "alltoall", "shift"))),
    ("performance.md", "benchmarks/bench_transformer.py"): (_first_losses_agree,),
}


# A line is a warning when it is a Python warning (`file.py:12: UserWarning: ...`), a Python log
# line at WARNING level or above (`WARNING:tensorflow:...`, `ERROR:root:...`), or an absl log line
# at those levels, from Python or TF's C++ (`W0000 00:00:1700000000.000000  123 file.cc:12] ...`).
# Info lines (`I0000 ...`: TF's oneDNN and cpu_feature_guard notices, servers started, XLA) and
# the lines continuing them are not warnings.
WARNING_LINE = re.compile(r"\w+Warning: |^(WARNING|ERROR|CRITICAL|FATAL):|^[WEF]\d{4} \d\d:\d\d:\d\d")

# Warning lines that are TensorFlow's own, whatever the program does: {pattern: why tolerated}.
TOLERATED = {
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$":
        "TF's C++ logging announces itself as TensorFlow loads",
    r"^WARNING:tensorflow:From \S*/(site|dist)-packages/tensorflow/\S+: \w+ \(from [\w.]+\) is deprecated ":
        "a deprecated TF function called by TF itself, not by the program: tf.disable_v2_behavior() "
        "calls disable_resource_variables, MonitoredTrainingSession's restore get_checkpoint_mtimes",
    r"^W\d{4} [\d:. ]+\d+ local_rendezvous\.cc:\d+\] Local rendezvous is aborting with status: "
    r"ABORTED: Cleanup \d+":
        "TF's distributed runtime dropping a finished step's transfers between tasks (sometimes: a "
        "race between the tasks; the step has succeeded)",
}


class Block(NamedTuple):
  page: pathlib.Path
  line: int
  language: str
  code: str
  fragment: bool

  @property
  def where(self) -> str:
    return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_blocks(page: pathlib.Path) -> list:
  """The fenced code blocks of a markdown page."""
  blocks, lines = [], page.read_text(encoding="utf-8").splitlines()
  i = 0
  while i < len(lines):
    match = re.match(r"^```(\w*)\s*$", lines[i])
    if not match:
      i += 1
      continue
    start, i = i, i + 1
    while i < len(lines) and not lines[i].startswith("```"):
      i += 1
    previous = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
    blocks.append(Block(page, start + 1, match.group(1), "\n".join(lines[start + 1:i]) + "\n",
                        previous == FRAGMENT_MARK))
    i += 1
  return blocks


def all_blocks() -> list:
  return [block for page in PAGES for block in read_blocks(page)]


def python_blocks() -> list:
  return [block for block in all_blocks() if block.language == "python"]


def commands(blocks: list) -> list:
  """(block, argv) for each command line shown: shell-block lines, and `$ ` lines elsewhere."""
  found = []
  for block in blocks:
    if block.language == "python":
      continue
    for line in block.code.replace("\\\n", " ").splitlines():   # joins continued lines
      line = line.strip()
      if line.startswith("$ "):
        line = line[2:]
      elif block.language not in SHELL_LANGUAGES:
        continue
      argv = shlex.split(line, comments=True)
      if argv:
        found.append((block, argv))
  return found


def with_temporary_folders(argv: list, folder: pathlib.Path) -> list:
  """argv with every --model_dir value replaced by `folder`, and every other folder under /tmp by one
  in `folder`: the test must not fill the documented folders (a later real run would resume from the
  test's tiny model) nor leave them in the system temp dir."""
  out = list(argv)
  for i, arg in enumerate(argv):
    if arg.startswith("--model_dir="):
      out[i] = f"--model_dir={folder}"
    elif i > 0 and argv[i - 1] == "--model_dir":
      out[i] = str(folder)
    elif re.match(r"^(--\w+=)?/tmp/", arg):
      flag, _, path = arg.rpartition("=")
      out[i] = (f"{flag}=" if flag else "") + str(folder / "tmp" / path[len("/tmp/"):])
  return out


def temp_dir_inside(folder: pathlib.Path) -> str:
  """TMPDIR for a program run by a test: a folder in the test's tmp_path, so that what it leaves in its
  temp dir (the pages' `tempfile.mkdtemp()` checkpoints and logs) goes with the test's tmp_path."""
  temp = folder / "temp"
  temp.mkdir(exist_ok=True)
  return str(temp)


def run(argv: list, cwd: pathlib.Path, temp: pathlib.Path, env=None) -> subprocess.CompletedProcess:
  """Runs `python ARGS` (by default with the repository importable and TF's C++ info and warnings
  hidden) in a fork of a warm interpreter (tests/warm_python.py), asserting that it succeeds; its
  temp dir is a folder in `temp`."""
  env = dict(env or dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2"),
             TMPDIR=temp_dir_inside(temp))
  assert argv[0] == sys.executable, argv
  result = warm_python.run(argv[1:], cwd=cwd, env=env, timeout=TIMEOUT_S)
  assert result.returncode == 0, (
      f"exit status {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
  return result


def user_environment() -> dict:
  """A user's: only installed packages importable (no PYTHONPATH), TF's C++ log lines all shown."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
  env.pop("PYTHONPATH", None)
  return env


def warning_lines(output: str) -> list:
  """The lines of `output` that are warnings or errors, but for TOLERATED ones."""
  return [line for line in output.splitlines()
          if WARNING_LINE.search(line) and not any(re.search(p, line) for p in TOLERATED)]


@pytest.mark.parametrize("block", [b for b in python_blocks() if not b.fragment], ids=lambda b: b.where)
def test_python_block_runs_saved_anywhere_and_prints_no_warning(block, tmp_path):
  missing = [m for m in NEEDS_OPTIONAL.get(str(block.page.relative_to(ROOT)), ())
             if importlib.util.find_spec(m) is None]
  if missing:
    pytest.skip(f"needs {missing}: the hf extra (pip install -e '.[hf]'; run_tests.sh --all installs it)")
  program = tmp_path / "block.py"
  program.write_text(block.code, encoding="utf-8")
  result = run([sys.executable, str(program)], cwd=tmp_path, temp=tmp_path, env=user_environment())
  warnings = warning_lines(result.stdout + "\n" + result.stderr)
  assert not warnings, f"{block.where} prints warnings:\n" + "\n".join(warnings)


def test_warning_lines_are_ours_not_tensorflows_start_up_or_internal_notices():
  output = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796296712.864822   14162 cpu_feature_guard.cc:227] This TensorFlow binary is optimized ...
To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with ...
I0000 00:00:1796296712.9   14162 port.cc:153] oneDNN custom operations are on. You may see ...
WARNING:tensorflow:From /v/lib/python3.11/site-packages/tensorflow/python/training/saver.py:1177: \
get_checkpoint_mtimes (from tensorflow.python.checkpoint.checkpoint_management) is deprecated and ...
Instructions for updating:
W0000 00:00:1796296822.085044   15562 local_rendezvous.cc:412] Local rendezvous is aborting with \
status: ABORTED: Cleanup 130960313850980463 [type.googleapis.com/tensorflow.DerivedStatus='']
WARNING:tensorflow:From /tmp/block.py:3: disable_resource_variables (from tensorflow.python.ops) is deprecated
WARNING:tensorflow:Using the default glorot_uniform_initializer for variable w; ...
ERROR:root:Path not found: layouts/cpu8_dp_mp.gin
/work/x.py:7: LayoutRuleWarning: Layout rule hidden:modle names mesh dimension 'modle', ...
<frozen runpy>:128: RuntimeWarning: 'mesh_tensorflow.explain' found in sys.modules after import ...
W0000 00:00:1796296822.085044   15562 grappler.cc:1] something else
E0512 11:18:24.123456 1234 main.py:12] an absl error from Python
"""
  assert [line[:30] for line in warning_lines(output)] == [
      "WARNING:tensorflow:From /tmp/b", "WARNING:tensorflow:Using the d", "ERROR:root:Path not found: lay",
      "/work/x.py:7: LayoutRuleWarnin", "<frozen runpy>:128: RuntimeWar", "W0000 00:00:1796296822.085044 ",
      "E0512 11:18:24.123456 1234 mai"]


def prompt_outputs(block: Block) -> dict:
  """{command line (shlex.join of its words, as the test's argv): the output lines the page shows
  after it} for the `$ ` prompts of a block."""
  outputs, current = {}, None
  for line in block.code.splitlines():
    if line.startswith("$ "):
      current = outputs.setdefault(shlex.join(shlex.split(line[2:])), [])
    elif current is not None and line.strip():
      current.append(line.rstrip())
  return outputs


def assert_shown_lines_printed(shown: list, output: str, where: str) -> None:
  """Each line the page shows is printed, in that order; a `...` line stands for any lines."""
  printed = [line.rstrip() for line in output.splitlines()]
  position = 0
  for line in shown:
    if line.strip() == "...":
      continue
    assert line in printed[position:], f"{where}: the page shows {line!r}, which the command did not print"
    position = printed.index(line, position) + 1


def command_id(x) -> str:
  return x.where if isinstance(x, Block) else " ".join(x)


@pytest.mark.slow
@pytest.mark.parametrize("block,argv", commands(all_blocks()), ids=command_id)
def test_command_runs_and_prints_what_the_page_says(block, argv, tmp_path):
  why_not_run = next((why for words, why in NOT_RUN.items() if tuple(argv[:len(words)]) == words), None)
  if any(arg.startswith("--tpu=") for arg in argv):
    why_not_run = NEEDS_A_TPU
  if why_not_run is not None:
    for script in [ROOT / word for word in argv if word.endswith((".sh", ".py"))]:
      assert script.is_file(), f"{block.where}: {script} does not exist"
      if script.suffix == ".sh":
        subprocess.run(["bash", "-n", str(script)], check=True)
    pytest.skip(f"not run: {why_not_run}")
  assert argv[0] in PYTHONS and len(argv) > 1, (
      f"{block.where}: don't know how to run {argv}; make it `python <script>` or add it to NOT_RUN")
  if tuple(argv[:3]) in IN_A_TEMPORARY_FOLDER:
    run([sys.executable] + argv[1:], cwd=tmp_path, temp=tmp_path)
    assert (tmp_path / argv[-1] / "bin" / "python").exists(), f"{block.where}: no interpreter in {argv[-1]}"
    return
  if argv[1] == "-m":   # python -m package.module ...: SHORT_SETTINGS are keyed by the module name
    script = argv[2]
  else:
    script = argv[1]
    assert (ROOT / script).is_file(), f"{block.where}: {script} does not exist"
  # Only the page's words are rewritten: the interpreter itself may live under /tmp (a clone there).
  result = run([sys.executable] + with_temporary_folders(argv[1:] + SHORT_SETTINGS.get(script, []),
                                                         tmp_path / "model_dir"), cwd=ROOT, temp=tmp_path)
  output = result.stdout + "\n" + result.stderr
  prompts = prompt_outputs(block) if block.language not in SHELL_LANGUAGES else {}
  assert not prompts or shlex.join(argv) in prompts, f"{block.where}: {argv} is none of its prompts {prompts}"
  shown = prompts.get(shlex.join(argv))
  if shown:
    assert_shown_lines_printed(shown, output, block.where)
  for check in STATED_OUTPUT.get((block.page.name, script), ()):
    if callable(check):
      check(output)
    else:
      assert check.search(output), (
          f"{block.where}: the page says it prints /{check.pattern}/; it printed:\n{output[-3000:]}")


# Every Python block marked as a fragment (not run), by page and first line, and why it cannot run
# as a program of its own; what it shows is run elsewhere.
FRAGMENTS = {
    ("several_hosts.md", "server = tf.distribute.Server("):
        "runs on each real host and serves until killed (server.join()); the page's complete program "
        "starts the same server in-process, and tests/backends/test_cluster_devices.py runs it",
    ("spatial_partitioning.md", "x = mtf.halo_exchange(x, hb_dim, h_dim, fh // 2)"):
        "the three lines of the pattern; examples/spatial_conv.py (run above as the page's command) is "
        "the complete program, and tests/ops/test_conv.py checks it against whole-image convolutions",
    ("tf2.md", "evaluate = module.function("):
        "continues the page's complete program (its module, loss_fn); tests/tf2/test_train_step.py "
        "runs functions other than the step on a module's variables",
    ("transformer.md", "with tf.compat.v1.Session(graph=tf.Graph()) as session:"):
        "continues the export program before it (its export_dir); tests/transformer/test_export_serving.py "
        "loads the SavedModel in a TF1 session the same way",
}


def test_few_python_blocks_are_fragments_and_each_says_why():
  blocks = python_blocks()
  fragments = [b for b in blocks if b.fragment]
  assert len(blocks) >= 10, "the pages lost their examples?"
  assert len(fragments) <= MAX_FRAGMENT_SHARE * len(blocks), (
      f"{len(fragments)} of {len(blocks)} Python blocks are marked as fragments "
      f"({[b.where for b in fragments]}); make some of them complete programs")
  def listed_as(block):
    return next((key for key in FRAGMENTS
                 if key[0] == block.page.name and block.code.lstrip().startswith(key[1])), None)
  unexplained = [b.where for b in fragments if listed_as(b) is None]
  assert not unexplained, f"fragments {unexplained}: add each to FRAGMENTS, saying why it cannot run"
  assert sorted(map(listed_as, fragments)) == sorted(FRAGMENTS), "FRAGMENTS lists blocks no longer marked"


def paragraph_before(block) -> str:
  """The text of the paragraph just above a block's fragment mark (what a reader sees above it)."""
  lines = block.page.read_text(encoding="utf-8").splitlines()[:block.line - 1]
  while lines and (not lines[-1].strip() or lines[-1].strip() == FRAGMENT_MARK):
    lines.pop()
  paragraph = []
  while lines and lines[-1].strip():
    paragraph.insert(0, lines.pop())
  return " ".join(paragraph)


def test_every_fragment_says_in_the_page_that_it_continues_a_program_or_is_an_excerpt():
  """The fragment mark is invisible when the page is rendered: the words above the block must say it."""
  silent = [b.where for b in python_blocks() if b.fragment
            and not re.search(r"\b(continu\w*|excerpt)\b", paragraph_before(b), re.I)]
  assert not silent, (f"fragments {silent}: say in the paragraph above each that it continues the "
                      f"program above (or is an excerpt of which program)")


def test_block_reader_sees_fences_languages_and_fragment_marks(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("text\n\n```python\nprint(1)\n```\n\n<!-- fragment -->\n\n```python\nx\n```\n"
                  "```sh\npython a.py --n 2  # a comment\n```\n```\n$ python b.py\nout\n```\n")
  blocks = read_blocks(page)
  assert [(b.line, b.language, b.code, b.fragment) for b in blocks] == [
      (3, "python", "print(1)\n", False), (9, "python", "x\n", True),
      (12, "sh", "python a.py --n 2  # a comment\n", False), (15, "", "$ python b.py\nout\n", False)]


def test_commands_are_read_from_shell_blocks_and_prompts_with_continuations(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("```sh\n# setup\npython a.py --n 2 \\\n  --m 'x y'  # a comment\n```\n"
                  "```text\npython not_a_command.py\n```\n```\n$ python b.py\nout\n```\n")
  assert [argv for _, argv in commands(read_blocks(page))] == [
      ["python", "a.py", "--n", "2", "--m", "x y"], ["python", "b.py"]]


def test_documented_model_dirs_and_tmp_folders_are_replaced_by_temporary_folders(tmp_path):
  argv = ["python", "-m", "m", "--model_dir", "/tmp/a", "--model_dir=/tmp/b", "--x", "1", "--out", "/tmp/c/d",
          "--log=/tmp/e", "tmp/f"]
  assert with_temporary_folders(argv, tmp_path) == [
      "python", "-m", "m", "--model_dir", str(tmp_path), f"--model_dir={tmp_path}", "--x", "1", "--out",
      str(tmp_path / "tmp" / "c" / "d"), f"--log={tmp_path / 'tmp' / 'e'}", "tmp/f"]


def test_lines_shown_after_a_prompt_must_be_printed_in_order():
  page_block = Block(ROOT / "page.md", 1, "", "$ python a.py --n 2\nstep 0: 1.5\n...\nOK\n", False)
  shown = prompt_outputs(page_block)["python a.py --n 2"]
  assert shown == ["step 0: 1.5", "...", "OK"]
  assert_shown_lines_printed(shown, "start\nstep 0: 1.5\nstep 1: 1.2\nOK\n", "page.md:1")
  for printed in ("step 0: 1.5\nstep 1: 1.2\n", "OK\nstep 0: 1.5\n", "step 0: 1.50\nOK\n"):
    with pytest.raises(AssertionError, match="the page shows"):
      assert_shown_lines_printed(shown, printed, "page.md:1")
