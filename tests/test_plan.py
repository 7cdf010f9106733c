"""The launch planner (:mod:`flash_attn.kernels.plan`) and the kernel declarations it reads.

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
from flash_attn.kernels import declarations, registry
from flash_attn.kernels import plan as P
from flash_attn.params import AttentionParams, KVCacheInputs, VarlenLayout

H100 = P.Target("sm90", 132)
H100_AOT = P.Target("sm90", 132, aot=True)


def meta(*shape, dtype=torch.float16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _within_limits(plan: P.Plan) -> None:
    for launch in plan.launches:
        assert all(0 <= n <= limit for n, limit in zip(launch.grid, limits.GRID_LIMITS)), (launch.kernel, launch.grid)


@pytest.mark.parametrize("target", [H100, H100_AOT], ids=["jit", "aot"])
def test_decode_grid_fits_any_batch_times_heads(target):
    """batch 1024 x 64 kv heads = 65536 (kernel) programs: axis 0 (up to 2**31 - 1) takes them."""
    b, h, hk, d = 1024, 64, 64, 128
    cache = KVCacheInputs(meta(b, 256, hk, d), meta(b, 256, hk, d), meta(b, dtype=torch.int32), meta(b, 1, hk, d),
                          meta(b, 1, hk, d))
    plan = P.plan_kvcache(P.describe_kvcache(meta(b, 1, h, d), AttentionParams(0.1, -1, 0), cache), target)
    assert not isinstance(plan, str), plan
    _within_limits(plan)
    grids = {launch.kernel: launch.grid for launch in plan.launches}
    assert grids["split_kv_kernel"][0] >= b * hk > 65535 and grids["append_kv_kernel"][0] >= b * hk


def test_decode_with_more_than_65535_programs_runs_through_a_backend():
    """The same call through a backend with the launch stubbed: planned, prepared, launched."""
    b, h, hk, d = 1024, 64, 64, 128
    seen = []
    backend = KernelBackend("stub", lambda device: H100_AOT, lambda launch, tensors, device: seen.append(launch.grid))
    cache = KVCacheInputs(meta(b, 256, hk, d), meta(b, 256, hk, d), meta(b, dtype=torch.int32), meta(b, 1, hk, d),
                          meta(b, 1, hk, d))
    out, lse = backend.forward_kvcache(meta(b, 1, h, d), AttentionParams(0.1, -1, 0), cache)
    assert out.shape == (b, 1, h, d) and lse.shape == (b, h, 1) and len(seen) >= 2


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
    assert isinstance(why, str) and "grid axis 1" in why


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
    assert "float32" in P.plan_forward(P.describe_forward(fp32, fp32, fp32, params), H100)
    big = meta(1, 8, 2, 512)
    assert "head dimension 512" in P.plan_forward(P.describe_forward(big, big, big, params), H100)
    cu = meta(3, dtype=torch.int32)
    pages = meta(4, 16, 2, 64)
    paged = VarlenLayout(cu, cu, 8, 8, meta(2, 2, dtype=torch.int32))
    q = meta(16, 2, 64)
    why = P.plan_backward(P.describe_backward(q, q, pages, pages, q, meta(2, 16, dtype=torch.float32), params, paged),
                          H100)
    assert "paged" in why


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
