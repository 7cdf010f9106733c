"""The ``aot`` path and ``import flash_attn`` with Triton not installed (no GPU needed).

Design rule: on the GPU path nobody needs Triton, nvcc or a C compiler at run time. Each check
runs in a fresh interpreter where ``import triton`` fails (``sys.modules["triton"] = None`` before
anything else, which makes every ``import triton...`` raise ``ModuleNotFoundError``) and ends by
asserting that no ``triton`` module was loaded.

The ``aot`` checks run the real backend entry points (``aot.forward`` / ``aot.backward`` -> the
planner -> argument packing) against a manifest synthesised from the specialisation set
(signatures per :func:`specializations.signature`, no compile), with the op library's
``register_kernel`` and ``aot_launch`` replaced by recorders: the run stops exactly where
``torch.ops.flash_attn.aot_launch`` would be called.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from support import TESTS

PREAMBLE = textwrap.dedent("""
    import sys
    sys.modules["triton"] = None  # "not installed": every import of triton fails

    def assert_no_triton():
        loaded = sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] == "triton")
        assert not loaded, loaded
""")


def _run_without_triton(*code: str) -> dict:
    """Runs the ``code`` blocks without Triton; the last prints one JSON line with what it checked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_ATTN_")}
    source = "".join(textwrap.dedent(block) for block in (PREAMBLE, *code))
    result = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_triton_is_really_blocked():
    got = _run_without_triton("""
        import json
        try:
            import triton.language  # noqa: F401
            blocked = False
        except ImportError:
            blocked = True
        print(json.dumps({"blocked": blocked}))
    """)
    assert got["blocked"]


def test_import_and_reference_backend_without_triton():
    got = _run_without_triton("""
        import json, warnings
        import torch
        import flash_attn
        from flash_attn import dispatch, flash_attn_func
        from flash_attn.planning import registry
        from flash_attn.planning import declarations
        from flash_attn.planning import configs
        from flash_attn.planning import plan
        from flash_attn.aot import specializations  # noqa: F401
        from flash_attn.backends import aot, cpu as cpu_backend, reference  # noqa: F401

        torch.manual_seed(0)
        q = torch.randn(2, 9, 4, 32, requires_grad=True)
        k = torch.randn(2, 13, 2, 32, requires_grad=True)
        v = torch.randn(2, 13, 2, 32, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = flash_attn_func(q, k, v, causal=True)
        out.sum().backward()
        kr, vr = (t.detach().repeat_interleave(2, dim=2).transpose(1, 2) for t in (k, v))
        mask = torch.ones(9, 13, dtype=torch.bool).tril(13 - 9)  # bottom-right aligned causal
        want = torch.nn.functional.scaled_dot_product_attention(q.detach().transpose(1, 2), kr, vr,
                                                                attn_mask=mask).transpose(1, 2)
        assert torch.allclose(out.detach(), want, atol=1e-5), (out.detach() - want).abs().max()
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
        cpu = torch.device("cpu")
        assert dispatch.unavailable_reason("reference", cpu) is None
        assert dispatch.unavailable_reason("cpu", cpu) is None and dispatch.last_backend() == "cpu"
        interp = dispatch.unavailable_reason("interpret", cpu)
        assert_no_triton()
        print(json.dumps({"interpret": interp}))
    """)
    assert got["interpret"] and "triton" in got["interpret"].lower()  # the interpreter does need Triton


