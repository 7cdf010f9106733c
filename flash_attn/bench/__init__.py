"""``python -m flash_attn bench [cpu|gpu|build]`` (``pixi run bench``): benchmarks.

* ``cpu``: this package's cpu backend side by side with PyTorch SDPA on the CPU (and
  optionally naive eager attention): time, the speed ratio and peak memory over sequence length,
  plain and with the features SDPA needs a materialised mask for (:mod:`flash_attn.bench.cpu`);
* ``gpu``: forward / forward+backward TFLOPs of the ``aot`` and ``triton`` backends vs SDPA's
  flash / efficient / cudnn backends and upstream ``flash_attn_2_cuda``, then decode
  (``flash_attn_with_kvcache``) in GB/s against the measured memory bandwidth (:mod:`.gpu`);
* ``build``: wall time, peak memory and size of the ahead-of-time kernel build (:mod:`.build`);
* ``overhead``: host time per call of the public functions on the ``aot`` path, launches stubbed
  (or, with ``--device cuda``, for real) (:mod:`.overhead`);
* ``ops``: the fused loss (``cross_entropy_loss``) and norms (``rms_norm_fn``/``layer_norm_fn``) vs
  ``F.cross_entropy``/``F.rms_norm``/``F.layer_norm`` and ``torch.compile`` of them, forward +
  backward, with peak memory, on the CPU and on CUDA when present (:mod:`.ops`);
* ``tune``: the launch-config sweep in three steps (``--tune-step prepare`` on the CPU, ``run`` on
  a GPU, ``fold`` on the CPU) that turns one short GPU window into configs (:mod:`.tune`);
* ``auto`` (default): ``gpu`` when PyTorch sees a CUDA device, else ``cpu``.

Results go to ``--out`` (default ``bench-results/``) as ``bench-<mode>.json`` / ``.csv`` /
``.png`` (the plot needs matplotlib), and a Markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from flash_attn.bench import common

CPU_SEQLENS = (1024, 2048, 4096, 8192, 16384)
CPU_FEATURE_SEQLENS = (1024, 4096, 16384)
GPU_SEQLENS = (1024, 4096, 16384)  # issue 24's table; fits one short GPU window with decode
QUICK_SEQLENS = (128, 256)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def _words(text: str) -> list[str]:
    return [x for x in text.replace(",", " ").split() if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", nargs="?", choices=("auto", "cpu", "gpu", "build", "overhead", "tune", "ops"), default="auto",
                        help="what to benchmark (default: gpu if CUDA is available, else cpu)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default: bench-results)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (a smoke test)")
    parser.add_argument("--seqlens", type=_ints, help="sequence lengths, e.g. 1024,2048 (cpu/gpu)")
    parser.add_argument("--repeats", type=int, help="timed repeats per case (median is reported)")
    parser.add_argument("--warmup", type=int, help="untimed calls before timing")
    parser.add_argument("--impls", type=_words, help="implementations to compare (cpu: flash_attn,sdpa[,eager,flex]; gpu: "
                        "flash_attn[aot],flash_attn[triton],sdpa[flash],sdpa[efficient],sdpa[cudnn],upstream)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--dtypes", type=_words, help="dtypes (cpu: default fp32,bf16; gpu: default fp16,bf16)")
    cpu = parser.add_argument_group("cpu mode")
    cpu.add_argument("--batch", type=int, default=1)
    cpu.add_argument("--heads", type=int, default=4)
    cpu.add_argument("--headdim", type=int, default=64)
    cpu.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="cpu: only this dtype")
    cpu.add_argument("--causal", action="store_true", help="cpu: only causal (default: full and causal)")
    cpu.add_argument("--backward", action="store_true", help="cpu: only forward+backward (default: both passes)")
    cpu.add_argument("--forward", action="store_true", help="cpu: only the forward (default: both passes)")
    cpu.add_argument("--features", type=_words, help="cpu: features vs SDPA with an explicit mask: "
                     "window,softcap,alibi,varlen,paged (default: all; 'none' for none)")
    cpu.add_argument("--feature-seqlens", type=_ints, help="cpu: sequence lengths of the feature cases "
                     "(default 1024,4096,16384)")
    cpu.add_argument("--threads", type=int, help="cpu: torch threads (default: PyTorch's default)")
    cpu.add_argument("--no-isolate", action="store_true",
                     help="measure in this process (faster; peak memory less exact) instead of a child per case")
    gpu = parser.add_argument_group("gpu mode")
    gpu.add_argument("--headdims", type=_ints, default=[64, 128, 256])
    gpu.add_argument("--total-tokens", type=int, default=16384, help="batch * seqlen (default 16384)")
    gpu.add_argument("--hidden", type=int, default=2048, help="heads * headdim (default 2048)")
    gpu.add_argument("--beyond", action=argparse.BooleanOptionalAction, default=True,
                     help="gpu: also time head dim 512, 192/128 (v's own head dim) and attention sinks at d64/d128 "
                          "(not with --quick)")
    gpu.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                     help="gpu: also time decode (flash_attn_with_kvcache, one token over a KV cache) in GB/s "
                     "against the measured memory bandwidth (default: on)")
    gpu.add_argument("--decode-graphs", action=argparse.BooleanOptionalAction, default=True,
                     help="gpu: also time each decode call captured in a CUDA graph (as servers run decode: "
                     "no host time per step), the 'decode_graph' rows (default: on)")
    gpu.add_argument("--decode-batches", type=_ints, help="gpu: decode batch sizes (default 1,4,16,64)")
    gpu.add_argument("--held-out", action="store_true",
                     help="gpu: also time shapes the launch configs were not tuned on (2k, 8k, 3001 tokens, GQA 8:1, "
                     "heads x headdim 4096 and 5120, batch 1 x 32k; gpu.HELD_OUT)")
    gpu.add_argument("--decode-cachelens", type=_ints, help="gpu: decode KV cache lengths (default 4096,16384,65536,131072)")
    gpu.add_argument("--decode-steps", action=argparse.BooleanOptionalAction, default=True,
                     help="gpu: also time decode as a real step (the new token's k/v appended, cache_seqlens per "
                     "sequence), with a contiguous and a paged cache (default: on)")
    gpu.add_argument("--rounds", type=int, default=None,
                     help="gpu: timing rounds per case, the implementations in a rotated order each round, the "
                     "repeats split over them; rows give the spread of the round medians (default 3; 1 with --quick)")
    gpu.add_argument("--family", choices=("sm80", "sm86"), default=None,
                     help="gpu: the mma.sync proxy: this package's aot images with the planner's family forced "
                     "(FLASH_ATTN_FORCE_FAMILY; images from `.ci/gpu-window prepare-proxy`) beside SDPA flash; "
                     "defaults to bf16, d64/128/256, 4k/16k, no decode, no beyond-FA2 rows")
    overhead = parser.add_argument_group("overhead mode")
    overhead.add_argument("--device", choices=("stubbed", "cuda"), default="stubbed",
                          help="stubbed: launches replaced by a no-op, any machine (default); cuda: real calls on a GPU")
    overhead.add_argument("--calls", type=int, default=200, help="calls per timed run (default 200)")
    overhead.add_argument("--profile", action="store_true",
                          help="overhead: also write where each case spends host time (cProfile) to --out")
    ops = parser.add_argument_group("ops mode (uses --total-tokens for the tokens, --hidden for the norms' width, "
                                    "--dtypes, --threads, --impls: flash_attn,torch,torch.compile)")
    ops.add_argument("--ops", type=_words, help="ops: loss,rms_norm,layer_norm (default: all)")
    ops.add_argument("--vocab", type=int, default=32768, help="ops: vocabulary size of the loss (default 32768)")
    ops.add_argument("--ops-devices", type=_words, help="ops: cpu and/or cuda (default: cpu, and cuda when present)")
    tune = parser.add_argument_group("tune mode (uses --out, --archs, --headdims, --seqlens)")
    tune.add_argument("--tune-step", choices=("prepare", "run", "fold"), default="prepare",
                      help="prepare: compile the candidates (CPU); run: time them (GPU); fold: update the config table")
    tune.add_argument("--budget-s", type=float, default=420.0, help="tune run: stop timing after this many seconds")
    tune.add_argument("--dry-run", action="store_true", help="tune fold: print the changes, leave configs.py alone")
    tune.add_argument("--tune-ws", choices=("include", "exclude", "only"), default="include",
                      help="tune run: time the warp-specialised candidates too (include), not (exclude), or only "
                           "them beside the table's entries (only: no SDPA baselines)")
    build = parser.add_argument_group("build mode")
    build.add_argument("--build-command", help="command to time; {python}, {out} and {archs} are filled in "
                       "(default: '{python} -m flash_attn build-kernels --out {out}')")
    build.add_argument("--archs", help="FLASH_ATTN_CUDA_ARCHS for the build (default: the package default)")


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    mode = args.mode
    if mode == "auto":
        import torch  # noqa: PLC0415

        mode = "gpu" if torch.cuda.is_available() else "cpu"
    return {"cpu": run_cpu, "gpu": run_gpu, "build": run_build, "overhead": run_overhead, "tune": run_tune,
            "ops": run_ops}[mode](args)


def run_ops(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from flash_attn.bench import ops  # noqa: PLC0415

    config = {
        "ops": args.ops or list(ops.OPS), "impls": args.impls or list(ops.IMPLEMENTATIONS),
        "devices": args.ops_devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else []),
        "dtypes": args.dtypes or ["bf16"], "tokens": 256 if args.quick else args.total_tokens,
        "vocab": 1000 if args.quick else args.vocab, "hidden": 256 if args.quick else args.hidden,
        "repeats": args.repeats or (2 if args.quick else 3),
    }
    unknown = [o for o in config["ops"] if o not in ops.OPS] + [i for i in config["impls"] if i not in ops.IMPLEMENTATIONS]
    unknown += [d for d in config["dtypes"] if d not in ops.DTYPES]
    if unknown:
        print(f"unknown op, implementation or dtype {unknown}; ops mode knows {', '.join(ops.OPS)}, "
              f"{', '.join(ops.IMPLEMENTATIONS)}, dtypes {', '.join(ops.DTYPES)}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = {"mode": "ops", "config": config, "machine": common.machine()}
    rows = ops.run(config, progress=_progress)
    columns = ("op", "impl", "device", "dtype", "pass", "tokens", "width", "time_ms", "time_ms_min", "repeats",
               "peak_mib", "speedup_vs_torch", "max_diff_vs_torch", "status", "note")
    paths = common.write_results(args.out, "bench-ops", meta, rows, columns)
    print(common.markdown_table(rows, [("op", "op"), ("device", "device"), ("dtype", "dtype"), ("tokens", "tokens"),
                                       ("width", "vocab / hidden"), ("impl", "impl"), ("time_ms", "fwd+bwd (ms)"),
                                       ("peak_mib", "peak (MiB)"), ("speedup_vs_torch", "torch / ours"),
                                       ("max_diff_vs_torch", "max abs diff vs torch"), ("status", "status")]))
    print("\n" + "\n".join(f"{kind}: {path}" for kind, path in paths.items()))
    return 0 if all(r["status"] in ("ok", "unsupported") or r["impl"] != "flash_attn" for r in rows) else 1


def run_tune(args: argparse.Namespace) -> int:
    from flash_attn.bench import tune  # noqa: PLC0415

    return tune.main(args)


def run_overhead(args: argparse.Namespace) -> int:
    from flash_attn.bench import overhead  # noqa: PLC0415

    mode = "device" if args.device == "cuda" else "stubbed"
    profiles: Optional[dict] = {} if args.profile else None
    try:
        rows = overhead.run(mode, calls=args.calls, repeats=args.repeats or 5, profiles=profiles)
    except RuntimeError as exc:
        print(f"bench overhead: {exc}", file=sys.stderr)
        return 2
    meta = {"mode": "overhead", "config": {"device": mode, "calls": args.calls}, "machine": common.machine()}
    columns = overhead.DEVICE_COLUMNS if mode == "device" else ("mode", "case", "us_per_call", "us_min", "us_max",
                                                                "launches_per_call")
    paths = common.write_results(args.out, "bench-overhead", meta, rows, columns)
    for case, text in (profiles or {}).items():
        path = Path(args.out) / f"bench-overhead-profile-{case.replace(' ', '-').replace('+', '-')}.txt"
        path.write_text(text)
        paths[f"profile {case}"] = path
    if mode == "device":
        print(common.markdown_table(rows, [("case", "call"), ("impl", "impl"), ("host_us", "host CPU us"),
                                           ("thread_us", "calling thread us"), ("gpu_us", "GPU us"),
                                           ("us_per_call", "wall us"), ("host_bound", "host > GPU"),
                                           ("gpu_covered", "GPU span clean"), ("status", "status")]))
    else:
        print(common.markdown_table(rows, [("case", "call"), ("us_per_call", "us per call"), ("us_min", "min"),
                                           ("us_max", "max"), ("launches_per_call", "launches")]))
    print("\n" + "\n".join(f"{kind}: {path}" for kind, path in paths.items() if kind != "png"))
    return 0


def run_cpu(args: argparse.Namespace) -> int:
    from flash_attn.bench import cpu  # noqa: PLC0415

    features = args.features if args.features is not None else list(cpu.FEATURES)
    features = [] if features == ["none"] else features
    config = {
        "seqlens": args.seqlens or list(QUICK_SEQLENS if args.quick else CPU_SEQLENS),
        "feature_seqlens": args.feature_seqlens or args.seqlens or list(QUICK_SEQLENS[-1:] if args.quick else CPU_FEATURE_SEQLENS),
        "impls": args.impls or list(cpu.DEFAULT_IMPLS),
        "dtypes": [args.dtype] if args.dtype else args.dtypes or ["fp32", "bf16"],
        "causal": [True] if args.causal else [False, True],
        "backward": [True] if args.backward else [False] if args.forward else [False, True],
        "features": features,
        "batch": args.batch, "heads": 2 if args.quick else args.heads, "headdim": 32 if args.quick else args.headdim,
        "repeats": args.repeats or (2 if args.quick else 3), "warmup": args.warmup or 1,
        "isolate": not args.no_isolate, "threads": args.threads,
    }
    unknown = [i for i in config["impls"] if i not in cpu.IMPLEMENTATIONS]
    unknown += [f for f in features if f not in cpu.FEATURES]
    unknown += [d for d in config["dtypes"] if d not in cpu.DTYPES]
    if unknown:
        print(f"unknown implementation, feature or dtype {unknown}; cpu mode knows {', '.join(cpu.IMPLEMENTATIONS)}, "
              f"features {', '.join(cpu.FEATURES)}, dtypes {', '.join(cpu.DTYPES)}", file=sys.stderr)
        return 2
    meta = {"mode": "cpu", "config": config, "machine": common.machine(), "features": cpu.FEATURES}
    _progress(f"cpu benchmark: {config}")
    rows = cpu.run(config, progress=_progress)
    columns = ("impl", "case", "dtype", "pass", "seqlen", "batch", "heads", "headdim", "causal", "time_ms",
               "time_ms_min", "repeats", "gflops", "peak_mib", "ratio", "ratio_flex", "status", "note")
    paths = common.write_results(args.out, "bench-cpu", meta, rows, columns)
    if not args.no_plot:
        threads = config["threads"] or meta["machine"]["torch_threads"]
        title = (f"CPU, {meta['machine']['cpu']} ({threads} threads): batch {config['batch']}, "
                 f"{config['heads']} heads, d={config['headdim']}")
        png = cpu.plot(rows, args.out / "bench-cpu.png", title)
        paths["png"] = png or "(not written: matplotlib is not installed)"
    table = [("case", "case"), ("dtype", "dtype"), ("pass", "pass"), ("seqlen", "seqlen")]
    for impl in config["impls"]:
        table.append((f"{impl}_ms", f"{impl} (ms)"))
    table += [(key, f"ratio ({baseline} / flash_attn)") for baseline, key in cpu.BASELINES.items()
              if baseline in config["impls"]]
    table += [(f"{impl}_mib", f"{impl} peak (MiB)") for impl in config["impls"]]
    print(common.markdown_table(cpu.summary_rows(rows), table))
    print("\n" + "\n".join(f"{kind}: {path}" for kind, path in paths.items()))
    return 0 if all(r.get("status") in ("ok", "skipped", "oom", "unsupported") for r in rows) else 1


def run_gpu(args: argparse.Namespace) -> int:
    from flash_attn.bench import gpu  # noqa: PLC0415

    return gpu.main(args, QUICK_SEQLENS if args.quick else GPU_SEQLENS)


def run_build(args: argparse.Namespace) -> int:
    from flash_attn.bench import build  # noqa: PLC0415

    result = build.run(command=args.build_command, archs=args.archs)
    result["machine"] = common.machine()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench-build.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if result.get("status") == "ok":
        print(f"build of {result['archs']}: {result['wall_s']:.1f} s wall, peak RSS {result['peak_rss_mib']:.0f} MiB, "
              f"{result['files']} files, {result['size_mib']:.1f} MiB in {result['out']}")
    else:
        print(f"build failed ({result.get('status')}: {result.get('note', '')}); see {path}", file=sys.stderr)
        for line in result.get("log_tail", [])[-5:]:
            print(f"  {line}", file=sys.stderr)
    print(f"json: {path}")
    return 0 if result.get("status") == "ok" else 1
