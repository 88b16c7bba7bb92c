"""`python -m mesh_tensorflow.transformer.convert to_hf|from_hf ...` (see cli.py)."""

import sys

from mesh_tensorflow.transformer.convert.cli import main

if __name__ == "__main__":
  sys.exit(main())
