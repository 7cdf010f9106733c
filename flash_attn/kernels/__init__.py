"""Triton kernels of the attention operations and their launchers.

=====================  ==========================================================================
``masking``            where the mask is computed: visibility, ALiBi, softcap, tile ranges
``dropout_rng``        the dropout keep mask (Philox, identical to :mod:`flash_attn.dropout`)
``forward``            forward kernel (dense and varlen, paged K/V) and the ``return_softmax`` one
``backward``           backward kernels: preprocess, dK/dV, dQ (no atomics, deterministic)
``decode``             KV-cache attention: split-KV kernel and the split combine
``kvcache_append``     writing new K/V rows (with rotary) into the cache
``configs``            where the GPU architecture is chosen: launch tables per arch and head dim
``launch``             forward/backward launchers shared by the ``triton`` and ``interpret``
                       backends, and the kernels' ABI (:func:`launch.kernel_signature`)
``decode_launch``      the KV-cache launcher (``superset`` mode: only the ahead-of-time variants)
``decode_configs``     KV-cache launch configs, and the decode kernels' ahead-of-time variants and ABI
``specializations``    the set compiled ahead of time, and which specialisation a launch maps onto
``registry``           the kernels by name (launchers name them; only Triton executors import them)
``interpreter``        running these kernels in Triton's interpreter on CPU tensors
=====================  ==========================================================================

Kernel modules (and ``interpreter``) import :mod:`triton`; this package's ``__init__``, ``configs``,
``registry``, ``specializations``, ``decode_configs`` and the launchers do not, so importing :mod:`flash_attn` never
requires Triton and the ``aot`` backend runs without it.
"""
