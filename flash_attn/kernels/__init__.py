"""The Triton kernels, and nothing else (what launches them: :mod:`flash_attn.planning`).

=====================  ==========================================================================
``forward``            forward kernel (dense and varlen, paged K/V) and the ``return_softmax`` one
``backward``           backward kernels: preprocess, fused (atomic dQ) or dK/dV + dQ (deterministic)
``decode``             KV-cache attention: split-KV kernel and the split combine
``kvcache_append``     writing new K/V rows (with rotary) into the cache
``masking``            where the mask is computed: visibility, ALiBi, softcap, tile ranges
``tiles``              tile helpers the kernels share: program ids, row pointers, online softmax
``dropout_rng``        the dropout keep mask (Philox, identical to :mod:`flash_attn.dropout`)
=====================  ==========================================================================

Strides are named ``stride_<tensor><dim>``: dims ``b`` batch entry, ``s`` sequence position (a
row), ``h`` head, ``x`` split (KV-cache partial results); tensors ``q k v o``, ``do dq dk dv``,
``l`` log-sum-exp, ``p`` probabilities or partial outputs, ``m`` partial log-sum-exp, ``kc vc``
the caches, ``kn vn`` new keys and values, ``a`` ALiBi slopes, ``bt`` block table, ``ro`` rotary.
The last dimension is always contiguous (stride 1).
"""
