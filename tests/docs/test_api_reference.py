"""docs/api/*.md, the Markdown API reference, is what scripts/api_markdown.py generates from the code."""

from __future__ import annotations

import importlib.util
import pathlib
import types

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("api_markdown", ROOT / "scripts" / "api_markdown.py")
api_markdown = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(api_markdown)
REGENERATE = "regenerate it: bash scripts/build_api_docs.sh"


def test_committed_api_reference_is_current():
  generated = api_markdown.pages()
  committed = {path.name: path.read_text(encoding="utf-8") for path in api_markdown.OUT.glob("*.md")}
  assert sorted(committed) == sorted(generated), f"docs/api/ has other pages than the modules: {REGENERATE}"
  stale = sorted(name for name in generated if committed[name] != generated[name])
  assert not stale, f"docs/api/ pages out of date with the code ({', '.join(stale)}): {REGENERATE}"


def test_the_public_entry_points_are_documented_with_their_arguments():
  pages = api_markdown.pages()
  top = pages["mesh_tensorflow.md"]
  for needle in ("## Lowering", "## get_variable", "## MtfRestoreHook", "## einsum", "\n    Args:\n"):
    assert needle in top, needle
  assert "## AdafactorOptimizer" in pages["mesh_tensorflow.optimize.md"]
  assert "## PlacementMeshImpl" in pages["mesh_tensorflow.placement_mesh_impl.md"]
  assert "[`mesh_tensorflow.layers`](mesh_tensorflow.layers.md)" in pages["README.md"]
  assert not [name for name in pages if "._" in name or name.startswith("_")], "implementation documented"


def _no_op():
  pass


def test_a_page_shows_each_signature_docstring_and_own_method_and_nothing_foreign():
  module = types.ModuleType("mesh_tensorflow.demo", "A demo module.")

  def scale(x: float, factor: float = 2.0, hook=_no_op) -> float:
    """Multiplies.

    Args:
      x: the value.
    """
    return x * factor

  class Box:
    """Holds a value."""

    def __init__(self, value):
      self.value = value

    def doubled(self):
      """Twice the value."""
      return 2 * self.value

    def _hidden(self):
      pass

  for value in (scale, Box):
    value.__module__ = "mesh_tensorflow.demo"
  module.scale, module.Box, module.Path = scale, Box, pathlib.Path   # pathlib.Path: not ours, left out
  page = api_markdown.module_page(module)
  assert page == api_markdown.HEADER + """# `mesh_tensorflow.demo`

```
A demo module.
```

- [`Box`](#box): Holds a value.
- [`scale`](#scale): Multiplies.

## Box

```
class Box(value)

    Holds a value.
```

### `Box.doubled`

```
doubled(self)

    Twice the value.
```

## scale

```
scale(x: 'float', factor: 'float' = 2.0, hook=<function _no_op>) -> 'float'

    Multiplies.

    Args:
      x: the value.
```
"""
