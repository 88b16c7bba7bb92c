"""TensorFlow's private modules are reached only through mesh_tensorflow/_tf_compat.py."""

from __future__ import annotations

import ast
import pathlib

import pytest

from mesh_tensorflow import _tf_compat

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mesh_tensorflow"


def private_tf_imports(path: pathlib.Path, root: pathlib.Path = PACKAGE.parent) -> list:
  """'file:line module' for each import of tensorflow.python (module- or function-level) in path."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module]
    else:
      continue
    found += [f"{path.relative_to(root)}:{node.lineno} {name}" for name in names
              if name == "tensorflow.python" or name.startswith("tensorflow.python.")]
  return found


def test_no_module_but_the_compat_module_imports_tensorflow_python():
  offenders = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "_tf_compat.py"
               for hit in private_tf_imports(path)]
  assert not offenders, "import these through mesh_tensorflow._tf_compat:\n" + "\n".join(offenders)


def test_the_check_finds_function_level_imports(tmp_path):
  source = tmp_path / "m.py"
  source.write_text("def f():\n  from tensorflow.python.ops import variables\n"
                    "  import tensorflow.python.eager\n")
  assert private_tf_imports(source, root=tmp_path) == ["m.py:2 tensorflow.python.ops",
                                                       "m.py:3 tensorflow.python.eager"]


@pytest.mark.parametrize("name", _tf_compat.__all__)
def test_every_entry_imports_on_this_tensorflow(name):
  assert getattr(_tf_compat, name).__name__ == _tf_compat._ENTRIES[name][0]


def test_an_entry_this_tensorflow_lacks_is_named_with_the_fix(monkeypatch):
  monkeypatch.setitem(_tf_compat._ENTRIES, "gone", ("tensorflow.python.no_such_module", "a reason"))
  with pytest.raises(ImportError, match=r"needs TensorFlow's internal module tensorflow.python.no_such_"
                                        r"module \(a reason\).*Update the entry 'gone' of mesh_tensorflow"):
    _tf_compat.gone  # noqa: B018
