"""A Triton whose import fails with something other than ImportError (a broken or mismatched
install raises what it raises) leaves CPU use alone: upstream's fused ops, rotary and the loss
import and run their PyTorch paths, with one warning naming the failure; the attention functions
run on the cpu backend. Checked in a fresh interpreter with a stand-in ``triton`` package first
on ``sys.path`` whose import raises RuntimeError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import json, warnings
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from flash_attn.layers.rotary import apply_rotary_emb
        from flash_attn.losses.cross_entropy import CrossEntropyLoss
        from flash_attn.ops.triton import layer_norm, linear, mlp, rotary, k_activations  # noqa: F401
        from flash_attn import flash_attn_func
        x = torch.randn(1, 4, 2, 8)
        cos, sin = torch.ones(4, 4), torch.zeros(4, 4)
        rotated = apply_rotary_emb(x, cos, sin)
        loss = CrossEntropyLoss()(torch.randn(3, 5), torch.tensor([0, 1, 2]))
        out = flash_attn_func(x, x, x)
    ours = [str(w.message) for w in caught if "Triton is installed but importing it fails" in str(w.message)]
    print(json.dumps({"rotated": torch.equal(rotated, x), "loss": float(loss), "out": list(out.shape),
                      "warnings": ours}))
""")


def test_a_triton_that_fails_to_import_leaves_cpu_use_alone(tmp_path):
    fake = tmp_path / "triton"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise RuntimeError("libcuda.so.1: cannot open shared object file")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_ATTN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["rotated"] and got["loss"] > 0 and got["out"] == [1, 4, 2, 8]
    assert len(got["warnings"]) == 1 and "RuntimeError: libcuda.so.1" in got["warnings"][0]
