"""The classes and functions a new user meets first document every argument in an Args section.

ruff's pydocstyle rules check docstring form (and that an Args section lists only real arguments);
this test checks that the section exists and is complete, which no ruff rule does.
"""

from __future__ import annotations

import inspect
import re

import pytest

import mesh_tensorflow as mtf

FIRST_MET = [
    mtf.Lowering, mtf.Lowering.export_to_tf_tensor, mtf.Lowering.lowered_operation,
    mtf.Lowering.copy_masters_to_slices, mtf.Lowering.copy_slices_to_masters,
    mtf.get_variable, mtf.VariableDType, mtf.import_tf_tensor, mtf.gradients,
    mtf.Mesh, mtf.einsum,
    mtf.placement_mesh_impl.PlacementMeshImpl,
    mtf.MtfRestoreHook, mtf.MtfCheckpointSaverListener,
    mtf.optimize.Optimizer.apply_grads, mtf.optimize.Optimizer.apply_grad,
    mtf.optimize.SgdOptimizer, mtf.optimize.MomentumOptimizer, mtf.optimize.AdamWeightDecayOptimizer,
    mtf.optimize.AdafactorOptimizer, mtf.optimize.AdafactorWithMultiLRSchedule,
    mtf.optimize.adafactor_decay_rate_pow, mtf.optimize.compute_lr_for_step,
    mtf.utils.BalancedVariablePlacer, mtf.utils.create_host_call,
]


def arguments(obj) -> list:
  """Names of the arguments a caller passes (self and cls excluded), '*args'-style for varargs."""
  signature = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
  prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
  return [prefix.get(p.kind, "") + name for name, p in signature.parameters.items()
          if name not in ("self", "cls")]


def documented_arguments(doc: str) -> list:
  """Names listed in the docstring's Args section (Google style)."""
  match = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)*)", doc, re.M)
  if not match:
    return []
  return re.findall(r"^ {2}(\*{0,2}\w+)(?: \([^)]*\))?:", match.group(1), re.M)


def name_of(obj) -> str:
  return obj.__qualname__


@pytest.mark.parametrize("obj", FIRST_MET, ids=name_of)
def test_documents_every_argument(obj):
  doc = inspect.getdoc(obj)
  assert doc and doc.strip(), f"{name_of(obj)} has no docstring"
  missing = [a for a in arguments(obj) if a not in documented_arguments(doc)]
  assert not missing, f"{name_of(obj)}: Args section lacks {missing}"


def test_args_section_reader_finds_names_types_and_varargs():
  doc = ("Summary.\n\nArgs:\n  x: one.\n    More about x.\n  y (int): two.\n  **kwargs: rest.\n\n"
         "Returns:\n  z\n")
  assert documented_arguments(doc) == ["x", "y", "**kwargs"]
  assert documented_arguments("Summary only.") == []
