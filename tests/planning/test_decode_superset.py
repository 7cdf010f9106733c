"""The ahead-of-time KV-cache launches: the fixed superset specialisations an AOT build ships.

The planner's ahead-of-time target (``Target(aot=True)``, :func:`flash_attn.planning.plan.plan_kvcache`)
launches only the ``(kernel, constexprs, config)`` combinations of
:func:`flash_attn.planning.decode_configs.aot_variants`, with every tensor argument laid out as the
kernels' declarations say. Checked here, in Triton's interpreter:

* exactness: the feature matrix of ``kernels/test_triton_decode.py`` (``support/kvcache_cases.py``)
  against the float64 oracle
  (and bit-for-bit against the specialised launches on a few cases);
* the set: a recording executor runs the launches a GPU family (sm80, sm90) would get and checks
  each one against the shipped specialisations and each runtime argument against the kernel's
  declaration (types, int32 range, alignment, declared divisibility);
* the refusals: layouts the images cannot serve are refused before any launch, leaving the cache
  untouched.
"""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from flash_attn.aot import specializations as S
from flash_attn.backends import interpret
from flash_attn.backends._execute import KernelsCannotRun
from flash_attn.planning import declarations, decode_configs as dc, plan, registry

from support.kvcache_cases import CASES, DTYPES, MODES, SPLIT_CASES, Case, check_case, make_inputs, run_kernels

KERNELS = ("split_kv_kernel", "append_kv_kernel", "rotary_q_kernel", "combine_splits_kernel")
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32"}

# head dims that are not a multiple of 8 are refused (test_refuses_what_it_cannot_serve)
SUPERSET_CASES = {name: case for name, case in CASES.items() if case.headdim % 8 == 0}
SUPERSET_CASES["d256_neox_causal"] = Case(seqlens=(33, 50), nheads=2, nheads_k=1, headdim=256, seqlen_cache=64,
                                          seqlen_new=1, rotary="neox", causal=True)


def superset(mode: str, family: str = "") -> plan.Target:
    """The ahead-of-time target: ``family``'s configs (default: the mode's own)."""
    if mode == "interpret":
        return plan.Target(family or "interpret", dc.INTERPRET_NUM_SMS, aot=True)
    from flash_attn.backends import triton as gpu

    own = gpu._target(torch.device("cuda"))
    return plan.Target(family or own.family, own.sm_count, aot=True)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values in storage shifted by one element (not 16-byte aligned)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16
    return out


class Recorder:
    """Runs launches in the interpreter, recording each with the tensors it got."""

    def __init__(self):
        self.launches = []

    def __call__(self, launch, tensors, device=None):
        args = [(name, tensors[v] if isinstance(v, plan.Slot) else v) for name, v in launch.args]
        self.launches.append((launch, args))
        interpret.run_launch(launch, tensors, device)


def check_launches(launches, family: str, dtype) -> set:
    """Every launch is a specialisation the build ships for ``family`` and its arguments honour
    the kernel's declaration. Returns the kernels seen."""
    dt = _DTYPE_NAMES[dtype]
    shipped = set(S.decode_specs(family, dt))
    for launch, args in launches:
        spec = S.Spec.of(launch.kernel, dt, launch.constexprs, launch.config)
        assert spec in shipped, f"{family}: {spec.key} is not shipped"
        decl = declarations.get(launch.kernel)
        for name, value in args:
            if name in decl.pointers:
                assert isinstance(value, torch.Tensor), (launch.kernel, name)
                assert "*" + _DTYPE_NAMES[value.dtype] == decl.pointer_type(name, dt), (launch.kernel, name, value.dtype)
                assert value.data_ptr() % 16 == 0, f"{launch.kernel}.{name} is not 16-byte aligned"
            elif decl.scalar_type(name) == "i32":
                assert isinstance(value, int) and not isinstance(value, bool), (launch.kernel, name, value)
                assert -(2**31) <= value < 2**31, (launch.kernel, name, value)
                if name in decl.divisible_by_8:
                    assert value % 8 == 0, f"{launch.kernel}.{name} = {value}: not its declared divisibility"
            else:
                assert isinstance(value, float), (launch.kernel, name, value)
    return {launch.kernel for launch, _ in launches}


# ---------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SUPERSET_CASES))
def test_superset_matches_oracle(name, dtype, mode):
    check_case(SUPERSET_CASES[name], dtype, mode, target=superset(mode))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_superset_num_splits(name, splits, dtype, mode):
    check_case(SPLIT_CASES[name], dtype, mode, num_splits=splits, target=superset(mode))


