"""Argument checks shared by every public function: a clear error instead of a wrong answer.

Shape, dtype and device checks read only tensor metadata, so they are safe to run while
``torch.compile`` traces. Checks that read tensor *values* (cu_seqlens, block tables, cache
lengths) live in the ``check_*_values`` functions, which run inside the custom ops (opaque to
the compiler), so they never cause a graph break.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Callable, Optional, Sequence

import torch

from flash_attn import environ
from flash_attn.limits import INT32_MAX, MAX_HEADDIM, cdiv
from flash_attn.params import KeyLengths, cache_capacity

# With FLASH_ATTN_DEBUG=1 the values of device tensors are checked on the host too (reading them
# waits for the device); otherwise only CPU tensors are (see check_values).
DEBUG_ENV = "FLASH_ATTN_DEBUG"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT32_MAX = torch.finfo(torch.float32).max


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


def check_varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table) -> None:
    """q ``(total_q, h, d)``; k/v ``(total_k, hk, d / dv)`` or pages ``(blocks, page, hk, d / dv)``."""
    if block_table is not None and not _is_block_table(block_table):  # it decides k and v's layout
        _fail(TypeError, f"block_table must be an int32 tensor of shape (batch_size, max_num_blocks_per_seq), got "
                         f"{_describe(block_table)}")
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


def _is_block_table(block_table) -> bool:
    return isinstance(block_table, torch.Tensor) and block_table.dtype == torch.int32 and block_table.dim() == 2


def check_block_table(block_table, batch: int, device: torch.device) -> None:
    if not _is_block_table(block_table):
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


def host_reads_values(t: torch.Tensor) -> bool:
    """Whether argument values of ``t`` are read on the host: always for CPU tensors; for others
    (reading them waits for the device and breaks CUDA-graph capture) only with
    ``FLASH_ATTN_DEBUG=1``; never for meta or fake tensors, nor while torch.compile traces."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return t.device.type == "cpu" or debug_checks()


def traced() -> bool:
    """Whether PyTorch is tracing or intercepting calls (torch.compile, a ``__torch_function__`` or
    ``__torch_dispatch__`` mode such as FakeTensorMode, a functorch transform): then the ops and
    their registrations, not the eager shortcuts around them, must see each call."""
    return bool(_is_compiling() or _function_mode() or _dispatch_modes() or _functorch_transforms())


# traced()'s probes, looked up once (each attribute path costs a few tens of ns per call)
_is_compiling = torch.compiler.is_compiling
_function_mode, _dispatch_modes = torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack
_functorch_transforms = torch._C._are_functorch_transforms_active


def debug_checks() -> bool:
    """Whether ``FLASH_ATTN_DEBUG`` asks for host value checks on device tensors (read per call)."""
    return _debug_setting() not in _OFF


_debug_setting = environ.raw_getter(DEBUG_ENV)
_OFF = (None, "", "0", b"", b"0")


def check_values(ok: torch.Tensor, exc_type: type[Exception], message: str) -> None:
    """A check of tensor values (``ok``: a 0-d bool tensor computed from them): on the host where
    :func:`host_reads_values` (a clear ``exc_type``); on a device otherwise, through
    ``torch._assert_async`` (no synchronisation: a device-side assert if it fails); not at all
    for meta tensors (they have no values)."""
    if ok.device.type == "meta":
        return
    if host_reads_values(ok):
        if not bool(ok):
            _fail(exc_type, message)
    else:
        torch._assert_async(ok, f"flash_attn: {message}")


