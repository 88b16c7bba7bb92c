"""Parsing of the "name:value;name:value" strings used for shapes, meshes and layouts."""

from __future__ import annotations

import re

_SEPARATORS = re.compile(r"[,.;\s]+")


def _parse_string_to_list_of_pairs(s: str, seconds_to_int: bool = False) -> list:
  """Parses "a:1;b:2" (separators `,` `.` `;` or spaces) into [("a", "1"), ("b", "2")].

  With `seconds_to_int`, the second element of each pair is converted to int.
  Raises ValueError naming the bad token.
  """
  ret = []
  for token in _SEPARATORS.split(s.strip()):
    if not token:
      continue
    parts = token.split(":")
    if len(parts) != 2:
      raise ValueError(
          f"Cannot parse {token!r} in {s!r}: expected 'name:value' pairs separated by "
          f"';' (for example 'batch:8;d_model:512' or 'batch:rows;d_ff:cols').")
    name, value = parts
    if seconds_to_int:
      try:
        value = int(value)
      except ValueError as e:
        raise ValueError(f"Cannot parse {token!r} in {s!r}: size {value!r} is not an integer.") from e
    ret.append((name, value))
  return ret
