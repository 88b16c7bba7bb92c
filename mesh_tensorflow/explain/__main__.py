"""`python -m mesh_tensorflow.explain`: the command line of `mtf.explain` (in mesh_tensorflow._explain.cli).

A module of its own, so that running it does not execute the package's `mesh_tensorflow.explain`,
which `import mesh_tensorflow` has already imported, a second time (runpy warns about that).
"""

import sys

from mesh_tensorflow._explain.cli import main

sys.exit(main())
