"""Op families. Each module keeps its Operation classes' shape rules, lowering and gradient together.

Convention: a module imports sibling families as modules (`from mesh_tensorflow._ops import
reduce as reduce_ops`). The families import each other without cycles (io < elementwise <
reduce < einsum < binary < ...; tests/ops/test_family_imports.py checks it); Tensor operators and
Graph rewrites reach the families through registries in `_core`, which imports none of them.
"""
