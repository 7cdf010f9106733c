"""``bench gpu``'s method (issue 42 item 3, issue 48 item 3) on the CPU: the implementations timed
in rotated order over rounds with a spread per row, decode as a real step (the new k/v appended at
each sequence's length, contiguous and paged caches) checked against a naive float32 oracle, and
``--family`` (the mma.sync proxy: our aot images under a forced family beside SDPA flash). Stand-in
timers and a stand-in image lookup stand for the GPU; no time here says anything about a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from flash_attn import __main__ as cli
from flash_attn.bench import gpu


def _config(**overrides):
    config = {"seqlens": [32], "headdims": [16], "dtypes": ["fp32"], "causal": [False], "backward": [False],
              "impls": ["flash_attn[reference]", "sdpa[math]"], "total_tokens": 64, "hidden": 32, "repeats": 6,
              "warmup": 2}
    config.update(overrides)
    return config


def test_round_orders_rotate_so_each_implementation_leads_once():
    orders = gpu.round_orders(3, 3)
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert sorted(o[0] for o in orders) == [0, 1, 2]
    assert gpu.round_orders(2, 1) == [[0, 1]]
    assert gpu.round_repeats(30, 3) == 10 and gpu.round_repeats(10, 3) == 4 and gpu.round_repeats(1, 3) == 1


def test_rounds_interleave_the_implementations_and_give_a_spread():
    """Three rounds: the order rotates, the warm-up is in the first round only, the repeats are
    split over the rounds, and each row's time is the median of all its times, its spread the
    range of the round medians over it."""
    log = []
    round_times = {"flash_attn[reference]": [[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]],
                   "sdpa[math]": [[4.0, 4.0], [4.0, 4.0], [4.0, 4.0]]}

    def timer_for(name):
        def timer(fn, warmup, repeats):
            log.append((name, warmup, repeats))
            return round_times[name][sum(1 for n, _, _ in log if n == name) - 1]
        return timer

    impls = gpu.implementations(["flash_attn[reference]", "sdpa[math]"])
    rows = [{"impl": i.name, "pass": "fwd"} for i in impls]
    timings = [gpu.Timing(r, i, lambda: None, timer_for(i.name)) for r, i in zip(rows, impls)]
    done = []
    gpu.measure_interleaved(timings, {i.name: None for i in impls}, _config(rounds=3), torch.device("cpu"),
                            lambda t: done.append(t.row["impl"]))
    assert [n for n, _, _ in log] == ["flash_attn[reference]", "sdpa[math]", "sdpa[math]", "flash_attn[reference]",
                                      "flash_attn[reference]", "sdpa[math]"]
    assert [w for _, w, _ in log] == [2, 2, 0, 0, 0, 0] and {r for _, _, r in log} == {2}
    ours, sdpa = rows
    assert ours["time_ms"] == 1.0 and ours["round_ms"] == [1.0, 2.0, 1.0] and ours["repeats"] == 6
    assert ours["spread_pct"] == pytest.approx(100.0) and sdpa["spread_pct"] == 0.0
    assert done == ["flash_attn[reference]", "sdpa[math]"]  # the last round's order


def test_one_round_has_no_spread():
    impls = gpu.implementations(["sdpa[math]"])
    row = {"impl": "sdpa[math]", "pass": "fwd"}
    gpu.measure_interleaved([gpu.Timing(row, impls[0], lambda: None, lambda fn, w, r: [3.0] * r)],
                            {"sdpa[math]": None}, _config(), torch.device("cpu"))
    assert row["status"] == "ok" and row["spread_pct"] is None and row["repeats"] == 6


def test_rows_of_a_case_are_written_before_the_next_case_is_timed(tmp_path):
    """With rounds, a case's rows are written once its last round is timed: before the next case."""
    seen = []

    def timer(fn, warmup, repeats):
        fn()
        seen.append(len((tmp_path / "bench-gpu.jsonl").read_text().splitlines()) - 1)
        return [1.0] * repeats

    args = cli.build_parser().parse_args(["bench", "gpu", "--out", str(tmp_path), "--seqlens", "32,64", "--headdims",
                                          "16", "--dtypes", "fp32", "--total-tokens", "64", "--hidden", "32",
                                          "--repeats", "3", "--warmup", "0", "--no-plot", "--no-beyond", "--no-decode",
                                          "--rounds", "3", "--impls", "flash_attn[reference],sdpa[math]"])
    assert gpu.main(args, device="cpu", timer=timer) == 0
    cases = 2 * 2 * 2  # lengths x masks x passes
    assert len(seen) == cases * 2 * 3
    # within case c, every timing saw the 2 * c rows of the cases before it (the last one's first row too)
    for c in range(cases):
        timings = seen[6 * c:6 * c + 6]
        assert timings[:5] == [2 * c] * 5 and timings[5] in (2 * c, 2 * c + 1)
    rows = [json.loads(line) for line in (tmp_path / "bench-gpu.jsonl").read_text().splitlines()[1:]]
    assert all(r["status"] == "ok" and len(r["round_ms"]) == 3 for r in rows)


