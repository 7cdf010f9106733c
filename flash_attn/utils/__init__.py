"""Helpers shared by the modules: ``generation`` (``InferenceParams``, sampling, ``decode``) and
``distributed`` (the collectives the tensor-parallel modules use)."""
