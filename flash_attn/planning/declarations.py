"""One declaration per kernel: what every other part of the package needs to know about it.

The registry (kernel name -> module), the launch planner (argument kinds), the specialisation
set and the ahead-of-time build (signature types, divisibility, the flags folded into every
shipped image) all read these. The kernel's parameters themselves are stated once, by its
``@triton.jit`` ``def``, and read from there without Triton (:attr:`Kernel.parameters`,
:mod:`flash_attn.planning.signatures`).

Types: pointers name their element type, ``"dt"`` standing for the q/k/v dtype (fp16 or bf16);
runtime integers are ``i32`` (sizes, strides, window bounds, switches), floats ``fp32``. Every
pointer is 16-byte aligned and the integers in ``divisible_by_8`` are multiples of 8, which the
planner guarantees (it copies inputs that are not laid out that way) and the compiled images
assume.

Pure Python: no torch, no triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional

from flash_attn import limits
from flash_attn.planning import configs, families, signatures

__all__ = ["EXACT_IMAGE_BLOCK_DS", "EXACT_IMAGE_DTYPES", "EXACT_IMAGE_FAMILIES", "HEAD_DIM_PAIR_IMAGES",
           "BUCKET_IMAGE_FAMILIES", "Kernel", "KERNELS", "get", "listed", "ships_head_dims"]


# q/k/v dtype names (torch's without "torch.", and the kernels' own) -> the kernels' name
_DTYPE_NAMES = {**{name.replace("torch.", ""): short for name, short in limits.KERNEL_DTYPES.items()},
                **{short: short for short in limits.KERNEL_DTYPES.values()}}


def dtype_name(dtype) -> Optional[str]:
    """``"fp16"``/``"bf16"`` (:data:`flash_attn.limits.KERNEL_DTYPES`) for a q/k/v dtype (a
    ``torch.dtype`` or its name), else ``None``."""
    return _DTYPE_NAMES.get(str(dtype).replace("torch.", ""))


def _names(text: str) -> frozenset:
    return frozenset(text.split())


@dataclass(frozen=True)
class Kernel:
    name: str
    module: str
    # which launch-config table (flash_attn.planning.configs) sizes its blocks; None: the KV-cache
    # kernels, sized by flash_attn.planning.decode_configs
    config_kind: Optional[str]
    pointers: Mapping[str, str]  # argument -> element type ("dt", "fp32", "i32", "i64")
    floats: frozenset = frozenset()  # fp32 scalars; every other runtime scalar is i32
    divisible_by_8: frozenset = frozenset()
    # constexprs every ahead-of-time image of it fixes (pointers fixed to None are not passed)
    folded: Mapping[str, object] = field(default_factory=dict)
    # its score-features variant (softcap, ALiBi and dropout compiled in, each switched at run
    # time by softcap > 0, use_alibi, dropout_p > 0): whether there is one
    has_features: bool = False
    # the flags of its exact-call images: lean calls whose flags have these values (no window or
    # causal mask, a head dim equal to BLOCK_D) run an image compiled for exactly that, on the
    # families, head dims and dtypes of EXACT_IMAGE_*; every other call runs the folded image
    exact: Mapping[str, object] = field(default_factory=dict)
    # compiled ahead of time; False: Triton's JIT and interpreter only (a testing feature)
    ships: bool = True

    @property
    def parameters(self) -> signatures.Parameters:
        """Its parameters as its source declares them (read once, without Triton)."""
        return signatures.parameters(self.module, self.name)

    @property
    def arg_names(self) -> tuple:
        """Every parameter in the kernel's order (``JITFunction.arg_names``)."""
        return self.parameters.names

    @property
    def constexprs(self) -> frozenset:
        """The parameters annotated ``tl.constexpr``."""
        return self.parameters.constexprs

    def ships_exact_image(self, family: str, block_d: int, dtype, block_dv: Optional[int] = None) -> bool:
        """Whether an exact-call image of this kernel ships for ``family``, ``block_d`` (and v's
        ``block_dv``: the exact images are square, q, k and v of one head dim) and ``dtype`` (a
        ``torch.dtype`` or its name)."""
        return (bool(self.exact) and listed(family, EXACT_IMAGE_FAMILIES) and block_d in EXACT_IMAGE_BLOCK_DS
                and block_dv in (None, block_d) and dtype_name(dtype) in EXACT_IMAGE_DTYPES)

    def serves_exactly(self, flags: Mapping[str, object]) -> bool:
        """Whether a call with these constexpr flags is one its exact-call image serves."""
        return bool(self.exact) and all(flags[name] == value for name, value in self.exact.items())

    def exact_constexprs(self) -> dict:
        """The constexprs of its exact-call image (:attr:`folded` with :attr:`exact` on top)."""
        if not self.exact:
            raise ValueError(f"{self.name} has no exact-call image")
        return {**self.folded, **self.exact}

    def tile_constexprs(self, block_d: int, config: "configs.Config", family: str,
                        block_dv: Optional[int] = None) -> dict:
        """The constexprs a launch config fixes on ``family`` (the planner's launch and the
        build's image agree through this): the blocks it declares (``block_dv``: v's head-dim
        block, default ``block_d``), the fused backward's gradient columns
        (:func:`configs.gradient_columns`), its tensor-descriptor switches
        (:func:`configs.uses_tma`, :func:`configs.uses_dq_tma`) and warp specialisation
        (:func:`configs.uses_ws`)."""
        declared = self.constexprs
        block_dv = block_d if block_dv is None else block_dv
        out = {"BLOCK_M": config.block_m, "BLOCK_D": block_d}
        if "BLOCK_DV" in declared:
            out["BLOCK_DV"] = block_dv
        if "BLOCK_DVOUT" in declared:
            out["BLOCK_DVOUT"] = configs.output_columns(block_dv)
        if "BLOCK_N" in declared:
            out["BLOCK_N"] = config.block_n
        if "BLOCK_DOUT" in declared:
            out["BLOCK_DOUT"] = configs.gradient_columns(self.config_kind, family, block_d, block_dv)
        if "TMA" in declared:
            out["TMA"] = configs.uses_tma(self.config_kind, family, config)
        if "WS" in declared:
            out["WS"] = configs.uses_ws(self.config_kind, family, config)
        if "TMA_DQ" in declared:
            out["TMA_DQ"] = configs.uses_dq_tma(self.config_kind, family, config)
        return out

    def pointer_type(self, name: str, dtype: str) -> str:
        """Triton type of pointer ``name`` for q/k/v of ``dtype`` ("fp16"/"bf16")."""
        element = self.pointers[name]
        return "*" + (dtype if element == "dt" else element)

    def scalar_type(self, name: str) -> str:
        return "fp32" if name in self.floats else "i32"

    def aot_constexprs(self, features: bool = False) -> dict:
        """The constexprs an ahead-of-time image fixes: :attr:`folded`, and for the score-features
        variant the three features on and their pointers (slopes, seed) passed again."""
        if not features:
            return dict(self.folded)
        if not self.has_features:
            raise ValueError(f"{self.name} has no score-features variant")
        out = {k: v for k, v in self.folded.items() if k not in _FEATURE_POINTERS}
        out.update(_FEATURE_FLAGS)
        return out


