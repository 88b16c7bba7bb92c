"""The surface comparison's rules (compare.py) on hand-written listings: no original needed."""

from tests.differential import compare

P = "POSITIONAL_OR_KEYWORD"


def test_a_call_the_original_takes_must_work_with_ours():
  original = [["x", P, None], ["rate", P, "0.0"], ["name", P, "None"]]
  assert compare.parameter_differences(original, [["x", P, None], ["rate", P, "0.0"], ["name", P, "None"],
                                                  ["extra", "KEYWORD_ONLY", "1"]]) == []
  swapped = [["x", P, None], ["name", P, "None"], ["rate", P, "0.0"]]
  assert compare.parameter_differences(original, swapped) == [
      "parameter 'rate' is not positional #1 (ours: #2, POSITIONAL_OR_KEYWORD)",
      "parameter 'name' is not positional #2 (ours: #1, POSITIONAL_OR_KEYWORD)"]
  assert compare.parameter_differences(original, [["x", P, None], ["rate", P, None], ["name", P, "'a'"]]) == [
      "parameter 'rate' has no default (original: 0.0)", "parameter 'name' defaults to 'a' (original: None)"]
  assert compare.parameter_differences(original, [["x", P, None], ["rate", P, "0.0"]]) == [
      "no parameter 'name'"]
  assert compare.parameter_differences(original, [["args", "VAR_POSITIONAL", None],
                                                  ["kwargs", "VAR_KEYWORD", None]]) == []
  assert compare.parameter_differences(original, [["x", P, None], ["kwargs", "VAR_KEYWORD", None]]) == []
  assert compare.parameter_differences(original, [["rate", P, "0.0"], ["kwargs", "VAR_KEYWORD", None]]) == [
      "parameter 'rate' is not positional #1 (ours: #0, POSITIONAL_OR_KEYWORD)"]


def test_unused_positional_parameters_may_be_renamed_in_place():
  original = [["unused_grad_ys", P, None]]
  assert compare.parameter_differences(original, [["grad_ys", P, None]]) == []
  assert compare.parameter_differences([["grad_ys", P, None]], [["dys", P, None]]) == [
      "no parameter 'grad_ys'", "new parameter 'dys' has no default"]


def test_names_missing_inherited_or_of_another_kind():
  original = {"m.f": {"kind": "function", "params": []}, "m.C": {"kind": "class", "params": []},
              "m.C.begin": {"kind": "method", "params": []}, "m.C.size": {"kind": "property"},
              "m.g": {"kind": "function", "params": []}}
  ours = {"m.f": {"kind": "function", "params": []},
          "m.C": {"kind": "class", "params": [], "inherited": ["begin"]},
          "m.C.size": {"kind": "method", "params": []}}
  assert compare.name_differences(original, ours) == {
      "m.C.size": "is a method (original: a property)", "m.g": "missing"}


def test_gin_configurables_must_bind_every_parameter_of_the_original():
  original = {"a.F": {"params": ["x", "y"], "var_keyword": False},
              "a.G": {"params": ["z"], "var_keyword": False}}
  assert compare.gin_differences(original, {"a.F": {"params": ["x"], "var_keyword": False}}) == {
      "a.F": "cannot bind y", "a.G": "not a configurable"}
  assert compare.gin_differences(original, {"a.F": {"params": [], "var_keyword": True},
                                            "a.G": {"params": ["z", "w"], "var_keyword": False}}) == {}