@pytest.mark.parametrize("name", ["plain_d64", "batch_idx_leftpad", "window_softcap", "paged16_causal"])
def test_superset_is_bitwise_the_specialised_kernel(name):
    """Neutral values (zero slopes, softcap off, -1 window bounds, a non-paged cache as pages, zero
    left padding) change nothing, not even the rounding (the interpreter's arithmetic)."""
    case = CASES[name]
    results = []
    for target in (None, superset("interpret")):
        args = make_inputs(case, torch.float16, torch.device("cpu"))
        out, lse = run_kernels(case, args, "interpret", target=target)
        results.append((out, lse, args["k_cache"], args["v_cache"]))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# The launches are the shipped set

FAMILY_CASES = {
    # rotary per row (causal), interleaved; splits + combine
    "causal_sq3_interleaved": (CASES["causal_sq3_interleaved"], 0),
    # GQA decode on pages, rotary at one position (GPT-NeoX), 3 splits
    "decode_gqa_paged": (SPLIT_CASES["decode_gqa_paged"], 3),
    # the many-rows config, head dim 32 on BLOCK_D 64, one split (direct output)
    "many_rows_gqa": (CASES["many_rows_gqa"], 1),
    # head dim 128 bucket, ALiBi per batch + softcap, cache_batch_idx + leftpad, no rotary
    "d128_alibi_softcap_batch_idx": (Case(seqlens=(25, 60), alibi="batch", softcap=5.0, headdim=128, batch_idx=True,
                                          leftpad=(2, 0), seqlen_new=2, nheads=4, nheads_k=2), 0),
    "d256": (SUPERSET_CASES["d256_neox_causal"], 0),
    # v's own head dim (192/128: the 256 bucket), sinks in the split kernel (one split) and in the combine
    "dv128_sinks_one_split": (Case(seqlens=(30, 61), nheads=4, nheads_k=2, headdim=192, headdim_v=128, seqlen_new=2,
                                   rotary="neox", causal=True, sinks=True), 1),
    "sinks_gqa_dv_splits": (SPLIT_CASES["sinks_gqa_dv"], 3),
}


@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_launches_are_aot_variants(name, family):
    """The interpreter runs the very launches (configs included) a GPU of ``family`` gets."""
    case, splits = FAMILY_CASES[name]
    recorder = Recorder()
    check_case(case, torch.float16, "interpret", num_splits=splits, target=superset("interpret", family),
               run_launch=recorder)
    kernels = check_launches(recorder.launches, family, torch.float16)
    splits_run = next(launch.grid[1] for launch, _ in recorder.launches if launch.kernel == "split_kv_kernel")
    assert ("combine_splits_kernel" in kernels) == (splits_run > 1)
    if name == "decode_gqa_paged":
        assert splits_run > 1  # the combine is among the checked launches


@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_launches_hopper_images(splits):
    """MLA decoding (q 64 + qv 512 against 64- and 512-wide caches, a token appended with rotary,
    sinks) runs on Hopper's own images (HAS_QV, head dims 64/512) and is refused elsewhere, before
    anything runs."""
    case = CASES["mla_qv_64_512"]
    recorder = Recorder()
    check_case(case, torch.bfloat16, "interpret", num_splits=splits, target=superset("interpret", "sm90"),
               run_launch=recorder)
    assert "split_kv_kernel" in check_launches(recorder.launches, "sm90", torch.bfloat16)
    split = next(launch for launch, _ in recorder.launches if launch.kernel == "split_kv_kernel")
    assert split.constexprs["HAS_QV"] and (split.constexprs["BLOCK_D"], split.constexprs["BLOCK_DV"]) == (64, 512)
    for family in ("sm80", "sm100", "sm120"):
        args = make_inputs(case, torch.bfloat16, torch.device("cpu"))
        with pytest.raises(KernelsCannotRun, match="qv with head dims 64/512"):
            run_kernels(case, args, "interpret", target=superset("interpret", family))


def test_head_dim_512_decodes_on_the_jit():
    """A square head dim 512 KV-cache call is not compiled ahead of time (the JIT runs it)."""
    case = Case(seqlens=(20, 37), headdim=512, nheads=2, nheads_k=1, seqlen_new=1)
    args = make_inputs(case, torch.float16, torch.device("cpu"))
    with pytest.raises(KernelsCannotRun, match="head dimension 512 in the KV-cache call"):
        run_kernels(case, args, "interpret", target=superset("interpret", "sm90"))
    check_case(case, torch.float16, "interpret")


