"""The kernel specialisations compiled ahead of time: the whole set, in one reviewable place.

A specialisation is ``(kernel, dtype, BLOCK_D, launch config) x image architecture``. The set is
pruned on purpose, by the rule *features that are cheap at run time are runtime arguments (or
exact supersets), not new kernels*. Every axis that is not listed below would multiply the build:
one big kernel (forward, dK/dV, dQ) costs 4-16 s of CPU per architecture and 0.2-0.45 MB of cubin
(measured here with Triton 3.9: sm_80 ~9 s / 0.3 MB, sm_90a ~9 s / 0.2 MB, sm_100a ~15 s /
0.43 MB, sm_120a ~5 s / 0.3 MB for the head-dim-128 forward), so every flag kept as an axis
doubles a build that must stay under 10 minutes on 2 cores and under 50 MB.

Shipped axes
    ``dtype``    fp16, bf16 (the element type is part of the machine code);
    ``BLOCK_D``  32, 64, 128, 256 (head dim padded to a power of two; head dims <= 16 run on the
                 32 specialisation, which is exact: the feature mask uses the run-time ``head_dim``;
                 the score-features variant starts at 64 the same way);
    ``config``   ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of :mod:`flash_attn.kernels.configs`
                 for the families an image runs on: the portable ``sm_80`` image also carries the
                 smaller-shared-memory ``sm86`` configs where they differ (consumer Ampere/Ada run
                 ``sm_80`` cubins but have 99 KB of shared memory, not 163 KB).

Flags folded into one specialisation (exact for every call they serve)
    ``IS_LOCAL=True``     the window bounds are run-time ints and ``-1`` means unbounded
                          (:mod:`flash_attn.kernels.masking`), so non-causal ``(-1, -1)`` and causal
                          ``(-1, 0)`` are both exact; tile skipping is computed at run time.
    ``PAD_HEADDIM=True``  the feature mask ``offs_d < head_dim`` uses the run-time head dim, so it is
                          exact for every head dim. ``head_dim`` is declared divisible by 8
                          (``i32:8``), which keeps the masked loads vectorised (16-byte ``cp.async``;
                          without the declaration Triton emits scalar loads). Head dims that are not
                          a multiple of 8 are not shipped (the interface pads them upstream; here they
                          fall back to Triton/reference).
    ``IS_VARLEN=True``    a dense call runs as a varlen call with ``cu_seqlens = arange(b + 1) * s``
                          and each batch stride rebased by ``- s * row_stride`` (the kernel adds
                          ``b * stride_b + cu_seqlens[b] * stride_row``): the same addresses, the same
                          per-sequence positions (masks, ALiBi, dropout counters), so exact
                          (:func:`dense_as_varlen`).

The score-features variant (one more specialisation per kernel, not three)
    ``HAS_SOFTCAP``, ``HAS_ALIBI``, ``HAS_DROPOUT`` are compiled in together and each is switched
    at run time: ``softcap > 0`` selects the softcapped logits (uniform ``tl.where``, not a branch),
    zero ALiBi slopes add exactly nothing, ``dropout_p > 0`` guards the Philox draw. The launchers
    use this variant for every call with any of the three (:func:`flash_attn.kernels.launch.
    uses_score_features`), so the Triton path runs exactly what is shipped here. It has its own
    launch configs (``configs.pick_config(..., features=True)``): the extra live tiles need
    smaller ones to keep the no-spill rule. Calls without the three run the lean kernels.

Not shipped (rare; the ``aot`` backend reports them unsupported and the dispatcher falls back to
the ``triton`` backend, else the reference, with a one-time warning)
    ``IS_PAGED`` in the varlen forward (paged caches are served by the KV-cache path).
    ``attn_probs_kernel`` (``return_attn_probs``): testing only.

The KV-cache (decode) kernels
    ``split_kv_kernel``, ``append_kv_kernel``, ``rotary_q_kernel``, ``combine_splits_kernel``: the
    *superset* specialisations of :func:`flash_attn.kernels.decode_configs.aot_variants` (every
    feature compiled in and exact when off, non-paged caches addressed as pages), for each dtype
    and head-dim bucket 64/128/256; their launch configs and argument types live there.

Pure Python (no torch, no triton import at module level) so that the selection logic is
unit-tested anywhere.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Iterable, Optional

from flash_attn.kernels import configs, decode_configs, registry

DTYPES = ("fp16", "bf16")
BLOCK_DS = (32, 64, 128, 256)
# The score-features variant starts at 64: head dims <= 32 run on it exactly (run-time head-dim mask).
FEATURE_BLOCK_DS = (64, 128, 256)
HEADDIM_DIVISOR = 8

# kernel function name -> (module, configs kind or None, constexpr flags fixed for the AOT build)
KERNELS: dict[str, tuple[str, Optional[str], dict]] = {
    "attn_fwd_kernel": ("flash_attn.kernels.forward", "fwd", dict(
        IS_VARLEN=True, IS_LOCAL=True, HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, IS_PAGED=False,
        PAD_HEADDIM=True, BlockTable=None, AlibiSlopes=None)),
    "attn_bwd_preprocess_kernel": ("flash_attn.kernels.backward", "fwd", dict(IS_VARLEN=True)),
    "attn_bwd_dkdv_kernel": ("flash_attn.kernels.backward", "bwd_dkdv", dict(
        IS_VARLEN=True, IS_LOCAL=True, HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, PAD_HEADDIM=True,
        AlibiSlopes=None)),
    "attn_bwd_dq_kernel": ("flash_attn.kernels.backward", "bwd_dq", dict(
        IS_VARLEN=True, IS_LOCAL=True, HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, PAD_HEADDIM=True,
        AlibiSlopes=None)),
}
# Kernels the launchers may call that have no AOT specialisation at all, and why.
NOT_SHIPPED = {
    "attn_probs_kernel": "return_attn_probs (a testing feature) is not compiled ahead of time",
}
# Call flags that no shipped specialisation serves, and why (value True means "needs a kernel").
UNSHIPPED_FLAGS = {
    "IS_PAGED": "paged K/V in the varlen forward",
}
# The score-features variant: these flags on together (each switched at run time in the kernel).
SCORE_FEATURES = dict(HAS_SOFTCAP=True, HAS_ALIBI=True, HAS_DROPOUT=True)
FEATURE_KERNELS = ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")

# Image architecture (compile target) -> config families whose launch configs it must carry.
_FAMILIES_BY_MAJOR = {8: ("sm80", "sm86"), 9: ("sm90",), 10: ("sm100",), 11: ("sm100",), 12: ("sm120",)}


def families_for(capability: tuple[int, int]) -> tuple[str, ...]:
    """Config families whose devices run an image compiled for ``capability``."""
    if capability[0] == 8 and capability[1] != 0:
        return ("sm86",)
    return _FAMILIES_BY_MAJOR.get(capability[0], (configs.arch_family(capability),))


def family_capability(family: str) -> tuple[int, int]:
    """A compute capability of ``family`` (to look up its configs)."""
    return {"sm80": (8, 0), "sm86": (8, 6), "sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}[family]


@dataclass(frozen=True)
class Spec:
    """One specialisation of one kernel (architecture-independent part)."""

    kernel: str
    dtype: str
    block_d: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    flags: tuple = field(default=(), compare=True)  # sorted (name, value) constexpr flags

    @property
    def constexprs(self) -> dict:
        out = dict(self.flags)
        names = _arg_names(self.kernel)
        out["BLOCK_D"] = self.block_d
        if "BLOCK_M" in names:
            out["BLOCK_M"] = self.block_m
        if "BLOCK_N" in names:
            out["BLOCK_N"] = self.block_n
        return out

    @property
    def key(self) -> str:
        """Stable, readable id (also the image file stem)."""
        flags = json.dumps(self.flags, sort_keys=True, default=str)
        digest = hashlib.sha1(flags.encode()).hexdigest()[:6]
        return (f"{self.kernel}.{self.dtype}.d{self.block_d}.m{self.block_m}n{self.block_n}"
                f"w{self.num_warps}s{self.num_stages}.{digest}")


def _arg_names(kernel: str) -> tuple[str, ...]:
    return registry.arg_names(kernel)  # read from the kernel source: no triton import


def kernel_function(kernel: str):
    """The ``@triton.jit`` function (imports triton)."""
    return registry.jit_function(kernel)


def variant_flags(kernel: str, features: bool) -> dict:
    """The constexpr flags of ``kernel``'s lean (``features=False``) or score-features variant."""
    _, _, flags = KERNELS[kernel]
    if not features:
        return dict(flags)
    out = {name: value for name, value in flags.items() if name != "AlibiSlopes"}  # a real pointer now
    out.update(SCORE_FEATURES)
    return out


