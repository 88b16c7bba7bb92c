"""The package's imports point down one order of layers, and no import chain comes back.

Every import of a mesh_tensorflow module counts: at module level and inside functions (a lazy
import is still a dependency), absolute and relative, and the package `__init__` that Python runs
on the way (`import a.b.c` from outside package `a.b` runs `a/b/__init__.py` first). A module may
import modules of its own layer or of layers below it; imports within a layer must not form a
cycle. docs/architecture.md ("Layer order") lists the same layers; a test keeps the two equal.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
from typing import Optional, Sequence

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mesh_tensorflow"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

# Bottom to top. A module belongs to the layer of the longest entry that is its name or a package
# above it; `pkg.__init__` names a package's own __init__.py (the package root included).
LAYERS = (
  ("core", ("mesh_tensorflow._core", "mesh_tensorflow._tf_compat", "mesh_tensorflow._cli_quiet")),
  ("lowering", ("mesh_tensorflow._lowering", "mesh_tensorflow.utils")),
  ("backends", ("mesh_tensorflow._backends", "mesh_tensorflow._launch", "mesh_tensorflow.tpu_variables",
                "mesh_tensorflow._lowering.dry_run")),
  ("op families and autodiff", ("mesh_tensorflow._ops", "mesh_tensorflow._autodiff")),
  ("op namespace", ("mesh_tensorflow.ops", "mesh_tensorflow.ops_with_redefined_builtins")),
  ("layers and optimizers", ("mesh_tensorflow._layers", "mesh_tensorflow._optimize",
                             "mesh_tensorflow.beam_search")),
  ("cost model", ("mesh_tensorflow._cost",)),
  ("layout search", ("mesh_tensorflow.auto_mtf",)),
  ("explainer", ("mesh_tensorflow._explain",)),
  ("tf2", ("mesh_tensorflow._tf2",)),
  ("public facades", ("mesh_tensorflow.layers", "mesh_tensorflow.optimize", "mesh_tensorflow.cost_model",
                      "mesh_tensorflow.explain", "mesh_tensorflow.tf2", "mesh_tensorflow.placement_mesh_impl",
                      "mesh_tensorflow.simd_mesh_impl", "mesh_tensorflow.collective_mesh_impl",
                      "mesh_tensorflow.launch")),
  ("package root", ("mesh_tensorflow.__init__", "mesh_tensorflow.test_utils")),
  ("transformer models and layers", ("mesh_tensorflow.transformer",)),
  ("transformer helpers", ("mesh_tensorflow.transformer._utils",)),
  ("transformer driver", ("mesh_tensorflow.transformer._train",)),
  ("transformer facades and entry points", ("mesh_tensorflow.transformer.__init__",
                                            "mesh_tensorflow.transformer.utils",
                                            "mesh_tensorflow.transformer.main",
                                            # the converter reads and writes the driver's model_dirs
                                            "mesh_tensorflow.transformer.convert")),
  ("explain command line", ("mesh_tensorflow._explain.transformer_graph", "mesh_tensorflow._explain.cli",
                            "mesh_tensorflow.explain.__main__")),
)


@dataclasses.dataclass(frozen=True)
class Import:
  """One dependency: `importer` (file `path`, line `line`) needs module `imported` loaded.

  `package_init` marks the `__init__` Python runs to reach a submodule named in the statement;
  `in_function` an import inside a function or lambda (run when called, not at import time).
  """

  importer: str
  path: str
  line: int
  imported: str
  in_function: bool
  package_init: bool = False

  def __str__(self) -> str:
    how = " (its package __init__)" if self.package_init else ""
    where = " inside a function" if self.in_function else ""
    return f"{self.path}:{self.line} imports {self.imported}{how}{where}"


def module_names(package: pathlib.Path) -> dict:
  """Dotted name -> path of every .py file under `package`; a package's own file is `pkg.__init__`."""
  root = package.parent
  return {".".join(p.relative_to(root).with_suffix("").parts): p for p in sorted(package.rglob("*.py"))}


def _loaded_by(name: str, modules: dict) -> Optional[str]:
  """The module `import name` loads: the module itself, the package's __init__, or the nearest above."""
  while name:
    for candidate in (name, name + ".__init__"):
      if candidate in modules:
        return candidate
    name = name.rpartition(".")[0]
  return None


def _is_module(name: str, modules: dict) -> bool:
  return name in modules or name + ".__init__" in modules


