"""Part of the stand-in for ortools (see cp_model.py)."""