AOT_SETUP = f"    TESTS = {str(TESTS)!r}\n" + """
    import json, os, sys, warnings
    import torch
    from flash_attn.aot import library as op_library
    from flash_attn.aot import archs
    from flash_attn import dispatch
    from flash_attn.backends import aot
    from flash_attn.planning import plan
    from flash_attn.aot import specializations as S
    from flash_attn.params import AttentionParams, VarlenLayout

    # A manifest for one sm_90a image, synthesised from the specialisation set (no compile).
    sys.path.insert(0, TESTS)
    from support.aot_buffers import by_slot, made_buffers
    from support.synthetic_images import synthetic_manifest

    m = synthetic_manifest()
    # an H100, as far as the backend asks (CPU tensors stand in for its memory)
    images = aot._DeviceImages(m, "sm_90a", plan.Target("sm90", 132, aot=True))
    aot._device_images = lambda device: images
    aot.BACKEND.unavailable_reason = lambda device: None

    registered, launched = {}, []

    def register_kernel(image, entry):
        return registered.setdefault(entry["key"], len(registered))

    def launch(kid, grid, tensors, ints, floats):  # where torch.ops.flash_attn.aot_launch would run
        key = next(k for k, v in registered.items() if v == kid)
        launched.append({"key": key, "grid": [int(g) for g in grid], "tensors": len(tensors),
                         "ints": len(ints), "floats": len(floats)})

    def launch_all(launches, passed, rows):  # where torch.ops.flash_attn.aot_run would run
        made = made_buffers(launches, passed, rows)
        tensors = {**by_slot(launches, passed, rows), **dict(zip(launches.made, made))}
        for p in launches.packed:
            ints = [tensors[i] if isinstance(i, plan.Rows) else i for i in p.ints]
            launch(p.kernel, p.grid, [tensors.get(name) for name in p.slots], ints, p.floats)  # unused: None
        return made

    op_library.register_kernel = register_kernel
    aot._launch = launch_all
    params = AttentionParams(softmax_scale=0.125, window_left=-1, window_right=0, softcap=0.0, dropout_p=0.0,
                             dropout_seed=0)
"""


def test_aot_unavailable_reason_does_not_mention_triton():
    got = _run_without_triton("""
        import json
        import torch
        from flash_attn import dispatch
        from flash_attn.backends import aot

        reasons = [aot.unavailable_reason(torch.device("cuda", 0)), aot.unavailable_reason(torch.device("cuda")),
                   dispatch.unavailable_reason("aot", torch.device("cuda", 0))]
        assert_no_triton()
        print(json.dumps({"reasons": reasons, "triton": dispatch.unavailable_reason("triton", torch.device("cuda"))}))
    """)
    for reason in got["reasons"]:
        assert reason is None or "triton" not in reason.lower(), reason
    assert got["triton"] and "triton" in got["triton"].lower()


@pytest.mark.parametrize("varlen", [False, True])
def test_aot_forward_backward_launch_plan_without_triton(varlen):
    got = _run_without_triton(AOT_SETUP, f"""
        varlen = {varlen!r}
        torch.manual_seed(0)
        if varlen:
            q = torch.randn(12, 4, 96, dtype=torch.bfloat16)
            k = torch.randn(20, 2, 96, dtype=torch.bfloat16)
            layout = VarlenLayout(cu_seqlens_q=torch.tensor([0, 5, 12], dtype=torch.int32),
                                  cu_seqlens_k=torch.tensor([0, 9, 20], dtype=torch.int32),
                                  max_seqlen_q=7, max_seqlen_k=11)
        else:
            q = torch.randn(2, 7, 4, 96, dtype=torch.bfloat16)
            k = torch.randn(2, 11, 2, 96, dtype=torch.bfloat16)
            layout = None
        v = torch.randn_like(k)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback would warn: the aot path must take these calls
            out, lse, _ = aot.forward(q, k, v, params, varlen=layout)
            dq, dk, dv = aot.backward(torch.randn_like(q), q, k, v, out, lse, params, varlen=layout)
            aot.backward(torch.randn_like(q), q, k, v, out, lse, params, varlen=layout, deterministic=True)
        assert out.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert_no_triton()
        print(json.dumps({{"launched": launched}}))
    """)
    launched = got["launched"]
    kernels = [row["key"].split(".")[0] for row in launched]
    # deterministic=False (the default): the fused kernel with atomic dQ; deterministic=True on Hopper: the
    # same kernels, dQ summed per split (one split here: a key block per sequence)
    assert kernels == ["attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_kernel", "attn_bwd_dq_convert_kernel",
                       "attn_bwd_preprocess_kernel", "attn_bwd_kernel", "attn_bwd_dq_convert_kernel"]
    for row in launched:
        assert ".bf16.d128." in row["key"], row  # head dim 96 -> the 128 bucket
        assert row["grid"][1:] in ([4, 1], [2, 1]), row  # (tiles x batch, heads, 1)
        assert row["tensors"] > 0 and row["ints"] > 0
    assert launched[0]["floats"] > 0


