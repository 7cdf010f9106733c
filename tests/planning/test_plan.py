"""The launch planner (:mod:`flash_attn.planning.plan`) and the kernel declarations it reads.

Plans are made from meta tensors here (shapes, strides and alignment, no data): what the planner
may look at. Checked: grids stay within CUDA's limits for any batch x heads, refusals say why,
inputs laid out otherwise are copied into the kernels' layout (and only those), every kernel's
declaration covers its source signature, and a plan is made once per call shape.
"""

from __future__ import annotations

import pytest
import torch

from flash_attn import limits
from flash_attn.backends._execute import KernelBackend
from flash_attn.params import AttentionParams, KVCacheInputs, VarlenLayout
from flash_attn.planning import configs, declarations, decode_configs as dc, plan as P, registry, shapes

H100 = P.Target("sm90", 132)
H100_AOT = P.Target("sm90", 132, aot=True)


def meta(*shape, dtype=torch.float16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _within_limits(plan: P.Plan) -> None:
    for launch in plan.launches:
        assert all(0 <= n <= limit for n, limit in zip(launch.grid, limits.GRID_LIMITS)), (launch.kernel, launch.grid)


def _rotary_tables(rows: int, d: int) -> dict:
    return dict(rotary_cos=meta(rows, d // 2, dtype=torch.float32), rotary_sin=meta(rows, d // 2, dtype=torch.float32))


@pytest.mark.parametrize("target", [H100, H100_AOT], ids=["jit", "aot"])
def test_decode_grid_fits_any_batch_times_heads(target):
    """batch 1024 x 64 kv heads = 65536 (kernel) programs: axis 0 (up to 2**31 - 1) takes them."""
    b, h, hk, d = 1024, 64, 64, 128
    cache = KVCacheInputs(meta(b, 256, hk, d), meta(b, 256, hk, d), meta(b, dtype=torch.int32), meta(b, 1, hk, d),
                          meta(b, 1, hk, d), **_rotary_tables(256, d))  # rotary: the append kernel runs too
    plan = P.plan_kvcache(P.describe_kvcache(meta(b, 1, h, d), AttentionParams(0.1, -1, 0), cache), target)
    assert isinstance(plan, P.Plan), plan
    _within_limits(plan)
    grids = {launch.kernel: launch.grid for launch in plan.launches}
    assert grids["split_kv_kernel"][0] >= b * hk > 65535 and grids["append_kv_kernel"][0] >= b * hk


@pytest.mark.parametrize("target", [H100, H100_AOT], ids=["jit", "aot"])
@pytest.mark.parametrize("cache_len", [4096, 256])
def test_a_decoding_step_appends_inside_the_attention_kernel(target, cache_len):
    """Without rotary the new rows are appended by the attention kernel (it reads them from k/v,
    not from the cache): a step is the attention and the split combine (batch 1 x 4k: split), or
    the attention alone (batch 64 x 256: one split). With rotary k is rotated by the append kernel
    first, and the attention kernel appends nothing."""
    b = 1 if cache_len == 4096 else 64
    hk, d = 8, 128
    q = meta(b, 1, 32, d)

    def launches(new_rows=1, **rotary):
        cache = KVCacheInputs(meta(b, cache_len, hk, d), meta(b, cache_len, hk, d), meta(b, dtype=torch.int32),
                              meta(b, new_rows, hk, d), meta(b, new_rows, hk, d), **rotary)
        query = q if new_rows == 1 else meta(b, new_rows, 32, d)
        plan = P.plan_kvcache(P.describe_kvcache(query, AttentionParams(0.1, -1, 0), cache), target)
        assert isinstance(plan, P.Plan), plan
        return [(launch.kernel, dict(launch.args).get("seqlen_append")) for launch in plan.launches]

    plain = [("split_kv_kernel", 1)] + ([("combine_splits_kernel", None)] if b == 1 else [])
    assert launches() == plain
    assert launches(**_rotary_tables(cache_len, d)) == [
        ("append_kv_kernel", None), ("rotary_q_kernel", None), ("split_kv_kernel", 0)] + plain[1:]
    # more new rows than the attention kernel's programs copy well: the append kernel first
    assert launches(new_rows=dc.FUSED_APPEND_ROWS)[0] == ("split_kv_kernel", dc.FUSED_APPEND_ROWS)
    assert launches(new_rows=dc.FUSED_APPEND_ROWS + 1)[:2] == [("append_kv_kernel", None), ("split_kv_kernel", 0)]


@pytest.mark.parametrize("family", ["cdna3", "rdna4"])
def test_amd_gpus_append_before_attending(family):
    """On AMD GPUs the append kernel runs first (decode_configs.FUSED_APPEND_VENDORS: the fused
    append's CTA barrier is not established to order global memory there)."""
    b, hk, d = 1, 8, 128
    cache = KVCacheInputs(meta(b, 4096, hk, d), meta(b, 4096, hk, d), meta(b, dtype=torch.int32), meta(b, 1, hk, d),
                          meta(b, 1, hk, d))
    plan = P.plan_kvcache(P.describe_kvcache(meta(b, 1, 32, d), AttentionParams(0.1, -1, 0), cache),
                          P.Target(family, 304))
    assert isinstance(plan, P.Plan), plan
    assert [(launch.kernel, dict(launch.args).get("seqlen_append")) for launch in plan.launches][:2] == [
        ("append_kv_kernel", None), ("split_kv_kernel", 0)]
    assert not dc.fuses_append(family) and dc.fuses_append("sm120") and dc.fuses_append("interpret")


def test_decode_with_more_than_65535_programs_runs_through_a_backend():
    """The same call through a backend with the launch stubbed: planned, prepared, launched."""
    b, h, hk, d = 1024, 64, 64, 128
    seen = []
    backend = KernelBackend("stub", lambda device: H100_AOT, lambda launch, tensors, device: seen.append(launch.grid))
    cache = KVCacheInputs(meta(b, 256, hk, d), meta(b, 256, hk, d), meta(b, dtype=torch.int32), meta(b, 1, hk, d),
                          meta(b, 1, hk, d))
    out, lse = backend.forward_kvcache(meta(b, 1, h, d), AttentionParams(0.1, -1, 0), cache)
    assert out.shape == (b, 1, h, d) and lse.shape == (b, h, 1)
    assert len(seen) == 1 and seen[0][0] >= b * hk  # the attention, appending the new rows itself (one split)


def test_attention_grid_fits_a_huge_varlen_batch():
    batch = 100_000  # sequences packed into one call: axis 2 (65535) would not hold them
    cu = meta(batch + 1, dtype=torch.int32)
    q = meta(batch * 4, 8, 64)
    params = AttentionParams(0.125, -1, 0)
    varlen = VarlenLayout(cu, cu, 4, 4)
    for target in (H100, H100_AOT):
        fwd = P.plan_forward(P.describe_forward(q, q, q, params, varlen), target)
        bwd = P.plan_backward(P.describe_backward(q, q, q, q, q, meta(8, batch * 4, dtype=torch.float32), params, varlen),
                              target)
        _within_limits(fwd)
        _within_limits(bwd)
        assert fwd.launches[0].grid[0] >= batch


def test_a_grid_beyond_the_limits_is_refused():
    q = meta(1, 128, 70_000, 64)  # 70000 query heads on axis 1
    why = P.plan_forward(P.describe_forward(q, q, q, AttentionParams(0.125)), H100)
    assert isinstance(why, P.Refusal) and why.by == P.PLANNER and "grid axis 1" in why.reason


def test_inputs_are_copied_only_when_their_layout_differs():
    params = AttentionParams(0.125)
    dense = P.plan_forward(P.describe_forward(meta(2, 64, 4, 64), meta(2, 64, 4, 64), meta(2, 64, 4, 64), params), H100)
    assert dense.prepare == ()
    # q a view with strides that are not multiples of 8 elements (head dim 60 of 64 columns is
    # fine: a row stride of 64); k shifted by one element (not 16-byte aligned); v transposed
    wide = meta(2, 64, 4, 68)[..., :64]  # row stride 68: not a multiple of 8
    shifted = meta(2 * 64 * 4 * 64 + 1)[1:].view(2, 64, 4, 64)
    odd = P.plan_forward(P.describe_forward(wide, shifted, meta(2, 64, 4, 64), params), H100)
    assert {p.slot for p in odd.prepare} == {"q", "k"}
    # a size-1 dimension's stride does not matter (it is only indexed at 0)
    single = meta(1, 64, 4, 64).as_strided((1, 64, 4, 64), (3, 256, 64, 1))
    assert P.plan_forward(P.describe_forward(single, single, single, params), H100).prepare == ()


def test_refusals_say_why():
    params = AttentionParams(0.125)
    fp32 = meta(1, 8, 2, 64, dtype=torch.float32)
    assert "float32" in P.plan_forward(P.describe_forward(fp32, fp32, fp32, params), H100).reason
    big = meta(1, 8, 2, 520)
    assert "head dimension 520" in P.plan_forward(P.describe_forward(big, big, big, params), H100).reason
    cu = meta(3, dtype=torch.int32)
    pages = meta(4, 16, 2, 64)
    paged = VarlenLayout(cu, cu, 8, 8, meta(2, 2, dtype=torch.int32))
    q = meta(16, 2, 64)
    why = P.plan_backward(P.describe_backward(q, q, pages, pages, q, meta(2, 16, dtype=torch.float32), params, paged),
                          H100)
    assert "paged" in why.reason


def test_plans_are_pure_and_made_once_per_shape():
    q = meta(2, 64, 4, 64)
    shape = P.describe_forward(q, q, q, AttentionParams(0.125, -1, 0))
    assert P.plan_forward(shape, H100) == P.plan_forward(shape, H100)
    made = []
    backend = KernelBackend("stub", lambda device: H100, lambda launch, tensors, device: None)
    original = P.plan_forward
    backend_plan = lambda s, t: made.append(s) or original(s, t)  # noqa: E731
    backend_plan.__name__ = "plan_forward"
    for _ in range(3):
        backend._prepare(backend_plan, shape, {"q": q, "k": q, "v": q}, q.device)()
    assert len(made) == 1


@pytest.mark.parametrize("name", sorted(declarations.KERNELS))
def test_declarations_cover_the_kernel_signatures(name):
    """Every runtime argument of the kernel source is typed by its declaration (pointers by element
    type, scalars as i32 or fp32), and nothing is declared that the kernel does not take."""
    decl = declarations.get(name)
    constexprs = registry.constexpr_names(name)
    runtime = [n for n in registry.arg_names(name) if n not in constexprs]
    assert set(decl.pointers) <= set(runtime) and decl.floats <= set(runtime) and decl.divisible_by_8 <= set(runtime)
    assert set(decl.folded) <= set(registry.arg_names(name))
    for arg in runtime:
        if arg in decl.pointers:
            assert decl.pointer_type(arg, "bf16") in ("*bf16", "*fp32", "*i32", "*i64")
        else:
            assert decl.scalar_type(arg) in ("i32", "fp32")
            assert arg not in decl.floats or arg not in decl.divisible_by_8


NO_FUSED_DETERMINISTIC = {("deterministic_splits", family): 0 for family in configs.FAMILY_CAPABILITY}
BACKWARD_KERNELS = ["attn_bwd_preprocess_kernel", "attn_bwd_kernel", "attn_bwd_dq_convert_kernel"]
SPLIT_KERNELS = ["attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"]


def _backward_plan(target, batch, seqlen, nheads, nheads_k, head_dim=128, deterministic=False, varlen=False):
    if varlen:  # packed rows: `batch` sequences of `seqlen`
        q, k = meta(batch * seqlen, nheads, head_dim), meta(batch * seqlen, nheads_k, head_dim)
        lse = meta(nheads, batch * seqlen, dtype=torch.float32)
        cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device="meta")
        layout = VarlenLayout(cu, cu, seqlen, seqlen)
    else:
        q, k = meta(batch, seqlen, nheads, head_dim), meta(batch, seqlen, nheads_k, head_dim)
        lse, layout = meta(batch, nheads, seqlen, dtype=torch.float32), None
    shape = P.describe_backward(q, q, k, k, q, lse, AttentionParams(0.1, -1, 0), varlen=layout,
                                deterministic=deterministic)
    return P.plan_backward(shape, target)


@pytest.mark.parametrize("target", [H100, H100_AOT], ids=["jit", "aot"])
def test_backward_runs_the_fused_kernel_one_program_per_key_block_by_default(target):
    """``deterministic=False`` plans the fused kernel: one program per key block (the grid's
    first axis: key blocks x batch; second: kv heads), dQ by atomic add into one fp32 buffer laid
    out like Q that the preprocess zeroes (no memset of its own), then the convert."""
    plan = _backward_plan(target, 2, 300, 8, 2)
    assert [x.kernel for x in plan.launches] == BACKWARD_KERNELS
    accum = {b.slot: b for b in plan.buffers}["dq_accum"]
    assert not accum.zeroed and accum.dtype == torch.float32 and accum.shape == (2, 300, 1, 8, 128)
    pre, main, convert = (dict(x.args) for x in plan.launches)
    assert pre["dQAccum"] == main["dQAccum"] == convert["dQAccum"] == "dq_accum"
    assert [pre[f"stride_a{d}"] for d in "bsh"] == [main[f"stride_dq{d}"] for d in "bsh"] == \
        [convert[f"stride_a{d}"] for d in "bsh"] == [300 * 8 * 128, 8 * 128, 128]
    key_blocks = -(-300 // plan.launches[1].config.block_n)
    assert (main["splits"], main["split_stride"], pre["slices"], convert["slices"]) == (key_blocks, 0, 1, 1)
    assert plan.launches[1].grid == (key_blocks * 2, 2, 1)


@pytest.mark.parametrize("aot", [False, True], ids=["jit", "aot"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_blackwell_runs_the_fused_backward(aot, head_dim):
    """B200 (sm100, 148 SMs): the fused kernel (tcgen05, pointer loads) for both ``deterministic``
    settings, in splits of its own when deterministic; head dim 256 with its gradient columns
    over two programs (the grid's second axis: kv heads x 2), which tensor memory needs."""
    b200 = P.Target("sm100", 148, aot=aot)
    parts = 2 if head_dim == 256 else 1
    for deterministic in (False, True):
        plan = _backward_plan(b200, 4, 2048, 16, 4, head_dim=head_dim, deterministic=deterministic)
        assert [x.kernel for x in plan.launches] == BACKWARD_KERNELS
        main = plan.launches[1]
        assert main.config == configs.fused_backward(head_dim, "sm100") and main.constexprs["TMA"] is False
        assert main.constexprs["BLOCK_DOUT"] == head_dim // parts and main.grid[1] == 4 * parts
        splits = min(8, -(-148 // (16 * parts))) if deterministic else 2048 // main.config.block_n
        assert dict(main.args)["splits"] == splits and main.grid[0] == splits * 4


@pytest.mark.parametrize("target", [H100, H100_AOT], ids=["jit", "aot"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_deterministic_backward_runs_the_fused_kernel_in_splits_of_its_own(target, varlen):
    """``deterministic=True`` on Hopper (FlashAttention-2's way): the fused kernel with fewer
    programs along the keys, enough for every SM (at most ``DETERMINISTIC_SPLITS``); each split
    adds dQ into Q-shaped sums of its own (interleaved per row: ``(rows, splits, heads, d)``),
    the preprocess zeroes all of them and the convert adds them up."""
    batch, seqlen, nheads, nheads_k = 4, 2048, 16, 4  # 16 programs a split, 16 key blocks
    plan = _backward_plan(target, batch, seqlen, nheads, nheads_k, deterministic=True, varlen=varlen)
    assert [x.kernel for x in plan.launches] == BACKWARD_KERNELS
    splits = min(configs.DETERMINISTIC_SPLITS["sm90"], -(-132 // (batch * nheads_k)))
    assert splits == 8
    pre, main, convert = (dict(x.args) for x in plan.launches)
    assert (main["splits"], pre["slices"], convert["slices"]) == (splits, splits, splits)
    assert main["split_stride"] == pre["split_stride"] == convert["split_stride"] == nheads * 128
    assert main["stride_dqs"] == splits * nheads * 128 and main["stride_dqh"] == 128
    assert plan.launches[1].grid == (splits * batch, nheads_k, 1)
    accum = {b.slot: b for b in plan.buffers}["dq_accum"]
    assert accum.shape[-3:] == (splits, nheads, 128) and not accum.zeroed


@pytest.mark.parametrize("why, target, sizes, overrides", [
    # batch 1 x 1 kv head: 8 splits keep 8 of 132 SMs busy, the split kernels all of them
    ("too few programs", H100, (1, 16384, 8, 1), {}),
    ("switched off", H100, (4, 2048, 16, 4), NO_FUSED_DETERMINISTIC),
    ("no fused kernel", P.Target("sm80", 108), (4, 2048, 16, 4), {}),
    ("dQ by TMA reductions", H100, (4, 2048, 16, 4),
     {("bwd_fused", "sm90", 128, v): configs.Config(64, 128, 8, 2, dq_tma=True) for v in configs.VARIANTS}),
])
def test_deterministic_backward_keeps_the_split_kernels_where_splits_cannot_serve(why, target, sizes, overrides):
    with configs.overridden(overrides):
        plan = _backward_plan(target, *sizes, deterministic=True)
        assert [x.kernel for x in plan.launches] == SPLIT_KERNELS, why
        assert dict(plan.launches[0].args)["slices"] == 0 and "dq_accum" not in {b.slot for b in plan.buffers}
        # deterministic=False is unchanged by it
        assert plan.launches[1].kernel != "attn_bwd_kernel"
    if why != "no fused kernel":
        with configs.overridden(overrides):
            assert _backward_plan(target, *sizes).launches[1].kernel == "attn_bwd_kernel"


@pytest.mark.parametrize("family, columns, tma", [("sm90", 128, True), ("sm80", 128, False), ("sm86", 128, False),
                                                  ("sm120", 128, False), ("sm100", 256, False)])
def test_the_deterministic_dkdv_kernel_splits_and_streams_on_hopper(family, columns, tma):
    """``deterministic=True`` at head dim 256 through the split kernels: on Hopper the dK/dV
    kernel splits its gradient columns over two programs per key block (the grid's second axis
    doubles) and streams Q and dO by TMA, as the fused backward does; the mma.sync families split
    them too (their 128 or 64 keys a program hold no whole d256 rows without replicating work),
    with pointer loads; Blackwell keeps whole rows and pointer loads."""
    q, k = meta(2, 300, 8, 256, dtype=torch.bfloat16), meta(2, 300, 2, 256, dtype=torch.bfloat16)
    lse = meta(2, 8, 300, dtype=torch.float32)
    for aot in (False, True):
        backward = P.describe_backward(q, q, k, k, q, lse, AttentionParams(0.1, -1, 0), deterministic=True)
        with configs.overridden(NO_FUSED_DETERMINISTIC):
            dkdv = P.plan_backward(backward, P.Target(family, 132, aot=aot)).launches[1]
        assert dkdv.kernel == "attn_bwd_dkdv_kernel"
        assert (dkdv.constexprs["BLOCK_DOUT"], dkdv.constexprs["TMA"]) == (columns, tma)
        assert dkdv.grid == (-(-300 // dkdv.config.block_n) * 2, 2 * 256 // columns, 1)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_aot_plans_pick_the_exact_call_image_where_one_ships(direction):
    """Full attention with an unpadded head dim (64, 128 or 256, bf16 or fp16) runs the exact-call
    image on sm90 (no mask code); causal, windowed, padded and score-feature calls, and other
    families, the folded superset."""
    kind = "fwd" if direction == "forward" else "bwd_fused"

    def flags(head_dim, causal=False, family="sm90", softcap=0.0, dtype=torch.bfloat16, aot=True):
        main = _main_launch(direction, head_dim, causal, family, softcap, dtype, aot)
        # the image's own launch config: the exact-call image's entry, or the lean / features one
        exact = main.constexprs["IS_LOCAL"] is False and main.constexprs["PAD_HEADDIM"] is False
        if main.kernel != "attn_bwd_dkdv_kernel":  # sm100 runs the split backward kernels at d256
            assert main.config == configs.pick(kind, head_dim, family, softcap > 0, exact=exact and softcap == 0)
        return main.constexprs["IS_LOCAL"], main.constexprs["PAD_HEADDIM"]

    assert flags(128) == (False, False)
    assert flags(64) == (False, False)
    assert flags(128, causal=True) == (True, True)
    assert flags(96) == (True, True)  # padded to 128
    assert flags(128, softcap=5.0) == (True, True)
    assert flags(128, family="sm100") == (True, True)
    assert flags(256) == (False, False)
    assert flags(160) == (True, True)  # padded to 256
    assert flags(128, dtype=torch.float16) == (False, False)  # fp16 too
    assert flags(128, causal=True, dtype=torch.float16) == (True, True)
    assert flags(64, dtype=torch.float16, aot=False) == (False, False)  # the JIT specialises every call
    assert flags(64, causal=True, aot=False) == (True, False)


def _main_launch(direction, head_dim, causal, family, softcap, dtype, aot):
    """The forward's launch, or the backward's fused (or split dK/dV) one."""
    q = meta(2, 300, 8, head_dim, dtype=dtype)
    params = AttentionParams(0.1, -1, 0 if causal else -1, softcap=softcap)
    target = P.Target(family, 132, aot=aot)
    if direction == "forward":
        plan = P.plan_forward(P.describe_forward(q, q, q, params), target)
    else:
        lse = meta(2, 8, 300, dtype=torch.float32)
        plan = P.plan_backward(P.describe_backward(q, q, q, q, q, lse, params), target)
    return [x for x in plan.launches if "IS_LOCAL" in x.constexprs][0]


def test_the_exact_call_image_runs_in_its_own_config():
    """On sm90 the d64 forward's exact-call image has its own tile (the sweeps measured 128x64 s3
    faster on full attention, 64x128 w4 s3 on causal): full calls, bf16 or fp16, launch with the
    one, causal calls (the folded image) with the other; the grid follows the config."""
    full = _main_launch("forward", 64, False, "sm90", 0.0, torch.bfloat16, True)
    causal = _main_launch("forward", 64, True, "sm90", 0.0, torch.bfloat16, True)
    fp16 = _main_launch("forward", 64, False, "sm90", 0.0, torch.float16, True)
    assert full.config == configs.pick("fwd", 64, "sm90", exact=True) != causal.config
    assert causal.config == configs.pick("fwd", 64, "sm90") and fp16.config == full.config
    assert full.constexprs["BLOCK_M"] == full.config.block_m and full.constexprs["BLOCK_N"] == full.config.block_n
    assert full.grid[0] == -(-300 // full.config.block_m) * 2


def _d128_everywhere(kind: str, family: str, config: configs.Config) -> dict:
    """:func:`configs.overridden` entries: ``config`` for ``kind``'s head-dim-128 bucket in every variant."""
    return {(kind, family, 128, variant): config for variant in configs.VARIANTS}


@pytest.mark.parametrize("aot", [False, True], ids=["jit", "aot"])
def test_the_fused_backward_streams_through_tensor_descriptors_where_its_config_says(aot):
    """``TMA`` of the fused backward: on by default on sm90 (configs.TMA_FAMILIES), off on
    Blackwell's candidates, and a config's own ``tma`` (a measured exception) wins over both."""
    assert _main_launch("backward", 128, False, "sm90", 0.0, torch.bfloat16, aot).constexprs["TMA"] is True
    with configs.overridden(_d128_everywhere("bwd_fused", "sm90", configs.Config(64, 128, 8, 2, tma=False))):
        launch = _main_launch("backward", 128, True, "sm90", 0.0, torch.bfloat16, aot)
    assert launch.kernel == "attn_bwd_kernel" and launch.constexprs["TMA"] is False
    with configs.overridden(_d128_everywhere("bwd_fused", "sm100", configs.Config(64, 128, 8, 1))):
        assert _main_launch("backward", 128, False, "sm100", 0.0, torch.bfloat16, aot).constexprs["TMA"] is False


@pytest.mark.parametrize("aot", [False, True], ids=["jit", "aot"])
def test_the_fused_backward_adds_dq_by_tma_reductions_where_its_config_says(aot):
    """``TMA_DQ``: off with the table's configs; on where a config asks for it on Hopper (the
    sweep's "-red" candidates), never on families without it (Blackwell's fused candidates)."""
    assert _main_launch("backward", 128, False, "sm90", 0.0, torch.bfloat16, aot).constexprs["TMA_DQ"] is False
    red = configs.Config(64, 128, 8, 2, dq_tma=True)
    with configs.overridden(_d128_everywhere("bwd_fused", "sm90", red)):
        launch = _main_launch("backward", 128, True, "sm90", 0.0, torch.bfloat16, aot)
    assert launch.kernel == "attn_bwd_kernel" and launch.constexprs["TMA_DQ"] is True and launch.config == red
    with configs.overridden(_d128_everywhere("bwd_fused", "sm100", red)):
        assert _main_launch("backward", 128, False, "sm100", 0.0, torch.bfloat16, aot).constexprs["TMA_DQ"] is False


@pytest.mark.parametrize("aot", [False, True], ids=["jit", "aot"])
def test_the_forward_is_warp_specialised_where_its_config_says(aot):
    """``WS`` of the forward: off with the table's configs, on (with ``TMA``) where a config asks
    for it on Hopper; the launch keeps the config's num_warps (Triton adds the partitions' warps,
    which the image's manifest records)."""
    assert _main_launch("forward", 128, False, "sm90", 0.0, torch.bfloat16, aot).constexprs["WS"] is False
    with configs.overridden(_d128_everywhere("fwd", "sm90", configs.Config(128, 128, 4, 2, ws=True))):
        launch = _main_launch("forward", 128, True, "sm90", 0.0, torch.bfloat16, aot)
    assert launch.kernel == "attn_fwd_kernel"
    assert (launch.constexprs["WS"], launch.constexprs["TMA"], launch.config.num_warps) == (True, True, 4)


# ---------------------------------------------------------------------------------------------
# Packed (varlen) calls: one plan for the batches of packed training


def _packed(total_q, total_k, max_q, max_k, batch=3, h=4, hk=2, d=64):
    cu = meta(batch + 1, dtype=torch.int32)
    q, k = meta(total_q, h, d), meta(total_k, hk, d)
    lse = meta(h, total_q, dtype=torch.float32)
    return q, k, lse, VarlenLayout(cu, cu, max_q, max_k)


def test_bucket_seqlen_rounds_up_to_tiles_and_few_buckets():
    assert [P.bucket_seqlen(n) for n in (0, 1, 128, 129, 1000, 1025, 1281, 4097)] == \
        [0, 128, 128, 256, 1024, 1280, 1536, 5120]
    buckets = {P.bucket_seqlen(n) for n in range(1, 65537)}
    assert all(b % shapes.SEQLEN_TILE == 0 for b in buckets)
    assert all(P.bucket_seqlen(n) >= n and P.bucket_seqlen(n) <= max(1.25 * n, 128 + n) for n in range(1, 65537))
    assert len([b for b in buckets if 2048 < b <= 4096]) == 4 and len(buckets) <= 40


@pytest.mark.parametrize("target", [H100, H100_AOT], ids=["jit", "aot"])
def test_packed_batches_of_other_lengths_share_a_plan(target):
    """Totals and longest sequences vary from batch to batch in padding-free training: the calls
    describe alike (row counts left to the call, longest sequences bucketed), so one plan serves
    them; the plan sizes its buffers and the lse head stride by the call's rows."""
    params = AttentionParams(0.125, -1, 0)
    a_q, a_k, a_lse, a = _packed(300, 310, 150, 160)
    b_q, b_k, b_lse, b = _packed(517, 480, 200, 250)
    assert P.describe_forward(a_q, a_k, a_k, params, a) == P.describe_forward(b_q, b_k, b_k, params, b)
    shape = P.describe_backward(a_q, a_q, a_k, a_k, a_q, a_lse, params, a)
    assert shape == P.describe_backward(b_q, b_q, b_k, b_k, b_q, b_lse, params, b)
    fwd = P.plan_forward(P.describe_forward(a_q, a_k, a_k, params, a), target)
    assert fwd.rows == (P.Q_ROWS,)
    assert {b.slot: b.shape for b in fwd.buffers}["lse"] == (4, P.Q_ROWS)
    assert dict(fwd.launches[0].args)["stride_lh"] is P.Q_ROWS
    main = fwd.launches[0]
    assert main.grid[0] == -(-256 // main.config.block_m) * 3  # the bucket of 200 (and of 150)
    bwd = P.plan_backward(shape, target)
    assert bwd.rows == (P.Q_ROWS, P.K_ROWS)
    assert {b.slot: b.shape[0] for b in bwd.buffers if b.slot in ("dq", "dk", "dv")} == \
        {"dq": P.Q_ROWS, "dk": P.K_ROWS, "dv": P.K_ROWS}
    # another count of sequences, or the longest sequence in the next bucket: another plan
    first = P.describe_forward(a_q, a_k, a_k, params, a)
    four_q, four_k, _, four = _packed(300, 310, 150, 160, batch=4)
    assert P.describe_forward(four_q, four_k, four_k, params, four) != first
    assert P.describe_forward(a_q, a_k, a_k, params, _packed(300, 310, 150, 300)[3]) != first


def test_packed_outputs_sized_by_the_bounds_keep_them_exact():
    """``return_softmax``: S_dmask is ``(batch, h, max_seqlen_q, max_seqlen_k)``, so those bounds stay exact."""
    q, k, _, varlen = _packed(300, 310, 150, 160)
    shape = P.describe_forward(q, k, k, AttentionParams(0.125), varlen, return_softmax=True)
    assert (shape.varlen.max_seqlen_q, shape.varlen.max_seqlen_k) == (150, 160) and shape.q.shape[0] == 300
    plan = P.plan_forward(shape, H100)
    assert {b.slot: b.shape for b in plan.buffers}["s_dmask"] == (3, 4, 150, 160) and plan.rows == ()


def test_backward_writes_the_callers_gradients_where_laid_out_for_the_kernels():
    """``grads``: the caller's tensors are the output slots when the kernels can write them (no
    buffer of the plan); others get a buffer (copied by the caller). ``delta``: Delta comes back."""
    q, k = meta(2, 64, 4, 64), meta(2, 64, 2, 64)
    lse = meta(2, 4, 64, dtype=torch.float32)
    params = AttentionParams(0.125, -1, 0)
    wide = meta(2, 64, 4, 68)[..., :64]  # a row stride of 68 elements: not a multiple of 8
    plan = P.plan_backward(P.describe_backward(q, q, k, k, q, lse, params, grads=(wide, meta(2, 64, 2, 64), None),
                                               delta=True), H100)
    assert {b.slot for b in plan.buffers} & {"dq", "dk", "dv"} == {"dq", "dv"}
    assert plan.results == ("dq", "dk", "dv", "delta")
    plain = P.plan_backward(P.describe_backward(q, q, k, k, q, lse, params), H100)
    assert {b.slot for b in plain.buffers} >= {"dq", "dk", "dv"} and plain.results == ("dq", "dk", "dv")


def test_a_packed_backend_call_allocates_by_the_calls_rows():
    """Through a backend (launches stubbed): two packed batches of other totals share one plan,
    each gets outputs of its own size, and the launches get its own lse head stride."""
    seen = []

    def run_launch(launch, tensors, device):
        seen.append({n: tensors[v] if isinstance(v, (P.Slot, P.Rows)) else v for n, v in launch.args})

    backend = KernelBackend("stub", lambda device: H100, run_launch)
    params = AttentionParams(0.125, -1, 0)
    for total in (300, 517):
        q, k, _, varlen = _packed(total, total, 150 + total // 10, 150)
        seen.clear()
        out, lse, _ = backend.forward(q, k, k, params, varlen=varlen)
        assert out.shape == q.shape and lse.shape == (4, total)
        dq, dk, dv, delta = backend.backward(q, q, k, k, out, lse, params, varlen=varlen, return_delta=True)
        assert dq.shape == q.shape and dk.shape == k.shape and delta.shape == (4, total)
        strides = [launch["stride_lh"] for launch in seen if "stride_lh" in launch]
        assert len(strides) >= 3 and set(strides) == {total}
    assert len(backend.plans) == 2  # one forward, one backward plan


def test_a_launch_names_exactly_the_kernels_parameters():
    """Launch values are keyed by the names of the kernel's ``def`` (read from its source): one
    missing or one the kernel does not take fails loudly, never a silently shifted argument."""
    from flash_attn.planning import launches

    config = configs.Config(0, 0, 4, 3)
    names = [n for n in registry.arg_names("combine_splits_kernel") if n not in ("BLOCK_R", "BLOCK_D")]
    values = dict.fromkeys(names, 1)
    constexprs = dict(BLOCK_R=16, BLOCK_D=64)
    made = launches.launch("combine_splits_kernel", (2,), values, constexprs, config)
    assert [n for n, _ in made.args] == names and made.grid == (2, 1, 1)
    with pytest.raises(KeyError, match="no value for \\['head_dim'\\]"):
        launches.launch("combine_splits_kernel", (2,), {n: 1 for n in names if n != "head_dim"}, constexprs, config)
    with pytest.raises(KeyError, match="no parameter for \\['headdim'\\]"):
        launches.launch("combine_splits_kernel", (2,), dict(values, headdim=1), constexprs, config)


def test_kernel_parameters_come_from_the_source():
    """The parameter list is the ``def``'s, as written (an oracle typed here for the smallest kernel)."""
    assert registry.arg_names("combine_splits_kernel")[:4] == ("OutPart", "LsePart", "Out", "Lse")
    assert registry.arg_names("combine_splits_kernel")[-2:] == ("BLOCK_R", "BLOCK_D")
    assert registry.constexpr_names("combine_splits_kernel") == {"BLOCK_R", "BLOCK_D"}
    from flash_attn.planning import signatures

    with pytest.raises(LookupError, match="defines no function 'no_such_kernel'"):
        signatures.parameters("flash_attn.kernels.decode", "no_such_kernel")


def test_the_cache_capacity_is_one_formula():
    """Rows one sequence can address: pages x page size when paged, else the cache's length; the
    planner, validation and the API read it from params.cache_capacity (shapes or tensors)."""
    from flash_attn.params import cache_capacity

    assert cache_capacity(meta(3, 100, 2, 64)) == 100
    assert cache_capacity(meta(40, 16, 2, 64), meta(3, 7, dtype=torch.int32)) == 7 * 16
    info = P.describe_kvcache(meta(3, 1, 4, 64), AttentionParams(0.1),
                              KVCacheInputs(meta(40, 16, 2, 64), meta(40, 16, 2, 64), meta(3, dtype=torch.int32),
                                            block_table=meta(3, 7, dtype=torch.int32)))
    assert cache_capacity(info.k_cache, info.block_table) == 112
