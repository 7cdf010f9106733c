"""The ahead-of-time kernel build (``python -m flash_attn build-kernels``) and the ``aot`` backend's
selection logic, without a GPU.

One build per test session: the installed ``flash_attn/_aot/`` when it holds sm_80 and sm_90a
images (``pip install`` with CUDA enabled builds it), else ``build-kernels --archs 80;90`` into a
temporary folder (a few minutes on 2 cores). GPU-only checks are marked ``gpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from flash_attn import _aot_library, aot_images  # noqa: E402
from flash_attn.backends import aot  # noqa: E402
from flash_attn.kernels import configs  # noqa: E402
from flash_attn.kernels import specializations as S  # noqa: E402
from flash_attn.params import AttentionParams  # noqa: E402

HAS_GPU = torch.cuda.is_available()
BUILT_ARCHS = {"sm_80": [(8, 0), (8, 6), (8, 9)], "sm_90a": [(9, 0)]}


@pytest.fixture(scope="session")
def aot_dir(tmp_path_factory) -> Path:
    installed = aot.find_manifest_dir()
    if installed is not None and os.environ.get("FLASH_ATTN_TEST_REBUILD") != "1":
        archs = set(json.loads((installed / "manifest.json").read_text()).get("archs", []))
        if {"sm_80", "sm_90a", "compute_80"} <= archs and (installed / "build-report.json").is_file():
            return installed
    out = tmp_path_factory.mktemp("aot")
    from flash_attn import aot_build

    aot_build.build(out, "80;90", quiet=True)
    return out


@pytest.fixture(scope="session")
def manifest(aot_dir) -> aot.Manifest:
    return aot.Manifest.load(aot_dir)


@pytest.fixture(scope="session")
def report(aot_dir) -> dict:
    return json.loads((aot_dir / "build-report.json").read_text())


# --- the specialisation set and the selection logic (no build needed) ----------------------------


def _params(causal=False, window=(-1, -1), softcap=0.0, dropout_p=0.0) -> AttentionParams:
    left, right = window
    if causal:
        right = 0
    return AttentionParams(softmax_scale=0.125, window_left=left, window_right=right,
                           softcap=softcap, dropout_p=dropout_p, dropout_seed=0)


def _is_features(spec) -> bool:
    return bool(dict(spec.flags).get("HAS_SOFTCAP"))


def test_spec_set_size_is_deliberate():
    # lean: 4 kernels x 2 dtypes x 4 head-dim buckets; score features: 3 kernels x 2 dtypes x 3
    # buckets; KV cache: 2 dtypes x 3 buckets x (2 split-KV configs + 3 append + 4 rotary + 1
    # combine); the sm_80 image also carries the sm86 configs where they differ
    def counts(capability):
        specs = S.specs_for_capability(capability)
        attention = [s for s in specs if s.kernel not in S.DECODE_KERNELS]
        return (len([s for s in attention if not _is_features(s)]), len([s for s in attention if _is_features(s)]),
                len(specs) - len(attention))

    for capability in ((9, 0), (10, 0), (12, 0)):
        assert counts(capability) == (32, 18, 60)
    lean, features, decode = counts((8, 0))
    assert 32 < lean <= 48 and 18 <= features <= 36 and 60 < decode <= 72
    for spec in (s for s in S.specs_for_capability((8, 0)) if s.kernel not in S.DECODE_KERNELS):
        flags = dict(spec.flags)
        assert flags.get("IS_LOCAL", True) and flags.get("PAD_HEADDIM", True) and flags["IS_VARLEN"]
        assert not any(flags.get(f) for f in S.UNSHIPPED_FLAGS)
        # a variant has all three score features or none
        assert len({flags.get(f, False) for f in S.SCORE_FEATURES}) == 1
        if _is_features(spec):
            assert "AlibiSlopes" not in flags and spec.block_d >= 64


@pytest.mark.parametrize("head_dim,block_d", [(8, 32), (16, 32), (32, 32), (40, 64), (64, 64), (72, 128),
                                              (96, 128), (128, 128), (160, 256), (256, 256)])
def test_head_dims_map_to_padded_buckets(head_dim, block_d):
    spec, why = S.spec_for_call("attn_fwd_kernel", torch.float16, head_dim, configs.pick_config("fwd", head_dim, (8, 0)),
                                {"IS_LOCAL": False, "IS_VARLEN": False})
    assert why == "" and spec.block_d == block_d and dict(spec.flags)["PAD_HEADDIM"]


FEATURES = {"HAS_SOFTCAP": True, "HAS_ALIBI": True, "HAS_DROPOUT": True}


@pytest.mark.parametrize("head_dim,block_d", [(8, 64), (32, 64), (64, 64), (96, 128), (256, 256)])
@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0), (10, 0), (12, 0)])
def test_score_features_map_to_their_variant(head_dim, block_d, capability):
    """Softcap / ALiBi / dropout calls (the launchers set the three flags together) run on the
    score-features variant, which the build ships for every architecture family."""
    for kernel, kind in (("attn_fwd_kernel", "fwd"), ("attn_bwd_dkdv_kernel", "bwd_dkdv"), ("attn_bwd_dq_kernel", "bwd_dq")):
        config = configs.pick_config(kind, head_dim, capability, features=True)
        spec, why = S.spec_for_call(kernel, torch.bfloat16, head_dim, config, dict(FEATURES, IS_LOCAL=True))
        assert why == "" and spec.block_d == block_d and _is_features(spec)
        assert spec in S.specs_for_capability(capability)
    # the backward preprocess has no feature flags: its one variant serves these calls
    spec, why = S.spec_for_call("attn_bwd_preprocess_kernel", torch.float16, head_dim,
                                configs.pick_config("fwd", head_dim, capability), FEATURES)
    assert why == "" and not _is_features(spec)


def test_unshipped_features_say_why():
    spec, why = S.spec_for_call("attn_fwd_kernel", torch.bfloat16, 128, configs.pick_config("fwd", 128, (9, 0)),
                                {"IS_PAGED": True})
    assert spec is None and "paged" in why and "ahead of time" in why


def test_unsupported_calls_say_why():
    cfg = configs.pick_config("fwd", 128, (9, 0))
    assert "multiple of 8" in S.spec_for_call("attn_fwd_kernel", torch.float16, 20, cfg, {})[1]
    assert "fp16/bf16" in S.spec_for_call("attn_fwd_kernel", torch.float32, 64, cfg, {})[1]
    assert "testing" in S.spec_for_call("attn_probs_kernel", torch.float16, 64, cfg, {})[1]
    specs, why = aot.required_specs("forward", torch.float16, 64, (9, 0), {}, return_softmax=True)
    assert specs == [] and "return_attn_probs" in why


def test_dense_as_varlen_rebases_batch_strides():
    # q (b=3, sq=5, h=2, d=64) contiguous: strides (640, 128, 64); lse (3, 2, 5)
    names = ["stride_qb", "stride_qm", "stride_qh", "stride_kb", "stride_kn", "stride_kh", "stride_lb", "stride_lh",
             "stride_ab", "seqlen_q", "seqlen_k", "CuSeqlensQ", "CuSeqlensK"]
    values = dict(stride_qb=640, stride_qm=128, stride_qh=64, stride_kb=7 * 128, stride_kn=128, stride_kh=64,
                  stride_lb=10, stride_lh=5, stride_ab=0, seqlen_q=5, seqlen_k=7)
    out = S.dense_as_varlen(names, values, batch=3)
    # the varlen kernel adds b * stride_b + (b * s) * stride_row: the dense address again
    for b in range(3):
        assert b * out["stride_qb"] + b * 5 * 128 == b * 640
        assert b * out["stride_kb"] + b * 7 * 128 == b * 7 * 128
        assert b * out["stride_lb"] + b * 5 == b * 10
    assert "stride_ab" not in out
    assert out["CuSeqlensQ"] == ("arange", 3, 5) and out["CuSeqlensK"] == ("arange", 3, 7)


def test_pack_arguments_range_checks_int32():
    entry = {"key": "k", "signature": ["*fp16:16", "i32", "fp32", "global_scratch", "profile_scratch"]}
    x = torch.empty(8, dtype=torch.float16)
    tensors, ints, floats = aot.pack_arguments(entry, ["X", "n", "s"], {"X": x, "n": 5, "s": 0.5})
    assert len(tensors) == 1 and ints == [5] and floats == [0.5]
    with pytest.raises(aot.AotUnsupported, match="int32"):
        aot.pack_arguments(entry, ["X", "n", "s"], {"X": x, "n": 2**31, "s": 0.5})


def test_unavailable_reason_on_cpu():
    reason = aot.unavailable_reason(torch.device("cpu"))
    assert reason is not None and "CUDA tensors" in reason


@pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a usable GPU")
def test_unavailable_reason_on_cuda_without_gpu():
    reason = aot.unavailable_reason(torch.device("cuda"))
    assert reason


# --- the build: manifest, signatures, report ------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(BUILT_ARCHS))
@pytest.mark.parametrize("op", ["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_manifest_has_every_spec_the_dispatcher_requests(manifest, arch, op, dtype):
    for capability in BUILT_ARCHS[arch]:
        assert manifest.image_for(capability).arch.name == arch
        for head_dim in (8, 16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256):
            for flags in ({}, {"IS_LOCAL": True}, {"IS_VARLEN": True, "IS_LOCAL": True}, dict(FEATURES),
                          dict(FEATURES, IS_VARLEN=True, IS_LOCAL=True)):
                reason = aot.call_reason(manifest, capability, op, dtype, head_dim, flags)
                assert reason is None, (capability, head_dim, flags, reason)


def test_ptx_covers_newer_gpus(manifest):
    choice = manifest.image_for((13, 0))
    assert choice.kind == "ptx" and choice.arch.name == "compute_80"
    assert aot.call_reason(manifest, (13, 0), "forward", torch.float16, 128, {}) is None
    # a GPU without its own cubin in this build runs the PTX with the configs it was built with:
    # every call (lean, score features, KV cache) finds its specialisation, whatever the family
    for capability in ((10, 0), (10, 3), (12, 0), (12, 1), (13, 0)):
        assert manifest.image_for(capability).kind == "ptx"
        assert aot.config_capability(capability, manifest.image_for(capability)) in ((8, 0), (8, 6))
        for op in ("forward", "backward"):
            for flags in ({}, dict(FEATURES, IS_LOCAL=True)):
                assert aot.call_reason(manifest, capability, op, torch.bfloat16, 96, flags) is None, (capability, op)
        assert aot.kvcache_reason(manifest, capability, torch.float16, 128) is None
    # shared memory decides: sm_100-class PTX devices take the sm80 configs, sm_120-class the sm86 ones
    assert aot.config_capability((10, 3), manifest.image_for((10, 3))) == (8, 0)
    assert aot.config_capability((12, 1), manifest.image_for((12, 1))) == (8, 6)
    assert "no shipped image" in aot.call_reason(manifest, (7, 5), "forward", torch.float16, 128, {})


def test_manifest_entries_come_from_triton_metadata(manifest):
    for entry in manifest.entries.values():
        assert entry["signature"][-2:] == ["global_scratch", "profile_scratch"]
        assert entry["name"] == entry["kernel"]
        flags = dict(tuple(x) for x in entry["spec"]["flags"])
        config = configs.Config(entry["spec"]["block_m"], entry["spec"]["block_n"], entry["spec"]["num_warps"],
                                entry["spec"]["num_stages"])
        if entry["kernel"] in S.DECODE_KERNELS:
            spec = S.decode_spec(entry["kernel"], entry["spec"]["dtype"], entry["constexprs"], config)
        else:
            spec = S.make_spec(entry["kernel"], entry["spec"]["dtype"], entry["spec"]["block_d"], config,
                               flags.get("HAS_SOFTCAP", False))
        assert spec.key == entry["key"]
        assert entry["num_warps"] == spec.num_warps
        assert (manifest.folder / entry["image"]).is_file()


def test_images_are_stored_compressed(manifest):
    """Every image is zlib-compressed on disk and inflates to a cubin (ELF) or PTX text."""
    entries = list(manifest.entries.values())
    for entry in entries[:: max(1, len(entries) // 25)]:
        assert entry["image"].endswith(_aot_library.COMPRESSED_SUFFIX)
        data = _aot_library.read_image(manifest.folder / entry["image"])
        if entry["arch"].startswith("compute_"):
            assert b".entry " + entry["name"].encode() in data
        else:
            assert data[:4] == b"\x7fELF"


def test_signature_agrees_with_an_independent_compile(manifest):
    """Recompile one spec with Triton here and compare its metadata with the manifest."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    entry = manifest.lookup("sm_80", next(k for (a, k) in manifest.entries if a == "sm_80"
                                          and k.startswith("attn_bwd_preprocess_kernel.fp16.d64")))
    spec = S.Spec(**{**entry["spec"], "flags": tuple(tuple(x) for x in entry["spec"]["flags"])})
    sig, attrs = S.signature(spec)
    src = ASTSource(S.kernel_function(spec.kernel), sig, constexprs=spec.constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 80, 32),
                              options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    fresh = _aot_library.manifest_entry(compiled, src)
    for key, value in fresh.items():
        assert entry[key] == value, key


