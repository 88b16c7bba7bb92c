"""Op families. Each module keeps its Operation classes' shape rules, lowering and gradient together.

Convention: a module imports sibling families as modules (`from mesh_tensorflow._ops import
reduce as reduce_ops`) and uses their attributes only inside functions, so import cycles are harmless.
"""
