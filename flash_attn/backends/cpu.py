"""The cpu backend: CPU tensors on PyTorch's fused CPU attention kernels, exactly.

It implements the contract of :mod:`flash_attn.backends` for CPU tensors on two engines that
take the same problems (:mod:`flash_attn.backends._layouts` adapts the layouts to them):

* :mod:`._cpu_fused`, PyTorch's fused CPU kernels, wherever their semantics are exactly ours (no
  softcap, no dropout); its plan adds the oneDNN products (:mod:`._onednn`, where a per-process
  probe finds them faster) and the causal tree (:mod:`._causal_tree`);
* the reference backend's tiled engine (:mod:`._reference_core`) for the rest, and for the
  forward of ``return_softmax`` (its probabilities are recomputed from that engine's lse, so that
  they sum to exactly 1).

:func:`direct_forward` is the eager route the dispatcher offers to public calls
(:func:`flash_attn.dispatch.run_direct`): whether a call is *plain* -- dense, no ALiBi, softcap,
dropout, softmax probabilities, window other than causal, sinks or qv, v of q's head dim, and one
kernel call in the general plan -- is decided there and nowhere else; a plain call is that one kernel call, whose autograd
formula, where autograd records, is PyTorch's own (its backward is the kernel call
:func:`backward` makes for the same problem).

The engine's sizes (:class:`~flash_attn.backends._reference_core.Tuning`) and the CPU's features
(:class:`~flash_attn.backends._cpu_fused.Features`) are parameters: :func:`engine` makes the
engine for others (tests run small sizes and fake CPUs on it); :data:`ENGINE` and
:func:`direct_forward` use the defaults and this CPU's features.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from flash_attn.backends import _causal_tree, _layouts, _onednn
from flash_attn.backends import _cpu_fused as fused
from flash_attn.backends import _reference_core as core
from flash_attn.backends._cpu_fused import THIS_CPU, Features
from flash_attn.backends._reference_core import DEFAULT_TUNING, Tuning
from flash_attn.backends.contract import runs_every_call
from flash_attn.params import AttentionParams
from flash_attn.placeholders import placeholder

__all__ = ["BACKEND", "unavailable_reason", "forward", "backward", "forward_kvcache", "direct_forward", "engine"]


def unavailable_reason(device: torch.device) -> Optional[str]:
    """The cpu backend runs CPU tensors."""
    return None if device.type == "cpu" else f"it runs CPU tensors only, not {device.type}"


@functools.lru_cache(maxsize=16)
def engine(tuning: Tuning = DEFAULT_TUNING, features: Features = THIS_CPU) -> _layouts.Engine:
    """The cpu backend's engine as an :class:`~flash_attn.backends._layouts.Engine`, sized by
    ``tuning`` for a CPU with ``features``: the fused kernels where they apply, the tiled engine
    for the rest."""

    def forward(problem: core.Problem, params: AttentionParams, return_softmax: bool):
        if not return_softmax and fused.supports(problem, params, tuning, features):
            result = fused.attention_forward(problem, params, tuning, features)
            if result is not None:  # None: special values, which only the tiled engine computes as upstream does
                return result
        return core.attention_forward(problem, params, None, tuning)

    def backward(problem: core.Problem, params: AttentionParams, dout: Tensor, out: Tensor, lse: Tensor):
        if fused.supports(problem, params, tuning, features):
            return fused.attention_backward(problem, params, dout, out, lse, tuning, features)
        return core.attention_backward(problem, params, dout, out, lse, None, tuning)

    def probabilities(problem: core.Problem, params: AttentionParams, lse: Tensor, sk: int):
        return core.softmax_with_dropout_signs(problem, params, lse, sk, None, tuning)

    return _layouts.Engine(forward=forward, backward=backward, probabilities=probabilities)


ENGINE = engine()


# The contract's operations on this engine (signatures: flash_attn.backends.contract); the backward
# is always deterministic and computed in the engine's own buffers.
forward = functools.partial(_layouts.forward, ENGINE)
backward = functools.partial(_layouts.backward, ENGINE)
forward_kvcache = functools.partial(_layouts.forward_kvcache, ENGINE)


# ----------------------------------------------------------------------------------------------
# The eager route of plain calls
# ----------------------------------------------------------------------------------------------


def _one_kernel_call(q: Tensor, k: Tensor, causal: bool, tuning: Tuning, features: Features) -> bool:
    """Whether the general plan (of :func:`engine` with ``tuning`` and ``features``) for dense,
    non-empty ``q (B, sq, h, d)``, ``k (B, sk, hk, d)`` (no ALiBi, softcap, dropout or window;
    ``causal`` bottom-right) is one kernel call in q's dtype on all rows and keys: full
    attention, or a causal square that is not cut as a tree, in a dtype not converted to fp32,
    and not one that :mod:`._onednn` computes."""
    dtype, sq, sk = q.dtype, q.shape[1], k.shape[1]
    if fused.OPS is None or dtype not in fused.DTYPES:
        return False
    if dtype == torch.float16 and not features.native_fp16():
        return False
    if fused.onednn_takes(dtype, sq, sk, tuning, features):
        return False
    if causal:
        if sq != sk or _causal_tree.applies(sq, sk, dtype, tuning.tree_min_rows):
            return False
        if dtype == torch.bfloat16 and fused.bf16_forward_as_fp32_tree(sq, sk, tuning, features):
            return False
    elif dtype == torch.bfloat16 and fused.bf16_full_forward_in_fp32(sq, sk, tuning, features):
        return False
    return True


# The op's unused outputs of a direct call (no softmax, no dropout seed), shared: nothing reads them.
_UNUSED = placeholder(torch.float32, torch.device("cpu"), (0,)), placeholder(torch.int64, torch.device("cpu"), (1,))


def direct_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
                   softmax_scale, window_left, window_right, softcap, dropout_p, return_softmax, deterministic,
                   *, tuning: Tuning = DEFAULT_TUNING, features: Features = THIS_CPU):
    """The outputs of ``flash_attn::forward`` (``out, lse, s_dmask, rng_state``; arguments as the
    op's) for a plain eager call, computed as the one kernel call the general plan would make,
    without the op or the plan; ``None`` for any other call (the caller then takes the general
    route). ``tuning`` and ``features``: those of the engine whose plan it is (:data:`ENGINE`'s
    unless given: :func:`engine`). ``s_dmask`` and ``rng_state`` are shared placeholders (the direct calls of
    :mod:`flash_attn.custom_ops` return the same).

    Only for eager calls (the dispatcher's caller checks that): ``out`` carries PyTorch's own
    autograd formula for the kernel where autograd records. Saving the op and the plan is most of a
    short call's time on the CPU (benchmarks/README.md).
    """
    if (cu_seqlens_q is not None or alibi_slopes is not None or return_softmax or softcap != 0.0
            or dropout_p != 0.0 or window_left >= 0 or window_right > 0 or q.numel() == 0 or k.numel() == 0
            or v.shape[-1] != q.shape[-1]):  # PyTorch's fused CPU kernel takes one head dim for q, k and v
        return None
    causal = window_right == 0
    if not _one_kernel_call(q, k, causal, tuning, features):
        return None
    kernel = fused.OPS[0]
    out, lse = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=softmax_scale)
    if not fused.plain_scores(lse):
        return None  # NaN or infinite scores: the general route computes them as upstream does
    return out.transpose(1, 2), lse, *_UNUSED


BACKEND = runs_every_call("cpu", unavailable_reason, forward, backward, forward_kvcache,
                          direct={"forward": direct_forward}, settings_error=_onednn.settings_error)
