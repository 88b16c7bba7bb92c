"""Stand-in for ortools' CP-SAT module, which is not installed (test-only import shim).

The original's auto_mtf.layout_optimizer imports it at module level; the differential tests only
list that module's names, so any use raises, naming the package.
"""


def __getattr__(name: str):
  raise ImportError(f"ortools.sat.python.cp_model.{name}: ortools is not installed; the differential "
                    "tests' import shim only lets the original's modules import")
