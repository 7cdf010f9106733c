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
``decode_launch``      the KV-cache launcher
``registry``           the kernels by name (launchers name them; only Triton executors import them)
``interpreter``        running these kernels in Triton's interpreter on CPU tensors
=====================  ==========================================================================

Kernel modules (and ``interpreter``) import :mod:`triton`; this package's ``__init__``, ``configs``,
``registry``, ``specializations`` and the launchers do not, so importing :mod:`flash_attn` never
requires Triton and the ``aot`` backend runs without it.
"""