# --- decode as a real step --------------------------------------------------------------------------

STEP = {"dtype": "fp32", "headdim": 16, "heads": 4, "kv_heads": 2, "batch": 3, "cachelen": 512, "seqlen": 1}


def test_step_lengths_are_ragged_and_leave_room_for_the_new_token():
    assert gpu.step_seqlens(1, 4096) == [4095]
    lengths = gpu.step_seqlens(8, 4096)
    assert lengths[0] == 4095 and min(lengths) >= 2048 and len(set(lengths)) == 8 and max(lengths) < 4096


def test_decode_step_bytes_against_a_hand_count():
    case = dict(STEP, dtype="bf16", batch=2, cachelen=8, kv_heads=1, heads=2, headdim=4)
    # lengths 7 and 5 (+1 each): 14 keys of K and V, 8 B a row; new k/v 2 x 2 rows; q and out 2 x 2 x 2 x 4 x 2 B
    assert gpu.step_seqlens(2, 8) == [7, 5]
    assert gpu.decode_step_bytes(case) == 2 * 14 * 8 + 2 * 2 * 8 + 2 * 2 * 2 * 4 * 2


@pytest.mark.parametrize("paged", [False, True])
def test_decode_step_reference_is_attention_over_the_appended_cache(paged):
    """The oracle against attention written out on the contiguous cache: the paged inputs hold the
    same tokens, scattered over shuffled pages."""
    case = dict(STEP, **({"page_size": 256} if paged else {}))
    inputs = gpu.decode_step_inputs(case, "cpu", torch.float32, torch.Generator().manual_seed(1))
    table = inputs["block_table"]
    if paged:
        assert inputs["k_cache"].shape == (3 * 2, 256, 2, 16) and table.shape == (3, 2) and table.dtype == torch.int32
        assert sorted(table.flatten().tolist()) == list(range(6)) and table.flatten().tolist() != list(range(6))
    want = gpu.decode_step_reference(inputs)
    for b, length in enumerate(inputs["cache_seqlens"].tolist()):
        k = inputs["k_cache"][table[b].long()].flatten(0, 1) if paged else inputs["k_cache"][b]
        v = inputs["v_cache"][table[b].long()].flatten(0, 1) if paged else inputs["v_cache"][b]
        k = torch.cat([k[:length], inputs["k_new"][b]]).double()
        v = torch.cat([v[:length], inputs["v_new"][b]]).double()
        for h in range(4):
            scores = (inputs["q"][b, 0, h].double() @ k[:, h // 2].T) / 4.0
            torch.testing.assert_close(want[b, 0, h].double(), scores.softmax(-1) @ v[:, h // 2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("paged", [False, True])
def test_our_decode_step_and_sdpas_match_the_oracle(paged):
    case = dict(STEP, **({"page_size": 256} if paged else {}))
    inputs = gpu.decode_step_inputs(case, "cpu", torch.float32, torch.Generator().manual_seed(2))
    want = gpu.decode_step_reference(inputs)
    names = ("q", "k_cache", "v_cache", "k_new", "v_new", "cache_seqlens", "block_table")
    ours = gpu.implementations(["flash_attn[reference]"])[0]
    with ours.context():
        got = ours.decode_step(*(inputs[n] for n in names))
    assert gpu.relative_error(got, want) < 1e-5
    # the new token was written into the cache at each sequence's length
    row = inputs["cache_seqlens"][0].item()
    cache = inputs["k_cache"][inputs["block_table"][0].long()].flatten(0, 1) if paged else inputs["k_cache"][0]
    assert torch.equal(cache[row], inputs["k_new"][0, 0])
    sdpa = gpu.implementations(["sdpa[math]"])[0]
    with sdpa.context():
        if paged:
            with pytest.raises(NotImplementedError, match="paged"):
                sdpa.decode_step(*(inputs[n] for n in names))
        else:
            assert gpu.relative_error(sdpa.decode_step(*(inputs[n] for n in names)), want) < 1e-5


def test_decode_step_rows(monkeypatch):
    """The step rows: ours and SDPA (math) checked then timed, SDPA's paged row unsupported; a
    wrong result of ours is an error row, not timed."""
    config = _config(headdims=[], rounds=2, decode={**gpu.DECODE_SHAPE, "heads": 4, "kv_heads": 2, "headdim": 16,
                                                     "dtype": "fp32", "batches": [2], "cachelens": [256],
                                                     "copy_bytes": 1 << 10, "graphs": False, "steps": True})
    rows = gpu.run(config, device="cpu", timer=lambda fn, w, r: [fn(), 1.0][1:] * r, free_memory=lambda: None)
    steps = [r for r in rows if r["pass"] in gpu.STEP_PASSES]
    got = {(r["impl"], r["pass"]): r for r in steps}
    assert set(got) == {(i, p) for i in ("flash_attn[reference]", "sdpa[math]") for p in gpu.STEP_PASSES}
    for key in (("flash_attn[reference]", "decode_step"), ("flash_attn[reference]", "decode_step_paged"),
                ("sdpa[math]", "decode_step")):
        assert got[key]["status"] == "ok" and got[key]["check"] == "ok" and got[key]["err_out"] < 1e-5
        assert got[key]["gbps"] > 0 and len(got[key]["round_ms"]) == 2
    assert got[("sdpa[math]", "decode_step_paged")]["status"] == "unsupported"
    assert got[("flash_attn[reference]", "decode_step_paged")]["page_size"] == gpu.PAGE_SIZE

    wrong = gpu._ours("reference")
    monkeypatch.setattr(gpu, "_ours", lambda backend: gpu.Implementation(
        wrong.name, wrong.unavailable, wrong.run, wrong.context, wrong.backend,
        decode_step=lambda *a: wrong.decode_step(*a) * 1.1))
    timed = []
    rows = gpu.run(dict(config, impls=["flash_attn[reference]"]), device="cpu",
                   timer=lambda fn, w, r: timed.append(fn) or [1.0] * r, free_memory=lambda: None)
    steps = [r for r in rows if r["pass"] in gpu.STEP_PASSES]
    assert all(r["status"] == "error" and "wrong result" in r["note"] for r in steps)
    assert len(timed) == 1  # the bandwidth copy only (the stand-in has no plain decode call)


def test_plain_decode_rows_are_checked_before_they_are_timed(monkeypatch):
    """The plain decode rows (one new query over a full cache, nothing appended): ours and SDPA
    (math) checked against the float32 reference, then timed; a wrong result of ours is an error
    row, not timed."""
    config = _config(headdims=[], rounds=1, decode={**gpu.DECODE_SHAPE, "heads": 4, "kv_heads": 2, "headdim": 16,
                                                     "dtype": "fp32", "batches": [2], "cachelens": [64],
                                                     "copy_bytes": 1 << 10, "graphs": False, "steps": False})
    rows = [r for r in gpu.run(config, device="cpu", timer=lambda fn, w, r: [fn(), 1.0][1:] * r,
                               free_memory=lambda: None) if r["pass"] == "decode"]
    assert {r["impl"] for r in rows} == {"flash_attn[reference]", "sdpa[math]"}
    assert all(r["status"] == "ok" and r["check"] == "ok" and r["err_out"] < 1e-5 for r in rows), rows

    wrong = gpu._ours("reference")
    monkeypatch.setattr(gpu, "_ours", lambda backend: gpu.Implementation(
        wrong.name, wrong.unavailable, wrong.run, wrong.context, wrong.backend,
        decode=lambda *a: wrong.decode(*a) * 1.1))
    timed = []
    rows = [r for r in gpu.run(dict(config, impls=["flash_attn[reference]"]), device="cpu",
                               timer=lambda fn, w, r: timed.append(fn) or [1.0] * r, free_memory=lambda: None)
            if r["pass"] == "decode"]
    assert len(rows) == 1 and rows[0]["status"] == "error" and "wrong result" in rows[0]["note"]
    assert len(timed) == 1  # the bandwidth copy only

    # with CUDA graphs asked for: the wrong call's replay is an error too, not captured nor timed
    captured = []
    graphs = dict(config, impls=["flash_attn[reference]"], decode={**config["decode"], "graphs": True})
    rows = [r for r in gpu.run(graphs, device="cpu", timer=lambda fn, w, r: [1.0] * r, free_memory=lambda: None,
                               capture=lambda call: captured.append(call) or call)
            if r["pass"] == "decode_graph"]
    assert len(rows) == 1 and rows[0]["status"] == "error" and "wrong result" in rows[0]["note"] and not captured


def test_a_replayed_row_is_judged_by_the_backend_its_capture_ran_on(monkeypatch):
    """A graphed decode row's replays call no Python, so the backend that counts is the one the
    captured call ran on, not the last eager call of whichever row ran since (on the 2026-11-30
    H200, aot's graph rows were reported as run by triton: a triton row had run in between). The
    stand-in ``last_backend`` stands for the dispatcher's record of the calls."""
    from flash_attn import dispatch

    ran = ["aot"]
    monkeypatch.setattr(dispatch, "last_backend", lambda: ran[-1])
    ours = gpu._ours("aot")
    replayed = gpu._Replayed(lambda: None, capture=lambda call: call)
    replayed()  # captured while aot ran
    ran.append("triton")  # another row's eager call since
    assert gpu._ran_elsewhere(ours, "cuda", replayed) is None
    assert gpu._ran_elsewhere(ours, "cuda", lambda: None) == "the triton backend ran it, not aot"
    fell_back = gpu._Replayed(lambda: None, capture=lambda call: call)
    fell_back()  # captured while triton ran: an error whatever runs after
    ran.append("aot")
    assert gpu._ran_elsewhere(ours, "cuda", fell_back) == "the triton backend ran it, not aot"


def test_decode_steps_are_on_by_default_and_can_be_left_out():
    config = gpu.config_from_args(cli.build_parser().parse_args(["bench", "gpu", "--decode-batches", "1,8",
                                                                 "--decode-cachelens", "4096"]))
    assert [(c["batch"], c["pass"]) for c in gpu.decode_step_cases(config)] == [
        (1, "decode_step"), (1, "decode_step_paged"), (8, "decode_step"), (8, "decode_step_paged")]
    off = gpu.config_from_args(cli.build_parser().parse_args(["bench", "gpu", "--no-decode-steps"]))
    assert gpu.decode_step_cases(off) == [] and off["rounds"] == 3
    assert gpu.config_from_args(cli.build_parser().parse_args(["bench", "gpu", "--quick"]))["rounds"] == 1
    with pytest.raises(ValueError, match="rounds"):
        gpu.config_from_args(cli.build_parser().parse_args(["bench", "gpu", "--rounds", "0"]))


# --- --family: the mma.sync proxy ------------------------------------------------------------------


def test_family_defaults_to_the_proxy_table():
    config = gpu.config_from_args(cli.build_parser().parse_args(["bench", "gpu", "--family", "sm86"]), (1024,))
    assert config["family"] == "sm86" and config["impls"] == ["flash_attn[aot]", "sdpa[flash]"]
    assert config["seqlens"] == [4096, 16384] and config["dtypes"] == ["bf16"] and config["headdims"] == [64, 128, 256]
    assert config["decode"] is None and config["beyond"] == []
    assert {(c["headdim"], c["causal"], c["pass"]) for c in gpu.cases(config)} == {
        (d, c, p) for d in (64, 128, 256) for c in (False, True) for p in ("fwd", "fwd_bwd")}


def test_family_refuses_other_backends_of_ours(tmp_path, capsys):
    args = cli.build_parser().parse_args(["bench", "gpu", "--family", "sm80", "--impls", "flash_attn[triton],sdpa[flash]",
                                          "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="flash_attn.aot."):
        gpu.config_from_args(args)
    assert gpu.main(args, device="cpu") == 2 and "--family sm80" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "gpu", "--family", "sm90"])


_REFERENCE = gpu._ours("reference")


def _aot_as_reference():
    """Our reference backend standing in for the aot images (what it stands for: the rows' plumbing;
    it cannot show a kernel under a forced family)."""
    ref = _REFERENCE
    return gpu.Implementation("flash_attn[aot]", lambda device: None, ref.run, ref.context, "aot", forward=ref.forward)


def test_family_rows_say_the_family_and_the_proxy(monkeypatch):
    monkeypatch.setattr(gpu, "_ours", lambda backend: _aot_as_reference())
    seen = []

    def image_of(device):
        from flash_attn.aot import forced

        seen.append(forced.forced_family())
        return ("compute_80", seen[-1])

    config = _config(impls=["flash_attn[aot]", "sdpa[math]"], family="sm86", rounds=2)
    rows = gpu.run(config, device="cpu", timer=lambda fn, w, r: [1.0] * r, image_of=image_of)
    assert seen == ["sm86"]  # the variable was set when the images were looked up
    ours = [r for r in rows if r["impl"] == "flash_attn[aot]"]
    assert ours and all(r["status"] == "ok" and r["family"] == "sm86" for r in ours)
    assert "sm86 tables" in ours[0]["proxy"] and "compute_80 PTX, compiled by the driver" in ours[0]["proxy"]
    assert all(r["family"] is None and r["proxy"] == gpu.PROXY_BASELINE_NOTE for r in rows if r["impl"] == "sdpa[math]")
    import os

    assert "FLASH_ATTN_FORCE_FAMILY" not in os.environ  # restored after the run


@pytest.mark.parametrize("found, says", [
    ("FLASH_ATTN_FORCE_FAMILY=sm80: no installed image carries the sm80 configs", "no installed image"),
    (("sm_90a", "sm90"), "runs the sm90 configs here, not the forced sm80"),
])
def test_family_rows_are_errors_where_the_images_do_not_run_the_family(monkeypatch, found, says):
    monkeypatch.setattr(gpu, "_ours", lambda backend: _aot_as_reference())
    monkeypatch.setenv("FLASH_ATTN_STRICT_BACKEND", "1")
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "aot")
    config = _config(impls=["flash_attn[aot]", "sdpa[math]"], family="sm80")
    rows = gpu.run(config, device="cpu", timer=lambda fn, w, r: [1.0] * r, image_of=lambda device: found)
    ours = [r for r in rows if r["impl"] == "flash_attn[aot]"]
    assert all(r["status"] == "error" and says in r["note"] and "time_ms" not in r for r in ours)


def test_proxy_ratios_pair_each_case_with_sdpa_flash():
    rows = [{"impl": "flash_attn[aot]", "status": "ok", "dtype": "bf16", "headdim": 128, "causal": True, "pass": "fwd",
             "seqlen": 4096, "time_ms": 2.0, "family": "sm80", "spread_pct": 1.0},
            {"impl": "sdpa[flash]", "status": "ok", "dtype": "bf16", "headdim": 128, "causal": True, "pass": "fwd",
             "seqlen": 4096, "time_ms": 3.0, "spread_pct": 2.5},
            {"impl": "sdpa[flash]", "status": "ok", "dtype": "bf16", "headdim": 128, "causal": False, "pass": "fwd",
             "seqlen": 4096, "time_ms": 3.0}]
    (ratio,) = gpu.proxy_ratios(rows)
    assert ratio["ratio"] == 1.5 and ratio["spread_pct"] == 2.5 and ratio["family"] == "sm80"
    assert ratio["target"] == 1.0 and ratio["meets"] is True
    assert [gpu.proxy_target({"pass": p, "headdim": d}) for p, d in
            (("fwd", 256), ("fwd_bwd", 64), ("fwd_bwd", 128), ("fwd_bwd", 256))] == [1.0, 0.9, 0.9, 0.8]
    assert "| 1.5" in gpu.proxy_markdown(rows, "sm80")


# --- flex_attention as the Triton peer -----------------------------------------------------------


def test_flex_is_a_named_baseline_checked_like_the_others(monkeypatch):
    """flex_attention's rows (eager flex standing in for the compiled one: the same semantics, the
    plumbing; what it cannot show is inductor's kernels, nor its CUDA backward) are checked against
    the float32 reference before timing, causal and not, with GQA; what it does not run is an
    ``unsupported`` row: its backward on the CPU (PyTorch's refusal), attention sinks."""
    monkeypatch.setattr(gpu, "FLEX_COMPILE", False)
    monkeypatch.setattr(gpu, "HELD_OUT", ((40, 1, 4, 2, 16),))
    monkeypatch.setattr(gpu, "BEYOND_CASES", ({"headdim": 16, "sinks": True},))
    config = _config(impls=["flex"], causal=[False, True], backward=[False, True], held_out=True,
                     beyond=list(gpu.BEYOND_CASES))
    rows = gpu.run(config, device="cpu", timer=lambda fn, w, r: [fn(), 1.0][1:] * r)
    plain = [r for r in rows if not r.get("sinks")]
    assert len(plain) == 4 + 4 and any(r.get("kv_heads") == 2 and r["pass"] == "fwd" for r in plain)
    for r in plain:
        assert r["what"] == gpu.WHAT["flex"] and "Triton peer" in r["what"]
        if r["pass"] == "fwd":
            assert r["status"] == "ok" and r["check"] == "ok" and r["err_out"] < 1e-5, r
        else:
            assert r["status"] == "unsupported" and "backward" in r["note"] and "time_ms" not in r, r
    sinks = [r for r in rows if r.get("sinks")]
    assert sinks and all(r["status"] == "unsupported" and "sinks" in r["note"] for r in sinks)
    assert "flex" in gpu.DEFAULT_IMPLS


def test_flex_unavailable_without_triton_on_cuda(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "triton":
            raise ImportError("no triton")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    assert "triton is not installed" in gpu.flex_unavailable(torch.device("cuda"))
    assert gpu.flex_unavailable(torch.device("cpu")) is None