def _pointers(**groups: str) -> Mapping[str, str]:
    return MappingProxyType({name: element for element, names in groups.items() for name in names.split()})


_FEATURE_FLAGS = MappingProxyType(dict(HAS_SOFTCAP=True, HAS_ALIBI=True, HAS_DROPOUT=True))
_FEATURE_POINTERS = ("AlibiSlopes", "DropoutSeed")
_LEAN = dict(IS_LOCAL=True, HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, PAD_HEADDIM=True,
             AlibiSlopes=None, DropoutSeed=None)
_ATTENTION_FLOATS = _names("softmax_scale softcap dropout_p")
# Full attention with an unpadded head dim: no mask code and no head-dim masks at all (the JIT,
# which specialises exactly, ran 10-30 % faster than the folded images on an H100 at 16k tokens).
_EXACT = MappingProxyType(dict(IS_LOCAL=False, PAD_HEADDIM=False))
# Where the exact-call images ship: family -> whether it does (a family not listed takes its nearest
# config parent's answer, :func:`listed`), and the head dims (each costs a compile per head dim and
# dtype, and the build has a 10-minute budget). Hopper measured them faster; the mma.sync families
# (A100, RTX 30-50) take them by the same design, read from compiles (not measured); Blackwell's
# JIT runs exact calls on its lean tiles.
EXACT_IMAGE_FAMILIES: Mapping[str, bool] = MappingProxyType({"sm80": True, "sm86": True, "sm90": True,
                                                              "sm100": False})
