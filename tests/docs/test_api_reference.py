"""scripts/build_api_docs.sh builds the HTML API reference, facades' re-exports and Args included."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_api_reference_documents_the_public_entry_points(tmp_path):
  out = tmp_path / "api"
  subprocess.run(["bash", str(ROOT / "scripts" / "build_api_docs.sh"), str(out)], check=True, timeout=300,
                 capture_output=True)
  pages = {
      "mesh_tensorflow.html": ['id="Lowering"', 'id="get_variable"', 'id="MtfRestoreHook"', 'id="einsum"'],
      "mesh_tensorflow/placement_mesh_impl.html": ['id="PlacementMeshImpl"'],
      "mesh_tensorflow/optimize.html": ['id="AdafactorOptimizer"',
                                        "the training step the default rates follow"],
      "mesh_tensorflow/utils.html": ['id="BalancedVariablePlacer"'],
  }
  for page, needles in pages.items():
    html = (out / page).read_text(encoding="utf-8")
    for needle in needles:
      assert needle in html, f"{page} lacks {needle}"
  assert not list(out.glob("mesh_tensorflow/_*")), "underscored implementation modules are documented"