def _library_or_skip():
    if not _aot_library.status().loaded:
        pytest.skip(_aot_library.status().reason)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "compute_80"])
def test_every_image_registers(manifest, arch):
    """``aot_register_kernel`` checks each image's parameter count and sizes (ELF .nv.info / PTX
    .param list) and block size against the manifest's signature and warps."""
    _library_or_skip()
    entries = [e for (a, _), e in manifest.entries.items() if a == arch]
    assert entries
    for entry in entries:
        assert isinstance(_aot_library.register_kernel(manifest.folder / entry["image"], entry), int)


@pytest.fixture
def launched(monkeypatch) -> list:
    """Kernel ids launched through ``_aot_library.launch``, which runs ``aot_launch``'s argument
    checks on meta tensors (no GPU, nothing executed)."""
    ids = []
    real_launch = _aot_library.launch

    def meta_launch(kid, grid, tensors, ints, floats):
        real_launch(kid, grid, [t.to("meta") for t in tensors], ints, floats)
        ids.append(kid)

    monkeypatch.setattr(aot._aot_library, "launch", meta_launch)
    return ids


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0)])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("feature", [None, "softcap", "alibi", "dropout"])
def test_launcher_arguments_pass_the_launch_checks(manifest, monkeypatch, launched, capability, varlen, feature):
    """The real launchers (forward + backward) through the AOT executor; every launch goes through
    ``aot_launch``'s argument checks (count, dtypes, alignment, int ranges) on meta tensors."""
    _library_or_skip()
    from flash_attn.kernels import launch
    from flash_attn.params import VarlenLayout

    monkeypatch.setattr(launch, "_capability", lambda device, interpret: capability)
    arch = manifest.image_for(capability).arch.name
    executor = aot.AotExecutor(manifest, arch)
    params = _params(causal=True, softcap=30.0 if feature == "softcap" else 0.0,
                     dropout_p=0.1 if feature == "dropout" else 0.0)
    slopes = torch.rand(4) if feature == "alibi" else None
    if varlen:
        q = torch.randn(12, 4, 96, dtype=torch.bfloat16)
        k = torch.randn(20, 2, 96, dtype=torch.bfloat16)
        cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
        cu_k = torch.tensor([0, 9, 20], dtype=torch.int32)
        layout = VarlenLayout(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=11)
    else:
        q = torch.randn(2, 7, 4, 96, dtype=torch.bfloat16)
        k = torch.randn(2, 11, 2, 96, dtype=torch.bfloat16)
        layout = None
    v = torch.randn_like(k)
    out, lse, _ = launch.forward(q, k, v, params, varlen=layout, alibi_slopes=slopes, executor=executor)
    launch.backward(torch.randn_like(q), q, k, v, out, lse, params, varlen=layout, alibi_slopes=slopes,
                    executor=executor)
    assert len(launched) == 4


