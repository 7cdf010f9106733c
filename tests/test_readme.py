"""The README: its usage example runs as written (on the CPU, through the reference backend), and
the facts it quotes from the code are the code's."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_usage_example_runs():
    usage = README.read_text().split("## Usage", 1)[1]
    code = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    out = namespace["out"]
    assert out.shape == (2, 1, 16, 64) and not out.isnan().any()
    # the decode step appended its key at each sequence's cache_seqlens row
    k_cache, step_k = namespace["k_cache"], namespace["step_k"]
    assert k_cache[0, 17].abs().sum() > 0 and k_cache[0, 18].abs().sum() == 0
    assert k_cache[1, 400].abs().sum() > 0 and k_cache[1, 16].abs().sum() == 0
    assert namespace["q_rot"].shape == namespace["q"].shape


def test_the_default_architectures_are_the_code_s():
    """Every architecture list the README calls the default is ``archs.DEFAULT_CUDA_ARCHS``."""
    from flash_attn.aot import archs

    arch_list = re.compile(r"`(\d{2,3}[a-z]?(?:\+PTX)?(?:;\d{2,3}[a-z]?(?:\+PTX)?)+)`")
    quoted = [m.group(1) for line in README.read_text().splitlines() if "default" in line
              for m in arch_list.finditer(line)]
    assert len(quoted) >= 2, quoted  # the configuration table and the variant matrix
    assert set(quoted) == {archs.DEFAULT_CUDA_ARCHS}, quoted