def _targets(node, module: str, modules: dict) -> list:
  """The dotted name each package module a statement imports has (relative names resolved)."""
  top = next(iter(modules)).split(".")[0]
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names if alias.name.split(".")[0] == top]
  base = node.module or ""
  if node.level:
    package = module.rpartition(".")[0]  # for pkg.__init__ too: `from . import x` looks in pkg
    for _ in range(node.level - 1):
      package = package.rpartition(".")[0]
    base = f"{package}.{base}" if base else package
  if base.split(".")[0] != top:
    return []
  # `from pkg import x` loads the submodule pkg.x when there is one, else takes a name from pkg.
  return [f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}", modules) else base
          for alias in node.names]


def _imports_of(module: str, path: pathlib.Path, modules: dict, root: pathlib.Path) -> list:
  found = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        for name in _targets(child, module, modules):
          found.extend(_dependencies(module, str(path.relative_to(root)), child.lineno, name, in_function,
                                     modules))
      visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

  visit(ast.parse(path.read_text(encoding="utf-8")), False)
  return found


def _dependencies(module, path, line, name, in_function, modules) -> list:
  """The module `name` loads, and the __init__ of each package above it that `module` is outside of."""
  out = []
  target = _loaded_by(name, modules)
  if target is not None and target != module:
    out.append(Import(module, path, line, target, in_function))
  parts = name.split(".")
  for k in range(1, len(parts)):
    package = ".".join(parts[:k])
    init = package + ".__init__"
    if init in modules and init != target and not module.startswith(package + "."):
      out.append(Import(module, path, line, init, in_function, package_init=True))
  return out


def package_imports(package: pathlib.Path = PACKAGE) -> list:
  """Every Import of a module of `package` by a module of `package` (module- and function-level)."""
  modules = module_names(package)
  found = (i for module, path in modules.items() for i in _imports_of(module, path, modules, package.parent))
  return list(dict.fromkeys(found))  # `from m import a, b` is one dependency


def layer_of(module: str, layers: Sequence = LAYERS) -> Optional[int]:
  """The index in `layers` of the longest entry that is `module` or a package above it."""
  best, best_length = None, -1
  for index, (_, entries) in enumerate(layers):
    for entry in entries:
      if (module == entry or module.startswith(entry + ".")) and len(entry) > best_length:
        best, best_length = index, len(entry)
  return best


def _edges(imports: Sequence[Import]) -> dict:
  """importer -> {imported: the first Import between them}."""
  edges = {}
  for i in imports:
    edges.setdefault(i.importer, {}).setdefault(i.imported, i)
  return edges