# The exact-call image of the plain decoding step (decode_configs.SPLIT_KV_EXACT): which calls it
# serves on a family that ships it, and that it serves them exactly (interpreter vs oracle).
EXACT_CASES = {
    # one query row, causal (masks nothing), GQA, a new key appended with rotary, 3 splits
    "decode_causal_rotary": (Case(seqlens=(70, 200), nheads=8, nheads_k=2, seqlen_cache=256, seqlen_new=1,
                                  rotary="neox", causal=True), 3, True),
    "decode_d128_one_split": (Case(seqlens=(5, 33), headdim=128, nheads=4, nheads_k=4), 1, True),
    "decode_d256": (Case(seqlens=(40, 17), headdim=256, nheads=2, nheads_k=1, seqlen_new=1), 0, True),
    # not served: three causal rows (masked), paged, a left window, ALiBi, softcap, cache_batch_idx
    "causal_three_rows": (Case(seqlens=(30, 41), seqlen_q=3, seqlen_new=3, causal=True), 0, False),
    "paged": (Case(seqlens=(70, 200), seqlen_cache=256, page_size=16, seqlen_new=1), 0, False),
    "left_window": (Case(seqlens=(30, 41), window=(8, 0)), 0, False),
    "alibi": (Case(seqlens=(30, 41), alibi="heads"), 0, False),
    "softcap": (Case(seqlens=(30, 41), softcap=4.0), 0, False),
    "batch_idx": (Case(seqlens=(30, 41), batch_idx=True), 0, False),
}


@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_the_plain_decoding_step_runs_the_exact_image(name, family):
    case, splits, served = EXACT_CASES[name]
    recorder = Recorder()
    check_case(case, torch.bfloat16, "interpret", num_splits=splits, target=superset("interpret", family),
               run_launch=recorder)
    check_launches(recorder.launches, family, torch.bfloat16)
    flags = next(launch.constexprs for launch, _ in recorder.launches if launch.kernel == "split_kv_kernel")
    expected = dc.SPLIT_KV_EXACT if served and dc.ships_exact(family) else dc.SPLIT_KV_SUPERSET
    assert {k: flags[k] for k in expected} == expected


def test_misaligned_inputs_are_made_ready():
    """Misaligned inputs are copied into the declared layout (the result stays exact); a size-1
    cache dimension with an odd stride is fine (its stride is passed as 0)."""
    case = Case(seqlens=(20, 37), nheads=4, nheads_k=1, seqlen_new=2, rotary="neox", alibi="batch", leftpad=(3, 0),
                batch_idx=True, causal=True, dtype_tables=True)

    def transform(args):
        args = dict(args)
        for name in ("q", "k", "v", "cache_seqlens", "cache_leftpad", "cache_batch_idx", "alibi_slopes",
                     "rotary_cos", "rotary_sin"):
            args[name] = _misaligned(args[name])
        for name in ("k_cache", "v_cache"):  # (b, s, 1, d) with head stride 3
            t = args[name]
            odd = torch.empty_strided(t.shape, (t.stride(0), t.stride(1), 3, 1), dtype=t.dtype)
            odd.copy_(t)
            args[name] = odd
        return args

    recorder = Recorder()
    for dtype in (torch.float16, torch.bfloat16):
        check_case(case, dtype, "interpret", transform=transform, target=superset("interpret", "sm80"),
                   run_launch=recorder)
        kernels = check_launches(recorder.launches, "sm80", dtype)
        assert {"append_kv_kernel", "rotary_q_kernel", "split_kv_kernel"} <= kernels
        recorder.launches.clear()


def _padded_cache(args):
    """Caches that are views of a buffer 4 features wider: head stride d + 4, not a multiple of 8."""
    args = dict(args)
    for name in ("k_cache", "v_cache"):
        t = args[name]
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 4, dtype=t.dtype)
        wide[..., : t.shape[-1]] = t
        args[name] = wide[..., : t.shape[-1]]
    return args


def _shifted_cache(args):
    args = dict(args)
    args["k_cache"] = _misaligned(args["k_cache"])
    return args


@pytest.mark.parametrize("what, case, dtype, transform, needle", [
    ("misaligned cache", CASES["gqa_append_d32"], torch.float16, _shifted_cache, "k_cache is not 16-byte aligned"),
    ("strides not multiple of 8", CASES["gqa_append_d32"], torch.bfloat16, _padded_cache, "not multiples of 8"),
    ("head dim 59", CASES["mqa_d59_neox_partial"], torch.float16, None, "head dimension 59"),
    ("fp32", CASES["gqa_append_d32"], torch.float32, None, "float32 inputs"),
])
def test_refuses_what_it_cannot_serve(what, case, dtype, transform, needle):
    """Refused before any launch (the cache is untouched), with a reason; the interpreter's own
    plan (exact flags) still runs the same call exactly."""
    args = make_inputs(case, dtype, torch.device("cpu"))
    if transform is not None:
        args = transform(args)
    before = args["k_cache"].clone()
    recorder = Recorder()
    with pytest.raises(KernelsCannotRun, match=needle):
        run_kernels(case, args, "interpret", target=superset("interpret"), run_launch=recorder)
    assert recorder.launches == [] and torch.equal(args["k_cache"], before)
    if what == "strides not multiple of 8":
        check_case(case, dtype, "interpret", transform=transform)


