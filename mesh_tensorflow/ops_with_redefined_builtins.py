"""`mtf.*`: every public name of mesh_tensorflow.ops, plus builtin-shadowing aliases."""
# ruff: noqa: F401, F403
from mesh_tensorflow import ops as _ops
from mesh_tensorflow.ops import *

# SCAFFOLD(lead): becomes plain imports once every family module has landed.
abs = getattr(_ops, "mtf_abs", None)  # pylint: disable=redefined-builtin
pow = getattr(_ops, "mtf_pow", None)  # pylint: disable=redefined-builtin
range = _ops.mtf_range  # pylint: disable=redefined-builtin
slice = getattr(_ops, "mtf_slice", None)  # pylint: disable=redefined-builtin
