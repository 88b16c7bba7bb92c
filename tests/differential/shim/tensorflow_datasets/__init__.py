"""Stand-in for tensorflow_datasets, which is not installed (test-only import shim).

The original imports it at module level; the differential tests never use it, so any attribute
access raises, naming the package.
"""


def __getattr__(name: str):
  raise ImportError(f"tensorflow_datasets.{name}: tensorflow_datasets is not installed; the "
                    "differential tests' import shim only lets the original's modules import")
