"""``.ci/gpu-window prepare-proxy`` and ``proxy`` (issue 48's mma.sync proxy) dry-run on the CPU with
stand-ins for ``python`` and ``nvidia-smi`` (what they stand for: the image build and the benchmark
on a device machine; what they cannot show: any image or timing, which tests/aot/test_proxy_images.py
and tests/tools/test_bench_gpu_method.py check). They show the commands, the environment the
benchmark runs in, that a family which hangs costs only its own limit, and that preparing the proxy
keeps what `prepare` put in the carry."""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path

from support import REPO as ROOT


def _stand_ins(tmp_path: Path, hang_when: str = "no hang") -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'name, driver_version, memory.total'\n")
    (tmp_path / "libflash_attn_aot.so").write_text("lib")
    (bin_dir / "python").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        if [[ "$1" == "-c" ]]; then echo {tmp_path}/libflash_attn_aot.so; exit 0; fi
        echo "$* | AOT_DIR=$FLASH_ATTN_AOT_DIR STRICT=$FLASH_ATTN_STRICT_BACKEND LIB=$FLASH_ATTN_AOT_LIBRARY" >> {tmp_path}/calls.log
        [[ "$*" == *"proxy build"* ]] && mkdir -p "$4" && echo '{{"images": 22}}'
        [[ "$*" == *"{hang_when}"* ]] && exec sleep 60
        exit 0
        """))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _run(tmp_path, bin_dir, *args, **env):
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env}
    return subprocess.run(["bash", str(ROOT / ".ci" / "gpu-window"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def test_prepare_proxy_adds_to_the_carry(tmp_path):
    bin_dir = _stand_ins(tmp_path)
    carry = tmp_path / "carry"
    (carry / "aot").mkdir(parents=True)
    (carry / "aot" / "manifest.json").write_text("{}")  # what `prepare` left
    result = _run(tmp_path, bin_dir, "prepare-proxy", str(carry))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (carry / "aot" / "manifest.json").is_file() and (carry / "lib" / "libflash_attn_aot.so").is_file()
    (call,) = (tmp_path / "calls.log").read_text().splitlines()
    assert call.startswith(f"-m flash_attn.kernel_build.proxy build {carry}/proxy --jobs 2 --sass")
    assert '"images": 22' in (carry / "proxy-verify.json").read_text()


def test_the_proxy_step_runs_both_families_on_the_proxy_images(tmp_path):
    bin_dir = _stand_ins(tmp_path)
    out, carry = tmp_path / "out", tmp_path / "carry"
    result = _run(tmp_path, bin_dir, "proxy", str(out), str(carry))
    assert result.returncode == 0, result.stdout + result.stderr
    verify, sm80, sm86 = (tmp_path / "calls.log").read_text().splitlines()
    assert verify.startswith(f"-m flash_attn.kernel_build.proxy verify {carry}/proxy")
    for family, call in (("sm80", sm80), ("sm86", sm86)):
        assert call.startswith(f"-m flash_attn bench gpu --family {family} --out {out}/{family} --repeats 9")
        assert f"AOT_DIR={carry}/proxy STRICT=1 LIB={carry}/lib/libflash_attn_aot.so" in call
    assert (out / "proxy-summary.txt").read_text().splitlines() == ["verify rc=0", "sm80 rc=0", "sm86 rc=0"]
    # the command the step runs is the proxy's table in the real command line
    from flash_attn import __main__ as cli
    from flash_attn.bench import gpu

    argv = sm86.split(" | ")[0].split()
    assert argv[:2] == ["-m", "flash_attn"]
    config = gpu.config_from_args(cli.build_parser().parse_args(argv[2:]))
    assert (config["family"], config["impls"], config["seqlens"], config["dtypes"], config["repeats"], config["rounds"]) \
        == ("sm86", list(gpu.PROXY_IMPLS), [4096, 16384], ["bf16"], 9, 3)


def test_a_family_that_hangs_costs_only_its_limit(tmp_path):
    bin_dir = _stand_ins(tmp_path, hang_when="--family sm80")
    out = tmp_path / "out"
    began = time.monotonic()
    result = _run(tmp_path, bin_dir, "proxy", str(out), str(tmp_path / "carry"), PROXY_LIMIT_S="2")
    assert time.monotonic() - began < 30
    assert result.returncode == 1
    summary = (out / "proxy-summary.txt").read_text().splitlines()
    assert summary[1].startswith("sm80 rc=12") and summary[2] == "sm86 rc=0"  # 124: timed out