def make_spec(kernel: str, dtype: str, block_d: int, config: configs.Config, features: bool = False) -> Spec:
    return Spec(kernel, dtype, block_d, config.block_m, config.block_n, config.num_warps, config.num_stages,
                tuple(sorted(variant_flags(kernel, features).items())))


DECODE_KERNELS = ("split_kv_kernel", "append_kv_kernel", "rotary_q_kernel", "combine_splits_kernel")
_BLOCK_FIELDS = ("BLOCK_D", "BLOCK_M", "BLOCK_N")


def decode_spec(kernel: str, dtype: str, constexprs: dict, config: configs.Config) -> Spec:
    """A KV-cache kernel's specialisation: every constexpr of the launch (``flags`` keeps those
    that are not block sizes) and its launch config."""
    flags = {k: v for k, v in constexprs.items() if k not in _BLOCK_FIELDS}
    return Spec(kernel, dtype, int(constexprs["BLOCK_D"]), int(constexprs.get("BLOCK_M", 0)),
                int(constexprs.get("BLOCK_N", 0)), config.num_warps, config.num_stages, tuple(sorted(flags.items())))


def decode_specs(family: str, dtype: str, block_d: Optional[int] = None) -> list[Spec]:
    """The KV-cache specialisations of ``family`` for ``dtype`` (one head-dim bucket, or all)."""
    return [decode_spec(kernel, dtype, constexprs, config)
            for kernel, constexprs, config in decode_configs.aot_variants(family)
            if block_d is None or constexprs["BLOCK_D"] == block_d]