def check_int(value, name: str, minimum: Optional[int] = None) -> int:
    """``value`` as an int (not a bool), at least ``minimum`` when given."""
    if isinstance(value, bool):
        _fail(TypeError, f"{name} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        _fail(TypeError, f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and number < minimum:
        _fail(ValueError, f"{name} must be >= {minimum}, got {number}")
    return number


def check_flag(value, name: str) -> bool:
    """``value`` as a bool: Python's ``True``/``False`` (or 0/1), nothing else (a string or a
    tensor would otherwise be read by its truth value)."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    _fail(TypeError, f"{name} must be a bool, got {value!r}")


def _real(value, name: str, accepted: str) -> float:
    """``value`` as a Python float: an int or float, not a bool (``True`` is not 1.0 here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(TypeError, f"{name} must be {accepted}, got {type(value).__name__} {value!r}")
    return float(value)


def check_window(window_size, any_negative: bool = False) -> tuple[int, int]:
    """``window_size`` as two ints ``(left, right)``, each ``-1`` (unbounded) or ``>= 0``
    (``any_negative``: any negative bound is unbounded, as upstream's low-level functions take it)."""
    accepted = "a pair of ints (left, right), -1 meaning unbounded"
    if not isinstance(window_size, (tuple, list)):
        _fail(TypeError, f"window_size must be {accepted}, got {type(window_size).__name__} {window_size!r}")
    if len(window_size) != 2:
        _fail(ValueError, f"window_size must be {accepted}, got {len(window_size)} entries: {window_size!r}")
    bounds = []
    for side, bound in zip(("left", "right"), window_size):
        if isinstance(bound, bool):
            _fail(TypeError, f"window_size must be {accepted}, got {window_size!r} ({side} is a bool)")
        try:
            bounds.append(operator.index(bound))
        except TypeError:
            _fail(TypeError, f"window_size must be {accepted}, got {window_size!r} ({side} is not an int)")
    left, right = bounds
    if (left < -1 or right < -1) and not any_negative:
        _fail(ValueError, f"window_size entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}")
    return left, right


def check_options(dropout_p, softcap, window_size, alibi_slopes, batch: int, nheads: int, device,
                  any_negative: bool = False) -> tuple[int, int]:
    """Scalar options; returns ``window_size`` as two ints (:func:`check_window`; the softcap of the
    call: :func:`softcap_value`)."""
    p = _real(dropout_p, "dropout_p", "a float in [0, 1)")
    if not 0.0 <= p < 1.0:
        _fail(ValueError, f"dropout_p must be in [0, 1), got {dropout_p!r}")
    check_softcap(softcap)
    left, right = check_window(window_size, any_negative)
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
            _fail(TypeError, f"alibi_slopes must be a float32 tensor of shape (nheads,) or (batch_size, nheads), got {_describe(alibi_slopes)}")
        if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
            _fail(ValueError, f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != device:
            _fail(ValueError, f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    return left, right


def check_softcap(softcap) -> float:
    """``softcap`` as a float: ``0`` or ``inf`` (both mean off), or a positive number; NaN and
    ``True`` are refused."""
    value = _real(softcap, "softcap", "a float (0 or inf = off)")
    if not value >= 0.0:  # NaN too; comparisons only, which torch.compile traces (math.isnan it cannot)
        _fail(ValueError, f"softcap must be >= 0 (0 or inf disables it), got {softcap!r}")
    return value


def softcap_value(softcap, softmax_scale: float) -> float:
    """The softcap a backend applies: ``inf`` is no softcap (``c * tanh(x / c)`` tends to ``x`` as
    ``c`` grows), so 0.0; a positive one so small that ``softmax_scale / softcap`` overflows
    float32 (the kernels' factor) is refused."""
    value = check_softcap(softcap)
    if value == math.inf:
        return 0.0
    if value > 0.0 and not abs(softmax_scale) / value < FLOAT32_MAX:
        _fail(ValueError, f"softcap {softcap!r} is too small: softmax_scale / softcap must fit in float32")
    return value


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
    if softmax_scale is None:
        return
    value = _real(softmax_scale, "softmax_scale", "a float or None")
    if not abs(value) < math.inf:  # NaN and +-inf; comparisons only, as in check_softcap
        _fail(ValueError, f"softmax_scale must be a finite number, got {softmax_scale!r}")


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


# ---------------------------------------------------------------------------------------------
# Checks made once per call signature: the metadata checks and normalisations above read only
# shapes, strides, dtypes, devices and the scalar arguments, so a call whose arguments look the
# same as an earlier call's that passed passes again, with the same normalised values.

_checked: dict = {}
CHECKED_LIMIT = 4096  # signatures kept (then forgotten all at once: a new shape costs one full check)


def signature(tensors: tuple, scalars: tuple, packed: int = 0) -> tuple:
    """The arguments as the metadata checks see them: each of ``tensors`` (plain tensors or
    ``None``) by shape, strides, dtype and device; ``scalars`` by value and type (``True``, ``1``
    and ``1.0`` are equal but told apart), a tuple among them only when it holds plain ints.
    The first ``packed`` tensors are packed rows ``(total, ...)``, held by :func:`packed_rows`
    instead of their row count: what their checks read of it (whether it is 0) and what a plan
    does (whether it takes it per call), so that packed batches of other totals share one
    signature (a class of calls, :func:`checked_call`'s ``shared``, whose caller compares what the
    checks compare of the totals).
    Raises ``TypeError`` for anything else (a tensor subclass, a number in ``tensors``, a list):
    those calls are checked every time."""
    types = tuple(map(type, scalars))
    key = [types, scalars]
    if packed:  # (no slicing on the calls without: every dense call computes its signature)
        for t in tensors[:packed]:
            if t is None:
                key.append(None)
            elif type(t) is _Tensor and t.dim():
                shape = t.shape
                key += (packed_rows(shape[0]), shape[1:], t.stride(), t.dtype, t.device)
            else:
                raise TypeError("not packed rows (a plain tensor with a first dimension)")
        tensors = tensors[packed:]
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) is _Tensor:
            key += (t.shape, t.stride(), t.dtype, t.device)
        else:
            raise TypeError("not a plain tensor")
    if tuple in types:
        for s in scalars:
            if type(s) is tuple:
                for e in s:
                    if type(e) is not int:
                        raise TypeError("a tuple of other than ints")
    return tuple(key)


_Tensor = torch.Tensor


def packed_rows(total: int) -> int:
    """A packed tensor's row count as a signature holds it: 0 (no rows: the layout checks skip an
    empty tensor), ``total`` beyond int32 (the kernels then take it as a plan constant), else -1:
    any count, taken per call."""
    return -1 if 0 < total <= INT32_MAX else total


def checked_call(tag: str, tensors: tuple, scalars: tuple, check, shared: Optional[Callable] = None,
                 own_keys: bool = False) -> tuple:
    """``(result, key)``: ``check(*tensors, *scalars)`` (metadata checks that return the call's
    normalised values), run once per :func:`signature` under ``tag`` (the function checking them):
    a later call with the same signature gets the first call's result without the checks. ``key``
    stands for ``(tag, signature)``: an int given to it when it was first checked, never given to
    another in this process (the layers below hash and compare it per call: the kernel backends'
    plan key, :attr:`flash_attn.params.AttentionParams.call`), or ``None`` when the call has none.

    ``shared(tensors, scalars)``, asked only for a new signature: the signature of a class of
    calls that the checks (and the layers below) treat alike, or ``None`` where this call is not in
    one; a new signature of a known class gets the class's result unchecked, and the class's key
    (a packed batch's: its totals left out) or, with ``own_keys``, a :class:`KeyLengths` of the
    class's key and a key of the signature's own. A repeated call finds its own signature, as any
    call does.

    A call that fails its checks is never remembered; arguments without a signature, and calls
    while torch.compile traces (the tracer must see the checks), are checked every time."""
    if _is_compiling():
        return check(*tensors, *scalars), None
    try:
        key = (tag, signature(tensors, scalars))
        return _checked[key]
    except KeyError:
        pass
    except (TypeError, RuntimeError):  # no signature, an unhashable scalar (a list), a tensor without strides
        return check(*tensors, *scalars), None
    class_signature = None if shared is None else shared(tensors, scalars)
    class_key = None if class_signature is None else (tag, "class", class_signature)  # never a call's own key
    found = None if class_key is None else _checked.get(class_key)
    if len(_checked) >= CHECKED_LIMIT - 1:
        _checked.clear()
    if found is None:
        found = _checked[key] = (check(*tensors, *scalars), next(_tokens))
        if class_key is not None:  # a new class, this signature its first
            _checked[class_key] = found
        return found
    _checked[key] = found if not own_keys else (found[0], KeyLengths(found[1], next(_tokens)))
    return _checked[key]


_tokens = itertools.count()


def checked(tag: str, tensors: tuple, scalars: tuple, check):
    """The result of :func:`checked_call` alone."""
    return checked_call(tag, tensors, scalars, check)[0]