@pytest.mark.parametrize("arch", sorted(BUILT_ARCHS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_manifest_has_every_kvcache_spec(manifest, arch, dtype):
    for capability in BUILT_ARCHS[arch]:
        for head_dim in (8, 64, 72, 128, 136, 256):
            assert aot.kvcache_reason(manifest, capability, dtype, head_dim) is None, (capability, head_dim)
    assert "multiple of 8" in aot.kvcache_reason(manifest, (8, 0), torch.float16, 59)
    assert "fp16/bf16" in aot.kvcache_reason(manifest, (8, 0), torch.float32, 64)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0)])
@pytest.mark.parametrize("paged,rotary,splits", [(False, False, 1), (True, True, 3), (False, True, 3)])
def test_kvcache_launcher_arguments_pass_the_launch_checks(manifest, launched, capability, paged, rotary, splits):
    """The KV-cache launcher in superset mode through the AOT executor: every launch (append,
    rotary, split-KV, combine) maps onto a shipped image and passes ``aot_launch``'s checks."""
    _library_or_skip()
    from flash_attn.kernels import decode_launch
    from flash_attn.params import KVCacheInputs

    arch = manifest.image_for(capability).arch.name
    executor = aot.AotExecutor(manifest, arch)
    b, hk, d = 2, 2, 96
    if paged:
        k_cache = torch.zeros(24, 16, hk, d, dtype=torch.float16)  # 12 pages of 16 rows per sequence
        block_table = torch.arange(24, dtype=torch.int32).reshape(12, 2).t().contiguous()
    else:
        k_cache = torch.zeros(b, 192, hk, d, dtype=torch.float16)
        block_table = None
    cos = sin = None
    if rotary:
        cos, sin = torch.rand(192, d // 2), torch.rand(192, d // 2)
    cache = KVCacheInputs(k_cache=k_cache, v_cache=torch.zeros_like(k_cache),
                          cache_seqlens=torch.tensor([5, 170], dtype=torch.int32),
                          k_new=torch.randn(b, 2, hk, d, dtype=torch.float16),
                          v_new=torch.randn(b, 2, hk, d, dtype=torch.float16), block_table=block_table,
                          rotary_cos=cos, rotary_sin=sin, num_splits=splits)
    q = torch.randn(b, 2, 8, d, dtype=torch.float16)
    decode_launch.forward_kvcache(q, _params(causal=True, softcap=20.0), cache, interpret=False, executor=executor,
                                  superset=True, family=configs.arch_family(capability))
    expected = 1 + (2 if rotary else 1) + (splits > 1)  # append, [rotary q], split-KV, [combine]
    # 192 cache rows are >= 2 key blocks on every family, so 3 requested splits stay > 1
    assert len(launched) == expected


def test_build_report_tensor_cores_and_spills(report):
    """What the build report says about the machine code, stated as measured (Triton 3.9):

    * every forward/backward kernel uses its architecture's tensor-core instructions: ``HMMA``
      (mma.sync) on sm_80 and sm_120a, ``HGMMA`` (wgmma) on sm_90a, ``UTC*MMA`` (tcgen05) on
      sm_100a, with one exception: the two head-dim-256 dK/dV kernels on sm_100a use ``HMMA``.
      tcgen05 needs >= 64 rows per MMA tile, and with 64 key rows the two 64x256 fp32 dK/dV
      accumulators fill all 512 tensor-memory columns (Triton 3.9 then emits an empty kernel),
      so that config keeps 32 key rows; and the head-dim-128 dK/dV kernel of the score-features
      variant on sm_90a (``HMMA``): every wgmma tile of it spills (``configs._FEATURES_TABLE``);
    * no ``LOCAL`` memory anywhere, and no stack frame (no spills) in any kernel with head dim
      <= 128. Head dim 256 may spill (the sm_90a wgmma dK/dV kernel keeps ~0.5 KB of stack: its
      accumulators alone take 128 registers a thread).
    """
    rows = [r for r in report["kernels"] if r["image"] == "cubin"]
    big = [r for r in rows if r["kernel"] in ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")]
    assert big
    # split-KV decode: 16-row tiles are below the wgmma/tcgen05 minimum, so any tensor-core family
    decode = [r for r in rows if r["kernel"] == "split_kv_kernel"]
    assert decode and all(r["sass_mma"] for r in decode), [r["key"] for r in decode if not r["sass_mma"]]
    want_by_arch = {"sm_80": "HMMA", "sm_90a": "HGMMA", "sm_100a": "UTC*MMA", "sm_120a": "HMMA"}
    problems = []
    for r in big:
        want = want_by_arch.get(r["arch"], "HMMA")
        if r["arch"] == "sm_100a" and r["kernel"] == "attn_bwd_dkdv_kernel" and r["block_d"] == 256:
            want = "HMMA"
        if r["arch"] == "sm_90a" and r["kernel"] == "attn_bwd_dkdv_kernel" and r["block_d"] == 128 and r["features"]:
            want = "HMMA"
        if want not in r["sass_mma"]:
            problems.append((r["arch"], r["key"], r["sass_mma"]))
    assert not problems, problems
    assert all(r["local"] == 0 for r in rows)
    spills = [(r["arch"], r["key"], r["reg"], r["stack"]) for r in rows if r["block_d"] <= 128 and r["stack"] != 0]
    assert not spills, spills
    totals = report["totals"]
    assert totals["kernels"] == len(report["kernels"]) and totals["bytes"] > 0 and totals["peak_rss_mb"] > 0
    assert all(r["compile_seconds"] > 0 for r in rows)
    assert report["ptxas"]["sm_80"]["path"]


def test_info_command(aot_dir):
    env = dict(os.environ, FLASH_ATTN_AOT_DIR=str(aot_dir))
    result = subprocess.run([sys.executable, "-m", "flash_attn", "info", "--aot-dir", str(aot_dir)],
                            capture_output=True, text=True, env=env, check=True)
    assert "sm_80" in result.stdout and "sm_90a" in result.stdout and "compute_80" in result.stdout
    assert "specialisations" in result.stdout and "op library" in result.stdout
    data = json.loads(subprocess.run([sys.executable, "-m", "flash_attn", "info", "--json", "--aot-dir", str(aot_dir)],
                                     capture_output=True, text=True, env=env, check=True).stdout)
    assert data["images"] > 0 and data["bytes"] > 0


def test_build_kernels_command_reports_a_failing_arch(tmp_path):
    result = subprocess.run([sys.executable, "-m", "flash_attn", "build-kernels", "--archs", "75", "-o", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "sm_75" in (result.stderr + result.stdout)


def test_resolve_archs_default_keeps_sm80_ptx():
    from flash_attn import aot_build

    assert aot_build.resolve_archs("") == ([80, 90, 100, 120], [80])
    assert aot_build.resolve_archs("90") == ([90], [90])
    assert aot_build.resolve_archs("80;90;compute_80") == ([80, 90], [80])


# --- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_aot_matches_reference_on_gpu(monkeypatch, causal, head_dim):
    if aot.unavailable_reason(torch.device("cuda")) is not None:
        pytest.skip(aot.unavailable_reason(torch.device("cuda")))
    from flash_attn.backends import reference

    q = torch.randn(2, 300, 4, head_dim, dtype=torch.float16, device="cuda", requires_grad=False)
    k = torch.randn(2, 257, 2, head_dim, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    params = _params(causal=causal)
    out, lse, _ = aot.forward(q, k, v, params)
    ref, ref_lse, _ = reference.forward(q.float(), k.float(), v.float(), params)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    dout = torch.randn_like(q)
    dq, dk, dv = aot.backward(dout, q, k, v, out, lse, params)
    rq, rk, rv = reference.backward(dout.float(), q.float(), k.float(), v.float(), ref, ref_lse, params)
    for ours, theirs in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(ours.float(), theirs, atol=1e-2, rtol=1e-2)
