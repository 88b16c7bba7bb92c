"""Compares two surface listings (surface.py's JSON): what of the original's is missing in ours
or differs from it in a way a client of the original would notice."""

from __future__ import annotations

POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")


def parameter_differences(original: list, ours: list) -> list:
  """Why a call written against the original's parameters could fail or mean something else with
  ours: a positional parameter renamed or moved (but for ones named unused*/_*, which are
  passed by position only; and a parameter ours takes through **kwargs counts as there, by
  keyword), a keyword or *args/**kwargs missing, a default
  dropped or changed (literal defaults only), or a new parameter without a default."""
  if original is None or ours is None:
    return []
  ours_kinds = {kind for _, kind, _ in ours}
  takes_any = {"VAR_POSITIONAL", "VAR_KEYWORD"} <= ours_kinds
  if takes_any and all(kind.startswith("VAR_") for _, kind, _ in ours):
    return []   # a (*args, **kwargs) wrapper accepts any call
  by_name = {name: (index, kind, default) for index, (name, kind, default) in enumerate(ours)}
  found = []
  for index, (name, kind, default) in enumerate(original):
    if kind.startswith("VAR_"):
      if kind not in ours_kinds:
        found.append(f"no {'*args' if kind == 'VAR_POSITIONAL' else '**kwargs'} (original has *{name})")
      continue
    if name not in by_name:
      if name.startswith(("unused", "_")) and index < len(ours) and ours[index][1] in POSITIONAL:
        continue   # a parameter marked unused is passed by position only; ours is at its place
      if "VAR_KEYWORD" not in ours_kinds:
        found.append(f"no parameter {name!r}")
      continue
    our_index, our_kind, our_default = by_name[name]
    if kind in POSITIONAL and (our_index != index or our_kind not in POSITIONAL):
      found.append(f"parameter {name!r} is not positional #{index} (ours: #{our_index}, {our_kind})")
    if default is not None and our_default is None:
      found.append(f"parameter {name!r} has no default (original: {default})")
    elif default not in (None, "<object>") and our_default not in (default, "<object>"):
      found.append(f"parameter {name!r} defaults to {our_default} (original: {default})")
  known = {name for name, _, _ in original}
  unused_places = {i for i, (name, kind, _) in enumerate(original)
                   if kind in POSITIONAL and name.startswith(("unused", "_"))}
  found += [f"new parameter {name!r} has no default" for i, (name, kind, default) in enumerate(ours)
            if name not in known and not kind.startswith("VAR_") and default is None
            and i not in unused_places]
  return found


def name_differences(original: dict, ours: dict) -> dict:
  """{qualified name: why} for each public name of the original missing or different in ours."""
  out = {}
  for qualified, described in sorted(original.items()):
    mine = ours.get(qualified)
    if mine is None:
      owner = ours.get(qualified.rsplit(".", 1)[0], {})
      if qualified.rsplit(".", 1)[1] not in owner.get("inherited", ()):
        out[qualified] = "missing"
      continue
    if mine["kind"] != described["kind"]:
      out[qualified] = f"is a {mine['kind']} (original: a {described['kind']})"
      continue
    why = parameter_differences(described.get("params"), mine.get("params"))
    if why:
      out[qualified] = "; ".join(why)
  return out


def gin_differences(original: dict, ours: dict) -> dict:
  """{selector: why} for each gin configurable of the original that ours lacks, or that cannot
  take one of the original's bindable parameters."""
  out = {}
  for selector, described in sorted(original.items()):
    mine = ours.get(selector)
    if mine is None:
      out[selector] = "not a configurable"
      continue
    lacking = [] if mine["var_keyword"] else sorted(set(described["params"]) - set(mine["params"]))
    if lacking:
      out[selector] = f"cannot bind {', '.join(lacking)}"
  return out