# d256 too: the fused backward's exact image has a quarter less code and 74 spill instructions in
# its loop against the folded one's 89 (benchmarks/README.md), for ~3 s of compile per image
EXACT_IMAGE_BLOCK_DS = frozenset({64, 128, 256})
# every kernel dtype, fp16 too: on the H200 (2026-11-27) full attention in fp16, on the folded
# images, ran 5-14 % behind bf16 on its exact-call images at d64 and d256, where causal calls
# (folded in both) ran alike
EXACT_IMAGE_DTYPES = frozenset(limits.KERNEL_DTYPES.values())

# The head-dim buckets whose attention images ship for some families only, lean variant (every
# other bucket ships for every family, both variants): each costs a compile per kernel, variant and
# dtype, within the build's budget. Family -> whether it ships; a family not listed takes the answer
# of its nearest config parent that is (families.lineage), as its launch configs do; none: no.
# Blackwell takes Hopper's tables but not these images: its compiles at head dim 512 are the
# build's slowest, and its tiles there are not measured (the JIT runs those calls).
BUCKET_IMAGE_FAMILIES: Mapping[int, Mapping[str, bool]] = MappingProxyType(
    {512: MappingProxyType({"sm80": True, "sm90": True, "sm100": False})})
# The (BLOCK_D, BLOCK_DV) pairs of the attention images besides the square ones (q, k and v of one
# head dim), lean variant, and where they ship (as above): DeepSeek's 192/128 (and 256/128)
# training shape. Any other pair runs on the square image of its wider head dim, the narrower
# one's columns masked at run time (exact).
HEAD_DIM_PAIR_IMAGES: Mapping[tuple, Mapping[str, bool]] = MappingProxyType(
    {(256, 128): MappingProxyType({"sm80": True, "sm90": True, "sm100": False})})


def listed(family: str, table: Mapping[str, bool]) -> bool:
    """``family``'s answer in a table of family -> bool: its own, else its nearest config parent's,
    else no."""
    for name in families.lineage(family):
        if name in table:
            return table[name]
    return False


def ships_head_dims(family: str, block_d: int, block_dv: int, features: bool = False) -> bool:
    """Whether the attention images of ``family`` include the head-dim pair ``(block_d, block_dv)``
    (of the score-features variant where ``features``)."""
    if block_d == block_dv:
        table = BUCKET_IMAGE_FAMILIES.get(block_d)
        return table is None or (not features and listed(family, table))
    return not features and listed(family, HEAD_DIM_PAIR_IMAGES.get((block_d, block_dv), {}))

