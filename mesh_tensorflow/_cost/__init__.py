"""The cost model: per-processor compute, communication and memory of a graph under a layout."""