def strongly_connected(imports: Sequence[Import]) -> list:
  """The sets of two or more modules that each reach one another through imports (Tarjan)."""
  edges = _edges(imports)
  index, low, stack, on_stack, groups = {}, {}, [], set(), []

  def connect(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges.get(v, {}):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = set()
      while v not in group:
        group.add(stack.pop())
      on_stack.difference_update(group)
      if len(group) > 1:
        groups.append(group)

  for v in sorted(edges):
    if v not in index:
      connect(v)
  return groups


def cycles(imports: Sequence[Import]) -> list:
  """For each strongly connected group of modules, its shortest cycle through its smallest name."""
  edges = _edges(imports)
  return [_shortest_cycle(min(group), group, edges) for group in strongly_connected(imports)]


def _shortest_cycle(start: str, group: set, edges: dict) -> list:
  """Breadth-first from `start` back to itself inside `group`: the Imports along the way."""
  came_by, frontier = {}, [start]
  while frontier:
    following = []
    for v in frontier:
      for w, imp in sorted(edges.get(v, {}).items()):
        if w in group and w not in came_by:
          came_by[w] = imp
          following.append(w)
    if start in came_by:
      break
    frontier = following
  path, v = [], start
  while True:
    path.append(came_by[v])
    v = came_by[v].importer
    if v == start:
      return path[::-1]


def upward_imports(imports: Sequence[Import], layers: Sequence = LAYERS) -> list:
  """The Imports whose module sits in a higher layer than the module importing it."""
  return [i for i in imports if layer_of(i.imported, layers) > layer_of(i.importer, layers)]


def _describe_upward(i: Import, layers: Sequence = LAYERS) -> str:
  return (f"{i}: layer '{layers[layer_of(i.importer, layers)][0]}' imports from the higher layer "
          f"'{layers[layer_of(i.imported, layers)][0]}'")


def test_every_module_belongs_to_a_layer():
  unplaced = [m for m in module_names(PACKAGE) if layer_of(m) is None]
  assert not unplaced, f"add these modules to LAYERS (and to docs/architecture.md's Layer order): {unplaced}"


def test_the_package_has_no_import_cycle():
  imports = package_imports()
  found = [(len(group), cycle) for group, cycle in zip(strongly_connected(imports), cycles(imports))]
  assert not found, "import cycles (module- or function-level), the shortest of each group:\n" + "\n\n".join(
      f"a cycle among {size} modules:\n" + "\n".join(str(i) for i in cycle) for size, cycle in found)


def test_no_module_imports_a_higher_layer():
  found = upward_imports(package_imports())
  assert not found, "imports that point up the layer order:\n" + "\n".join(_describe_upward(i) for i in found)


def test_architecture_doc_lists_the_same_layers():
  section = ARCHITECTURE.read_text(encoding="utf-8").split("## Layer order", 1)[1].split("\n## ", 1)[0]
  documented = []
  # "3. **backends**: `_backends`, `_launch` -- a remark" (continuation lines indented by 3)
  for name, text in re.findall(r"^\d+\. \*\*(.+?)\*\*:(.*(?:\n {3}.*)*)", section, flags=re.MULTILINE):
    listed = re.split(r"\s--\s", text)[0]
    documented.append((name, tuple(f"mesh_tensorflow.{m}" for m in re.findall(r"`([^`]+)`", listed))))
  assert documented == [(name, tuple(entries)) for name, entries in LAYERS]


def _write_package(tmp_path: pathlib.Path, files: dict) -> pathlib.Path:
  for name, text in files.items():
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return tmp_path / "pkg"


def test_the_scanner_sees_function_level_relative_and_package_init_imports(tmp_path):
  package = _write_package(tmp_path, {
      "pkg/__init__.py": "from pkg import top\n",
      "pkg/low/__init__.py": "",
      "pkg/low/a.py": "def f():\n  from . import b\n  from .b import helper\n",
      "pkg/low/b.py": "import os\nhelper = 1\n",
      "pkg/high/__init__.py": "from pkg.high import c\n",
      "pkg/high/c.py": "from pkg.low import a\n",
      "pkg/top.py": "def g():\n  import pkg.high.c\n",
  })
  found = {(i.importer, i.line, i.imported, i.in_function, i.package_init) for i in package_imports(package)}
  assert found == {
      ("pkg.__init__", 1, "pkg.top", False, False),
      ("pkg.low.a", 2, "pkg.low.b", True, False),
      ("pkg.low.a", 3, "pkg.low.b", True, False),
      ("pkg.high.__init__", 1, "pkg.high.c", False, False),
      ("pkg.high.c", 1, "pkg.low.a", False, False),
      ("pkg.high.c", 1, "pkg.low.__init__", False, True),
      ("pkg.top", 2, "pkg.high.c", True, False),
      ("pkg.top", 2, "pkg.high.__init__", True, True),
  }


def test_a_function_level_import_that_closes_a_cycle_is_reported_with_its_line(tmp_path):
  package = _write_package(tmp_path, {
      "pkg/__init__.py": "",
      "pkg/a.py": "from pkg import b\n",
      "pkg/b.py": "x = 1\n\ndef f():\n  from pkg.a import y\n",
      "pkg/c.py": "from pkg import a\n",
  })
  found = cycles(package_imports(package))
  assert [[str(i) for i in cycle] for cycle in found] == [[
      "pkg/a.py:1 imports pkg.b", "pkg/b.py:4 imports pkg.a inside a function"]]


def test_an_upward_import_names_the_module_the_line_and_both_layers(tmp_path):
  package = _write_package(tmp_path, {
      "pkg/__init__.py": "",
      "pkg/low.py": "def f():\n  import pkg.high\n",
      "pkg/high.py": "from pkg import low\n",
  })
  layers = (("bottom", ("pkg.low", "pkg.__init__")), ("top", ("pkg.high",)))
  found = upward_imports(package_imports(package), layers)
  assert [_describe_upward(i, layers) for i in found] == [
      "pkg/low.py:2 imports pkg.high inside a function: layer 'bottom' imports from the higher layer 'top'"]
