"""``python -m flash_attn bench``: the CPU mode end to end on tiny sizes (in process and in child
processes; plain cases and the feature cases against SDPA with explicit masks, with the speed
ratio), that its memory measurement sees what eager attention allocates (quadratic) and that the
cpu and reference backends keep it small, PyTorch's flex_attention as a second baseline (the same work, its
forward only), the GPU mode's plumbing with a fake timer on the CPU,
and the build mode on a stand-in build command."""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flash_attn import __main__ as cli
from flash_attn import dispatch
from flash_attn.bench import build, common, cpu, gpu


def test_flop_count():
    assert common.attention_flops(2, 3, 5, 7, 11, causal=False) == 4 * 2 * 3 * 5 * 7 * 11
    assert common.attention_flops(2, 3, 5, 7, 11, causal=True) == 2 * 2 * 3 * 5 * 7 * 11
    assert common.attention_flops(1, 1, 4, 4, 8, causal=False, backward=True) == 3.5 * 4 * 4 * 4 * 8


def test_cpu_quick_in_process(tmp_path, capsys):
    status = cli.main(["bench", "cpu", "--quick", "--no-isolate", "--seqlens", "64,96", "--repeats", "2", "--dtype",
                       "fp32", "--forward", "--features", "none", "--impls", "flash_attn,eager,sdpa", "--no-plot",
                       "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0
    data = json.loads((tmp_path / "bench-cpu.json").read_text())
    assert data["meta"]["machine"]["torch"] == torch.__version__
    rows = data["results"]
    assert [(r["case"], r["seqlen"], r["impl"]) for r in rows] == [
        (c, s, i) for c in ("full", "causal") for s in (64, 96) for i in ("flash_attn", "eager", "sdpa")]
    for r in rows:
        assert r["status"] == "ok" and r["repeats"] == 2 and r["time_ms"] > 0 and r["pass"] == "fwd"
        flops = common.attention_flops(r["batch"], r["heads"], r["seqlen"], r["seqlen"], r["headdim"], r["causal"])
        # the exact count of visible pairs: causal counts the diagonal (s(s+1)/2, not s^2/2)
        assert r["gflops"] == pytest.approx(flops / (r["time_ms"] * 1e-3) / 1e9, rel=0.02 if r["causal"] else 1e-9)
        assert ("ratio" in r) == (r["impl"] == "flash_attn") and (r.get("ratio") or 1) > 0
    with (tmp_path / "bench-cpu.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 12
    assert "| case | dtype | pass | seqlen | flash_attn (ms) | eager (ms) | sdpa (ms) | ratio (sdpa / flash_attn) |" in out


def test_cpu_backward_and_causal_in_process(tmp_path):
    status = cli.main(["bench", "cpu", "--quick", "--no-isolate", "--seqlens", "64", "--repeats", "1", "--causal",
                       "--backward", "--dtype", "bf16", "--features", "none", "--no-plot", "--out", str(tmp_path)])
    assert status == 0
    rows = json.loads((tmp_path / "bench-cpu.json").read_text())["results"]
    assert {r["pass"] for r in rows} == {"fwd_bwd"} and all(r["causal"] for r in rows)
    assert {r["impl"] for r in rows} == {"flash_attn", "sdpa"} and {r["dtype"] for r in rows} == {"bf16"}


def test_cpu_feature_cases(tmp_path):
    """Every feature against SDPA with its explicit mask (softcap: the causal mask), forward and
    backward; the visible-pair counts are the features' own."""
    status = cli.main(["bench", "cpu", "--quick", "--no-isolate", "--seqlens", "256", "--repeats", "1", "--dtype", "fp32",
                       "--causal", "--backward", "--no-plot", "--out", str(tmp_path)])
    assert status == 0
    rows = json.loads((tmp_path / "bench-cpu.json").read_text())["results"]
    features = [r["case"] for r in rows if r["impl"] == "flash_attn" and r["case"] in cpu.FEATURES]
    assert features == list(cpu.FEATURES)
    assert all(r["status"] == "ok" and r["peak_mib"] >= 0 for r in rows)
    assert all(r["ratio"] > 0 for r in rows if r["impl"] == "flash_attn")
    spec = dict(seqlen=256, feature="window")
    assert cpu.visible_pairs(spec) == sum(min(i + 1, 64) for i in range(256))
    assert cpu.visible_pairs(dict(seqlen=256, feature="varlen")) == sum(n * (n + 1) // 2 for n in (128, 64, 32, 32))


@pytest.mark.parametrize("feature", list(cpu.FEATURES))
def test_sdpa_gets_an_equivalent_mask(feature):
    """The ratio compares equal work: SDPA with the feature's explicit mask computes what
    flash_attn computes (softcap, which SDPA cannot do: what flash_attn computes without it)."""
    spec = dict(batch=1, heads=2, headdim=16, seqlen=48 if feature != "paged" else 600, dtype="fp32",
                causal=True, backward=False, feature=feature)
    fns = cpu._calls(spec, raw=True)
    ours, sdpa = fns["flash_attn"]().reshape(1, spec["seqlen"], 2, 16), fns["sdpa"]()
    if feature == "softcap":
        assert not torch.allclose(ours, sdpa, atol=1e-3)
        ours = cpu._calls(dict(spec, feature=None), raw=True)["flash_attn"]()
    torch.testing.assert_close(ours, sdpa, atol=2e-5, rtol=1e-4)


FLEX_MISSING = cpu.flex_unavailable()


@pytest.mark.skipif(FLEX_MISSING is not None, reason=f"flex_attention cannot run here: {FLEX_MISSING}")
@pytest.mark.parametrize("case", ["full", "causal", *cpu.FEATURES])
def test_flex_computes_what_flash_attn_computes(case):
    """The flex ratio compares equal work: flex_attention with the case's block mask and score
    modification computes what flash_attn computes, softcap included (compiled by inductor)."""
    feature = case if case in cpu.FEATURES else None
    spec = dict(batch=1, heads=2, headdim=16, seqlen=48 if feature != "paged" else 600, dtype="fp32",
                causal=case != "full", backward=False, feature=feature)
    fns = cpu._calls(spec, raw=True)
    ours, flex = fns["flash_attn"]().reshape(1, spec["seqlen"], 2, 16), fns["flex"]()
    torch.testing.assert_close(ours, flex, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(FLEX_MISSING is not None, reason=f"flex_attention cannot run here: {FLEX_MISSING}")
def test_flex_forward_is_timed_and_its_missing_backward_reported(tmp_path, capsys):
    """flex's forward gets a ratio of its own beside SDPA's; its forward+backward case, which
    PyTorch refuses on the CPU, is reported as unsupported with PyTorch's reason and does not
    fail the run."""
    status = cli.main(["bench", "cpu", "--quick", "--no-isolate", "--seqlens", "64", "--repeats", "2", "--dtype", "fp32",
                       "--causal", "--features", "none", "--impls", "flash_attn,sdpa,flex", "--no-plot",
                       "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0
    rows = {(r["pass"], r["impl"]): r for r in json.loads((tmp_path / "bench-cpu.json").read_text())["results"]}
    assert rows["fwd", "flex"]["status"] == "ok" and rows["fwd", "flex"]["time_ms"] > 0
    assert rows["fwd", "flash_attn"]["ratio_flex"] > 0 and rows["fwd", "flash_attn"]["ratio"] > 0
    # PyTorch's own refusal, not ours: "NotImplementedError: FlexAttention does not support backward on CPU..."
    assert rows["fwd_bwd", "flex"]["status"] == "unsupported" and "backward" in rows["fwd_bwd", "flex"]["note"]
    assert rows["fwd_bwd", "flex"]["note"].startswith("NotImplementedError: ")
    assert "ratio_flex" not in rows["fwd_bwd", "flash_attn"] and rows["fwd_bwd", "flash_attn"]["ratio"] > 0
    assert "| ratio (sdpa / flash_attn) | ratio (flex / flash_attn) |" in out
    with (tmp_path / "bench-cpu.csv").open() as fh:
        assert [r["ratio_flex"] != "" for r in csv.DictReader(fh) if r["impl"] == "flash_attn"] == [True, False]


def test_a_failed_flex_compilation_costs_only_its_own_row(monkeypatch):
    def compiled():
        def fail(*args, **kwargs):
            raise RuntimeError("inductor: C++ compile error\nmore")
        return fail

    monkeypatch.setattr(cpu, "flex_unavailable", lambda: None)  # as where a compiler is found
    monkeypatch.setattr(cpu, "_compiled_flex", compiled)
    rows = {r["impl"]: r for r in cpu.run(_config(seqlens=[32], impls=["flash_attn", "sdpa", "flex"], isolate=False))}
    assert rows["flex"]["status"] == "error" and rows["flex"]["note"] == "RuntimeError: inductor: C++ compile error"
    assert rows["flash_attn"]["status"] == rows["sdpa"]["status"] == "ok"
    assert rows["flash_attn"]["ratio"] > 0 and "ratio_flex" not in rows["flash_attn"]


def test_flex_is_reported_unsupported_without_a_compiler(monkeypatch):
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    assert "no C++ compiler" in cpu.flex_unavailable()
    rows = cpu.run(_config(seqlens=[32], impls=["flex"], isolate=False))
    assert [(r["status"], "compiler" in r["note"]) for r in rows] == [("unsupported", True)]


LINUX_PROC = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak memory is read from /proc")


def _config(**overrides):
    config = {"seqlens": [1024, 2048], "impls": ["eager"], "batch": 1, "heads": 2, "headdim": 32, "dtypes": ["fp32"],
              "causal": [False], "backward": [False], "features": [], "repeats": 1, "warmup": 1, "isolate": True}
    config.update(overrides)
    return config


@LINUX_PROC
def test_memory_measurement_sees_eager_grow_quadratically():
    """In fresh child processes: eager's extra peak memory holds at least its score matrix and
    grows ~4x when the sequence doubles."""
    small, large = cpu.run(_config())
    assert small["status"] == large["status"] == "ok", (small, large)
    scores_mib = 2 * 2048 * 2048 * 4 / 2**20  # heads * s * s * fp32
    assert large["peak_mib"] >= 0.9 * scores_mib, large
    assert large["peak_mib"] / small["peak_mib"] >= 3.0, (small["peak_mib"], large["peak_mib"])


@LINUX_PROC
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_cpu_backends_memory_is_bounded(backend):
    """The same problem through this package stays far below eager's 128 MiB score matrix, on
    the cpu backend (PyTorch's fused kernels) and on the reference's tiled engine with its 1 MiB
    score tiles (run in a child, so nothing freed earlier hides the peak; what the allocator keeps
    varies by a few MiB)."""
    script = textwrap.dedent(f"""
        import json
        from flash_attn.bench import cpu
        spec = dict(impls=["flash_attn"], seqlen=4096, batch=1, heads=2, headdim=32, dtype="fp32", repeats=1,
                    warmup=1, backend={backend!r})
        print(json.dumps(cpu.measure(spec)))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])["flash_attn"]
    assert result["peak_mib"] < 32, result


def test_eager_is_skipped_when_it_cannot_fit(monkeypatch):
    monkeypatch.setattr(cpu, "available_memory_bytes", lambda: 1 << 30)
    (row,) = cpu.run(_config(seqlens=[65536], heads=8, headdim=64))
    assert row["status"] == "skipped" and "GiB" in row["note"]


def test_cpu_plot(tmp_path):
    pytest.importorskip("matplotlib")
    status = cli.main(["bench", "cpu", "--quick", "--no-isolate", "--seqlens", "32,64", "--repeats", "1", "--dtype",
                       "fp32", "--features", "window", "--out", str(tmp_path)])
    assert status == 0
    assert (tmp_path / "bench-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# GPU mode: everything but the CUDA timer, on the CPU.
# ---------------------------------------------------------------------------------------------


def _gpu_config(**overrides):
    config = {"seqlens": [32, 64], "headdims": [32, 64], "dtypes": ["fp32"], "causal": [False, True],
              "backward": [False, True], "impls": ["flash_attn[reference]", "flash_attn[aot]", "sdpa[math]", "upstream"],
              "total_tokens": 128, "hidden": 128, "repeats": 3, "warmup": 0}
    config.update(overrides)
    return config


def test_gpu_mode_plumbing_with_a_fake_timer():
    calls = []

    def fake_timer(fn, warmup, repeats):
        fn()  # the measured call really runs
        calls.append(repeats)
        return [2.0, 1.0, 4.0]

    config = _gpu_config()
    rows = gpu.run(config, device="cpu", timer=fake_timer)
    assert len(rows) == len(gpu.cases(config)) * len(config["impls"]) == 2 * 2 * 2 * 2 * 4
    for r in rows:
        assert r["batch"] * r["seqlen"] == 128 and r["heads"] * r["headdim"] == 128
    ours = [r for r in rows if r["impl"] == "flash_attn[reference]"]
    assert all(r["status"] == "ok" and r["time_ms"] == 2.0 for r in ours)
    for r in ours:
        flops = common.attention_flops(r["batch"], r["heads"], r["seqlen"], r["seqlen"], r["headdim"], r["causal"],
                                       r["pass"] == "fwd_bwd")
        assert r["tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    aot = [r for r in rows if r["impl"] == "flash_attn[aot]"]
    aot_reason = dispatch.unavailable_reason("aot", torch.device("cpu"))
    assert all(r["status"] == "unavailable" for r in aot) and aot_reason and aot_reason in aot[0]["note"]
    assert all(r["status"] == "unavailable" and "CUDA only" in r["note"] for r in rows if r["impl"] == "upstream")
    assert all(r["status"] == "ok" for r in rows if r["impl"] == "sdpa[math]")
    assert len(calls) == 2 * len(ours)  # ours and sdpa[math]


def test_gpu_mode_checks_each_case_before_timing_it(monkeypatch):
    """Each case's output and gradients are compared with float32 math attention before the case
    is timed (:func:`gpu.check`), the errors recorded in the row; a result of ours beyond the
    tolerance is an error row and is not timed; other implementations' are recorded."""
    timed = []
    config = _gpu_config(seqlens=[32], headdims=[32], causal=[True], impls=["flash_attn[reference]", "sdpa[math]"])
    rows = gpu.run(config, device="cpu", timer=lambda fn, w, r: timed.append(fn) or [1.0])
    assert len(rows) == 4 and len(timed) == 4
    for r in rows:
        assert r["check"] == "ok" and r["err_out"] < 1e-5, r
        assert (r["err_grad"] is None) == (r["pass"] == "fwd") and (r["err_grad"] or 0) < 1e-5

    wrong = gpu._ours("reference")
    monkeypatch.setattr(gpu, "_ours", lambda backend: gpu.Implementation(
        wrong.name, wrong.unavailable, wrong.run, wrong.context, wrong.backend,
        forward=lambda q, k, v, causal: wrong.forward(q, k, v, causal) * 1.1))
    timed.clear()
    rows = gpu.run(config, device="cpu", timer=lambda fn, w, r: timed.append(fn) or [1.0])
    ours = [r for r in rows if r["impl"] == "flash_attn[reference]"]
    assert all(r["check"] == "mismatch" and r["status"] == "error" and "wrong result" in r["note"] for r in ours)
    assert all("time_ms" not in r for r in ours) and len(timed) == 2  # only sdpa[math] was timed


def test_gpu_held_out_shapes_are_checked_and_named(monkeypatch):
    """``--held-out`` adds shapes the configs were not tuned on (tiny stand-ins here: an odd length
    and GQA 4:1), each checked against the reference (GQA: k/v heads repeated for it) and timed;
    every row names what the implementation is."""
    monkeypatch.setattr(gpu, "HELD_OUT", ((37, 2, 4, 4, 16), (24, 1, 8, 2, 16)))
    config = _gpu_config(seqlens=[32], headdims=[32], causal=[True], impls=["flash_attn[reference]", "sdpa[math]"],
                         held_out=True)
    rows = gpu.run(config, device="cpu", timer=lambda fn, w, r: [fn(), 1.0][1:])
    held = [r for r in rows if r.get("held_out")]
    assert [(r["seqlen"], r["heads"], r["kv_heads"], r["pass"]) for r in held[::2]] == [
        (37, 4, 4, "fwd"), (37, 4, 4, "fwd_bwd"), (24, 8, 2, "fwd"), (24, 8, 2, "fwd_bwd")]
    for r in rows:
        assert r["status"] == "ok" and r["check"] == "ok" and r["err_out"] < 1e-5, r
    assert {r["what"] for r in rows} == {gpu.WHAT["flash_attn[reference]"], "PyTorch SDPA math (unfused)"}
    assert gpu.WHAT["sdpa[flash]"] == "PyTorch SDPA flash (vendored FA2)"


def test_gpu_rows_flag_a_time_that_is_the_hosts():
    """Every timed row has the host's CPU time per call (``host_ms``) and, where that is a large
    share of the event time, ``host_alone_ms`` (one call timed alone); a row whose event time is not
    clearly above it is flagged ``host_bound`` (stand-in timers: one far below any host time, one
    far above)."""
    config = _gpu_config(seqlens=[32], headdims=[32], causal=[False], backward=[False],
                         impls=["flash_attn[reference]", "sdpa[math]"])
    for event_ms, bound in ((1e-6, True), (1e6, False)):
        rows = gpu.run(config, device="cpu", timer=lambda fn, w, r: [event_ms])
        assert len(rows) == 2
        for r in rows:
            assert r["status"] == "ok" and r["host_ms"] > 0 and r["host_bound"] is bound, r
            assert r["host_alone_ms"] > 0 if bound else r.get("host_alone_ms") is None, r
    assert "(host-bound" in gpu._progress_line(dict(rows[0], host_bound=True))


def test_the_host_time_of_a_call_alone_follows_each_synchronisation():
    """``host_alone_ms``'s measure: each call timed alone right after a device synchronisation (as
    the event timer times one), the calling thread's CPU time, the median: a call that computes for
    a while is measured at about that, whatever the others."""
    import time as clock  # noqa: PLC0415

    order = []

    def busy():
        order.append("call")
        end = clock.thread_time() + (0.02 if len(order) == 6 else 0.002)  # one slow call of five
        while clock.thread_time() < end:
            pass

    us = gpu._alone_us(busy, lambda: order.append("sync"), calls=5)
    assert order == ["sync", "call"] * 5
    assert 1500 < us < 15000


def test_gpu_rows_compare_the_host_with_the_gpus_own_time(monkeypatch):
    """Where the host's time is a large share of the event time, the GPU's own time per call is
    measured (``gpu_ms``) and the row is host-bound when the host's time exceeds it, whatever the
    share: the H200's decode rows (host 89 us, event 123 us, kernels ~10 us) were host-bound
    and the share rule alone missed them. A stand-in span stands in for a CUDA device's
    sleep-covered span (what it cannot show: that span's own accuracy); where the host's share is
    small, no span is taken."""
    config = _gpu_config(seqlens=[32], headdims=[32], causal=[False], backward=[False],
                         impls=["flash_attn[reference]"])
    spans = []

    def span_of(gpu_ms):
        def span(call, calls, host_s):
            spans.append((calls, host_s))
            for _ in range(calls):
                call()
            return gpu_ms * calls, True
        return span

    # the event time far below the host's: a span is taken, and the GPU's time decides against
    # the share rule set to say the opposite (a share out of reach; a share every row meets)
    for gpu_ms, share, bound in ((1e-6, 1e9, True), (1e6, 0.0, False)):
        monkeypatch.setattr(gpu, "_gpu_span", lambda device, gpu_ms=gpu_ms: span_of(gpu_ms))
        monkeypatch.setattr(gpu, "HOST_BOUND_SHARE", share)
        (row,) = gpu.run(config, device="cpu", timer=lambda fn, w, r: [fn(), 1e-9][1:] * r)
        assert row["gpu_ms"] == pytest.approx(gpu_ms) and row["gpu_covered"] is True, row
        assert row["host_bound"] is bound, row
    assert spans and all(calls == gpu.HOST_CALLS and host_s > 0 for calls, host_s in spans)

    spans.clear()  # an event time far above the host's: the GPU's time is not needed, nor taken
    monkeypatch.setattr(gpu, "HOST_BOUND_SHARE", 0.8)
    rows = gpu.run(config, device="cpu", timer=lambda fn, w, r: [1e6] * r)
    assert rows[0].get("gpu_ms") is None and rows[0]["host_bound"] is False and not spans


def test_gpu_reference_is_chunked_without_changing_the_answer(monkeypatch):
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, 24, 3, 8, generator=g) for _ in range(4))
    whole_out, whole_grads = gpu.reference(q, k, v, dout, True)
    monkeypatch.setattr(gpu, "REFERENCE_SCORES", 24 * 24 * 2)  # two heads at a time: three slices
    out, grads = gpu.reference(q, k, v, dout, True)
    torch.testing.assert_close(out, whole_out, rtol=0, atol=0)
    for a, b in zip(grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and the reference itself against a naive float64 attention
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = (qd @ kd.transpose(-1, -2)) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out.double(), (scores.softmax(-1) @ vd).transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_gpu_rows_beyond_fa2():
    """Head dim 512, v's own head dim and attention sinks: ours run them (FLOPs at q's and v's own
    widths), SDPA runs v's own head dim and has no sinks (an ``unsupported`` row, not an error)."""
    beyond = [{"headdim": 64, "headdim_v": 32}, {"headdim": 32, "sinks": True}]
    config = _gpu_config(seqlens=[32], causal=[True], impls=["flash_attn[reference]", "sdpa[math]"], beyond=beyond)
    rows = gpu.run(config, device="cpu", timer=lambda fn, w, r: [fn(), 2.0][1:])
    ours = {(r["headdim"], r.get("headdim_v"), bool(r.get("sinks")), r["pass"]): r for r in rows
            if r["impl"] == "flash_attn[reference]"}
    assert all(r["status"] == "ok" for r in ours.values()), ours
    row = ours[(64, 32, False, "fwd_bwd")]
    flops = common.attention_flops(row["batch"], row["heads"], 32, 32, (64 + 32) / 2, True, True)
    assert row["tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    sdpa = [r for r in rows if r["impl"] == "sdpa[math]"]
    assert all(r["status"] == "ok" for r in sdpa if not r.get("sinks"))
    assert all(r["status"] == "unsupported" and "sinks" in r["note"] for r in sdpa if r.get("sinks"))
    lines = [gpu._progress_line(r) for r in rows]
    assert any("d=64/32" in line for line in lines) and any("d=32+sinks" in line for line in lines)


def test_gpu_mode_reports_a_backend_that_rejects_a_case():
    rows = gpu.run(_gpu_config(seqlens=[32], headdims=[32], causal=[False], backward=[False], impls=["sdpa[efficient]"]),
                   device="cpu", timer=lambda fn, w, r: [fn(), 1.0][1:])
    (row,) = rows
    assert row["status"] in ("ok", "unsupported")  # no efficient kernel on this CPU: reported, not raised
    if row["status"] == "unsupported":
        assert row["note"]


def test_gpu_mode_needs_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert cli.main(["bench", "gpu"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_gpu_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = gpu.run(_gpu_config(), device="cpu", timer=lambda fn, w, r: [1.0])
    (png,) = gpu.plot(rows, tmp_path, "bench-gpu", "test")
    assert png.read_bytes()[:4] == b"\x89PNG"


def _gpu_args(tmp_path, *extra, decode=False):
    """The training table only (no rows beyond FlashAttention-2), unless ``decode`` (then pass the
    decode sizes in ``extra``; no decode steps); one timing round per row."""
    return cli.build_parser().parse_args(["bench", "gpu", "--out", str(tmp_path), "--seqlens", "32,64", "--headdims",
                                          "32", "--dtypes", "fp32", "--total-tokens", "64", "--hidden", "64",
                                          "--repeats", "2", "--warmup", "0", "--no-plot", "--no-beyond", "--rounds", "1",
                                          "--no-decode-steps", "--decode" if decode else "--no-decode", *extra])


def test_gpu_main_writes_each_row_as_it_goes(tmp_path):
    """When a row is timed, the rows before it are already in the JSON-lines and CSV files."""
    seen = []

    def timer(fn, warmup, repeats):
        fn()
        lines = (tmp_path / "bench-gpu.jsonl").read_text().splitlines()
        with (tmp_path / "bench-gpu.csv").open() as fh:
            seen.append((len(lines) - 1, len(list(csv.DictReader(fh)))))  # minus the meta line
        return [1.0, 2.0]

    args = _gpu_args(tmp_path, "--impls", "flash_attn[reference],sdpa[math]")
    assert gpu.main(args, device="cpu", timer=timer) == 0
    assert seen == [(n, n) for n in range(len(seen))] and len(seen) == 2 * 2 * 2 * 2
    lines = [json.loads(line) for line in (tmp_path / "bench-gpu.jsonl").read_text().splitlines()]
    assert lines[0]["meta"]["mode"] == "gpu" and len(lines) == 1 + len(seen)
    assert json.loads((tmp_path / "bench-gpu.json").read_text())["results"] == lines[1:]


def test_gpu_main_exits_1_when_a_row_of_ours_crashed(tmp_path, capsys):
    calls = []

    def timer(fn, warmup, repeats):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("an illegal memory access was encountered")
        return [1.0]

    assert gpu.main(_gpu_args(tmp_path, "--impls", "flash_attn[reference]"), device="cpu", timer=timer) == 1
    rows = [json.loads(line) for line in (tmp_path / "bench-gpu.jsonl").read_text().splitlines()[1:]]
    assert [r["status"] for r in rows].count("error") == 1 and len(rows) == 8  # the others still ran
    assert "illegal memory access" in rows[2]["note"]
    assert "error:" in capsys.readouterr().err


def test_gpu_main_counts_other_implementations_rejections_as_unsupported(tmp_path):
    def timer(fn, warmup, repeats):
        raise RuntimeError("No available kernel")

    assert gpu.main(_gpu_args(tmp_path, "--impls", "sdpa[math]"), device="cpu", timer=timer) == 0
    rows = json.loads((tmp_path / "bench-gpu.json").read_text())["results"]
    assert {r["status"] for r in rows} == {"unsupported"}


def test_gpu_main_strict_mode_makes_an_unavailable_backend_an_error(tmp_path, monkeypatch):
    args = _gpu_args(tmp_path, "--impls", "flash_attn[aot]")  # no aot on the CPU
    assert gpu.main(args, device="cpu", timer=lambda fn, w, r: [1.0]) == 0  # reported, not failed
    monkeypatch.setenv("FLASH_ATTN_STRICT_BACKEND", "1")
    assert gpu.main(args, device="cpu", timer=lambda fn, w, r: [1.0]) == 1
    rows = json.loads((tmp_path / "bench-gpu.json").read_text())["results"]
    assert {r["status"] for r in rows} == {"error"}


def test_gpu_rows_that_another_backend_ran_are_errors(monkeypatch):
    (aot_impl,) = gpu.implementations(["flash_attn[aot]"])
    (sdpa,) = gpu.implementations(["sdpa[math]"])
    monkeypatch.setattr(dispatch, "last_backend", lambda: "triton")
    assert gpu._ran_elsewhere(aot_impl, "cuda") == "the triton backend ran it, not aot"
    assert gpu._ran_elsewhere(sdpa, "cuda") is None
    monkeypatch.setattr(dispatch, "last_backend", lambda: "aot")
    assert gpu._ran_elsewhere(aot_impl, "cuda") is None


# ---------------------------------------------------------------------------------------------
# GPU mode, decode: the case list, the bytes and GB/s arithmetic, the skip rule and the rows, on
# the CPU. What the stand-ins cannot show: CUDA event timings, the real bandwidth of a copy,
# torch.cuda.mem_get_info as the free-memory probe, whether SDPA's flash/cudnn kernels and
# upstream's fwd_kvcache take these calls on a GPU, and which backend the dispatcher picked there.
# ---------------------------------------------------------------------------------------------

from flash_attn.bench import GPU_SEQLENS  # noqa: E402


def test_gpu_default_config_is_the_issue_table_plus_decode(tmp_path):
    """Issue 24's table: bf16 and fp16, d64/128/256, causal and not, 1k/4k/16k, fwd and fwd+bwd,
    sdpa[flash] and sdpa[cudnn] in the same run; decode batch 1-64 x cache 4k-128k, 32/8 heads,
    d128, bf16; --no-decode and the size overrides."""
    args = cli.build_parser().parse_args(["bench", "gpu", "--out", str(tmp_path)])
    config = gpu.config_from_args(args, GPU_SEQLENS)
    assert {"sdpa[flash]", "sdpa[cudnn]", "flash_attn[aot]", "flash_attn[triton]"} <= set(config["impls"])
    train = {(c["dtype"], c["headdim"], c["causal"], c["seqlen"], c["pass"]) for c in gpu.cases(config)
             if c["headdim"] in (64, 128, 256) and not c.get("sinks")}
    assert train == {(t, d, c, s, p) for t in ("bf16", "fp16") for d in (64, 128, 256) for c in (False, True)
                     for s in (1024, 4096, 16384) for p in ("fwd", "fwd_bwd")}
    # beyond FlashAttention-2: head dim 512, 192/128, sinks at d64/d128 (the table's rows without them
    # are the same shapes), every dtype, mask, length and pass
    assert len(gpu.cases(config)) == len(train) + 4 * 2 * 2 * 3 * 2
    assert {(c["headdim"], c.get("headdim_v"), bool(c.get("sinks"))) for c in gpu.cases(config)} >= {
        (512, None, False), (192, 128, False), (64, None, True), (128, None, True)}
    decode = gpu.decode_cases(config)
    assert [(c["batch"], c["cachelen"]) for c in decode] == [
        (b, n) for b in (1, 4, 16, 64) for n in (4096, 16384, 65536, 131072)]
    assert {(c["heads"], c["kv_heads"], c["headdim"], c["dtype"], c["seqlen"], c["pass"]) for c in decode} == {
        (32, 8, 128, "bf16", 1, "decode")}
    assert gpu.config_from_args(cli.build_parser().parse_args(["bench", "gpu", "--no-decode"]))["decode"] is None
    small = gpu.config_from_args(cli.build_parser().parse_args(
        ["bench", "gpu", "--decode-batches", "2,8", "--decode-cachelens", "1024"]))
    assert [(c["batch"], c["cachelen"]) for c in gpu.decode_cases(small)] == [(2, 1024), (8, 1024)]


def test_decode_bytes_against_a_hand_count():
    # batch 4, 4096 cached tokens, 8 KV heads of 128, bf16: K and V 4*4096*8*128*2 B = 32 MiB each;
    # q and out 4*32*128*2 B = 32 KiB each
    case = dict(dtype="bf16", batch=4, cachelen=4096, kv_heads=8, heads=32, headdim=128, seqlen=1)
    assert gpu.decode_bytes(case) == 2 * (32 << 20) + 2 * (32 << 10)
    # the largest default case: 64 x 128k x 8 x 128 x 2 B x 2 = 32 GiB, plus 2 x 512 KiB
    assert gpu.decode_bytes(dict(case, batch=64, cachelen=131072)) == (32 << 30) + (1 << 20)
    assert gpu.decode_bytes(dict(case, dtype="fp32", batch=1, cachelen=10, kv_heads=2, heads=4, headdim=8)) == (
        2 * 10 * 2 * 8 * 4 + 2 * 4 * 8 * 4)


def test_skip_rule():
    assert gpu.DECODE_HEADROOM == 1 << 30
    need = gpu.decode_bytes(dict(dtype="bf16", batch=64, cachelen=131072, kv_heads=8, heads=32, headdim=128, seqlen=1))
    assert gpu.skip_reason(need, 79 << 30) is None  # an H100 with 79 GiB free runs the 32 GiB case
    assert gpu.skip_reason(need, None) is None  # free memory unknown: run
    note = gpu.skip_reason(need, 30 << 30)
    assert note.startswith("skipped: would need 33.0 GiB") and note.endswith("the GPU has 30.0 GiB free")
    # the boundary: tensors plus the headroom must fit in what is free
    assert gpu.skip_reason(1000, (1 << 30) + 1000) is None and gpu.skip_reason(1001, (1 << 30) + 1000)


def test_nominal_bandwidth_by_device_name():
    assert gpu.nominal_bandwidth("NVIDIA H100 80GB HBM3") == ("H100 SXM", 3.35e12)
    assert gpu.nominal_bandwidth("NVIDIA H200") == ("H200", 4.8e12)
    assert gpu.nominal_bandwidth("NVIDIA H100 PCIe") == ("H100 PCIe", 2.0e12)
    assert gpu.nominal_bandwidth("NVIDIA A100-SXM4-80GB") is None and gpu.nominal_bandwidth(None) is None


def test_sdpa_decode_computes_what_flash_attn_with_kvcache_computes():
    """The SDPA baseline does the same work: query heads grouped by their KV head, over the whole
    cache, equal to flash_attn_with_kvcache (GQA: query head h reads KV head h // 4)."""
    from flash_attn import flash_attn_with_kvcache

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 1, 8, 16, generator=g)
    k_cache, v_cache = torch.randn(2, 3, 40, 2, 16, generator=g)
    expected = flash_attn_with_kvcache(q, k_cache, v_cache)
    torch.testing.assert_close(gpu.sdpa_decode(q, k_cache, v_cache), expected, atol=2e-6, rtol=1e-5)
    # and by hand, one query head: head 5 attends over KV head 1
    scores = (k_cache[1, :, 1] @ q[1, 0, 5]) / 4.0
    torch.testing.assert_close(gpu.sdpa_decode(q, k_cache, v_cache)[1, 0, 5],
                               scores.softmax(0) @ v_cache[1, :, 1], atol=2e-6, rtol=1e-5)


def _decode_config(**decode):
    d = dict(gpu.DECODE_SHAPE, heads=4, kv_heads=2, headdim=16, batches=[1, 2], cachelens=[64, 256], copy_bytes=1 << 20)
    d.update(decode)
    return _gpu_config(seqlens=[], impls=["flash_attn[reference]", "sdpa[math]"], decode=d)


def test_decode_gbps_and_bandwidth_fraction(monkeypatch):
    """The copy is timed first (1 ms for 2 x 1 MiB moved), then each decode call (4 ms); GB/s and
    the percentages follow from the hand-counted bytes. The calls really run: both decode
    implementations return the same output."""
    monkeypatch.setattr(gpu, "nominal_bandwidth", lambda name: ("H100 SXM", 3.35e12))  # as on an H100
    outputs = []

    def timer(fn, warmup, repeats):
        out = fn()
        outputs.append(out)
        return [1.0] if len(outputs) == 1 else [4.0, 3.0, 5.0]

    rows = gpu.run(_decode_config(), device="cpu", timer=timer, free_memory=lambda: 64 << 30)
    copy, decode = rows[0], rows[1:]
    assert copy["pass"] == "copy" and copy["status"] == "ok"
    assert copy["gbps"] == pytest.approx(2 * (1 << 20) / 1e-3 / 1e9)  # 2.097 GB/s
    assert copy["nominal_pct"] == pytest.approx(100 * copy["gbps"] / 3350)
    assert [(r["batch"], r["cachelen"], r["impl"]) for r in decode] == [
        (b, n, i) for b in (1, 2) for n in (64, 256) for i in ("flash_attn[reference]", "sdpa[math]")]
    for r in decode:
        hand = 2 * r["batch"] * r["cachelen"] * 2 * 16 * 2 + 2 * r["batch"] * 4 * 16 * 2  # K+V, then q+out, bf16
        assert r["status"] == "ok" and r["gbytes"] == hand / 1e9 and r["time_ms"] == 4.0
        assert r["gbps"] == pytest.approx(hand / 4e-3 / 1e9)
        assert r["bw_pct"] == pytest.approx(100 * hand / 4e-3 / (2 * (1 << 20) / 1e-3))
        assert r["nominal_pct"] == pytest.approx(100 * hand / 4e-3 / 3.35e12)
    for ours, sdpa in zip(outputs[1::2], outputs[2::2]):
        assert ours.shape[1:] == (1, 4, 16)
        torch.testing.assert_close(ours, sdpa, atol=2e-2, rtol=2e-2)  # bf16


def test_decode_in_a_cuda_graph_is_timed_per_replay():
    """``graphs``: after each eager decode row, the same call captured once (inside the
    implementation's context: the backend it names is set while capturing) and timed over
    GRAPH_REPLAYS replays per timed call, so the row's time is one replay's. The stand-in for
    CUDA's graph records what was captured; what it cannot show is a real graph's timing."""
    import os

    captured, replays = [], []

    def capture(call):
        captured.append(os.environ.get("FLASH_ATTN_BACKEND"))
        out = call()
        return lambda: replays.append(out.shape)

    def timer(fn, warmup, repeats):
        fn()
        return [2.0 * gpu.GRAPH_REPLAYS]  # a graph row: 2 ms per replay; an eager row: 40 ms

    config = _decode_config(batches=[1], cachelens=[64], graphs=True)
    rows = gpu.run(config, device="cpu", timer=timer, free_memory=lambda: 64 << 30, capture=capture)
    decode = [(r["impl"], r["pass"], r["time_ms"]) for r in rows[1:]]
    assert decode == [("flash_attn[reference]", "decode", 40.0), ("flash_attn[reference]", "decode_graph", 2.0),
                      ("sdpa[math]", "decode", 40.0), ("sdpa[math]", "decode_graph", 2.0)]
    # once per implementation, under its own backend (SDPA's rows leave the run's setting alone)
    assert captured == ["reference", os.environ.get("FLASH_ATTN_BACKEND")]
    assert len(replays) == 2 * 2 * gpu.GRAPH_REPLAYS  # the untimed first call and the timed one, each
    graph_row = rows[2]
    assert graph_row["gbps"] == pytest.approx(gpu.decode_bytes(graph_row) / 2e-3 / 1e9)


def test_decode_cases_that_do_not_fit_are_skipped_not_failed():
    """Free memory holds the 64-token cases (and the 1 GiB headroom) but not the 256-token ones:
    those are skipped rows for every implementation, saying how much they need."""
    config = _decode_config(batches=[2], copy_bytes=1024)
    small, large = gpu.decode_cases(config)
    free = gpu.DECODE_HEADROOM + gpu.decode_bytes(small) + 100
    assert gpu.decode_bytes(large) + gpu.DECODE_HEADROOM > free
    rows = gpu.run(config, device="cpu", timer=lambda fn, w, r: [fn(), 1.0][1:], free_memory=lambda: free)
    by_len = {n: [r for r in rows if r.get("cachelen") == n] for n in (64, 256)}
    assert [r["status"] for r in by_len[64]] == ["ok", "ok"]
    assert [r["status"] for r in by_len[256]] == ["skipped", "skipped"]
    assert all(r["note"].startswith("skipped: would need 1.0 GiB") and "GiB free" in r["note"] for r in by_len[256])
    assert "time_ms" not in by_len[256][0] and "gbps" not in by_len[256][0]


def test_gpu_main_writes_decode_rows_as_it_goes(tmp_path, capsys, monkeypatch):
    """The bandwidth row and each decode row reach the JSON-lines and CSV files as they are done;
    the Markdown has a decode section with GB/s, % of the measured bandwidth and the skipped row."""
    seen = []

    def timer(fn, warmup, repeats):
        fn()
        lines = (tmp_path / "bench-gpu.jsonl").read_text().splitlines()
        with (tmp_path / "bench-gpu.csv").open() as fh:
            seen.append((len(lines) - 1, len(list(csv.DictReader(fh)))))
        return [1.0]

    args = _gpu_args(tmp_path, "--impls", "flash_attn[reference],sdpa[math]", "--decode-batches", "1",
                     "--decode-cachelens", "128,100000", decode=True)
    args.seqlens = [32]  # 8 training rows
    monkeypatch.setattr(gpu, "COPY_BYTES", 1 << 20)  # not 2 GiB on a test machine
    free = gpu.DECODE_HEADROOM + (3 << 20)  # the copy (2 MiB) and the 128-token cache (0.5 MiB), not the 100k one
    assert gpu.main(args, device="cpu", timer=timer, free_memory=lambda: free) == 0
    # training, copy, decode: each timed row finds every row before it written to both files
    assert seen == [(n, n) for n in (*range(9), 9, 11)]
    rows = [json.loads(line) for line in (tmp_path / "bench-gpu.jsonl").read_text().splitlines()[1:]]
    # each implementation's eager call, then the same call in a CUDA graph (none on a CPU: said so)
    assert [r["pass"] for r in rows[8:]] == ["copy"] + ["decode", "decode_graph"] * 4
    assert [r["status"] for r in rows[9:]] == ["ok", "unsupported"] * 2 + ["skipped"] * 4
    assert rows[10]["note"] == "CUDA graphs need a CUDA device"
    with (tmp_path / "bench-gpu.csv").open() as fh:
        csv_rows = list(csv.DictReader(fh))
    assert float(csv_rows[9]["gbps"]) == pytest.approx(rows[9]["gbps"]) and csv_rows[9]["cachelen"] == "128"
    out = capsys.readouterr().out
    assert "### Decode: flash_attn_with_kvcache" in out
    assert "Memory bandwidth measured by a device-to-device copy in this run:" in out
    assert "| batch | cache | implementation | call | GB moved | ms | GB/s | % of measured | % of nominal | note |" in out
    assert "skipped: would need" in out


def test_gpu_main_exits_1_when_a_decode_row_of_ours_crashed(tmp_path, monkeypatch):
    def timer(fn, warmup, repeats):
        out = fn()
        if isinstance(out, torch.Tensor) and out.dim() == 4:  # a decode call (training returns None, the copy 1-D)
            raise RuntimeError("an illegal memory access was encountered")
        return [1.0]

    args = _gpu_args(tmp_path, "--impls", "flash_attn[reference],sdpa[math]", "--decode-batches", "1",
                     "--decode-cachelens", "64", decode=True)
    args.seqlens = [32]
    monkeypatch.setattr(gpu, "COPY_BYTES", 1 << 20)
    assert gpu.main(args, device="cpu", timer=timer, free_memory=lambda: 64 << 30) == 1
    rows = [json.loads(line) for line in (tmp_path / "bench-gpu.jsonl").read_text().splitlines()[1:]]
    decode = {r["impl"]: r for r in rows if r["pass"] == "decode"}
    ours = decode["flash_attn[reference]"]
    assert ours["status"] == "error" and "illegal memory" in ours["note"]
    assert decode["sdpa[math]"]["status"] == "unsupported"  # another implementation's failure is not ours
    assert [r["status"] for r in rows if not r["pass"].startswith("decode")] == ["ok"] * 9


# ---------------------------------------------------------------------------------------------
# Build mode.
# ---------------------------------------------------------------------------------------------

FAKE_BUILD = textwrap.dedent("""
    import os, sys
    out = sys.argv[1]
    ballast = bytearray(96 << 20)  # resident memory the measurement must see
    for i in range(3):
        with open(os.path.join(out, f"kernel{i}.cubin"), "wb") as fh:
            fh.write(b"x" * (1 << 20))
    print("archs", os.environ["FLASH_ATTN_CUDA_ARCHS"])
""")


def test_build_mode_measures_time_memory_and_size(tmp_path, capsys):
    script = tmp_path / "fake_build.py"
    script.write_text(FAKE_BUILD)
    status = cli.main(["bench", "build", "--build-command", f"{{python}} {script} {{out}}", "--archs", "80;90a",
                       "--out", str(tmp_path / "results")])
    assert status == 0, capsys.readouterr()
    result = json.loads((tmp_path / "results" / "bench-build.json").read_text())
    assert result["status"] == "ok" and result["archs"] == "80;90a"
    assert result["files"] == 3 and result["size_mib"] == pytest.approx(3.0)
    assert result["peak_rss_mib"] >= 96
    assert result["wall_s"] > 0 and result["log_tail"] == ["archs 80;90a"]


def test_build_mode_reports_a_failing_build(tmp_path):
    result = build.run(command="{python} -c 'import sys; print(\"boom\"); sys.exit(3)'", out_dir=tmp_path)
    assert result["status"] == "error" and result["exit_status"] == 3 and result["log_tail"] == ["boom"]


# ---------------------------------------------------------------------------------------------
# bench overhead (stubbed: the aot path with its launches counted, CPU tensors)


def test_overhead_packed_batches_differ_from_call_to_call():
    from flash_attn.bench import overhead  # noqa: PLC0415

    batches = overhead._packed_batches(50, 4, torch.device("cpu"))
    assert len({total for _, _, total in batches}) == 50 and len({longest for _, longest, _ in batches}) > 10
    for cu, longest, total in batches:
        lengths = (cu[1:] - cu[:-1]).tolist()
        assert cu[0] == 0 and cu[-1] == total and len(lengths) == 4 and min(lengths) >= 1 and max(lengths) == longest


def test_overhead_packed_training_finds_its_plans():
    """Packed training whose lengths change every call plans (almost) nothing per call: varlen
    plans are keyed by bucketed bounds, not by the exact totals (before: a forward and a backward
    plan per call, ~550 us each)."""
    from flash_attn.bench import overhead  # noqa: PLC0415

    try:
        rows = overhead.run("stubbed", calls=20, repeats=1)
    except RuntimeError as exc:  # no aot installation (manifest, op library) to stub
        pytest.skip(str(exc))
    by_case = {row["case"]: row for row in rows}
    assert list(by_case) == [*overhead.CASES, *overhead.FLOOR_CASES]
    assert by_case["packed training"]["launches_per_call"] == 4
    assert by_case["packed training"]["plans_per_call"] < 0.5
    assert by_case["packed training, later layer"]["launches_per_call"] == 4
    assert all(by_case[case]["plans_per_call"] == 0
               for case in ("forward", "forward+backward", "packed training, later layer", "decode step",
                            "plain decode"))
    assert by_case["plain decode"]["launches_per_call"] == 2  # the split attention and the combine
    assert all(by_case[case]["us_per_call"] > 0 and by_case[case]["launches_per_call"] == 0
               for case in overhead.FLOOR_CASES)


@pytest.fixture
def stubbed_launches():
    """``bench overhead``'s stub (:func:`flash_attn.bench.overhead.stubbed_aot`) for the test: its
    function counting the launches; skipped without an aot installation (manifest, op library)."""
    from flash_attn.bench import overhead  # noqa: PLC0415

    try:
        stub = overhead.stubbed_aot()
        launches = stub.__enter__()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        yield launches
    finally:
        stub.__exit__(None, None, None)


def test_overhead_growing_cache_is_one_class_of_signatures_on_one_template(stubbed_launches, monkeypatch):
    """The growing cache's decode step (Hugging Face's ``generate()`` without a static cache): every
    call has a key length no call had, so a signature of its own, but all are one class: checked
    once, and the aot backend runs the class's one template with each call's key length and k/v
    strides (no description, no planning, no plan made or held per length)."""
    from flash_attn import flash_attn_interface, validation  # noqa: PLC0415
    from flash_attn.bench import overhead  # noqa: PLC0415
    from flash_attn.planning import plan as P  # noqa: PLC0415

    step = overhead._calls(torch.device("cpu"))["growing cache decode"]
    plans = overhead.aot._device_images(torch.device("cpu")).plans
    monkeypatch.setattr(validation, "_checked", {})  # (earlier benchmarks in this process checked these lengths)
    checks, described = [], []
    real_checks, real_describe = flash_attn_interface._dense_checks, P.describe_forward
    monkeypatch.setattr(flash_attn_interface, "_dense_checks", lambda *a: checks.append(1) or real_checks(*a))
    monkeypatch.setattr(P, "describe_forward", lambda *a: described.append(1) or real_describe(*a))
    before = stubbed_launches()
    for _ in range(3):  # the first (planned: the template), the class's first two (its template found, its lane held)
        step()
    held = len(plans)
    for _ in range(27):
        step()
    assert stubbed_launches() == before + 30
    own = [key for key in validation._checked if key[0] == "flash_attn_func" and len(key) == 2]
    assert len(own) == 30 and checks == [1] and described == [1, 1]  # 30 signatures of one class
    assert len(plans) == held  # nothing per length
    assert [type(value).__name__ for value in plans._values.values()].count("PerCall") == 1


def test_overhead_repeats_one_captured_aot_launch(stubbed_launches):
    """Device mode's "one aot launch" row repeats a forward's op library call alone: here, with the
    CUDA launch stubbed (no GPU), the captured arguments are the forward's (its plan of one launch,
    making no buffer: its tensors, out/lse among them, passed in) and repeating them reaches the
    op library's launch each time, through its checks (a misaligned tensor is refused)."""
    from flash_attn import flash_attn_func  # noqa: PLC0415
    from flash_attn.bench import overhead  # noqa: PLC0415

    q = torch.randn(1, 128, 16, 128).to(torch.bfloat16)
    launch, (plan, tensors, rows) = overhead._captured_launch(lambda: flash_attn_func(q, q, q, causal=True))
    assert plan.dtype == torch.int64 and plan[:2].tolist() == [0, 1] and len(tensors) >= 5 and rows == []
    before = stubbed_launches()
    for _ in range(3):
        assert launch(plan, tensors, rows) == []
    assert stubbed_launches() == before + 3
    with pytest.raises(RuntimeError, match="aligned"):
        launch(plan, [t.view(-1)[1:] if t.dtype == torch.bfloat16 else t for t in tensors], rows)
    assert stubbed_launches() == before + 3
    with pytest.raises(RuntimeError, match="launched nothing"):
        overhead._captured_launch(lambda: None)
    # "its buffers made": the forward's own arguments, its plan making out and lse on every repeat
    launch, (plan, tensors, rows) = overhead._captured_launch(lambda: flash_attn_func(q, q, q, causal=True),
                                                              made=True)
    assert plan[0].item() == 2 and not any(t.shape == (1, 16, 128) for t in tensors)
    first, second = launch(plan, tensors, rows), launch(plan, tensors, rows)
    assert [t.shape for t in first] == [q.shape, (1, 16, 128)] and first[0].data_ptr() != second[0].data_ptr()
    assert stubbed_launches() == before + 6  # the capture ran the forward once more


def test_overhead_parts_of_a_forwards_op_call(stubbed_launches):
    """Device mode's rows of what a forward's op call is made of, run here on CPU tensors: the
    empty kernel's image passes the library's checks (its PTX against its signature and warps)
    and its launch is counted; the library's empty op launches nothing and returns its count;
    PyTorch's out and lse are the shapes the library makes for the forward ("its buffers made")."""
    from flash_attn.bench import overhead  # noqa: PLC0415

    calls = overhead._launch_calls(torch.device("cpu"))
    assert set(overhead.LAUNCH_CASES + overhead.PART_CASES) == set(calls)
    assert overhead.empty_kernel() == overhead.empty_kernel()  # registered once
    before = stubbed_launches()
    calls["one aot launch, an empty kernel"]()
    assert stubbed_launches() == before + 1
    before = stubbed_launches()
    assert calls[overhead.PART_CASES[0]]() == before and stubbed_launches() == before
    made = calls["one aot launch, its buffers made"]()
    assert stubbed_launches() == before + 1
    assert [(t.shape, t.dtype) for t in calls[overhead.PART_CASES[1]]()] == [(t.shape, t.dtype) for t in made]


def test_overhead_profile_names_the_package_functions(tmp_path, capsys):
    """``--profile`` writes, per case, where host time goes: the public entry point and the
    dispatcher appear with their cumulative time, at least the whole call's own time in sum."""
    from flash_attn.bench import overhead  # noqa: PLC0415

    status = cli.main(["bench", "overhead", "--profile", "--calls", "20", "--repeats", "1", "--out", str(tmp_path)])
    if status == 2:
        pytest.skip(capsys.readouterr().err)
    assert status == 0
    text = (tmp_path / "bench-overhead-profile-decode-step.txt").read_text()
    assert text.startswith("20 calls")
    assert "(flash_attn/kvcache.py:" in text and "(flash_attn/dispatch.py:" in text
    assert sorted(p.name for p in tmp_path.glob("bench-overhead-profile-*.txt")) == sorted(
        f"bench-overhead-profile-{c.replace(' ', '-').replace('+', '-')}.txt" for c in overhead.CASES)


# --- bench ops: the fused loss and norms against PyTorch's ops ------------------------------------


def test_ops_quick_in_process(tmp_path, capsys):
    from flash_attn.bench import ops

    status = cli.main(["bench", "ops", "--quick", "--impls", "flash_attn,torch", "--dtypes", "fp32", "--repeats",
                       "1", "--ops-devices", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0
    rows = json.loads((tmp_path / "bench-ops.json").read_text())["results"]
    assert [(r["op"], r["impl"]) for r in rows] == [(op, impl) for op in ops.OPS for impl in ("flash_attn", "torch")]
    for row in rows:
        assert row["status"] == "ok" and row["time_ms"] > 0 and row["device"] == "cpu"
        # both rows computed the same thing (fp32: up to summation order)
        assert row["max_diff_vs_torch"] < 1e-4, row
        if sys.platform == "linux":
            assert row["peak_mib"] is not None and row["peak_mib"] >= 0
    assert all((r["speedup_vs_torch"] is not None) == (r["impl"] == "flash_attn") for r in rows)
    assert {r["width"] for r in rows} == {1000, 256} and {r["tokens"] for r in rows} == {256}
    assert "| loss | cpu | fp32 |" in out
    assert (tmp_path / "bench-ops.csv").read_text().startswith("op,impl,device")


def test_ops_a_failing_compile_costs_only_its_own_row(tmp_path, monkeypatch):
    def no_compiler(fn, *args, **kwargs):
        def fails(*a, **k):
            raise RuntimeError("no C++ compiler")
        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    status = cli.main(["bench", "ops", "--quick", "--ops", "loss", "--repeats", "1", "--ops-devices", "cpu",
                       "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench-ops.json").read_text())["results"]
    assert status == 0
    assert {r["impl"]: r["status"] for r in rows} == {"flash_attn": "ok", "torch": "ok", "torch.compile": "error"}
    assert "no C++ compiler" in rows[-1]["note"]


def test_ops_unknown_names_are_refused(tmp_path, capsys):
    assert cli.main(["bench", "ops", "--ops", "softmax", "--out", str(tmp_path)]) == 2
    assert "unknown op" in capsys.readouterr().err


def test_overhead_device_rows_interleave_and_flag_the_host_bound(monkeypatch):
    """Device mode's rows on CPU callables, with a stand-in GPU span (the CUDA one needs a GPU:
    it is not run here): each case and implementation timed ``repeats`` times in interleaved
    order, medians and spreads of host and GPU time per call, host > GPU flagged, a call that
    raises kept as its own error row while the others run."""
    from flash_attn.bench import overhead  # noqa: PLC0415

    order = []

    def call(name):
        return lambda: order.append(name)

    def refuses():
        raise RuntimeError("no kernel for this shape\nsecond line")

    # the GPU span says 1 ms per call for "slow" (the host is far quicker), 0 for the rest
    def gpu_span(fn, calls, host_s):
        slow = order[-1].startswith("slow")
        return (calls * 1.0 if slow else 0.0), True

    entered = []

    @contextlib.contextmanager
    def context():
        entered.append(len(order))
        yield

    calls_by_impl = {"ours": {"fast": call("fast ours"), "slow": call("slow ours")},
                     "theirs": {"fast": refuses, "slow": call("slow theirs")}}
    rows = overhead.device_rows(calls_by_impl, calls=4, repeats=3, sync=lambda: None, gpu_span=gpu_span,
                                contexts={"theirs": context}, launches={"fast": 1})
    assert [(r["case"], r["impl"], r["status"]) for r in rows] == [
        ("fast", "ours", "ok"), ("fast", "theirs", "error"), ("slow", "ours", "ok"), ("slow", "theirs", "ok")]
    assert rows[1]["note"] == "RuntimeError: no kernel for this shape"
    # interleaved: each repeat runs every case and implementation once (warm-up 3 + 4 timed + span 4)
    runs = [name for name, _ in itertools.groupby(order)]
    assert runs == ["fast ours", "slow ours", "slow theirs"] * 3
    assert len(entered) == 2 + 1 + 1  # theirs' context around each of its runs (fast once: it failed)
    for row in (rows[0], rows[2], rows[3]):
        assert row["host_min"] <= row["host_us"] <= row["host_max"] and row["us_min"] <= row["us_per_call"]
        assert row["thread_us"] >= 0 and row["gpu_covered"] is True
    assert rows[0]["gpu_us"] == 0.0 and rows[0]["host_bound"] is True and rows[0]["launches_per_call"] == 1
    assert rows[2]["gpu_us"] == 1000.0 and rows[2]["host_bound"] is False and rows[2]["launches_per_call"] is None


def test_overhead_device_mode_times_our_calls_on_both_launch_routes():
    """Device mode times our calls twice, interleaved in one run: on the op library's default
    launch route (the CUDA runtime's) and with every launch by the driver (``DRIVER_ROUTE``, its
    context switching the route on around each run and back after), PyTorch's own launch and the
    parts of a call once; SDPA's backends on fresh calls each, cuDNN's untimed case left out. (The
    route switch itself runs here; what each route costs needs a GPU.)"""
    from flash_attn.aot import library as op_library  # noqa: PLC0415
    from flash_attn.bench import overhead  # noqa: PLC0415

    if not op_library.status().loaded:
        pytest.skip(op_library.status().reason)
    ops = op_library.ops()
    seen = []

    def route():  # the route a call runs on, left as it was
        on = ops.aot_use_driver_launch(True)
        ops.aot_use_driver_launch(on)
        seen.append(on)

    ours = {"forward": route, "one aot launch": route, "one PyTorch launch": route,
            **{part: route for part in overhead.PART_CASES}}
    sdpa = lambda: {"forward": route, "growing cache decode": route}  # noqa: E731
    calls_by_impl, contexts = overhead.device_impls(ours, sdpa)
    assert list(calls_by_impl) == list(overhead.IMPLS)
    assert list(calls_by_impl[overhead.DRIVER_ROUTE]) == ["forward", "one aot launch"]
    assert "growing cache decode" not in calls_by_impl["sdpa[cudnn]"]
    assert calls_by_impl["sdpa[flash]"] is not calls_by_impl["sdpa[cudnn]"]
    rows = overhead.device_rows({impl: calls_by_impl[impl] for impl in ("flash_attn", overhead.DRIVER_ROUTE)},
                                calls=2, repeats=2, sync=lambda: None,
                                contexts={overhead.DRIVER_ROUTE: contexts[overhead.DRIVER_ROUTE]})
    assert all(r["status"] == "ok" for r in rows)
    # per repeat: forward on each route, one aot launch on each, PyTorch's launch and the parts once
    per_run = 3 + 2  # warm-up, then the timed calls
    one_repeat = ([False] * per_run + [True] * per_run) * 2 + [False] * per_run * 3
    assert seen == one_repeat * 2
    assert ops.aot_use_driver_launch(False) is False  # left as it was


def test_overhead_device_rows_without_a_gpu_span():
    from flash_attn.bench import overhead  # noqa: PLC0415

    rows = overhead.device_rows({"ours": {"forward": lambda: None}}, calls=2, repeats=2, sync=lambda: None)
    assert rows[0]["gpu_us"] is None and rows[0]["host_bound"] is None and rows[0]["status"] == "ok"
    assert set(rows[0]) == set(overhead.DEVICE_COLUMNS)


def test_overhead_device_mode_needs_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the device mode runs in .ci/gpu-check's overhead step instead")
    assert cli.main(["bench", "overhead", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_overhead_stage_breakdown_nests_the_stages(stubbed_launches):
    """The per-stage breakdown of a forward and a decode step (stubbed aot): the stages a call
    runs, nested as they run (a signature's third call: no lane held by the op library yet, then
    the signature's lane, straight from the custom op's entry for an eager forward, inside the
    dispatcher's route of the plan held for the signature for the decode step; the lane passing the
    call's tensors to the op library as they are; then its plan held; the later calls: the held
    lane alone), and no stage dearer than the whole call it is part of (with slack for timing
    noise on a shared machine)."""
    from flash_attn.bench import overhead  # noqa: PLC0415

    held = "dispatch, a held lane: the op library's call (metadata compared, buffers made, launches checked)"
    calls = overhead._calls(torch.device("cpu"))
    for case, entry in (("forward", "custom op entry"), ("decode step", "custom op entry (kv cache)")):
        for _ in range(2):  # the signature's lane is made at its second call
            calls[case]()
        rows = overhead.stage_breakdown(calls[case], calls=100, repeats=5)  # its third call: the Python lane
        names = [(r["depth"], r["stage"]) for r in rows]
        op = "forward" if case == "forward" else "forward_kvcache"
        # the op library holds no lane yet: the Python route, then its plan held for the next calls
        assert names[:4] == [(0, "the whole call"), (1, held), (1, "metadata checks"), (1, entry)]
        assert names[-1] == (1, "dispatch, a lane held for the next calls")
        lane = 2 if case == "forward" else 3
        if case != "forward":
            assert (2, f"dispatch, the plan held for the signature ({op})") in names
        assert (lane, f"dispatch, the signature's lane ({op})") in names
        assert (lane + 1, "the op library's call: buffers made, launches checked (the CUDA launch stubbed)") in names
        assert not any(stage.startswith("inputs prepared") for _, stage in names)  # the aot lane's direct path
        assert not any("plan lookup" in name for _, name in names)  # the general route not taken
        assert all(r["us"] >= 0 and r["count"] >= 1 for r in rows)  # the stubbed launch may round to 0
        assert rows[0]["us"] > 0 and all(r["us"] < 3 * rows[0]["us"] for r in rows[1:])
        text = overhead.stages_text(rows)
        assert "the signature's lane" in text and text.count("\n") == len(rows) + 1
        # the later calls: the held lane alone
        assert [(r["depth"], r["stage"]) for r in overhead.stage_breakdown(calls[case], calls=20, repeats=1)] == [
            (0, "the whole call"), (1, held)]
    # packed training, a new batch every call: both ops on the signature's route
    calls["packed training"]()
    rows = overhead.stage_breakdown(calls["packed training"], calls=20, repeats=3)
    names = [(r["depth"], r["stage"]) for r in rows]
    assert (2, "dispatch, the plan held for the signature (forward)") in names
    assert any(stage == "dispatch, the plan held for the signature (backward)" for _, stage in names)
    assert not any("plan lookup" in name for _, name in names)
    # ... and the same batch again (a later layer), from its fifth step: the held training lanes
    for _ in range(4):
        calls["packed training, later layer"]()
    rows = overhead.stage_breakdown(calls["packed training, later layer"], calls=20, repeats=3)
    assert [(r["depth"], r["stage"]) for r in rows] == [
        (0, "the whole call"), (1, "dispatch, the training call's held lanes looked up"),
        (1, "custom op entry, the training call's held lanes (its autograd record)"),
        (2, "the held forward's op library call (metadata compared, buffers made, launches checked)"),
        (1, "the held backward's op library call (metadata compared, buffers made, launches checked)")]


def test_overhead_stage_breakdown_of_the_general_route(stubbed_launches, monkeypatch):
    """A call without a signature (a list among its arguments, a tensor subclass: checked every
    time) takes the dispatcher's general route, split into plan lookup and execution."""
    from flash_attn import validation  # noqa: PLC0415
    from flash_attn.bench import overhead  # noqa: PLC0415

    checked_call = validation.checked_call
    monkeypatch.setattr(validation, "checked_call", lambda *args: (checked_call(*args)[0], None))
    rows = overhead.stage_breakdown(overhead._calls(torch.device("cpu"))["packed training"], calls=20, repeats=3)
    names = [(r["depth"], r["stage"]) for r in rows]
    assert (2, "dispatch (forward)") in names and (2, "dispatch (backward)") in names
    assert (3, "plan lookup (forward: describe the call, find its plan)") in names
    assert (4, "inputs prepared (the buffers too, before the op library made them)") in names
    assert not any("the plan held" in name for _, name in names)
