"""Backends: interchangeable implementations of the three attention operations.

Every backend module defines ``BACKEND``, a :class:`~flash_attn.backends.contract.Backend`: the
three operations (``forward``, ``backward``, ``forward_kvcache``) as the dispatcher calls them,
whether the backend can run on a device, and its optional eager routes
(:mod:`flash_attn.backends.contract` states the contract). The modules also export the three
operations as plain functions (a kernel backend's raise when its kernels do not serve the call).

The backends: ``aot`` and ``triton`` (the GPU kernels, shipped or compiled on first use),
``interpret`` (the same kernels in Triton's interpreter), ``cpu`` (:mod:`.cpu`: PyTorch's fused
CPU kernels, oneDNN products and a causal tree, exactly; the fast path of CPU tensors) and
``reference`` (:mod:`.reference`: the exact tiled definition alone, on any device).
"""
