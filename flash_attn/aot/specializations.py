"""The kernel specialisations compiled ahead of time: the whole set, in one reviewable place.

A specialisation is ``(kernel, dtype, constexprs, launch config) x image architecture``. The set is
pruned by one rule: *features that are cheap at run time are runtime arguments or exact
supersets, not new kernels* (each kept axis would double a build that must stay under 10
minutes and 50 MB). Per kernel, the flags every image fixes are in its declaration
(:mod:`flash_attn.planning.declarations`); the launch planner (:mod:`flash_attn.planning.plan`,
``Target(aot=True)``) plans every call onto exactly these.

Attention kernels (forward, backward preprocess, dK/dV, dQ):
    ``dtype`` fp16/bf16; ``BLOCK_D`` 32, 64, 128, 256 (the head dim's bucket: the feature mask uses
    the run-time ``head_dim``, declared a multiple of 8); the launch config of each family the image
    runs on (:func:`~flash_attn.planning.families.families_for`: the portable ``sm_80`` image also
    carries the ``sm86`` configs of consumer Ampere/Ada). Dense and varlen calls share one kernel (``packed`` is a run-time switch); causal,
    sliding-window and unmasked calls too (``IS_LOCAL`` with ``-1`` bounds is exact).
    Plus one *score-features* variant per kernel from ``BLOCK_D`` 64 up: softcap, ALiBi and
    dropout compiled in together, each switched at run time. And, on the families of
    ``declarations.EXACT_IMAGE_FAMILIES``, the *exact-call* images of the forward and the fused
    backward: full attention with an unpadded head dim, compiled without mask code, in their own
    launch config where the sweep measured one faster for them (``configs.pick(..., exact=True)``).
    Not shipped (the dispatcher falls back to Triton, else the reference): paged K/V in the varlen
    forward, ``return_attn_probs``, head dims that are not a multiple of 8.

KV-cache kernels (split-KV attention, append, rotary q, combine):
    the superset variants of :func:`flash_attn.planning.decode_configs.aot_variants`, for each
    dtype and head-dim bucket 64/128/256.

Pure Python (no torch, no triton import at module level).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional, Sequence

from flash_attn import limits
from flash_attn.planning import configs, declarations, decode_configs, families, registry
from flash_attn.planning.families import families_for

DTYPES = tuple(limits.KERNEL_DTYPES.values())
BLOCK_DS = configs.HEADDIM_BUCKETS
FEATURE_BLOCK_DS = configs.FEATURE_BUCKETS
# The kernels compiled ahead of time, from their declarations: attention kernels are sized by the
# launch-config tables, the KV-cache kernels by decode_configs.
ATTENTION_KERNELS = tuple(k.name for k in declarations.KERNELS.values() if k.ships and k.config_kind is not None)
DECODE_KERNELS = tuple(k.name for k in declarations.KERNELS.values() if k.ships and k.config_kind is None)
_BLOCK_FIELDS = ("BLOCK_D", "BLOCK_M", "BLOCK_N")


def family_capability(family: str) -> tuple[int, int]:
    """A compute capability whose image carries ``family``'s configs: the one its images are
    compiled for."""
    return families.get(family).image_capability


@dataclass(frozen=True)
class Spec:
    """One specialisation of one kernel (the architecture-independent part)."""

    kernel: str
    dtype: str
    block_d: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    flags: tuple = field(default=(), compare=True)  # sorted (name, value): every other constexpr

    @classmethod
    def of(cls, kernel: str, dtype: str, constexprs: dict, config: configs.Config) -> "Spec":
        """The specialisation of a launch: its constexprs and launch config."""
        flags = {k: v for k, v in constexprs.items() if k not in _BLOCK_FIELDS}
        return cls(kernel, dtype, int(constexprs["BLOCK_D"]), int(constexprs.get("BLOCK_M", 0)),
                   int(constexprs.get("BLOCK_N", 0)), config.num_warps, config.num_stages, tuple(sorted(flags.items())))

    @property
    def constexprs(self) -> dict:
        out = dict(self.flags)
        out["BLOCK_D"] = self.block_d
        if self.block_m:
            out["BLOCK_M"] = self.block_m
        if self.block_n:
            out["BLOCK_N"] = self.block_n
        return out

    @property
    def key(self) -> str:
        """Stable, readable id (also the image file stem)."""
        flags = json.dumps(self.flags, sort_keys=True, default=str)
        digest = hashlib.sha1(flags.encode()).hexdigest()[:6]
        return (f"{self.kernel}.{self.dtype}.d{self.block_d}.m{self.block_m}n{self.block_n}"
                f"w{self.num_warps}s{self.num_stages}.{digest}")


def kernel_function(kernel: str):
    """The ``@triton.jit`` function (imports triton)."""
    return registry.jit_function(kernel)


def attention_spec(kernel: str, dtype: str, block_d: int, config: configs.Config, family: str,
                   features: bool = False, exact: bool = False, block_dv: Optional[int] = None) -> Spec:
    """The ahead-of-time specialisation of one attention kernel for devices of ``family``: its
    folded flags (or, ``exact``, those of its exact-call image), blocks (v's ``block_dv``, default
    ``block_d``) and config."""
    decl = declarations.get(kernel)
    flags = decl.exact_constexprs() if exact else decl.aot_constexprs(features)
    return Spec.of(kernel, dtype, {**flags, **decl.tile_constexprs(block_d, config, family, block_dv)}, config)


def head_dim_pairs(family: str, features: bool, block_ds: Sequence[int] = BLOCK_DS,
                   jit: bool = False) -> list[tuple[int, int]]:
    """The ``(BLOCK_D, BLOCK_DV)`` pairs of ``family``'s attention images (of the score-features
    variant where ``features``): the square ones of the buckets it ships, then the declared pairs
    (:func:`~flash_attn.planning.declarations.ships_head_dims`), within ``block_ds``. ``jit``: the
    square ones of every bucket, shipped or not (what a JIT compiles: AMD's report)."""
    squares = [(d, d) for d in (FEATURE_BLOCK_DS if features else BLOCK_DS) if d in block_ds]
    if jit:
        return squares
    pairs = [pair for pair in declarations.HEAD_DIM_PAIR_IMAGES if pair[0] in block_ds]
    return [pair for pair in squares + pairs if declarations.ships_head_dims(family, *pair, features)]


def attention_specs(family: str, dtype: str, block_ds: Sequence[int] = BLOCK_DS,
                    with_features: bool = True) -> list[Spec]:
    """The attention kernels' specialisations for devices of ``family``: per kernel, the lean
    variant for every head-dim pair (:func:`head_dim_pairs`) and (forward, dK/dV, dQ) the
    score-features variant; each with the launch config the planner picks for that family, head
    dims and variant. ``block_ds`` and ``with_features`` narrow it (``bench tune`` builds one head
    dim's lean kernels)."""
    return [spec for spec, _ in attention_launches(family, dtype, block_ds, with_features)]


def attention_launches(family: str, dtype: str, block_ds: Sequence[int] = BLOCK_DS,
                       with_features: bool = True, jit: bool = False) -> list[tuple[Spec, configs.Config]]:
    """:func:`attention_specs` with the launch config of each (its compiler options beyond
    ``num_warps`` and ``num_stages``: :func:`flash_attn.planning.configs.compiler_options`);
    ``jit``: every square head-dim bucket, as :func:`head_dim_pairs`."""
    out = []
    block_ds = [d for d in block_ds if configs.refusal(d, family) is None]  # a bucket the family does not run
    for kernel in ATTENTION_KERNELS:
        decl = declarations.get(kernel)
        for features in (False, True) if decl.has_features and with_features else (False,):
            for block_d, block_dv in head_dim_pairs(family, features, block_ds, jit):
                widest = max(block_d, block_dv)
                fused = any(configs.fused_backward(widest, family, f) for f in (False, True))
                if kernel == "attn_bwd_dq_convert_kernel" and not fused:
                    continue  # only the fused backward needs it
                config = configs.pick(decl.config_kind, widest, family, features)
                if config is None:  # the split kernels serve this head dim (configs.fused_backward)
                    continue
                out.append((attention_spec(kernel, dtype, block_d, config, family, features, block_dv=block_dv),
                            config))
                if not features and decl.ships_exact_image(family, block_d, dtype, block_dv):
                    exact_config = configs.pick(decl.config_kind, widest, family, exact=True)
                    out.append((attention_spec(kernel, dtype, block_d, exact_config, family, exact=True), exact_config))
    return out


def decode_specs(family: str, dtype: str, block_d: Optional[int] = None) -> list[Spec]:
    """The KV-cache specialisations of ``family`` for ``dtype`` (one head-dim bucket, or all)."""
    return [Spec.of(kernel, dtype, constexprs, config)
            for kernel, constexprs, config in decode_configs.aot_variants(family)
            if block_d is None or constexprs["BLOCK_D"] == block_d]


def specs_for_capability(capability: tuple[int, int]) -> list[Spec]:
    """Every specialisation an image compiled for ``capability`` ships (deduplicated)."""
    out: dict[Spec, None] = {}
    for family in families_for(capability):
        for dtype in DTYPES:
            out.update(dict.fromkeys(decode_specs(family, dtype)))
            out.update(dict.fromkeys(attention_specs(family, dtype)))
    return list(out)


def signature(spec: Spec) -> tuple[dict, dict]:
    """``(signature, attrs)`` for ``triton.compile(ASTSource(...))``, from the kernel's declaration:
    constexprs as ``"constexpr"``, pointers typed and declared 16-byte aligned, the declared
    integers divisible by 8."""
    decl = declarations.get(spec.kernel)
    constexprs = spec.constexprs
    sig, attrs = {}, {}
    for index, name in enumerate(registry.arg_names(spec.kernel)):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in decl.pointers:
            sig[name] = decl.pointer_type(name, spec.dtype)
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = decl.scalar_type(name)
            if name in decl.divisible_by_8:
                attrs[(index,)] = [["tt.divisibility", 8]]
    return sig, attrs


dtype_name = declarations.dtype_name
