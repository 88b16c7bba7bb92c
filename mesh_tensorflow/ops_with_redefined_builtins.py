"""`mtf.*`: every public name of mesh_tensorflow.ops, plus builtin-shadowing aliases."""
# ruff: noqa: F401, F403
from mesh_tensorflow.ops import *
from mesh_tensorflow.ops import mtf_abs as abs  # pylint: disable=redefined-builtin
from mesh_tensorflow.ops import mtf_pow as pow  # pylint: disable=redefined-builtin
from mesh_tensorflow.ops import mtf_range as range  # pylint: disable=redefined-builtin
from mesh_tensorflow.ops import mtf_slice as slice  # pylint: disable=redefined-builtin
