"""The estimator-free training driver behind `transformer.utils.run` (re-exported there)."""
