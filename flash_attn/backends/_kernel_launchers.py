"""The backend functions shared by the two backends that run our Triton kernels through the Python
launchers (:mod:`flash_attn.kernels.launch`): ``triton`` (compiled) and ``interpret`` (Triton's
interpreter). They differ only in the backend name (for fallback warnings) and the executor.
"""

from __future__ import annotations


def _launch():
    # Imported on first call: selecting a backend must stay cheap.
    from flash_attn.kernels import launch  # noqa: PLC0415

    return launch


def kernel_backend(name: str, interpret: bool):
    """``(forward, backward, forward_kvcache)`` of the backend contract for backend ``name``."""

    def forward(q, k, v, params, *, varlen=None, alibi_slopes=None, return_softmax=False):
        return _launch().contract_forward(name, interpret, q, k, v, params, varlen=varlen,
                                          alibi_slopes=alibi_slopes, return_softmax=return_softmax)

    def backward(dout, q, k, v, out, lse, params, *, varlen=None, alibi_slopes=None, deterministic=False):
        return _launch().contract_backward(name, interpret, dout, q, k, v, out, lse, params, varlen=varlen,
                                           alibi_slopes=alibi_slopes, deterministic=deterministic)

    def forward_kvcache(q, params, cache, *, alibi_slopes=None):
        return _launch().contract_forward_kvcache(name, interpret, q, params, cache, alibi_slopes=alibi_slopes)

    return forward, backward, forward_kvcache