# ---------------------------------------------------------------------------------------------
# The description itself (pure Python)


def _constexpr_params(kernel: str) -> set:
    return {p.name for p in registry.jit_function(kernel).params if p.is_constexpr}


@pytest.mark.parametrize("family", dc.FAMILIES)
def test_aot_variants_are_complete_and_distinct(family):
    variants = dc.aot_variants(family)
    keys = [(k, tuple(sorted(f.items())), c) for k, f, c in variants]
    # 3 head-dim buckets x (2 split + 3 append + 4 rotary + 1 combine), + 1 exact split each where
    # shipped; Hopper's MLA images: 2 split (HAS_QV, 64/512) + 3 append (64/512) + 1 combine (512)
    assert len(keys) == len(set(keys)) == (33 + 6 if family == "sm90" else 33 if dc.ships_exact(family) else 30)
    for kernel, constexprs, config in variants:
        assert set(constexprs) == _constexpr_params(kernel), kernel
        assert constexprs["BLOCK_D"] in dc.HEADDIM_BUCKETS
        mla = constexprs.get("HAS_QV") or (kernel == "append_kv_kernel" and constexprs["BLOCK_DV"] != constexprs["BLOCK_D"])
        if kernel == "combine_splits_kernel" and constexprs["BLOCK_D"] == dc.QV_HEAD_DIMS[1]:
            mla = True
        assert not mla or (dc.ships_qv(family) and family == "sm90"), (family, kernel, constexprs)
        if kernel == "split_kv_kernel":
            bucket = max(constexprs["BLOCK_D"], constexprs["BLOCK_DV"])
            assert config in dc.bucket_configs(family, bucket)
            assert (constexprs["BLOCK_M"], constexprs["BLOCK_N"]) == (config.block_m, config.block_n)
            flags = {k: constexprs[k] for k in dc.SPLIT_KV_SUPERSET}
            assert (flags == dc.SPLIT_KV_SUPERSET or (flags == dict(dc.SPLIT_KV_SUPERSET, HAS_QV=True) and mla)
                    or (flags == dc.SPLIT_KV_EXACT and dc.ships_exact(family)
                        and config == dc.bucket_configs(family, constexprs["BLOCK_D"])[0]))
        else:
            assert config in (dc.AUX_CONFIG, dc.ROTARY_CONFIG, dc.COMBINE_CONFIG)


def test_decode_configs_is_pure_python():
    import flash_attn.planning.decode_configs as module

    tree = ast.parse(inspect.getsource(module))
    imported = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert not imported & {"torch", "triton", "numpy"}, imported


def test_superset_head_dim_buckets():
    assert [dc.superset_block_d(d) for d in (8, 32, 64, 72, 128, 136, 256, 264, 512)] == \
        [64, 64, 64, 128, 128, 256, 256, 512, 512]
    # the square bucket of the wider head dim, but MLA's own pair with qv
    assert dc.block_dims(192, 128, superset=True) == (256, 256)
    assert dc.block_dims(64, 512, superset=True, qv=True) == (64, 512)
    assert dc.block_dims(40, 24, superset=False) == (64, 32)


def test_compiles_ahead_of_time_without_spills(tmp_path, monkeypatch):
    """The sm80 head-dim-128 decode variant compiles from the declared signature (no GPU needed)
    with no stack frame, and the declared alignment keeps its K/V loads 16-byte ``cp.async``."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flash_attn.kernel_build.build import cuobjdump_path, resource_usage

    if cuobjdump_path() is None:
        pytest.skip("cuobjdump not found")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    kernel, constexprs, config = next(v for v in dc.aot_variants("sm80")
                                      if v[0] == "split_kv_kernel" and v[1]["BLOCK_D"] == 128)
    signature, attrs = S.signature(S.Spec.of(kernel, "bf16", constexprs, config))
    compiled = triton.compile(ASTSource(registry.jit_function(kernel), signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 80, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    cubin = tmp_path / "split_kv.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = resource_usage(cubin, cuobjdump_path())
    assert usage["stack"] == 0 and usage["local"] == 0, usage
    assert "HMMA" in usage["sass_mma"]
    assert "cp.async.cg.shared.global" in compiled.asm["ptx"] and ", 0x10," in compiled.asm["ptx"]
