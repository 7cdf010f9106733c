"""The README's usage example runs as written (on the CPU, through the reference backend)."""

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
