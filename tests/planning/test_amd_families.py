"""The AMD families (ROCm PyTorch): devices matched by ``gcnArchName``, their launch tables, and the
planner's choices on a simulated ROCm device of each family.

No AMD GPU is available to this project: a ROCm device is simulated by stubbing what the code
reads of PyTorch (``torch.version.hip``, ``torch.cuda.is_available``, ``get_device_properties``
with a ``gcnArchName`` and a CU count). What that stands in for: ROCm PyTorch's own answers on an
MI300X, MI355X, RX 7900 XTX or RX 9070 XT. What it cannot show: that the compiled kernels run
there (tests/backends/test_rocm_simulated.py checks their results in Triton's interpreter and
compiles them for the target; no GPU runs them).
"""

from __future__ import annotations

import runpy
import types
from pathlib import Path

import pytest
import torch

from flash_attn import limits
from flash_attn.aot import specializations as S
from flash_attn.params import AttentionParams, KVCacheInputs
from flash_attn.planning import configs, decode_configs as dc, families, plan as P
from support import rocm

KB = 1024
DEVICES = {name: family for name, (family, _) in rocm.DEVICES.items()}
AMD = families.of_vendor("amd")


@pytest.mark.parametrize("gcn_arch,family", list(DEVICES.items()))
def test_gcn_arch_names_map_to_their_family(gcn_arch, family):
    assert families.arch_family(gcn_arch) == family
    record = families.get(family)
    assert record.vendor == "amd" and record.image_capability is None  # Triton's JIT only
    assert record.wave_size == (64 if family.startswith("cdna") else 32)
    assert record.mma == ("mfma" if family.startswith("cdna") else "wmma")


def test_amd_records_state_their_lds_and_targets():
    assert {name: families.get(name).shared_memory for name in AMD} == {
        "cdna3": 64 * KB, "cdna4": 160 * KB, "rdna3": 64 * KB, "rdna4": 64 * KB}
    assert [families.triton_target(name) for name in AMD] == [
        ("hip", "gfx942", 64), ("hip", "gfx950", 64), ("hip", "gfx1100", 32), ("hip", "gfx1201", 32)]
    assert families.triton_target("sm90") == ("cuda", 90, 32)


@pytest.mark.parametrize("gcn_arch", ["gfx90a:sramecc+:xnack-", "gfx908", "gfx1030", "gfx1151"])
def test_other_amd_gpus_are_in_no_family_and_say_why(gcn_arch):
    with pytest.raises(ValueError, match=f"AMD GPU {gcn_arch.split(':')[0]} is in no GPU family.*gfx942"):
        families.arch_family(gcn_arch)


def test_nvidia_capabilities_never_match_an_amd_family():
    for capability in ((8, 0), (9, 0), (9, 4), (11, 0), (12, 0)):
        assert families.get(families.arch_family(capability)).vendor == "nvidia"


def test_a_family_record_checks_vendor_and_matcher():
    with pytest.raises(ValueError, match="matched by GcnArchs"):
        families.Family("x", "amd", families.Capabilities((9, 4)), 64 * KB, "mfma", None)
    with pytest.raises(ValueError, match="unknown vendor"):
        families.Family("x", "intel", families.GcnArchs(("gfx942",)), 64 * KB, "mfma", None)


@pytest.mark.parametrize("family", AMD)
def test_every_amd_config_is_a_valid_launch_on_its_gpu(family):
    """Whatever head dim (1..512, bar a refused bucket) and variant a call has, its config on an AMD family is a valid
    workgroup there: at most 1024 threads (num_warps x the wave size), MMA-sized tiles, none of
    NVIDIA's TMA switches. Its LDS is the compiler's count, held against the family's limit for
    every entry in tests/aot/test_amd_kernels.py (configs.estimate_shared_memory models NVIDIA's
    pipelines, not the AMD backend's, which keeps Q in registers and stages K/V once)."""
    for kind in configs.KINDS:
        for features in (False, True):
            for headdim in range(1, limits.MAX_HEADDIM + 1):
                if configs.refusal(headdim, family):
                    continue
                config = configs.pick(kind, headdim, family, features=features)
                if config is None:
                    assert kind == "bwd_fused" and configs.pick("bwd_dkdv", headdim, family, features)
                    continue
                assert config.block_m % 16 == 0 and config.block_n % 16 == 0, (kind, headdim, config)
                assert configs.threads(config, family) <= 1024 and config.num_stages >= 1
                assert not (config.tma or config.ws or config.dq_tma)  # NVIDIA's tensor memory accelerator
    for bucket in dc.HEADDIM_BUCKETS:
        if configs.refusal(bucket, family):
            continue
        for config in dc.bucket_configs(family, bucket):
            assert configs.threads(config, family) <= 1024
    for config in (dc.AUX_CONFIG, dc.ROTARY_CONFIG, dc.COMBINE_CONFIG):
        assert configs.threads(config, family) <= 1024


