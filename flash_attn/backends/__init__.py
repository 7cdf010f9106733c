"""Backends: interchangeable implementations of the three attention operations.

Every backend module exposes the same functions (the contract the dispatcher relies on):

``unavailable_reason(device: torch.device) -> str | None``
    ``None`` when the backend can run tensors on ``device``; otherwise a sentence saying why not.

``forward(q, k, v, params, *, varlen=None, alibi_slopes=None, return_softmax=False)``
    -> ``(out, lse, s_dmask)``.
    Dense: q ``(b, sq, h, d)``, k/v ``(b, sk, hk, d)``; out like q, lse fp32 ``(b, h, sq)``.
    Varlen (``varlen`` a :class:`~flash_attn.params.VarlenLayout`): q ``(total_q, h, d)``,
    k/v ``(total_k, hk, d)`` or paged; out like q, lse fp32 ``(h, total_q)``.
    ``s_dmask`` is ``None`` unless ``return_softmax``; then fp32 ``(b, h, max_sq, max_sk)`` holding
    the softmax probabilities, negated where dropout dropped the entry.
    Rows that see no key: out 0, lse +inf.

``backward(dout, q, k, v, out, lse, params, *, varlen=None, alibi_slopes=None,
deterministic=False, grads=None, return_delta=False)`` -> ``(dq, dk, dv)`` shaped like q, k, v
(for paged K/V: like the page pool).
    The probabilities are recomputed from the given ``lse`` and the softmax correction
    ``rowsum(dout * out)`` from the given ``out``, never from a fresh forward: given the ``out``
    and ``lse`` of a longer sequence (context parallelism), the result is this block's share.
    ``grads``: the caller's ``(dq, dk, dv)`` (each may be ``None``), which a backend may write in
    place and return; ``return_delta``: a fourth result, Delta ``rowsum(dout * out)`` fp32 shaped
    like lse (both for the low-level API, :mod:`flash_attn.lowlevel`).

``forward_kvcache(q, params, cache, *, alibi_slopes=None)`` -> ``(out, lse)``
    ``cache`` a :class:`~flash_attn.params.KVCacheInputs`; q ``(b, sq, h, d)``; appends
    ``cache.k_new``/``v_new`` into the cache in place (after rotary on k) before attending.

Optional: ``direct_forward(*args)`` with the arguments of the ``flash_attn::forward`` op
(:mod:`flash_attn.custom_ops`) -> the op's outputs ``(out, lse, s_dmask, rng_state)`` or ``None``: a
route for eager calls around the op, which the backend takes for the calls it chooses (``None``:
the op runs). Only the ``cpu``
backend has one (its plain calls: one fused-kernel call that keeps PyTorch's own autograd formula).

Arguments arrive already validated and normalised by :mod:`flash_attn.flash_attn_interface`
(dtypes, shapes, devices, value ranges), so a backend only computes.

The backends: ``aot`` and ``triton`` (the GPU kernels, shipped or compiled on first use),
``interpret`` (the same kernels in Triton's interpreter), ``cpu`` (:mod:`.cpu`: PyTorch's fused
CPU kernels, oneDNN products and a causal tree, exactly; the fast path of CPU tensors) and
``reference`` (:mod:`.reference`: the exact tiled definition alone, on any device).
"""
