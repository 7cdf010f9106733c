"""Triton kernels of the attention operations and their launchers.

=====================  ==========================================================================
``masking``            where the mask is computed: visibility, ALiBi, softcap, tile ranges
``dropout_rng``        the dropout keep mask (Philox, identical to :mod:`flash_attn.dropout`)
``forward``            forward kernel (dense and varlen, paged K/V) and the ``return_softmax`` one
``backward``           backward kernels: preprocess, dK/dV, dQ (no atomics, deterministic)
``decode``             KV-cache attention: split-KV kernel and the split combine
``kvcache_append``     writing new K/V rows (with rotary) into the cache
``declarations``       one declaration per kernel: module, argument types, flags folded ahead of time
``plan``               the launch planner: a call's shape -> kernels, grids, arguments by name
``configs``            where the GPU architecture is chosen: launch tables per arch and head dim
``decode_configs``     KV-cache launch configs and the ahead-of-time variants of those kernels
``specializations``    the set compiled ahead of time
``registry``           the kernels by name (only Triton executors import them)
``interpreter``        running these kernels in Triton's interpreter on CPU tensors
=====================  ==========================================================================

Kernel modules (and ``interpreter``) import :mod:`triton`; the others do not, so importing
:mod:`flash_attn` never requires Triton and the ``aot`` backend runs without it.
"""