def specs_for_capability(capability: tuple[int, int]) -> list[Spec]:
    """Every specialisation an image compiled for ``capability`` ships (deduplicated)."""
    out: list[Spec] = []
    for family in families_for(capability):
        for dtype in DTYPES:
            out.extend(spec for spec in decode_specs(family, dtype) if spec not in out)
    for family in families_for(capability):
        fcap = family_capability(family)
        for kernel, (_, kind, _) in KERNELS.items():
            for features in (False, True) if kernel in FEATURE_KERNELS else (False,):
                for dtype in DTYPES:
                    for block_d in FEATURE_BLOCK_DS if features else BLOCK_DS:
                        config = configs.pick_config(kind, block_d, fcap, features=features)
                        spec = make_spec(kernel, dtype, block_d, config, features)
                        if spec not in out:
                            out.append(spec)
    return out


# --- the argument contract ------------------------------------------------------------------------

_FP32_POINTERS = frozenset({"LSE", "Delta", "AlibiSlopes"})
_I32_POINTERS = frozenset({"CuSeqlensQ", "CuSeqlensK", "BlockTable"})
_FLOAT_ARGS = frozenset({"softmax_scale", "softcap", "dropout_p"})
_I64_ARGS = frozenset({"dropout_seed"})


def signature(spec: Spec) -> tuple[dict, dict]:
    """``(signature, attrs)`` for ``triton.compile(ASTSource(...))``: pointers ``*dtype`` (fp32 for
    LSE/Delta, i32 for cu_seqlens/block tables) declared 16-byte aligned, ``head_dim`` declared
    divisible by 8, strides/sizes/window ``i32``, seed ``i64``, scale/softcap/dropout ``fp32``.
    The KV-cache kernels declare theirs in :mod:`flash_attn.kernels.decode_configs`."""
    constexprs = spec.constexprs
    if spec.kernel in DECODE_KERNELS:
        return decode_configs.aot_signature(spec.kernel, spec.dtype, constexprs)
    sig, attrs = {}, {}
    for index, name in enumerate(_arg_names(spec.kernel)):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _FLOAT_ARGS:
            sig[name] = "fp32"
        elif name in _I64_ARGS:
            sig[name] = "i64"
        elif name.startswith("stride_") or name in ("seqlen_q", "seqlen_k", "group", "head_dim", "page_size",
                                                    "window_left", "window_right"):
            sig[name] = "i32"
            if name == "head_dim":
                attrs[(index,)] = [["tt.divisibility", HEADDIM_DIVISOR]]
        else:
            element = "fp32" if name in _FP32_POINTERS else "i32" if name in _I32_POINTERS else spec.dtype
            sig[name] = "*" + element
            attrs[(index,)] = [["tt.divisibility", 16]]
    return sig, attrs


