"""The op families import each other without cycles (at module level or inside functions)."""

import ast
import pathlib

import mesh_tensorflow as mtf

PACKAGE = pathlib.Path(mtf.__file__).parent
FAMILIES = {p.stem for p in (PACKAGE / "_ops").glob("*.py") if p.stem != "__init__"}


def _family_imports(path: pathlib.Path) -> set:
  """The op families (and _autodiff) a module imports, wherever the import statement is."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "mesh_tensorflow._ops":
        found.update(alias.name for alias in node.names)
      elif node.module.startswith("mesh_tensorflow._ops."):
        found.add(node.module.split(".")[2])
      elif node.module == "mesh_tensorflow":
        found.update(alias.name for alias in node.names if alias.name == "_autodiff")
    elif isinstance(node, ast.Import):
      found.update(alias.name.split(".")[2] for alias in node.names
                   if alias.name.startswith("mesh_tensorflow._ops."))
  return found & (FAMILIES | {"_autodiff"})


def _import_graph() -> dict:
  graph = {name: _family_imports(PACKAGE / "_ops" / f"{name}.py") for name in FAMILIES}
  graph["_autodiff"] = _family_imports(PACKAGE / "_autodiff.py")
  return graph


def _find_cycle(graph: dict):
  """A list of modules forming an import cycle, or None."""
  state = {}

  def visit(node, path):
    state[node] = "open"
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        cycle = visit(nxt, path + [nxt])
        if cycle:
          return cycle
    state[node] = "done"
    return None
  for start in sorted(graph):
    if start not in state:
      cycle = visit(start, [start])
      if cycle:
        return cycle
  return None


def test_op_families_form_an_acyclic_import_graph():
  graph = _import_graph()
  assert graph["binary"] >= {"einsum", "reduce"}  # the scan sees the imports
  assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"


def test_the_cycle_finder_finds_cycles():
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