def test_num_warps_counts_waves_of_the_family():
    config = configs.Config(128, 64, 4, 2)
    assert configs.threads(config, "cdna3") == 256 and configs.threads(config, "rdna3") == 128
    assert configs.threads(config, "sm90") == 128


def test_compiler_options_carry_the_amd_knobs_on_amd_only():
    config = configs.Config(128, 32, 4, 2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1)
    assert configs.compiler_options(config, "cdna3") == dict(num_warps=4, num_stages=2, waves_per_eu=2,
                                                             matrix_instr_nonkdim=16, kpack=1)
    assert configs.compiler_options(config, "sm80") == dict(num_warps=4, num_stages=2)  # NVIDIA's backend refuses them
    assert configs.compiler_options(config, "interpret") == dict(num_warps=4, num_stages=2)


def test_amd_rows_are_one_per_bucket_and_a_missing_one_fails_loudly(monkeypatch):
    """Issue 44's bucket 512 on AMD: one row per family; without it the tables refuse to load."""
    rows = {"cdna3": {32: (configs.Config(64, 64, 4, 2),) * 3 + (None,)}}
    with pytest.raises(ValueError, match="cdna3: rows for head-dim buckets \\[32\\]; one per head-dim bucket"):
        configs._amd_rows(rows)
    monkeypatch.setattr(limits, "HEADDIM_BUCKETS", (*limits.HEADDIM_BUCKETS, 512))
    with pytest.raises(ValueError, match="one per head-dim bucket"):
        runpy.run_path(str(Path(configs.__file__)), run_name="configs_copy")


@pytest.fixture
def refused_256(monkeypatch):
    """cdna3's head-dim-256 row made a refusal (what a bucket a family cannot run looks like)."""
    why = "made up for the test"
    table, _, refused = configs._amd_rows({**configs._AMD, "cdna3": {**configs._AMD["cdna3"], 256: configs.Refused(why)}})
    monkeypatch.setattr(configs, "_REFUSED", refused)
    monkeypatch.setattr(configs, "_TABLE", {**configs._TABLE, **table})
    return why


def test_a_refused_bucket_is_refused_with_its_reason_by_the_planner(refused_256):
    assert configs.refusal(200, "cdna3") == refused_256 and configs.refusal(128, "cdna3") is None
    assert configs.refusal(200, "cdna4") == refused_256  # its child inherits the row
    with pytest.raises(ValueError, match=refused_256):
        configs.pick("fwd", 256, "cdna3")
    q = torch.empty(2, 64, 4, 256, dtype=torch.bfloat16, device="meta")
    planned = P.plan_forward(P.describe_forward(q, q, q, AttentionParams(0.0625, -1, 0)), P.Target("cdna3", 304))
    assert isinstance(planned, P.Refusal) and refused_256 in planned.reason and "256" in planned.reason
    cache = KVCacheInputs(q, q, torch.empty(2, dtype=torch.int32, device="meta"))
    planned = P.plan_kvcache(P.describe_kvcache(q[:, :1], AttentionParams(0.0625, -1, 0), cache),
                             P.Target("cdna3", 304))
    assert isinstance(planned, P.Refusal) and refused_256 in planned.reason
    assert all(spec.block_d != 256 for spec in S.attention_specs("cdna3", "bf16"))


# --- a simulated ROCm device ----------------------------------------------------------------------


@pytest.fixture
def rocm_device(monkeypatch):
    """``rocm_device(gcn_arch)``: PyTorch answering as ROCm with that AMD GPU (support/rocm.py)."""
    from flash_attn.backends import triton as triton_backend

    yield lambda gcn_arch: rocm.simulate(monkeypatch, gcn_arch)
    triton_backend._device_target.cache_clear()


