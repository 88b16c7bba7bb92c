"""Gin files shipped with mesh_tensorflow.transformer (package data, found with importlib.resources).

This package only holds data. Never import the gin library relative to it: running a module inside
transformer/ as a script would let this folder shadow the `gin` library.
"""