def runtime_arg_names(kernel: str, constexprs: Iterable[str]) -> list[str]:
    names = set(constexprs)
    return [n for n in _arg_names(kernel) if n not in names]


# --- which specialisation a call needs -------------------------------------------------------------


def dtype_name(dtype) -> Optional[str]:
    text = str(dtype).replace("torch.", "")
    return {"float16": "fp16", "bfloat16": "bf16", "fp16": "fp16", "bf16": "bf16"}.get(text)


def unsupported_flags(flags: dict) -> Optional[str]:
    """Why a launch with the launcher's ``flags`` has no shipped specialisation, or ``None``."""
    missing = [what for name, what in UNSHIPPED_FLAGS.items() if flags.get(name)]
    if missing:
        return " and ".join(missing) + " (not compiled ahead of time)"
    return None


def spec_for_call(kernel: str, dtype, head_dim: int, config: configs.Config, flags: dict) -> tuple[Optional[Spec], str]:
    """The specialisation a launch maps onto, or ``(None, why not)``.

    ``flags`` are the launcher's constexpr flags for the call (``IS_LOCAL``, ``IS_VARLEN``...).
    """
    if kernel in NOT_SHIPPED:
        return None, NOT_SHIPPED[kernel]
    if kernel in DECODE_KERNELS:
        name = dtype_name(dtype)
        if name is None:
            return None, f"{dtype} inputs (the AOT kernels take fp16/bf16)"
        return decode_spec(kernel, name, flags, config), ""
    if kernel not in KERNELS:
        return None, f"{kernel} is not compiled ahead of time"
    name = dtype_name(dtype)
    if name is None:
        return None, f"{dtype} inputs (the AOT kernels take fp16/bf16)"
    if head_dim % HEADDIM_DIVISOR != 0 and head_dim > 0:
        return None, f"head dimension {head_dim} (the AOT kernels need a multiple of {HEADDIM_DIVISOR})"
    if head_dim > BLOCK_DS[-1]:
        return None, f"head dimension {head_dim} > {BLOCK_DS[-1]}"
    why = unsupported_flags(flags)
    if why:
        return None, why
    # kernels without the feature constexprs (backward preprocess) serve every call as they are
    features = kernel in FEATURE_KERNELS and any(flags.get(flag) for flag in SCORE_FEATURES)
    block_ds = FEATURE_BLOCK_DS if features else BLOCK_DS
    block_d = max(block_ds[0], configs.padded_headdim(head_dim))
    return make_spec(kernel, name, block_d, config, features), ""


def dense_as_varlen(names: list[str], values: dict, batch: int) -> dict:
    """Rebase a dense launch's batch strides so it runs exactly on the varlen specialisation.

    The varlen kernel addresses row ``i`` of sequence ``b`` at ``b * stride_b + (cu[b] + i) *
    stride_row``; with ``cu[b] = b * s`` the rebased ``stride_b - s * stride_row`` gives the dense
    address. Returns the changed values and the two ``cu_seqlens`` as ``("arange", batch, s)``
    requests (the caller makes the tensors). Rows are query rows for strides ending in ``m`` and
    the lse/delta (``stride_lb``, row stride 1), key rows for those ending in ``n``.
    """
    sq, sk = int(values["seqlen_q"]), int(values.get("seqlen_k", 0))
    out = {}
    for name in names:
        if not (name.startswith("stride_") and name.endswith("b")) or name in ("stride_ab", "stride_btb"):
            continue
        stem = name[len("stride_"):-1]
        if name == "stride_lb":
            out[name] = int(values[name]) - sq
        elif f"stride_{stem}m" in values:
            out[name] = int(values[name]) - sq * int(values[f"stride_{stem}m"])
        elif f"stride_{stem}n" in values:
            out[name] = int(values[name]) - sk * int(values[f"stride_{stem}n"])
        else:
            raise ValueError(f"no row stride for {name}")
    out["CuSeqlensQ"] = ("arange", batch, sq)
    if "CuSeqlensK" in names:
        out["CuSeqlensK"] = ("arange", batch, sk)
    return out