@pytest.mark.parametrize("gcn_arch,family", list(DEVICES.items()))
def test_triton_backend_takes_a_rocm_device_with_its_family_tables(rocm_device, monkeypatch, gcn_arch, family):
    """On ROCm PyTorch the triton backend runs (the aot backend refuses: its images are NVIDIA's),
    plans with the family's tables and CU count, and hands Triton the family's AMD knobs."""
    from flash_attn.backends import aot

    triton_backend = rocm_device(gcn_arch)
    cuda = torch.device("cuda", 0)
    assert triton_backend.unavailable_reason(cuda) is None
    assert "not ROCm" in aot.unavailable_reason(cuda)
    target = triton_backend._target(cuda)
    assert target == P.Target(family, rocm.DEVICES[gcn_arch][1])

    launched = []
    monkeypatch.setattr(triton_backend, "_ensure_scratch_allocator", lambda: None)
    monkeypatch.setattr(triton_backend.registry, "jit_function",
                        lambda name: _Recorder(name, launched))
    monkeypatch.setattr(torch.cuda, "device", lambda device: _NoContext())
    q = torch.empty(2, 300, 8, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 300, 2, 128, dtype=torch.bfloat16, device="meta")
    plan = P.plan_forward(P.describe_forward(q, k, k, AttentionParams(128 ** -0.5, -1, 0)), target)
    for launch in plan.launches:
        triton_backend._run_launch(launch, {slot: None for slot in _slots(launch)}, cuda)
    (name, options), = launched
    want = configs.pick("fwd", 128, family)
    assert name == "attn_fwd_kernel" and plan.launches[0].config == want
    assert options == configs.compiler_options(want, family) and "waves_per_eu" in options


class _Recorder:
    def __init__(self, name, launched):
        self.name, self.launched = name, launched

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.launched.append((self.name, {k: kwargs[k] for k in ("num_warps", "num_stages", "waves_per_eu",
                                                                    "matrix_instr_nonkdim", "kpack") if k in kwargs}))
        return launch


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _slots(launch):
    from flash_attn.planning.shapes import Rows, Slot

    return {value for _, value in launch.args if isinstance(value, (Slot, Rows))}


@pytest.mark.parametrize("gcn_arch,family", list(DEVICES.items()))
def test_planner_choices_on_each_simulated_family(rocm_device, monkeypatch, gcn_arch, family):
    """Forward, backward (fused where the family's table has it, split otherwise and for
    deterministic=True) and the KV cache, planned for the device the backend finds: every launch
    in the family's configs, its split count from the device's CUs."""
    target = rocm_device(gcn_arch)._target(torch.device("cuda", 0))
    params = AttentionParams(64 ** -0.5, -1, 0)
    q = torch.empty(4, 1024, 16, 64, dtype=torch.float16, device="meta")
    kv = torch.empty(4, 1024, 4, 64, dtype=torch.float16, device="meta")
    fwd = P.plan_forward(P.describe_forward(q, kv, kv, params), target)
    assert [launch.config for launch in fwd.launches] == [configs.pick("fwd", 64, family)]
    lse = torch.empty(4, 16, 1024, dtype=torch.float32, device="meta")
    for deterministic in (False, True):
        bwd = P.plan_backward(P.describe_backward(q, q, kv, kv, q, lse, params, None, None, deterministic, None, False),
                              target)
        by_kernel = {launch.kernel: launch.config for launch in bwd.launches}
        fused = configs.fused_backward(64, family)
        if fused is not None and not deterministic:
            assert by_kernel["attn_bwd_kernel"] == fused
        else:
            assert by_kernel["attn_bwd_dkdv_kernel"] == configs.pick("bwd_dkdv", 64, family)
            assert by_kernel["attn_bwd_dq_kernel"] == configs.pick("bwd_dq", 64, family)
    cache = KVCacheInputs(torch.empty(4, 4096, 4, 64, dtype=torch.float16, device="meta"),
                          torch.empty(4, 4096, 4, 64, dtype=torch.float16, device="meta"),
                          torch.empty(4, dtype=torch.int32, device="meta"))
    step = torch.empty(4, 1, 16, 64, dtype=torch.float16, device="meta")
    from flash_attn.planning import kvcache

    sms = []
    monkeypatch.setattr(kvcache, "choose_num_splits", lambda *args: sms.append(args[3]) or 4)
    dec = P.plan_kvcache(P.describe_kvcache(step, params, cache), target)
    split = next(launch for launch in dec.launches if launch.kernel == "split_kv_kernel")
    assert split.config == dc.bucket_configs(family, 64)[0] and sms == [rocm.DEVICES[gcn_arch][1]]


