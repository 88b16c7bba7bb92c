"""Operation orders that keep peak memory low (upstream `auto_mtf.scheduler`).

The code lives in the cost model (`mesh_tensorflow._cost.scheduler`), whose memory estimate
schedules with it and on which the layout search builds; this module keeps upstream's name.
"""
# ruff: noqa: F401
from mesh_tensorflow._cost.scheduler import ALGORITHMS, minimize_peak_memory
