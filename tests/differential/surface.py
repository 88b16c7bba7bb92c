"""Lists the public surface of whichever mesh_tensorflow is importable, as JSON (see sides.py).

Run under the original 0.1.21 and under ours, in a subprocess each; test_surface.py compares the
two listings. The listing has:
- "names": {"module.name": description} for every public module of the package (no `_` part,
  no `*_test`, not the original's bert/ and experimental/ research code, which our package does
  not reimplement), every public name a module defines or re-exports from the package (names
  imported from TensorFlow, NumPy, six, ... are not the package's), and every public method and
  property of those classes ("module.Class.method"). A description is {"kind": ..., "params":
  [[name, kind, default or null], ...]} with the signature of functions, methods and __init__;
  a class's also has "inherited": the public names it gets from classes outside the package.
- "gin": {"full.selector": {"params": [...], "var_keyword": bool}} for every gin configurable
  of the package registered once all modules are imported, with the parameters gin can bind.
- "import_errors": {module: error} for modules that did not import.
"""

import argparse
import importlib
import inspect
import json
import pkgutil
import types

import gin

import mesh_tensorflow

PACKAGE = "mesh_tensorflow"
SKIPPED_PACKAGES = ("mesh_tensorflow.bert", "mesh_tensorflow.experimental")
SIMPLE_DEFAULTS = (bool, int, float, str, type(None))


def is_public_module(name: str) -> bool:
  parts = name.split(".")
  return (not any(p.startswith("_") for p in parts) and not parts[-1].endswith("_test")
          and not name.startswith(SKIPPED_PACKAGES))


def import_modules() -> tuple:
  """({name: module} of the public modules, {name: error} of those that failed to import).

  Walks package by package, never importing a skipped or private one (pkgutil.walk_packages
  would import every package to look inside it).
  """
  modules, errors = {PACKAGE: mesh_tensorflow}, {}
  pending = [mesh_tensorflow]
  while pending:
    package = pending.pop()
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
      if not is_public_module(info.name):
        continue
      try:
        modules[info.name] = importlib.import_module(info.name)
      except Exception as error:  # pylint: disable=broad-except  (reported, not hidden)
        errors[info.name] = f"{type(error).__name__}: {error}"
        continue
      if info.ispkg:
        pending.append(modules[info.name])
  return modules, errors


def is_ours(module_name: str, name: str, value) -> bool:
  """Whether a module attribute belongs to the package: not imported from TF, NumPy, ..., and
  a module only where it is that module's own submodule (not `import mesh_tensorflow as mtf`)."""
  if isinstance(value, types.ModuleType):
    return value.__name__ == f"{module_name}.{name}"
  if inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value):
    return (getattr(value, "__module__", "") or "").startswith(PACKAGE)
  return (type(value).__module__.startswith(PACKAGE)
          or isinstance(value, SIMPLE_DEFAULTS + (dict, list, tuple)))


def parameters(function) -> list:
  """[[name, kind, default], ...]: default is a repr for literals, "<object>" for other values,
  null where there is none."""
  try:
    signature = inspect.signature(function)
  except (TypeError, ValueError):
    return None
  out = []
  for param in signature.parameters.values():
    if param.default is inspect.Parameter.empty or param.default is gin.REQUIRED:
      default = None   # gin.REQUIRED: a client must pass it, as with no default
    elif isinstance(param.default, SIMPLE_DEFAULTS):
      default = repr(param.default)
    else:
      default = "<object>"
    out.append([param.name, param.kind.name, default])
  return out


def describe(value) -> dict:
  if isinstance(value, types.ModuleType):
    return {"kind": "module"}
  if inspect.isclass(value):
    inherited = sorted(n for n in dir(value) if not n.startswith("_") and not any(
        n in vars(c) for c in value.__mro__ if (c.__module__ or "").startswith(PACKAGE)))
    init = value.__init__
    params = [] if init is object.__init__ else (parameters(init) or [None])[1:]
    return {"kind": "class", "params": params, "inherited": inherited}
  if callable(value) and not isinstance(value, gin.config.ConfigurableReference):
    return {"kind": "function", "params": parameters(value)}
  return {"kind": "value"}


def class_members(qualified: str, cls: type) -> dict:
  """The public methods and properties `cls` defines or inherits from classes of the package."""
  members = {}
  for name in dir(cls):
    if name.startswith("_"):
      continue
    owner = next((c for c in cls.__mro__ if name in vars(c)), None)
    if owner is None or not (owner.__module__ or "").startswith(PACKAGE):
      continue
    raw = vars(owner)[name]
    if isinstance(raw, property):
      members[f"{qualified}.{name}"] = {"kind": "property"}
    elif isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw):
      function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
      params = parameters(function)
      if inspect.isfunction(raw) and params:
        params = params[1:]   # self
      members[f"{qualified}.{name}"] = {"kind": "method", "params": params}
  return members


def public_names(modules: dict) -> dict:
  names = {}
  for module_name, module in sorted(modules.items()):
    for name, value in sorted(vars(module).items()):
      if name.startswith("_") or not is_ours(module_name, name, value):
        continue
      qualified = f"{module_name}.{name}"
      names[qualified] = describe(value)
      if inspect.isclass(value):
        names.update(class_members(qualified, value))
  return names


def configurables() -> dict:
  """Every registered gin configurable: the parameters a binding may set."""
  out = {}
  for selector, configurable in gin.config._REGISTRY.items():  # pylint: disable=protected-access
    if not selector.startswith(PACKAGE + "."):
      continue   # gin's own (gin.tf.utils.singleton_per_graph, ...)
    wrapped = configurable.wrapped
    function = wrapped.__init__ if inspect.isclass(wrapped) else wrapped
    params = parameters(function) or []
    if inspect.isclass(wrapped):
      params = params[1:]
    names = [p[0] for p in params if p[1] in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")]
    if configurable.allowlist:
      names = [n for n in names if n in configurable.allowlist]
    if configurable.denylist:
      names = [n for n in names if n not in configurable.denylist]
    out[selector] = {"params": names, "var_keyword": any(p[1] == "VAR_KEYWORD" for p in params)}
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", required=True, help="JSON file to write")
  args = parser.parse_args()
  modules, errors = import_modules()
  listing = {"package": mesh_tensorflow.__file__, "names": public_names(modules),
             "gin": configurables(), "import_errors": errors}
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(listing, f, indent=1, sort_keys=True)


if __name__ == "__main__":
  main()
