"""Helpers shared by the modules: ``generation`` (``InferenceParams``, sampling, ``decode``),
``distributed`` (the collectives the tensor-parallel modules use) and ``benchmark`` (upstream's
timing, profiling and memory helpers, on the inputs' device)."""