_DECLARED = (
    Kernel("attn_fwd_kernel", "flash_attn.kernels.forward", "fwd",
           _pointers(dt="Q K V Out QV", fp32="LSE AlibiSlopes Sinks", i32="CuSeqlensQ CuSeqlensK BlockTable",
                     i64="DropoutSeed"),
           _ATTENTION_FLOATS, _names("head_dim head_dim_v"),
           folded=MappingProxyType(dict(_LEAN, IS_PAGED=False, BlockTable=None, HAS_QV=False, QV=None)),
           has_features=True, exact=_EXACT),
    Kernel("attn_probs_kernel", "flash_attn.kernels.forward", "fwd",
           _pointers(dt="Q K", fp32="LSE S AlibiSlopes", i32="CuSeqlensQ CuSeqlensK BlockTable", i64="DropoutSeed"),
           _ATTENTION_FLOATS, _names("head_dim"), ships=False),
    Kernel("attn_bwd_preprocess_kernel", "flash_attn.kernels.backward", "fwd",
           _pointers(dt="Out dOut", fp32="Delta dQAccum", i32="CuSeqlensQ"), divisible_by_8=_names("head_dim head_dim_v")),
    Kernel("attn_bwd_kernel", "flash_attn.kernels.backward", "bwd_fused",
           _pointers(dt="Q K V dOut dK dV", fp32="LSE Delta dQAccum AlibiSlopes", i32="CuSeqlensQ CuSeqlensK",
                     i64="DropoutSeed"),
           _ATTENTION_FLOATS, _names("head_dim head_dim_v"), folded=MappingProxyType(_LEAN), has_features=True,
           exact=_EXACT),
    Kernel("attn_bwd_dq_convert_kernel", "flash_attn.kernels.backward", "fwd",
           _pointers(dt="dQ", fp32="dQAccum", i32="CuSeqlensQ"), _names("softmax_scale"), _names("head_dim")),
    Kernel("attn_bwd_dkdv_kernel", "flash_attn.kernels.backward", "bwd_dkdv",
           _pointers(dt="Q K V dOut dK dV", fp32="LSE Delta AlibiSlopes", i32="CuSeqlensQ CuSeqlensK", i64="DropoutSeed"),
           _ATTENTION_FLOATS, _names("head_dim head_dim_v"), folded=MappingProxyType(_LEAN), has_features=True),
    Kernel("attn_bwd_dq_kernel", "flash_attn.kernels.backward", "bwd_dq",
           _pointers(dt="Q K V dOut dQ", fp32="LSE Delta AlibiSlopes", i32="CuSeqlensQ CuSeqlensK", i64="DropoutSeed"),
           _ATTENTION_FLOATS, _names("head_dim head_dim_v"), folded=MappingProxyType(_LEAN), has_features=True),
    # The KV-cache kernels ship one "superset" variant (every feature compiled in, switched at run
    # time; plain caches addressed as one page per sequence): flash_attn.planning.decode_configs.
    Kernel("split_kv_kernel", "flash_attn.kernels.decode", None,
           _pointers(dt="Q K V Out QV K_new V_new", fp32="OutPart Lse Alibi Sinks",
                     i32="Seqlens Leftpad BatchIdx BlockTable"),
           _names("softmax_scale softcap empty_lse"),
           _names("stride_qb stride_qs stride_qh stride_kb stride_ks stride_kh stride_vb stride_vs stride_vh "
                  "stride_ob stride_os stride_oh stride_px stride_pb stride_ps stride_ph stride_qvb stride_qvs "
                  "stride_qvh stride_knb stride_kns stride_knh stride_vnb stride_vns stride_vnh head_dim head_dim_v"),
           folded=MappingProxyType(dict(IS_LOCAL=True, HAS_SOFTCAP=True, HAS_ALIBI=True, PAGED=True,
                                        HAS_BATCH_IDX=False, HAS_LEFTPAD=True))),
    Kernel("combine_splits_kernel", "flash_attn.kernels.decode", None,
           _pointers(dt="Out", fp32="OutPart LsePart Lse Sinks"),
           divisible_by_8=_names("stride_px stride_pb stride_ps stride_ph stride_ob stride_os stride_oh head_dim")),
    Kernel("append_kv_kernel", "flash_attn.kernels.kvcache_append", None,
           _pointers(dt="K_new V_new K_cache V_cache", fp32="Cos Sin", i32="Seqlens BatchIdx BlockTable"),
           divisible_by_8=_names("stride_knb stride_kns stride_knh stride_vnb stride_vns stride_vnh "
                                 "stride_kcb stride_kcs stride_kch stride_vcb stride_vcs stride_vch head_dim "
                                 "head_dim_v"),
           folded=MappingProxyType(dict(PAGED=True, HAS_BATCH_IDX=False))),
    Kernel("rotary_q_kernel", "flash_attn.kernels.kvcache_append", None,
           _pointers(dt="Q Q_out", fp32="Cos Sin", i32="Seqlens"),
           divisible_by_8=_names("stride_qb stride_qs stride_qh stride_ob stride_os stride_oh head_dim")),
)

KERNELS: Mapping[str, Kernel] = MappingProxyType({k.name: k for k in _DECLARED})


def get(name: str) -> Kernel:
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"unknown kernel {name!r}; declared: {', '.join(KERNELS)}") from None
