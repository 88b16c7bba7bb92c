"""Lowering: turning the lazy mtf graph into per-processor TensorFlow ops."""