@pytest.mark.parametrize("gcn_arch,family", list(DEVICES.items()))
def test_head_dim_512_is_planned_on_each_family_with_its_row(rocm_device, monkeypatch, gcn_arch, family):
    """Issue 44's head dim 512 on AMD (no longer refused): forward, backward and KV cache planned on
    the family's d512 row, NVIDIA's design: the forward's output columns over two programs, the
    backward's dK/dV columns over four (q/k's 128 each), the decode kernel on its 512 configs."""
    target = rocm_device(gcn_arch)._target(torch.device("cuda", 0))
    params = AttentionParams(512 ** -0.5, -1, 0)
    q = torch.empty(2, 300, 4, 512, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(2, 300, 2, 512, dtype=torch.bfloat16, device="meta")
    fwd = P.plan_forward(P.describe_forward(q, kv, kv, params), target)
    (launch,) = fwd.launches
    assert launch.config == configs.pick("fwd", 512, family) and launch.constexprs["BLOCK_DVOUT"] == 256
    lse = torch.empty(2, 4, 300, dtype=torch.float32, device="meta")
    for deterministic in (False, True):
        bwd = P.plan_backward(P.describe_backward(q, q, kv, kv, q, lse, params, None, None, deterministic, None, False),
                              target)
        by_kernel = {launch.kernel: launch for launch in bwd.launches}
        fused = configs.fused_backward(512, family)
        dkdv = by_kernel["attn_bwd_kernel" if fused is not None and not deterministic else "attn_bwd_dkdv_kernel"]
        assert dkdv.config == (fused if dkdv.kernel == "attn_bwd_kernel" else configs.pick("bwd_dkdv", 512, family))
        assert dkdv.constexprs["BLOCK_DOUT"] == 128
        if dkdv.kernel == "attn_bwd_dkdv_kernel":
            assert by_kernel["attn_bwd_dq_kernel"].config == configs.pick("bwd_dq", 512, family)
    cache = KVCacheInputs(torch.empty(2, 1024, 2, 512, dtype=torch.bfloat16, device="meta"),
                          torch.empty(2, 1024, 2, 512, dtype=torch.bfloat16, device="meta"),
                          torch.empty(2, dtype=torch.int32, device="meta"))
    step = torch.empty(2, 1, 4, 512, dtype=torch.bfloat16, device="meta")
    dec = P.plan_kvcache(P.describe_kvcache(step, params, cache), target)
    split = next(launch for launch in dec.launches if launch.kernel == "split_kv_kernel")
    assert split.config == dc.bucket_configs(family, 512)[0]


def test_an_unsupported_amd_gpu_runs_the_reference_with_the_reason(rocm_device):
    from flash_attn import dispatch

    triton_backend = rocm_device("gfx90a:sramecc+:xnack-")
    reason = triton_backend.unavailable_reason(torch.device("cuda", 0))
    assert "AMD GPU gfx90a is in no GPU family" in reason
    dispatch.reset()
    try:
        first, reasons = dispatch.auto_choice(torch.device("cuda", 0))
    finally:
        dispatch.reset()
    assert first == "reference" and any("gfx90a" in r for r in reasons)


@pytest.mark.parametrize("gcn_arch,family", [(rocm.BY_FAMILY[f], f) for f in AMD] + [("gfx90a:sramecc+:xnack-", None)])
def test_the_fused_linear_asks_for_tf32_only_where_triton_has_it(rocm_device, gcn_arch, family):
    """``flash_attn.ops.triton.linear`` on fp32 with TF32 allowed: Triton's AMD backend takes
    ``input_precision="tf32"`` on CDNA3 only (XF32) and refuses to compile it elsewhere, so the
    other AMD GPUs get exact fp32 products. Compiled here for each family's GPU."""
    pytest.importorskip("triton")
    from flash_attn.kernel_build import amd
    from flash_attn.ops.triton import linear

    rocm_device(gcn_arch)
    x = types.SimpleNamespace(dtype=torch.float32, is_cuda=True, device=torch.device("cuda", 0))
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        precision = linear._input_precision(x)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    assert precision == ("tf32" if family == "cdna3" else "ieee")
    if family is None:
        return
    kernel, kwargs = amd._recorded(linear, lambda: linear._linear_act_triton(
        torch.randn(64, 64), torch.randn(64, 64), None, "id", False))[0]
    compiled = amd.compile_launch(kernel, {**kwargs, "INPUT_PRECISION": precision}, family)
    assert "v_" + families.get(family).mma in compiled.asm["amdgcn"] or precision == "ieee"
    if precision == "ieee":  # what TF32 would have done there
        with pytest.raises(Exception) as refused:
            amd.compile_launch(kernel, {**kwargs, "INPUT_PRECISION": "tf32"}, family)
        assert "tf32" in str(refused.value.__cause__ or refused.value)
