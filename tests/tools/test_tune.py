"""``bench tune`` end to end on the CPU: prepare compiles the candidates for sm_90a (for real),
run times them with the GPU timing faked (the real planner, kernels and correctness check, run by
Triton's interpreter), fold rewrites the config table.

What the fake timer stands in for: CUDA-event times on a GPU. It cannot show which candidate is
fast; it shows that the sweep measures every candidate through the planner's override, checks it,
keeps its rows when cut off, and that the fold picks the fastest correct one and edits the table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from flash_attn.bench import tune
from flash_attn.planning import configs

C = configs.Config
FAST = C(16, 16, 1, 1)  # the interpreter runs any tile: three candidates for head dim 32
SLOW = C(32, 32, 1, 1)


@pytest.fixture
def interpreter_candidates(monkeypatch):
    monkeypatch.setattr(tune, "CANDIDATES", {
        ("fwd", "interpret"): {32: [FAST, SLOW]},
        ("bwd_fused", "interpret"): {32: [FAST, SLOW, tune.SPLIT]},
    })


def fake_timer(times: dict):
    """Milliseconds by the config the planner was told to use (what a GPU would measure)."""
    def timer(fn):
        fn()  # the call must run: a candidate that crashes must crash here too
        active = list(configs._overrides.values())
        return times.get(tune._config_text(active[0]) if active else "table", 5.0)
    return timer


def _run(out: Path, times: dict, **kwargs) -> list[dict]:
    path = tune.run(out, device="cpu", backend="interpret", family="interpret", headdims=[32], seqlens=[32],
                    total_tokens=32, hidden=64, timer=fake_timer(times), reference="math", baselines=(), **kwargs)
    return tune.read_rows(path)


def test_run_measures_and_checks_every_candidate(tmp_path, interpreter_candidates):
    rows = _run(tmp_path, {"16x16w1s1": 1.0, "32x32w1s1": 2.0})
    measured = [r for r in rows if r.get("impl") == "flash_attn"]
    # per shape (causal and not): the table's entry + the listed ones, forward and backward
    configs_seen = {(r["kind"], r["config"]) for r in measured}
    assert configs_seen == {("fwd", "32x16w1s1"), ("fwd", "16x16w1s1"), ("fwd", "32x32w1s1"),
                            ("bwd_fused", "16x32w1s1"), ("bwd_fused", "16x16w1s1"), ("bwd_fused", "32x32w1s1"),
                            ("bwd_fused", "split")}
    assert len(measured) == 2 * len(configs_seen)
    assert all(r["ok"] and r["backend_ran"] == "interpret" and r["max_rel_error"] < 2e-2 for r in measured), measured
    assert rows[0]["event"] == "start" and rows[-1]["event"] == "done"
    # each measurement announced before it ran, the announcement right before its row
    begun = [i for i, r in enumerate(rows) if r.get("event") == "begin"]
    assert len(begun) == len(measured)
    assert all({**rows[i], "event": None}.items() <= {**rows[i + 1], "event": None}.items() for i in begun)
    assert not [r for r in tune._with_unfinished(rows) if "error" in r]
    # after each shape's candidates, deterministic=True as planned: checked and timed
    planned = [r for r in rows if r.get("impl") == "flash_attn[deterministic]"]
    assert len(planned) == 2 and all(r["ok"] and r["ms"] for r in planned), planned


def test_the_warp_specialised_candidates_run_on_their_own(tmp_path, monkeypatch):
    """``ws="only"`` times the warp-specialised candidates beside the table's entries of their kind
    (on the interpreter: the single-loop descriptor path), ``"exclude"`` everything else, so that
    the GPU window can run the never-measured ones in processes of their own."""
    ws = C(16, 16, 1, 1, ws=True)
    monkeypatch.setattr(tune, "CANDIDATES", {("fwd", "interpret"): {32: [FAST, ws]},
                                            ("bwd_fused", "interpret"): {32: [FAST]}})
    only = [r for r in _run(tmp_path / "only", {}, ws="only") if r.get("impl") == "flash_attn"]
    assert {(r["kind"], r["config"]) for r in only} == {("fwd", "32x16w1s1"), ("fwd", "16x16w1s1-ws")}
    assert all(r["ok"] for r in only), only
    rest = [r for r in _run(tmp_path / "rest", {}, ws="exclude") if r.get("impl") == "flash_attn"]
    assert {(r["kind"], r["config"]) for r in rest} == {("fwd", "32x16w1s1"), ("fwd", "16x16w1s1"),
                                                      ("bwd_fused", "16x32w1s1"), ("bwd_fused", "16x16w1s1")}


def test_candidates_split_by_warp_specialisation():
    for d in (64, 128, 256):
        listed = {ws: tune.candidates("sm90", [d], ws) for ws in tune.WS_SELECTIONS}
        entries = {(k, d, configs.pick(k, d, "sm90", exact=e)) for k in ("fwd", "bwd_fused") for e in (False, True)}
        split = {c for c in listed["include"] if c[2] is not None and c[2].ws}
        assert split and all(c[0] == "fwd" for c in split)
        assert set(listed["exclude"]) == set(listed["include"]) - split
        assert set(listed["only"]) == split | {e for e in entries if e[0] == "fwd"}
    with pytest.raises(ValueError, match="ws must be one of"):
        tune.candidates("sm90", [64], "some")


def test_a_candidate_that_never_finished_is_ruled_out(tmp_path):
    """A candidate announced but never measured (its process hung in the kernel and the window's
    timeout killed it) is a failure on that shape: it cannot win on the shapes it did finish."""
    rows = _sweep_rows({"128x64w8s2": (2.0, 1.2), "128x128w4s2-ws": (1.0, 0.6)}, kind="fwd", d=128)
    hung = next(r for r in rows if r.get("config") == "128x128w4s2-ws" and r["seqlen"] == 16384 and r["causal"])
    rows = [r for r in rows if r is not hung] + [{**{k: v for k, v in hung.items() if k not in ("ok", "ms", "impl")},
                                                   "event": "begin"}]
    results = tmp_path / tune.RESULTS
    results.write_text("\n".join(json.dumps(r) for r in rows))
    lean = tune.winners(tune.read_rows(results))[0]
    assert lean["winner"] == "128x64w8s2"
    assert {c["config"]: c["ok"] for c in lean["candidates"]} == {"128x64w8s2": True, "128x128w4s2-ws": False}
    assert "128x128w4s2-ws x" in tune.summary([lean])
    # the same candidate measured after its announcement: it wins
    results.write_text("\n".join(json.dumps(r) for r in rows + [hung]))
    assert tune.winners(tune.read_rows(results))[0]["winner"] == "128x128w4s2-ws"


def test_a_wrong_candidate_is_caught(tmp_path, interpreter_candidates, monkeypatch):
    real = tune._sdpa
    monkeypatch.setattr(tune, "_sdpa", lambda q, k, v, causal, name: real(q, k, v, causal, name) * 1.5)
    rows = [r for r in _run(tmp_path, {}) if r.get("impl") == "flash_attn"]
    assert rows and not any(r["ok"] for r in rows)
    assert all(w["winner"] is None for w in tune.winners(tune.read_rows(tmp_path / tune.RESULTS)))


def test_a_cut_off_run_keeps_its_rows(tmp_path, interpreter_candidates):
    rows = _run(tmp_path, {}, budget_s=0.0)
    assert rows[-1]["event"] == "stopped"
    with (tmp_path / tune.RESULTS).open("a") as f:
        f.write('{"impl": "flash_attn", "kind": "fwd", "conf')  # killed mid-row
    assert tune.read_rows(tmp_path / tune.RESULTS) == rows


_TABLE_TEXT = '''_TABLE = {
    ("fwd", "interpret"): (_C(32, 16, 1, 1), _C(32, 16, 1, 1), _C(32, 16, 1, 1), _C(32, 16, 1, 1)),
    ("bwd_fused", "interpret"): (_C(16, 32, 1, 1), _C(16, 32, 1, 1), None, None),
}
'''


def test_fold_writes_the_fastest_correct_candidate(tmp_path, interpreter_candidates):
    _run(tmp_path, {"16x16w1s1": 1.0, "32x32w1s1": 2.0, "split": 0.5})
    table = tmp_path / "configs_copy.py"
    table.write_text(_TABLE_TEXT)
    rows = tune.fold(tmp_path / tune.RESULTS, table)
    by_kind = {r["kind"]: r for r in rows}
    assert by_kind["fwd"]["winner"] == "16x16w1s1" and by_kind["fwd"]["changed"]
    assert by_kind["bwd_fused"]["winner"] == "split" and by_kind["bwd_fused"]["changed"]
    text = table.read_text()
    assert '("fwd", "interpret"): (_C(16, 16, 1, 1), _C(32, 16, 1, 1),' in text  # head dim 32: the first bucket
    assert '("bwd_fused", "interpret"): (None, _C(16, 32, 1, 1), None, None),' in text
    assert "16x16w1s1" in tune.summary(rows)


def test_fold_keeps_an_entry_within_noise(tmp_path, interpreter_candidates):
    _run(tmp_path, {"16x16w1s1": 4.95, "32x32w1s1": 9.0, "split": 9.0})  # the table's entry: 5.0
    rows = tune.winners(tune.read_rows(tmp_path / tune.RESULTS))
    assert {r["kind"]: r["winner"] for r in rows} == {"fwd": "32x16w1s1", "bwd_fused": "16x32w1s1"}


def test_fold_keeps_out_a_candidate_slower_than_the_entry_on_any_shape(tmp_path):
    """One entry serves every length: a candidate with the best geometric mean that is slower than
    the current entry on one shape beyond noise (here 7 % at 16k causal, as the d64 forward's TMA
    tile measured) does not replace it; the fastest candidate that loses nowhere does (2 % at one
    shape is noise). The summary says which shape kept a candidate out."""
    rows = [{"event": "start", "family": "sm90"}]
    current = tune._config_text(configs.pick("bwd_fused", 64, "sm90"))
    times = {current: {1024: (2.0, 1.4), 4096: (5.3, 3.0), 16384: (18.8, 9.5)},
             "64x128w8s2": {1024: (1.8, 1.15), 4096: (5.1, 3.0), 16384: (18.7, 9.7)},  # 2 % slower at 16k causal
             "64x128w8s1": {1024: (1.2, 0.8), 4096: (4.0, 2.5), 16384: (19.0, 10.2)}}  # 7 % slower there
    for config, by_length in times.items():
        for seqlen, (full, causal) in by_length.items():
            for is_causal, ms in ((False, full), (True, causal)):
                rows.append({"impl": "flash_attn", "kind": "bwd_fused", "head_dim": 64, "seqlen": seqlen,
                             "causal": is_causal, "config": config, "ok": True, "ms": ms})
    (lean, exact), module = _fold_copy(tmp_path, rows)
    by_config = {c["config"]: c for c in lean["candidates"]}
    assert by_config["64x128w8s1"]["geomean_ms"] < by_config["64x128w8s2"]["geomean_ms"]  # the best mean...
    assert (lean["winner"], lean["changed"]) == ("64x128w8s2", True)  # ...kept out: 16k causal loses 7 %
    assert module["pick"]("bwd_fused", 64, "sm90") == C(64, 128, 8, 2)
    # full attention alone (the exact-call image): 64x128w8s1 loses 1 % at 16k, noise: it wins there
    assert exact["winner"] == "64x128w8s1"
    assert "64x128w8s1 " in tune.summary([lean]) and "(+7 % at 16384 causal: kept out)" in tune.summary([lean])


def test_fold_edits_the_real_table(tmp_path):
    """Rows as a GPU run of sm90 writes them: the d128 fused-backward entry of the package's own
    table is rewritten, and the rewritten module still gives every other entry unchanged."""
    rows = [{"event": "start", "family": "sm90"}]
    assert configs.pick("bwd_fused", 128, "sm90") == C(64, 128, 8, 3)  # the entry the rows overturn
    for config, ms in (("64x128w8s3", 2.0), ("64x128w8s2", 1.5), ("split", 3.0)):
        for seqlen in (4096, 16384):
            rows.append({"impl": "flash_attn", "kind": "bwd_fused", "head_dim": 128, "seqlen": seqlen, "causal": False,
                         "config": config, "ok": True, "ms": ms * seqlen / 4096})
    results = tmp_path / tune.RESULTS
    results.write_text("\n".join(json.dumps(r) for r in rows))
    copy = tmp_path / "configs.py"
    copy.write_text(Path(configs.__file__).read_text())
    lean, exact = tune.fold(results, copy)
    assert lean["winner"] == "64x128w8s2" and lean["changed"]
    # the exact-call image's winner over the same (full-attention) rows is the lean one: it inherits
    assert exact["variant"] == "exact" and exact["winner"] == "64x128w8s2" and not exact["changed"]
    namespace = _module(copy)
    assert namespace["pick"]("bwd_fused", 128, "sm90") == C(64, 128, 8, 2)
    assert namespace["pick"]("bwd_fused", 128, "sm90", exact=True) == C(64, 128, 8, 2)
    for kind in configs.KINDS:
        for family in ("sm80", "sm86", "sm90", "sm100", "sm120"):
            for d in (32, 64, 256):
                assert namespace["pick"](kind, d, family) == configs.pick(kind, d, family)
                assert namespace["pick"](kind, d, family, exact=True) == configs.pick(kind, d, family, exact=True)


def _module(path: Path) -> dict:
    namespace: dict = {"__name__": "configs_copy"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102
    return namespace


def _fold_copy(tmp_path: Path, rows: list[dict]) -> tuple[list[dict], dict]:
    """``rows`` folded into a copy of the package's configs module: the fold's rows, the copy."""
    results = tmp_path / tune.RESULTS
    results.write_text("\n".join(json.dumps(r) for r in rows))
    copy = tmp_path / "configs.py"
    copy.write_text(Path(configs.__file__).read_text())
    return tune.fold(results, copy), _module(copy)


def _sweep_rows(times: dict, kind: str = "fwd", d: int = 64) -> list[dict]:
    """Rows of an sm90 sweep: ``times[config] = (full ms, causal ms)`` at 4k and 16k tokens."""
    rows = [{"event": "start", "family": "sm90"}]
    for config, (full, causal) in times.items():
        for seqlen in (4096, 16384):
            for is_causal, ms in ((False, full), (True, causal)):
                rows.append({"impl": "flash_attn", "kind": kind, "head_dim": d, "seqlen": seqlen, "causal": is_causal,
                             "config": config, "ok": True, "ms": ms * seqlen / 4096})
    return rows


def test_fold_gives_the_exact_call_image_the_tile_fastest_on_full_attention(tmp_path):
    """Full attention runs the exact-call image, causal calls the folded one: when the full rows
    favour one tile and the causal rows another (as the H100 and H200 sweeps measured at d64), the
    lean entry is the geometric-mean winner and the exact-call entry the full-attention winner."""
    results = tmp_path / tune.RESULTS
    rows = _sweep_rows({"128x128w8s3": (1.77, 1.15), "128x64w8s3": (1.51, 1.30), "128x128w8s2": (2.0, 1.35)})
    results.write_text("\n".join(json.dumps(r) for r in rows))
    copy = tmp_path / "configs.py"
    # the starting point: both d64 entries 128x128w8s3 (the lean one as the H100 sweep left it);
    # an exact-call row holds one entry per head-dim bucket
    later = ", None" * (len(configs.HEADDIM_BUCKETS) - 2)
    inherited = f'("fwd", "sm90"): (None, None{later}),'
    source = Path(configs.__file__).read_text()
    shipped = f'("fwd", "sm90"): (None, _C(128, 64, 8, 3){later}),'
    assert shipped in source
    source = source.replace(shipped, inherited)
    copy.write_text(re.sub(r'^(    \("fwd", "sm90"\): \(_C\(128, 128, 8, 3\), )_C\([^)]*\)', r"\1_C(128, 128, 8, 3)", source,
                           count=1, flags=re.M))
    assert _module(copy)["pick"]("fwd", 64, "sm90") == C(128, 128, 8, 3)
    assert _module(copy)["pick"]("fwd", 64, "sm90", exact=True) == C(128, 128, 8, 3)  # the starting point
    lean, exact = tune.fold(results, copy, pick=_module(copy)["pick"])
    assert (lean["winner"], lean["changed"]) == ("128x128w8s3", False)  # geomean 1.8 % faster: within noise
    assert (exact["winner"], exact["changed"]) == ("128x64w8s3", True)
    module = _module(copy)
    assert module["pick"]("fwd", 64, "sm90") == C(128, 128, 8, 3)
    assert module["pick"]("fwd", 64, "sm90", exact=True) == C(128, 64, 8, 3)
    assert module["pick"]("fwd", 128, "sm90", exact=True) == module["pick"]("fwd", 128, "sm90")
    assert "exact-call (full attention)" in tune.summary([lean, exact])

    # a later sweep where the lean winner is the exact one's too: the exact entry inherits again
    rows = _sweep_rows({"128x128w8s3": (1.77, 1.15), "128x64w8s3": (1.51, 1.0)})
    results.write_text("\n".join(json.dumps(r) for r in rows))
    lean, exact = tune.fold(results, copy, pick=_module(copy)["pick"])
    assert lean["winner"] == exact["winner"] == "128x64w8s3" and lean["changed"] and exact["changed"]
    assert inherited in copy.read_text().split("_EXACT_TABLE")[1]
    assert _module(copy)["pick"]("fwd", 64, "sm90", exact=True) == C(128, 64, 8, 3)


def test_fold_writes_pointer_loads_where_they_win(tmp_path):
    """The sweep times the d128 fused backward's tile with pointer loads ("-ptr") beside the same
    tile through tensor descriptors (the sm90 default): where the pointer loads win, the folded
    entry says ``tma=False``, and the planner and the build then compile and launch the image
    with ``TMA`` off."""
    (lean, exact), module = _fold_copy(tmp_path, _sweep_rows({"64x128w8s2": (2.0, 1.2), "64x128w8s2-ptr": (1.7, 1.0)},
                                                            kind="bwd_fused", d=128))
    assert (lean["winner"], lean["changed"]) == ("64x128w8s2-ptr", True)
    assert (exact["winner"], exact["changed"]) == ("64x128w8s2-ptr", False)  # inherits the lean entry
    picked = module["pick"]("bwd_fused", 128, "sm90")
    assert picked == C(64, 128, 8, 2, tma=False) and tune._config_text(picked) == "64x128w8s2-ptr"
    assert not module["uses_tma"]("bwd_fused", "sm90", picked)
    assert module["uses_tma"]("bwd_fused", "sm90", C(64, 128, 8, 2))
    assert tune._parse_config(tune._config_text(picked)) == picked
    assert tune._parse_config("64x128w8s2") == C(64, 128, 8, 2) != picked


def test_fold_writes_warp_specialisation_where_it_wins(tmp_path):
    """A "-ws" candidate (Triton's producer/consumer warp specialisation) that wins the d128
    forward folds to ``ws=True``; the folded entry then switches ``WS`` and, with it, ``TMA`` on
    for the build and the planner on Hopper (and Blackwell), and on neither on Ampere."""
    (lean, *_), module = _fold_copy(tmp_path, _sweep_rows({"128x64w8s2": (2.0, 1.2), "128x128w4s2-ws": (1.5, 1.0)},
                                                         kind="fwd", d=128))
    assert (lean["winner"], lean["changed"]) == ("128x128w4s2-ws", True)
    picked = module["pick"]("fwd", 128, "sm90")
    assert picked == C(128, 128, 4, 2, ws=True) and tune._parse_config(tune._config_text(picked)) == picked
    assert module["uses_ws"]("fwd", "sm90", picked) and module["uses_tma"]("fwd", "sm90", picked)
    assert not module["uses_ws"]("fwd", "sm80", picked) and not module["uses_ws"]("bwd_fused", "sm90", picked)
    from flash_attn.aot import specializations as S

    flags = dict(S.attention_spec("attn_fwd_kernel", "bf16", 128, picked, "sm90").flags)
    assert (flags["WS"], flags["TMA"]) == (True, True)
    flags = dict(S.attention_spec("attn_fwd_kernel", "bf16", 128, picked, "sm80").flags)
    assert (flags["WS"], flags["TMA"]) == (False, False)


def test_the_deterministic_kernels_are_timed_deterministic(tmp_path, monkeypatch):
    """A dK/dV or dQ candidate only runs when ``deterministic=True``: the sweep calls it so (the
    interpreter's backend records which kernels the backward launched), and its rows say so."""
    import flash_attn

    monkeypatch.setattr(tune, "CANDIDATES", {("bwd_dkdv", "interpret"): {32: [FAST]},
                                            ("bwd_dq", "interpret"): {32: [FAST]}})
    calls = []
    real = flash_attn.flash_attn_func
    monkeypatch.setattr(flash_attn, "flash_attn_func", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    rows = [r for r in _run(tmp_path, {}) if r.get("impl") == "flash_attn"]
    assert {r["kind"] for r in rows} == {"bwd_dkdv", "bwd_dq"} and all(r["deterministic"] and r["ok"] for r in rows)
    assert calls and all(kw["deterministic"] for kw in calls)


def test_fold_writes_the_deterministic_dkdv_entry(tmp_path):
    """The dK/dV kernel has no exact-call image: its winner goes to the lean table only."""
    (lean,), module = _fold_copy(tmp_path, _sweep_rows({"64x128w8s2": (3.0, 2.0), "32x128w8s2": (2.5, 1.6)},
                                                       kind="bwd_dkdv", d=128))
    assert (lean["variant"], lean["winner"], lean["changed"]) == ("lean", "32x128w8s2", True)
    assert module["pick"]("bwd_dkdv", 128, "sm90") == C(32, 128, 8, 2)
    assert module["pick"]("bwd_dkdv", 64, "sm90") == configs.pick("bwd_dkdv", 64, "sm90")


def test_fold_writes_dq_by_tma_reductions_where_they_win(tmp_path):
    """A "-red" candidate (dQ by TMA reductions) that wins the d128 fused backward folds to
    ``dq_tma=True``, which the build and the planner then compile and launch on Hopper."""
    (lean, _), module = _fold_copy(tmp_path, _sweep_rows({"64x128w8s2": (2.0, 1.2), "64x128w8s2-red": (1.6, 1.0)},
                                                        kind="bwd_fused", d=128))
    assert (lean["winner"], lean["changed"]) == ("64x128w8s2-red", True)
    picked = module["pick"]("bwd_fused", 128, "sm90")
    assert picked == C(64, 128, 8, 2, dq_tma=True) and tune._parse_config(tune._config_text(picked)) == picked
    assert module["uses_dq_tma"]("bwd_fused", "sm90", picked) and not module["uses_dq_tma"]("bwd_fused", "sm80", picked)
    from flash_attn.aot import specializations as S

    assert dict(S.attention_spec("attn_bwd_kernel", "bf16", 128, picked, "sm90").flags)["TMA_DQ"] is True


def test_the_planned_and_built_tma_follow_the_config():
    """``Config.tma`` reaches the fused backward's ``TMA`` constexpr on both sides that must agree:
    the build's specialisation and the planner's launch."""
    from flash_attn.aot import specializations as S

    for tma, expected in ((None, True), (False, False), (True, True)):
        spec = S.attention_spec("attn_bwd_kernel", "bf16", 128, C(64, 128, 8, 2, tma), "sm90")
        assert dict(spec.flags)["TMA"] is expected
    assert dict(S.attention_spec("attn_bwd_kernel", "bf16", 128, C(64, 128, 8, 2), "sm100").flags)["TMA"] is False


def test_candidates_time_both_table_entries():
    listed = [(kind, d, c) for kind, d, c in tune.candidates("sm90", [64]) if kind == "fwd"]
    assert listed[0][2] == configs.pick("fwd", 64, "sm90")
    assert listed[1][2] == configs.pick("fwd", 64, "sm90", exact=True) != listed[0][2]
    assert len(set(listed)) == len(listed)


@pytest.mark.slow
def test_prepare_compiles_every_candidate_for_sm90a(tmp_path):
    pytest.importorskip("triton")
    from flash_attn.aot import specializations as S

    report = tune.prepare(tmp_path, "90", [64], jobs=2, quiet=True)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    keys = {e["key"] for e in manifest["kernels"]}
    kernels = {"fwd": "attn_fwd_kernel", "bwd_fused": "attn_bwd_kernel", "bwd_dkdv": "attn_bwd_dkdv_kernel",
               "bwd_dq": "attn_bwd_dq_kernel"}
    for kind, d, config in tune.candidates("sm90", [64]):
        if config is not None:
            assert S.attention_spec(kernels[kind], "bf16", d, config, "sm90").key in keys, (kind, config)
    listed = json.loads((tmp_path / tune.CANDIDATES_FILE).read_text())
    assert listed["family"] == "sm90" and len(listed["candidates"]) == len(tune.candidates("sm90", [64]))
    # small enough to carry to a GPU beside the op library
    assert report["totals"]["bytes"] < 16 * 2**20
    assert all(r.get("dots") for r in report["kernels"] if r["kernel"] in ("attn_fwd_kernel", "attn_bwd_kernel"))
