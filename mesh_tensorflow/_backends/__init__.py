"""Backends: MeshImpl subclasses that execute slicewise computation and collectives."""
