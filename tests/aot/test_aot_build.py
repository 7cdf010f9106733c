"""The ahead-of-time kernel build (``python -m flash_attn build-kernels``) and the ``aot`` backend's
selection logic, without a GPU.

One build per test session: the installed ``flash_attn/_aot/`` when it holds sm_80 and sm_90a
images (``pip install`` with CUDA enabled builds it), else ``build-kernels --archs 80;90`` into a
temporary folder (a few minutes on 2 cores). GPU-only checks are marked ``gpu``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from flash_attn.aot import archs, library as op_library, manifest as aot_manifest, specializations as S  # noqa: E402
from flash_attn.backends import aot  # noqa: E402
from flash_attn.planning import configs, plan as P  # noqa: E402
from flash_attn.params import AttentionParams, VarlenLayout  # noqa: E402

from support.aot_buffers import launched_as, made_buffers  # noqa: E402
from support.calls import attention_calls, beyond_fa2_calls, kvcache_calls  # noqa: E402

HAS_GPU = torch.cuda.is_available()
BUILT_ARCHS = {"sm_80": [(8, 0), (8, 6), (8, 9)], "sm_90a": [(9, 0)]}


@pytest.fixture(scope="session")
def aot_dir(tmp_path_factory) -> Path:
    installed = aot_manifest.find_manifest_dir()
    if installed is not None and os.environ.get("FLASH_ATTN_TEST_REBUILD") != "1":
        archs = set(json.loads((installed / "manifest.json").read_text()).get("archs", []))
        if {"sm_80", "sm_90a", "compute_80"} <= archs and (installed / "build-report.json").is_file():
            return installed
    out = tmp_path_factory.mktemp("aot")
    from flash_attn.kernel_build import build as aot_build

    aot_build.build(out, "80;90", quiet=True)
    return out


@pytest.fixture(scope="session")
def manifest(aot_dir) -> aot_manifest.Manifest:
    return aot_manifest.Manifest.load(aot_dir)


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
    # lean: 4 kernels (forward, preprocess, split dK/dV and dQ) x 2 dtypes x 4 head-dim buckets;
    # score features: 3 kernels x 2 dtypes x 3 buckets; KV cache: 2 dtypes x 3 buckets x (2 split-KV
    # configs + 3 append + 4 rotary + 1 combine); the sm_80 image also carries the sm86 configs
    # where they differ
    def counts(capability):
        specs = S.specs_for_capability(capability)
        attention = [s for s in specs if s.kernel not in S.DECODE_KERNELS]
        return (len([s for s in attention if not _is_features(s)]), len([s for s in attention if _is_features(s)]),
                len(specs) - len(attention))

    # sm_90a: + the fused backward, its dQ convert, and the exact-call forward and fused backward
    # at head dims 64, 128 and 256 in both dtypes, + the plain decoding step's exact split-KV image
    # (2 dtypes x 3 buckets); Blackwell: + the fused backward and its dQ convert (no exact-call
    # images); sm_120: the split kernels, + the exact-call forward (3 head dims x 2 dtypes) and the
    # exact split-KV image (2 dtypes x 3 buckets); sm_80: + the exact-call forward and (at head dim
    # 128, the only bucket with a fused backward there) fused backward, and the exact split-KV
    # images of its two tables (sm80 and sm86: 2 x 6). Beyond FlashAttention-2 (sm_80 and sm_90a, lean, 2
    # dtypes): head dim 512 (forward, preprocess, dK/dV, dQ; no fused backward on sm_90a: it failed
    # on an H200) and the 256/128 pair (the same kernels + on sm_90a the fused backward and its
    # convert, d256's); MLA decoding on sm_90a (2 split-KV + 3 append + 1 combine)
    assert counts((9, 0)) == (32 + 8 + 8 + 12 + 8 + 10, 18 + 6, 60 + 6 + 12)
    assert counts((10, 0)) == (32 + 8 + 8, 18 + 6, 60)
    assert counts((12, 0)) == (32 + 6, 18, 60 + 6)
    lean, features, decode = counts((8, 0))
    assert 32 + 8 + 8 + 8 < lean <= 48 + 8 + 8 + 8 and 18 <= features <= 36 and 60 + 12 < decode <= 72 + 12
    for spec in (s for s in S.specs_for_capability((8, 0)) if s.kernel not in S.DECODE_KERNELS):
        flags = dict(spec.flags)
        if not flags.get("IS_LOCAL", True):  # an exact-call image: full attention, unpadded, lean
            assert not flags["PAD_HEADDIM"] and not _is_features(spec) and spec.block_d in (64, 128, 256)
            assert spec.kernel in ("attn_fwd_kernel", "attn_bwd_kernel")
            continue
        assert flags.get("PAD_HEADDIM", True) and not flags.get("IS_PAGED")
        # a variant has all three score features or none
        assert len({flags.get(f, False) for f in ("HAS_SOFTCAP", "HAS_ALIBI", "HAS_DROPOUT")}) == 1
        if _is_features(spec):
            assert "AlibiSlopes" not in flags and spec.block_d >= 64


def _planned_specs(op, args, kwargs, target):
    """The specialisations the ahead-of-time planner launches for one call (or its refusal)."""
    describe, planner = {"forward": (P.describe_forward, P.plan_forward),
                         "backward": (P.describe_backward, P.plan_backward),
                         "forward_kvcache": (P.describe_kvcache, P.plan_kvcache)}[op]
    planned = planner(describe(*args, **kwargs), target)
    if isinstance(planned, P.Refusal):
        return planned
    dtype = S.dtype_name(planned.dtype)
    return [S.Spec.of(launch.kernel, dtype, launch.constexprs, launch.config) for launch in planned.launches]


def _all_calls(dtype, head_dim):
    yield from attention_calls(dtype, head_dim)
    yield from kvcache_calls(dtype, head_dim)


@pytest.mark.parametrize("family", ["sm80", "sm86", "sm90", "sm100", "sm120"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_planned_launch_is_shipped(family, dtype):
    """Every call (dense, varlen, each mask, each score feature, forward, backward, KV cache with
    and without pages, rotary, left padding, batch indices) planned for a GPU of ``family`` launches
    only specialisations the build ships for that family, whatever the head dim (multiple of 8)."""
    shipped = set(S.specs_for_capability(S.family_capability(family)))
    target = P.Target(family, 132, aot=True)
    for head_dim in (8, 32, 40, 64, 96, 128, 160, 256):
        for name, op, args, kwargs in _all_calls(dtype, head_dim):
            specs = _planned_specs(op, args, kwargs, target)
            assert not isinstance(specs, P.Refusal), f"{name} {op} d{head_dim}: refused ({specs})"
            missing = [spec.key for spec in specs if spec not in shipped]
            assert not missing, f"{name} {op} d{head_dim} on {family}: {missing}"


@pytest.mark.parametrize("family", ["sm80", "sm86", "sm90", "sm100", "sm120"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_calls_beyond_fa2_run_on_shipped_images_or_are_refused(family, dtype):
    """Calls beyond flash-attn 2.8 (v's own head dim, sinks, head dim 512, MLA decoding) planned
    for a GPU of ``family``: on the families whose images hold them, only shipped specialisations
    (v's own head dim everywhere: the 256/128 pair images or the square image of the wider head
    dim); elsewhere refused before anything runs, naming why."""
    shipped = set(S.specs_for_capability(S.family_capability(family)))
    target = P.Target(family, 132, aot=True)
    for name, op, args, kwargs, needs in beyond_fa2_calls(dtype):
        specs = _planned_specs(op, args, kwargs, target)
        if needs is not None and family not in needs:
            assert isinstance(specs, P.Refusal), f"{name} {op} on {family}: planned, but its images do not ship"
            assert "head dimension 512" in specs.reason or "qv" in specs.reason, specs.reason
            continue
        assert not isinstance(specs, P.Refusal), f"{name} {op} on {family}: refused ({specs})"
        missing = [spec.key for spec in specs if spec not in shipped]
        assert not missing, f"{name} {op} on {family}: {missing}"
        if name.startswith("d192v128") and family in ("sm80", "sm90") and op != "forward_kvcache":
            blocks = {(spec.block_d, dict(spec.flags).get("BLOCK_DV")) for spec in specs if spec.kernel in S.ATTENTION_KERNELS
                      and spec.kernel not in ("attn_bwd_dq_convert_kernel",)}
            assert blocks == {(256, 128)} or "softcap" in name, (name, op, blocks)  # the pair images


@pytest.mark.parametrize("head_dim,block_d,features_block_d", [(8, 32, 64), (32, 32, 64), (40, 64, 64), (64, 64, 64),
                                                               (72, 128, 128), (128, 128, 128), (160, 256, 256)])
def test_head_dims_map_to_their_bucket(head_dim, block_d, features_block_d):
    """The ahead-of-time images are per head-dim bucket; the run-time head dim masks the rest
    (full attention with a head dim equal to its bucket runs sm90's exact-call image, unmasked)."""
    target = P.Target("sm90", 132, aot=True)
    for name, op, args, kwargs in attention_calls(torch.bfloat16, head_dim):
        if op != "forward":
            continue
        (spec,) = _planned_specs(op, args, kwargs, target)
        mask, feature = name.split("-")[:2]
        want = features_block_d if feature != "none" else block_d
        exact = mask == "full" and feature == "none" and head_dim == block_d and block_d in (64, 128, 256)
        assert spec.block_d == want and dict(spec.flags)["PAD_HEADDIM"] == (not exact), name
        assert dict(spec.flags)["IS_LOCAL"] == (not exact), name


def test_unshipped_calls_are_refused_with_the_reason():
    target = P.Target("sm90", 132, aot=True)
    q = torch.empty(2, 64, 4, 128, dtype=torch.float16, device="meta")
    params = _params()
    why = lambda **kw: P.plan_forward(P.describe_forward(q, q, q, params, **kw), target)  # noqa: E731
    assert "testing" in why(return_softmax=True).reason
    pages = torch.empty(8, 16, 4, 128, dtype=torch.float16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    paged = P.plan_forward(P.describe_forward(q[0], pages, pages, params, VarlenLayout(
        cu, cu, 64, 64, torch.empty(2, 4, dtype=torch.int32, device="meta"))), target)
    assert "paged" in paged.reason and "ahead of time" in paged.reason
    odd = torch.empty(2, 64, 4, 20, dtype=torch.float16, device="meta")
    assert "multiple of 8" in P.plan_forward(P.describe_forward(odd, odd, odd, params), target).reason
    fp32 = q.float()
    assert "fp16/bf16" in P.plan_forward(P.describe_forward(fp32, fp32, fp32, params), target).reason
    # the JIT backends run what the images do not
    jit = P.Target("sm90", 132)
    assert isinstance(P.plan_forward(P.describe_forward(odd, odd, odd, params), jit), P.Plan)


def test_pack_checks_int32_and_the_image_signature():
    entry = {"key": "k", "signature": ["*fp16:16", "i32", "fp32", "global_scratch", "profile_scratch"]}
    launch = P.Launch("k", (1, 1, 1), (("X", P.Slot("x")), ("n", 5), ("s", 0.5)), {}, configs.Config(0, 0, 4, 1))
    packed = aot.pack(launch, entry)
    assert packed.slots == ["x"] and packed.ints == [5] and packed.floats == [0.5]
    too_big = P.Launch("k", (1, 1, 1), (("X", P.Slot("x")), ("n", 2**31), ("s", 0.5)), {}, launch.config)
    refused = aot.pack(too_big, entry)
    assert "int32" in refused.reason and refused.by == P.IMAGES
    stale = P.Launch("k", (1, 1, 1), (("X", P.Slot("x")), ("n", 5)), {}, launch.config)
    refused = aot.pack(stale, entry)
    assert "rebuild" in refused.reason and refused.by == P.IMAGES


def test_unavailable_reason_on_cpu():
    reason = aot.unavailable_reason(torch.device("cpu"))
    assert reason is not None and "CUDA tensors" in reason


@pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a usable GPU")
def test_unavailable_reason_on_cuda_without_gpu():
    reason = aot.unavailable_reason(torch.device("cuda"))
    assert reason


# --- the build: manifest, signatures, report ------------------------------------------------------


def _missing_from_manifest(manifest, capability, dtype, head_dims=(8, 40, 64, 96, 128, 160, 256)):
    """Planned specialisations for a device of ``capability`` that its image does not ship."""
    choice = manifest.image_for(capability)
    family = configs.arch_family(archs.config_capability(capability, choice))
    target = P.Target(family, 132, aot=True)
    missing = []
    for head_dim in head_dims:
        for name, op, args, kwargs in _all_calls(dtype, head_dim):
            specs = _planned_specs(op, args, kwargs, target)
            assert not isinstance(specs, P.Refusal), (name, op, head_dim, specs)
            missing += [(name, op, head_dim, s.key) for s in specs if manifest.lookup(choice.arch.name, s.key) is None]
    return missing


@pytest.mark.parametrize("arch", sorted(BUILT_ARCHS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_manifest_has_every_spec_the_planner_launches(manifest, arch, dtype):
    for capability in BUILT_ARCHS[arch]:
        assert manifest.image_for(capability).arch.name == arch
        assert _missing_from_manifest(manifest, capability, dtype) == []


def test_ptx_covers_newer_gpus(manifest):
    choice = manifest.image_for((13, 0))
    assert choice.kind == "ptx" and choice.arch.name == "compute_80"
    # a GPU without its own cubin in this build runs the PTX with the configs it was built with:
    # every call (lean, score features, KV cache) finds its specialisation, whatever the family
    for capability in ((10, 0), (10, 3), (12, 0), (12, 1), (13, 0)):
        assert manifest.image_for(capability).kind == "ptx"
        assert archs.config_capability(capability, manifest.image_for(capability)) in ((8, 0), (8, 6))
        assert _missing_from_manifest(manifest, capability, torch.bfloat16, head_dims=(96,)) == []
    # shared memory decides: sm_100-class PTX devices take the sm80 configs, sm_120-class the sm86 ones
    assert archs.config_capability((10, 3), manifest.image_for((10, 3))) == (8, 0)
    assert archs.config_capability((12, 1), manifest.image_for((12, 1))) == (8, 6)
    assert "no shipped image" in manifest.image_for((7, 5)).reason


def test_manifest_entries_come_from_triton_metadata(manifest):
    for entry in manifest.entries.values():
        assert entry["signature"][-2:] == ["global_scratch", "profile_scratch"]
        assert entry["name"] == entry["kernel"]
        spec = S.Spec(**{**entry["spec"], "flags": tuple(tuple(x) for x in entry["spec"]["flags"])})
        assert spec.key == entry["key"] and spec.constexprs == entry["constexprs"]
        assert entry["num_warps"] == spec.num_warps
        assert (manifest.folder / entry["image"]).is_file()
        # what a driver needs to load it (flash_attn.backends.aot never picks an image it cannot load)
        assert re.fullmatch(r"\d+\.\d+", entry["ptxas"]) and re.fullmatch(r"\d+\.\d+", entry["ptx_isa"])


def test_images_are_stored_compressed(manifest):
    """Every image is zlib-compressed on disk and inflates to a cubin (ELF) or PTX text."""
    entries = list(manifest.entries.values())
    for entry in entries[:: max(1, len(entries) // 25)]:
        assert entry["image"].endswith(op_library.COMPRESSED_SUFFIX)
        data = op_library.read_image(manifest.folder / entry["image"])
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
    fresh = op_library.manifest_entry(compiled, src)
    for key, value in fresh.items():
        assert entry[key] == value, key


def _library_or_skip():
    if not op_library.status().loaded:
        pytest.skip(op_library.status().reason)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "compute_80"])
def test_every_image_registers(manifest, arch):
    """``aot_register_kernel`` checks each image's parameter count and sizes (ELF .nv.info / PTX
    .param list) and block size against the manifest's signature and warps."""
    _library_or_skip()
    entries = [e for (a, _), e in manifest.entries.items() if a == arch]
    assert entries
    for entry in entries:
        assert isinstance(op_library.register_kernel(manifest.folder / entry["image"], entry), int)


@pytest.fixture
def launched(monkeypatch) -> list:
    """Kernel ids launched by the ``aot`` backend, through ``aot_run``'s real checks on meta
    tensors (argument count, dtypes, int ranges, declared divisibility; no GPU, nothing executed)."""
    ids = []
    real = aot._launch

    def checked(launches, *call):
        made = real(launches, *call)
        ids.extend(p.kernel for p in launches.packed)
        return made

    monkeypatch.setattr(aot, "_launch", checked)
    return ids


def images_for(monkeypatch, manifest, capability):
    """The ``aot`` backend as it runs on a device of ``capability``, for meta tensors."""
    choice = manifest.image_for(capability)
    family = configs.arch_family(archs.config_capability(capability, choice))
    images = aot._DeviceImages(manifest, choice.arch.name, P.Target(family, 132, aot=True))
    monkeypatch.setattr(aot, "_device_images", lambda device: images)
    return images


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_call_passes_the_launch_checks(manifest, monkeypatch, launched, capability, dtype):
    """Every representative call through the ``aot`` backend: packed onto shipped images and
    launched through ``aot_launch``'s argument checks (meta tensors)."""
    _library_or_skip()
    images_for(monkeypatch, manifest, capability)
    for head_dim in (40, 128):
        for name, op, args, kwargs in _all_calls(dtype, head_dim):
            runner = aot.BACKEND.prepare[op](*args, **kwargs)
            assert not isinstance(runner, P.Refusal), (name, op, runner)
            before = len(launched)
            runner()
            assert len(launched) > before, (name, op)


def test_a_new_key_length_is_written_from_its_template(manifest, monkeypatch):
    """A decode loop's growing cache (Hugging Face's layout: ``(b, hk, s, d)`` transposed): the
    ``aot`` backend writes each key length's launches from one template, and they are exactly the
    launches it packs from the planner's own plan of that call."""
    _library_or_skip()
    images = images_for(monkeypatch, manifest, (9, 0))
    backend = aot._backend
    q = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16, device="meta")
    for length in (1000, 1001, 4097, 1, 1000):
        k = v = torch.empty(1, 8, length, 128, dtype=torch.bfloat16, device="meta").transpose(1, 2)
        shape = P.describe_forward(q, k, v, _params(causal=True))
        got = backend._by_shape(images.plans, P.plan_forward, shape, images.target, q.device)
        want = backend.executable(P.plan_forward(shape, images.target), images.target, q.device)
        assert torch.equal(got.launches.plan, want.launches.plan), length
        assert (got.launches.packed, got.launches.names, got.launches.rows) == \
            (want.launches.packed, want.launches.names, want.launches.rows)
        assert not any(isinstance(v, P.Extent) for p in got.launches.packed for v in p.ints)
    assert sum(1 for key in images.plans._values if "template" in key) == 1


def test_a_growing_caches_calls_run_their_classs_template(manifest, monkeypatch):
    """The public calls of a growing cache (one class of signatures, flash_attn.params.KeyLengths:
    the ``aot`` backend holds one template for it): each call's plan, with the row counts it passes
    put where the plan names them, is what the planner's own plan of that call packs to (CPU
    tensors, the launch itself left out). The class's first two joining lengths are written from
    the template on the known route; from then on its lane runs the template itself, each call's
    key length and k/v strides passed per call, one plan tensor for every length."""
    from flash_attn import dispatch, flash_attn_func, validation  # noqa: PLC0415
    from flash_attn.params import KeyLengths  # noqa: PLC0415

    _library_or_skip()
    images = images_for(monkeypatch, manifest, (9, 0))
    monkeypatch.setattr(dispatch, "route", lambda device: dispatch.Route(torch.device(device), ("aot",)))
    monkeypatch.setattr(dispatch, "_chains", {})
    monkeypatch.setattr(validation, "_checked", {})
    written, keys = [], []
    monkeypatch.setattr(aot, "_launch", lambda launches, *call: written.append((launches.plan, call[1])) or made_buffers(
        launches, *call))
    real_known = dispatch.run_known
    monkeypatch.setattr(dispatch, "run_known", lambda op, device, call, *a: keys.append(call) or real_known(
        op, device, call, *a))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 32, 128, generator=g).to(torch.bfloat16)
    cache = torch.randn(1, 8, 4100, 128, generator=g).to(torch.bfloat16)
    flat = torch.randn(8 * 4100 * 128, generator=g).to(torch.bfloat16)  # for torch.cat's layout: strides per length
    params = AttentionParams(128 ** -0.5, -1, 0)
    lengths = (1000, 1001, 4097, 1, 1000, 2048, 3, 4100)
    for length in lengths:
        kv = (cache[:, :, :length], flat[:8 * length * 128].view(1, 8, length, 128))
        for k in kv:
            k = v = k.transpose(1, 2)
            flash_attn_func(q, k, v, causal=True)
            planned = P.plan_forward(P.describe_forward(q, k, v, params), images.target)
            want = aot._backend.executable(planned, images.target, q.device)
            plan, rows = written[-1]
            assert launched_as(plan, rows) == launched_as(want.launches.plan, ()), (length, k.stride())
    # on the known route: the first length (planned, a plain key), the class's first two joining
    # signatures (filled in), the first met again (its held plan); the others on the class's lane
    assert len(written) == 2 * len(lengths) and [type(key) for key in keys] == [int, KeyLengths, KeyLengths, int]
    assert len({id(plan) for plan, _ in written[3:] if plan is not written[0][0]}) == 1  # the class's one plan


def test_build_report_tensor_cores_and_spills(report):
    """What the build report says about the machine code, stated as measured (Triton 3.9):

    * every forward/backward kernel uses its architecture's tensor-core instructions (``mma``:
      read from the SASS for kernels with a stack frame, else what the PTX's MMA instructions
      assemble to, which ptxas cannot change): ``HMMA``
      (mma.sync) on sm_80 and sm_120a, ``HGMMA`` (wgmma) on sm_90a, ``UTC*MMA`` (tcgen05) on
      sm_100a, with one exception: the two head-dim-256 dK/dV kernels on sm_100a use ``HMMA``.
      tcgen05 needs >= 64 rows per MMA tile, and with 64 key rows the two 64x256 fp32 dK/dV
      accumulators fill all 512 tensor-memory columns (Triton 3.9 then emits an empty kernel),
      so that config keeps 32 key rows;
    * no ``LOCAL`` memory anywhere, and no stack frame (no spills) in any kernel with head dim
      <= 128 but the fused backward, on sm_90a the dK/dV kernel that walks its tiles, and the
      mma.sync training images (sm_80: forward and dK/dV) whose FlashAttention-2 tiles keep a
      few spills (issue 48: their floors and the bound on spills in their loops are
      tests/aot/test_mma_sync_floors.py's; ptxas 13.0: the d128 forward 128x64 40 B, dK/dV
      32x128 304 B, 8 spill instructions in either loop). Head dim 256 may spill. The fused
      backward (128 keys x head dim of dK and dV, 128 registers a thread, plus S, dP and dQ)
      spills by design, measured with ptxas 13.0 on sm_90a: d64 184 B, d128 552 B (score
      features 1128 B), and the sm_90a dK/dV kernel on the same tiles 24-176 B; on sm_80 (d128)
      616 B, none in its loop; kept under 1.5 KB at head dims <= 128 (what the tuning sweep
      weighs against smaller tiles).
    """
    rows = [r for r in report["kernels"] if r["image"] == "cubin"]
    big = [r for r in rows if r["kernel"] in ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")]
    assert big
    # split-KV decode: 16-row tiles are below the wgmma/tcgen05 minimum, so any tensor-core family
    decode = [r for r in rows if r["kernel"] == "split_kv_kernel"]
    assert decode and all(r["mma"] for r in decode), [r["key"] for r in decode if not r["mma"]]
    want_by_arch = {"sm_80": "HMMA", "sm_90a": "HGMMA", "sm_100a": "UTC*MMA", "sm_120a": "HMMA"}
    problems = []
    for r in big:
        want = want_by_arch.get(r["arch"], "HMMA")
        if r["arch"] == "sm_100a" and r["kernel"] == "attn_bwd_dkdv_kernel" and r["block_d"] == 256:
            want = "HMMA"
        if want not in r["mma"]:
            problems.append((r["arch"], r["key"], r["mma"]))
    assert not problems, problems
    assert all(r["local"] == 0 for r in rows)
    fused_tiles = lambda r: r["kernel"] == "attn_bwd_kernel" or (  # noqa: E731
        r["kernel"] == "attn_bwd_dkdv_kernel" and r["arch"] == "sm_90a") or (
        r["kernel"] in ("attn_fwd_kernel", "attn_bwd_dkdv_kernel") and r["arch"] == "sm_80")
    spills = [(r["arch"], r["key"], r["reg"], r["stack"]) for r in rows
              if r["block_d"] <= 128 and r["stack"] != 0 and not fused_tiles(r)]
    assert not spills, spills
    fused = [(r["arch"], r["key"], r["stack"]) for r in rows if fused_tiles(r) and r["block_d"] <= 128]
    assert fused and all(stack <= 1536 for _, _, stack in fused), fused
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


def test_resolve_archs():
    from flash_attn.kernel_build import build as aot_build

    names = lambda archs: [a.name for a in archs]  # noqa: E731
    cubins, ptxs = aot_build.resolve_archs("")
    # the default: family cubins for Blackwell and Thor where this ptxas assembles them
    assert {"sm_80", "sm_90a"} <= set(names(cubins)) and names(ptxs) == ["compute_80"]
    targets = aot_build.ptxas_targets(100)
    for family in ("sm_100f", "sm_110f", "sm_120f"):
        assert (family in names(cubins)) == (family in targets)
    assert tuple(map(names, aot_build.resolve_archs("90"))) == (["sm_90a"], [])  # sm_90a PTX is not portable
    with pytest.raises(SystemExit, match="portable"):
        aot_build.resolve_archs("90;compute_90")
    assert tuple(map(names, aot_build.resolve_archs("80;90;compute_80"))) == (["sm_80", "sm_90a"], ["compute_80"])
    # one compile feeds a family group: Thor's image comes from the sm_100 compile
    from flash_attn.aot.archs import parse_arch

    assert [aot_build.triton_capability(parse_arch(a)) for a in ("sm_100f", "sm_110f", "sm_120f", "sm_90a")] == \
        [100, 100, 120, 90]


@pytest.mark.parametrize("fp_fusion", ["1", "0"])
def test_a_family_target_is_assembled_once_per_image(monkeypatch, tmp_path, fp_fusion):
    """The sm_100 compile feeds sm_100f and sm_110f: ptxas runs once for each of them and never
    for Triton's own sm_100a (whose cubin the build would throw away), with Triton's options
    (``--fmad=false`` where the build turns FP fusion off), and each image is a cubin for the
    target it is filed under (as cuobjdump reads its ELF header)."""
    from flash_attn.kernel_build import build as aot_build

    if not {"sm_100f", "sm_110f"} <= aot_build.ptxas_targets(100):
        pytest.skip("this ptxas does not assemble the sm_100f / sm_110f family targets (CUDA < 12.9)")
    spec = next(s for s in S.specs_for_capability((10, 0)) if s.kernel == "attn_bwd_preprocess_kernel")
    ptxas_runs = {}
    real_run = subprocess.run

    def recording_run(cmd, *args, **kwargs):
        for a in cmd:
            if isinstance(a, str) and a.startswith("--gpu-name="):
                ptxas_runs.setdefault(a.split("=", 1)[1], []).append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", recording_run)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", fp_fusion)
    result = aot_build.compile_job({"spec": aot_build.job_spec(spec), "cap": 100, "out": str(tmp_path), "cubins": ["sm_100f", "sm_110f"],
                                    "ptx": [], "cuobjdump": aot_build.cuobjdump_path()})
    monkeypatch.undo()
    assert {arch: len(runs) for arch, runs in ptxas_runs.items()} == {"sm_100f": 1, "sm_110f": 1}, ptxas_runs
    assert all(("--fmad=false" in runs[0]) == (fp_fusion == "0") for runs in ptxas_runs.values()), ptxas_runs
    cuobjdump = aot_build.cuobjdump_path()
    for entry, _ in result["rows"]:
        cubin = tmp_path / "check.cubin"
        cubin.write_bytes(op_library.read_image(tmp_path / entry["image"]))
        listing = subprocess.run([cuobjdump, "--list-elf", str(cubin)], capture_output=True, text=True, check=True)
        # cuobjdump names a family cubin by its base (sm_100f -> sm_100), an arch-specific one in full
        assert f".{entry['arch'].removesuffix('f')}.cubin" in listing.stdout, (entry["arch"], listing.stdout)


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
