"""Internals of `mtf.explain`: the gin Transformer graph builder, the report and the plots."""