def test_aot_unshipped_call_falls_back_to_reference_without_triton():
    got = _run_without_triton(AOT_SETUP, """
        q = torch.randn(1, 5, 2, 64, dtype=torch.float16)
        k = torch.randn(1, 6, 2, 64, dtype=torch.float16)
        os.environ["FLASH_ATTN_BACKEND"] = "aot"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, lse, probs = dispatch.run("forward", q.device, q, k, k, params, return_softmax=True)
        assert out.shape == q.shape and torch.isfinite(out.float()).all() and probs is not None
        assert_no_triton()
        print(json.dumps({"launched": launched, "warnings": [str(w.message) for w in caught]}))
    """)
    assert got["launched"] == []
    assert any("return_attn_probs" in w and "reference backend" in w for w in got["warnings"]), got["warnings"]


def test_aot_features_and_kvcache_launch_without_triton():
    """Softcap / ALiBi / dropout calls run the score-features kernels, and ``forward_kvcache`` the
    superset KV-cache kernels: no fallback, no Triton."""
    got = _run_without_triton(AOT_SETUP, """
        from flash_attn.params import KVCacheInputs

        q = torch.randn(2, 7, 4, 64, dtype=torch.float16)
        k = torch.randn(2, 11, 2, 64, dtype=torch.float16)
        capped = AttentionParams(softmax_scale=0.125, window_left=-1, window_right=0, softcap=30.0,
                                 dropout_p=0.1, dropout_seed=3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback would warn
            out, lse, _ = aot.forward(q, k, k, capped, alibi_slopes=torch.rand(4))
            aot.backward(torch.randn_like(q), q, k, k, out, lse, capped)
            features = list(launched)
            launched.clear()
            cache = KVCacheInputs(k_cache=torch.zeros(2, 320, 2, 64, dtype=torch.bfloat16),
                                  v_cache=torch.zeros(2, 320, 2, 64, dtype=torch.bfloat16),
                                  cache_seqlens=torch.tensor([3, 290], dtype=torch.int32),
                                  k_new=torch.randn(2, 1, 2, 64, dtype=torch.bfloat16),
                                  v_new=torch.randn(2, 1, 2, 64, dtype=torch.bfloat16), num_splits=2)
            aot.forward_kvcache(torch.randn(2, 1, 4, 64, dtype=torch.bfloat16), params, cache)
            plain = list(launched)
            launched.clear()
            angles = torch.arange(320.0)[:, None] * torch.rand(32)[None, :]
            rotary = cache._replace(rotary_cos=angles.cos(), rotary_sin=angles.sin())
            aot.forward_kvcache(torch.randn(2, 1, 4, 64, dtype=torch.bfloat16), params, rotary)
        assert_no_triton()
        print(json.dumps({"features": features, "kvcache": plain, "rotary": launched}))
    """)
    kernels = [row["key"].split(".")[0] for row in got["features"]]
    assert kernels == ["attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_kernel", "attn_bwd_dq_convert_kernel"]
    # without rotary the attention kernel appends the new rows itself; with it, the append kernel rotates them
    assert [row["key"].split(".")[0] for row in got["kvcache"]] == ["split_kv_kernel", "combine_splits_kernel"]
    assert [row["key"].split(".")[0] for row in got["rotary"]] == [
        "append_kv_kernel", "rotary_q_kernel", "split_kv_kernel", "combine_splits_kernel"]
    assert all(".bf16.d64." in row["key"] for row in got["kvcache"] + got["rotary"])


def test_kernel_names_resolve_like_the_jit_functions():
    """:func:`registry.arg_names` and :func:`registry.constexpr_names` (the kernels' declarations,
    read without Triton) are what the ``JITFunction`` says: a declaration that drifts from its
    kernel's signature fails here."""
    pytest.importorskip("triton")
    from flash_attn.planning import registry

    for name in registry.KERNEL_MODULES:
        fn = registry.jit_function(name)
        assert registry.arg_names(name) == tuple(fn.arg_names), name
        assert fn.fn.__name__ == name and fn.fn.__module__ == registry.KERNEL_MODULES[name]
        assert registry.constexpr_names(name) == {p.name for p in fn.params if p.is_constexpr}, name
