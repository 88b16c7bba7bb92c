"""The core (`_core`) stands alone: it imports no op family, and op families register into it."""

import ast
import pathlib
import subprocess
import sys

import pytest

import mesh_tensorflow as mtf

PACKAGE = pathlib.Path(mtf.__file__).parent
CORE_MODULES = sorted(p.stem for p in (PACKAGE / "_core").glob("*.py") if p.stem != "__init__")


def _imported_modules(path: pathlib.Path) -> set:
  """Every module a file imports, at top level or inside functions."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def test_core_modules_import_only_the_core():
  for path in (PACKAGE / "_core").glob("*.py"):
    ours = {m for m in _imported_modules(path) if m.startswith("mesh_tensorflow")}
    outside = sorted(m for m in ours if not m.startswith("mesh_tensorflow._core"))
    assert not outside, f"{path.name} imports {outside}"


# Loads the core under a bare `mesh_tensorflow` package (its __init__, which imports everything,
# is not run), uses it, and prints the mesh_tensorflow modules that got loaded.
_STANDALONE = f"""
import sys, types
package = types.ModuleType("mesh_tensorflow")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["mesh_tensorflow"] = package
import importlib
for name in {CORE_MODULES!r}:
  importlib.import_module("mesh_tensorflow._core." + name)
from mesh_tensorflow._core.graph import Graph, Mesh
from mesh_tensorflow._core.dims import Shape
from mesh_tensorflow._core.layout import slice_shape
mesh = Mesh(Graph(), "m")
assert slice_shape(Shape("a:4;b:6"), "rows:2", "a:rows") == [2, 6]
try:
  mesh.graph.rewrite_stack_variables()
except RuntimeError as e:
  assert "import mesh_tensorflow" in str(e)
print(sorted(m for m in sys.modules if m.startswith("mesh_tensorflow")))
"""


@pytest.mark.slow
def test_core_loads_and_runs_without_any_op_family():
  out = subprocess.run([sys.executable, "-c", _STANDALONE], capture_output=True, text=True, check=True)
  loaded = ast.literal_eval(out.stdout.strip().splitlines()[-1])
  assert loaded and all(m == "mesh_tensorflow" or m.startswith("mesh_tensorflow._core") for m in loaded)


def test_op_families_register_tensor_operators_and_graph_rewrites():
  mesh = mtf.Mesh(mtf.Graph(), "m")
  x = mtf.ones(mesh, "a:2")
  assert type((x + x).operation).__name__ == "AddOperation"
  assert [type((-x).operation).__name__, type((1.0 / x).operation).__name__] == [
      "SlicewiseOperation", "ScalarMultiplyOperation"]
  assert mesh.graph.combine_assignments([]) == []
