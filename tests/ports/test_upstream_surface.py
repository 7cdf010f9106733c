"""Upstream flash-attn's module surface, exactly: every module-level name of upstream's ``flash_attn/``
modules is here, or listed below as not provided, with the reason.

The names come from upstream's source at commit 0251105a (``__version__`` 2.8.4), parsed with
``ast`` (never imported): functions, classes and assignments, those under a top-level
``if``/``try`` included (``tests/data/upstream-surface-0251105a.json``, written by
``tests/support/upstream_surface.py``, which says how to regenerate it). What the restored names
compute is tested in tests/ports/test_upstream_names.py and tests/ports/test_fused_ops.py.
"""

from __future__ import annotations

import importlib
import json
import subprocess
from pathlib import Path

import pytest

from support.upstream_surface import record

RECORD = Path(__file__).resolve().parents[1] / "data" / "upstream-surface-0251105a.json"
COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"
MIRROR = Path("/work/.mirror/Dao-AILab+flash-attention/repo")

_LEGACY = ("upstream's legacy module, kept upstream for old code and not maintained there: the first "
           "Triton FlashAttention (2022-23, superseded by flash_attn_func, which runs on Triton kernels here)")
_BLOCKSPARSE = ("upstream's FlashAttention-1 block-sparse attention, whose CUDA extension upstream no longer "
                "builds (importing it fails there too); no block-sparse kernel here")
NOT_PROVIDED_MODULES = {
    "flash_attn.flash_attn_triton": _LEGACY,
    "flash_attn.flash_attn_triton_og": _LEGACY,
    "flash_attn.flash_blocksparse_attention": _BLOCKSPARSE,
    "flash_attn.flash_blocksparse_attn_interface": _BLOCKSPARSE,
}

_RAW = "a wrapper of the dropout_layer_norm extension's raw entry point (its buffers and return layout); call the public functions"
_TRITON_PRIVATE = ("a private launch helper or kernel of upstream's Triton code: the kernels here are organised "
                   "differently (other arguments), so the name would not be a drop-in; call the public functions")
NOT_PROVIDED_NAMES = {
    ("flash_attn.ops.layer_norm", "_dropout_add_layer_norm_subset_forward"): _RAW,
    ("flash_attn.ops.layer_norm", "_dropout_add_layer_norm_subset_backward"): _RAW,
    ("flash_attn.ops.layer_norm", "_dropout_add_layer_norm_forward"): _RAW,
    ("flash_attn.ops.layer_norm", "_dropout_add_layer_norm_backward"): _RAW,
    ("flash_attn.ops.layer_norm", "_dropout_add_layer_norm_parallel_residual_forward"): _RAW,
    ("flash_attn.ops.layer_norm", "_dropout_add_layer_norm_parallel_residual_backward"): _RAW,
    **{("flash_attn.ops.triton.layer_norm", name): _TRITON_PRIVATE for name in (
        "_layer_norm_fwd", "_layer_norm_fwd_impl", "_layer_norm_fwd_1pass_kernel", "_layer_norm_bwd",
        "_layer_norm_bwd_impl", "_layer_norm_bwd_kernel", "triton_autotune_configs")},
    **{("flash_attn.ops.triton.linear", name): _TRITON_PRIVATE for name in (
        "kernel_fwd", "kernel_bwd", "get_configs_io_bound", "init_to_zero")},
    ("flash_attn.ops.triton.cross_entropy", "cross_entropy_fwd_kernel"): _TRITON_PRIVATE,
    ("flash_attn.ops.triton.cross_entropy", "cross_entropy_bwd_kernel"): _TRITON_PRIVATE,
    ("flash_attn.ops.triton.rotary", "rotary_kernel"): _TRITON_PRIVATE,
}

SURFACE = json.loads(RECORD.read_text())


def test_the_record_is_upstreams_at_the_pinned_commit():
    assert SURFACE["commit"] == COMMIT and SURFACE["version"] == "2.8.4"
    assert "flash_attn.flash_attn_interface" in SURFACE["modules"]
    assert not any(m.startswith("flash_attn.cute") for m in SURFACE["modules"])  # FA4: another distribution
    if not MIRROR.exists():
        pytest.skip(f"no git mirror of upstream at {MIRROR}: the record is not regenerated here (the rest of the file uses it)")
    found = subprocess.run(["git", "-C", str(MIRROR), "cat-file", "-e", COMMIT], capture_output=True)
    if found.returncode != 0:
        pytest.skip(f"the mirror at {MIRROR} lacks commit {COMMIT}")
    assert record(str(MIRROR), COMMIT) == SURFACE  # the committed record is what the script writes


@pytest.mark.parametrize("module", sorted(SURFACE["modules"]))
def test_every_upstream_name_is_here(module):
    names = SURFACE["modules"][module]
    if module in NOT_PROVIDED_MODULES:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(module)
        return
    ours = importlib.import_module(module)
    missing = [n for n in names if not hasattr(ours, n) and (module, n) not in NOT_PROVIDED_NAMES]
    assert not missing, f"{module} lacks upstream's {missing}"


def test_what_is_not_provided_is_listed_exactly():
    """Every listed exclusion names an upstream name that is really absent here (a restored name
    leaves the list), and says why."""
    for (module, name), reason in NOT_PROVIDED_NAMES.items():
        assert name in SURFACE["modules"][module], (module, name)
        assert not hasattr(importlib.import_module(module), name), f"{module}.{name} is provided: unlist it"
        assert len(reason) > 40
    total = sum(len(v) for v in SURFACE["modules"].values())
    excluded = len(NOT_PROVIDED_NAMES) + sum(len(SURFACE["modules"][m]) for m in NOT_PROVIDED_MODULES)
    print(f"upstream surface at {COMMIT[:8]}: {total} names, {total - excluded} here, {excluded} listed as not provided")
    # 4 legacy modules (27 names) and 20 names, with the reasons above (docs/compatibility.md lists them)
    assert (total, excluded) == (326, 47)
