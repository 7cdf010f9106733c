"""Argument checks shared by every public function: a clear error instead of a wrong answer.

Shape, dtype and device checks read only tensor metadata, so they are safe to run while
``torch.compile`` traces. Checks that read tensor *values* (cu_seqlens, block tables, cache
lengths) live in the ``check_*_values`` functions, which run inside the custom ops (opaque to
the compiler), so they never cause a graph break.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

import torch

from flash_attn.limits import MAX_HEADDIM, cdiv
from flash_attn.params import cache_capacity

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fail(exc_type: type[Exception], message: str):
    raise exc_type(message)


def check_tensor(t, name: str, ndim: int, layout: str) -> torch.Size:
    """``t`` is a tensor of rank ``ndim`` with a supported dtype and a contiguous last dim; returns
    its shape (the checks run on every call: each tensor attribute is read once)."""
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    shape = t.shape
    if len(shape) != ndim:
        _fail(ValueError, f"{name} must have shape {layout} ({ndim} dims), got shape {tuple(shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        _fail(TypeError, f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.stride(-1) != 1 and shape[-1] > 1 and t.numel() > 0:
        _fail(
            ValueError,
            f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}; "
            f"call .contiguous() on it",
        )
    return shape


def check_same(*named: tuple[str, torch.Tensor]) -> None:
    """All tensors (given as ``(name, tensor)``) share dtype and device."""
    (first_name, first), *rest = named
    dtype, device = first.dtype, first.device
    for name, t in rest:
        if t.dtype != dtype:
            _fail(TypeError, f"{name} has dtype {t.dtype} but {first_name} has {dtype}; they must match")
        if t.device != device:
            _fail(ValueError, f"{name} is on {t.device} but {first_name} is on {device}; they must be on the same device")


def check_heads(q_heads: int, k_heads: int, q_dim: int, k_dim: int, v_dim: int) -> None:
    """Head counts (MQA/GQA) and head dims: q and k share theirs, v (and so the output) may have its
    own (``headdim_v``); each between 1 and :data:`~flash_attn.limits.MAX_HEADDIM`."""
    if q_heads == 0 or k_heads == 0:
        _fail(ValueError, f"nheads of q ({q_heads}) and of k/v ({k_heads}) must be at least 1")
    if q_heads % k_heads != 0:
        _fail(ValueError, f"nheads of q ({q_heads}) must be a multiple of nheads of k/v ({k_heads}) for MQA/GQA")
    if q_dim != k_dim:
        _fail(ValueError, f"headdim of q ({q_dim}) and k ({k_dim}) must be equal (v may have its own, headdim_v)")
    if not 1 <= q_dim <= MAX_HEADDIM:
        _fail(ValueError, f"headdim must be between 1 and {MAX_HEADDIM}, got {q_dim}")
    if not 1 <= v_dim <= MAX_HEADDIM:
        _fail(ValueError, f"headdim_v (v's head dim) must be between 1 and {MAX_HEADDIM}, got {v_dim}")


def check_dense_qkv(q, k, v) -> None:
    """q ``(b, sq, h, d)``, k ``(b, sk, hk, d)``, v ``(b, sk, hk, dv)``."""
    q_shape = check_tensor(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    k_shape = check_tensor(k, "k", 4, "(batch, seqlen_k, nheads_k, headdim)")
    v_shape = check_tensor(v, "v", 4, "(batch, seqlen_k, nheads_k, headdim_v)")
    check_same(("q", q), ("k", k), ("v", v))
    if k_shape[:3] != v_shape[:3]:
        _fail(ValueError, f"k and v must agree in (batch, seqlen_k, nheads_k), got {tuple(k_shape)} and {tuple(v_shape)}")
    if q_shape[0] != k_shape[0]:
        _fail(ValueError, f"q and k must have the same batch size, got {q_shape[0]} and {k_shape[0]}")
    check_heads(q_shape[2], k_shape[2], q_shape[3], k_shape[3], v_shape[3])


def check_cu_seqlens(cu, name: str, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor):
        _fail(TypeError, f"{name} must be an int32 torch.Tensor of shape (batch_size + 1,), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        _fail(TypeError, f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        _fail(ValueError, f"{name} must be 1-D of shape (batch_size + 1,), got shape {tuple(cu.shape)}")
    if cu.device != device:
        _fail(ValueError, f"{name} is on {cu.device} but q is on {device}; they must be on the same device")


def as_max_seqlen(value, name: str, bound: Optional[int] = None) -> int:
    """``value`` as a non-negative Python int; 0-d integer tensors (transformers passes them for
    packed sequences) are accepted. One on a device other than the CPU is not read when ``bound``
    (an upper bound from the shapes) is given: reading it waits for the device and breaks
    CUDA-graph capture, and ``bound`` is returned instead (see :func:`varlen_max_seqlens`)."""
    if isinstance(value, bool):
        _fail(ValueError, f"{name} must be a non-negative int, got {value!r}")
    if isinstance(value, (int, torch.SymInt)):
        number = value  # kept as is: operator.index would specialise a traced SymInt
    elif bound is not None and _device_scalar(value):
        return bound
    else:
        try:
            number = operator.index(value)
        except TypeError:
            _fail(ValueError, f"{name} must be a non-negative int, got {value!r}")
    if number < 0:
        _fail(ValueError, f"{name} must be a non-negative int, got {number}")
    return number


def _device_scalar(value) -> bool:
    """A 0-d integer tensor whose value lives on a device (reading it would wait for the device)."""
    return (isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type != "cpu"
            and not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool))


def _packed_bounds(q, k, block_table) -> tuple[Optional[int], Optional[int]]:
    """Upper bounds of the longest query and key sequence from the shapes alone: the packed rows,
    or a block-table row of pages; ``None`` where the shapes are not those of a varlen call."""
    bound_q = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else None
    bound_k = None
    if isinstance(k, torch.Tensor):
        if block_table is None and k.dim() == 3:
            bound_k = k.shape[0]
        elif isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and k.dim() == 4:
            bound_k = cache_capacity(k, block_table)
    return bound_q, bound_k


def varlen_max_seqlens(q, k, block_table, max_seqlen_q, max_seqlen_k, exact: bool = False) -> tuple[int, int]:
    """``max_seqlen_q/k`` of a varlen call as ints (:func:`as_max_seqlen`). A 0-d tensor on a GPU
    is not read unless ``exact``: the kernels take each sequence's length from cu_seqlens and size
    their grids from this value (programs past a sequence's end return at once), so a bound from the
    shapes gives the same results without a device sync. ``exact`` where the value sizes an output
    (``return_attn_probs``: ``(batch, nheads, max_seqlen_q, max_seqlen_k)``)."""
    bound_q, bound_k = (None, None) if exact else _packed_bounds(q, k, block_table)
    return as_max_seqlen(max_seqlen_q, "max_seqlen_q", bound_q), as_max_seqlen(max_seqlen_k, "max_seqlen_k", bound_k)


def check_varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table) -> None:
    """q ``(total_q, h, d)``; k/v ``(total_k, hk, d / dv)`` or pages ``(blocks, page, hk, d / dv)``."""
    check_tensor(q, "q", 3, "(total_q, nheads, headdim)")
    kv_rank, kv_layout = (4, "(num_blocks, page_block_size, nheads_k, headdim)") if block_table is not None else (3, "(total_k, nheads_k, headdim)")
    check_tensor(k, "k", kv_rank, kv_layout)
    check_tensor(v, "v", kv_rank, kv_layout.replace("headdim)", "headdim_v)"))
    check_same(("q", q), ("k", k), ("v", v))
    if k.shape[:-1] != v.shape[:-1]:
        _fail(ValueError, f"k and v must have the same shape except headdim, got {tuple(k.shape)} and {tuple(v.shape)}")
    check_heads(q.shape[1], k.shape[-2], q.shape[2], k.shape[-1], v.shape[-1])
    check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.device)
    check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q.device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        _fail(ValueError, f"cu_seqlens_q and cu_seqlens_k must both have batch_size + 1 entries, got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    if block_table is not None:
        check_block_table(block_table, cu_seqlens_q.shape[0] - 1, q.device)


def check_block_table(block_table, batch: int, device: torch.device) -> None:
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        _fail(TypeError, f"block_table must be an int32 tensor of shape (batch_size, max_num_blocks_per_seq), got {_describe(block_table)}")
    if block_table.shape[0] != batch:
        _fail(ValueError, f"block_table must have batch_size ({batch}) rows, got {block_table.shape[0]}")
    if block_table.device != device:
        _fail(ValueError, f"block_table is on {block_table.device} but q is on {device}")


def check_index_vector(t, name: str, batch: int, device: torch.device, owner: str = "q") -> None:
    """``t`` is an int32 tensor of shape ``(batch,)`` (per-sequence lengths or indices) on
    ``device``, the device of the tensor named ``owner``."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (batch,):
        _fail(TypeError, f"{name} must be an int32 tensor of shape ({batch},), got {_describe(t)}")
    if t.device != device:
        _fail(ValueError, f"{name} is on {t.device} but {owner} is on {device}")


def check_options(dropout_p, softcap, window_size, alibi_slopes, batch: int, nheads: int, device) -> tuple[int, int]:
    """Scalar options; returns ``window_size`` as two ints."""
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        _fail(ValueError, f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if not isinstance(softcap, (int, float)) or float(softcap) < 0.0:
        _fail(ValueError, f"softcap must be >= 0 (0 disables it), got {softcap!r}")
    if window_size is None or len(window_size) != 2:
        _fail(ValueError, f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        _fail(ValueError, f"window_size entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
            _fail(TypeError, f"alibi_slopes must be a float32 tensor of shape (nheads,) or (batch_size, nheads), got {_describe(alibi_slopes)}")
        if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
            _fail(ValueError, f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != device:
            _fail(ValueError, f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    return left, right


def check_sinks(sinks, nheads: int, device) -> None:
    """Attention sinks (``learnable_sink``): ``None`` or a float32 tensor ``(nheads,)`` on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32:
        _fail(TypeError, f"learnable_sink must be a float32 tensor of shape ({nheads},) (one logit per query head), "
                         f"got {_describe(sinks)}")
    if tuple(sinks.shape) != (nheads,):
        _fail(ValueError, f"learnable_sink must have shape ({nheads},) (one logit per query head), got {tuple(sinks.shape)}")
    if sinks.device != device:
        _fail(ValueError, f"learnable_sink is on {sinks.device} but q is on {device}")


def check_qv(qv, q, head_dim_v: int, layout: str) -> None:
    """MLA's absorbed queries: ``None`` or a tensor shaped like q with v's head dim, q's dtype and device."""
    if qv is None:
        return
    expected = (*q.shape[:-1], head_dim_v)
    check_tensor(qv, "qv", len(expected), layout)
    if tuple(qv.shape) != expected:
        _fail(ValueError, f"qv must have shape {layout} = {expected} (q's with v's head dim), got {tuple(qv.shape)}")
    check_same(("q", q), ("qv", qv))


def check_softmax_scale(softmax_scale) -> None:
    if softmax_scale is not None and not isinstance(softmax_scale, (int, float)):
        _fail(TypeError, f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


# ---------------------------------------------------------------------------------------------
# Value checks: these read tensor contents, so they run inside the custom ops.


def check_cu_seqlens_values(cu: torch.Tensor, name: str, total: Optional[int], max_seqlen: int, max_name: str) -> list[int]:
    """cu starts at 0, never decreases, ends at ``total`` (if given); returns it as a list."""
    values = cu.tolist()
    if values[0] != 0:
        _fail(ValueError, f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(n < 0 for n in lengths):
        _fail(ValueError, f"{name} must be non-decreasing, got {values}")
    if total is not None and values[-1] != total:
        _fail(ValueError, f"{name}[-1] ({values[-1]}) must equal the number of rows of the packed tensor ({total})")
    if lengths and max(lengths) > max_seqlen:
        _fail(ValueError, f"{max_name} ({max_seqlen}) is smaller than the longest sequence in {name} ({max(lengths)})")
    return values


def check_block_table_values(block_table: torch.Tensor, num_blocks: int, page_size: int, seqlens: Sequence[int]) -> None:
    """Every page a sequence uses exists, and the table has enough columns for its length."""
    for b, n in enumerate(seqlens):
        needed = cdiv(n, page_size) if n > 0 else 0
        if needed > block_table.shape[1]:
            _fail(ValueError, f"block_table has {block_table.shape[1]} pages per sequence but sequence {b} needs {needed} pages of {page_size} rows")
        if needed:
            used = block_table[b, :needed]
            lo, hi = int(used.min()), int(used.max())
            if lo < 0 or hi >= num_blocks:
                _fail(IndexError, f"block_table[{b}] refers to page {lo if lo < 0 else hi}, outside the page pool of {num_blocks} pages")


def check_positions_fit(seqlens: Sequence[int], capacity: int, what: str) -> None:
    for b, n in enumerate(seqlens):
        if n > capacity:
            _fail(ValueError, f"{what}: sequence {b} needs {n} rows but the cache holds only {capacity}")


def softmax_scale(softmax_scale, headdim: int) -> float:
    """The softmax scale of a call: ``headdim ** -0.5`` unless given."""
    check_softmax_scale(softmax_scale)
    return float(headdim ** (-0.5) if softmax_scale is None else softmax_scale)


def causal_window(causal: bool, window_size) -> tuple[int, int]:
    """``(left, right)``; causal is the window ``(left, 0)``."""
    left, right = window_size
    return (left, 0) if causal else (left, right)


def bounded_window(causal: bool, window_size, seqlen_k: int) -> tuple[int, int]:
    """:func:`causal_window` normalised as upstream does where the key length is known (the
    low-level functions, the KV cache's capacity): a negative bound, or one no smaller than
    ``seqlen_k``, is unbounded (-1)."""
    left, right = causal_window(causal, window_size)
    left = -1 if left < 0 or left >= seqlen_k else int(left)
    right = -1 if right < 0 or right >= seqlen_k else int(right)
    return left, right
