"""One view of a tf.Graph or an mtf.Graph for scheduling and memory (upstream `auto_mtf.graph_interface`).

The code lives in the cost model (`mesh_tensorflow._cost.graph_interface`), whose memory estimate
schedules over it and on which the layout search builds; this module keeps upstream's name.
"""
# ruff: noqa: F401
from mesh_tensorflow._cost.graph_interface import GraphInterface
