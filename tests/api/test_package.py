"""Package metadata and the public API surface: the flash-attn 2.8 names and signatures.

The signatures below are the specification, written down from flash-attn 2.8's
``flash_attn/flash_attn_interface.py`` (Dao-AILab/flash-attention): parameter names, order,
kinds and defaults must be identical so existing callers (positional or keyword) keep working.
They are unchanged in upstream's current source (version 2.8.4, commit
0251105a2fb19d2957484b7f023cd8c115286ced); the low-level functions' and entry points' changes
since 2.8.3 are checked in tests/api/test_lowlevel_api.py.

Beyond them, keyword-only after the last one (so no positional call changes meaning): the newer
interfaces' features, spelled as they spell them (``EXTENSIONS``): FlashAttention-4's
``learnable_sink`` everywhere, FlashAttention-3's ``qv`` where FlashAttention-3 has it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re

import pytest

import flash_attn
import flash_attn.flash_attn_interface as interface

_EMPTY = inspect.Parameter.empty

# name -> [(parameter, default)], in order; _EMPTY = required.
_COMMON_TAIL = [
    ("dropout_p", 0.0),
    ("softmax_scale", None),
    ("causal", False),
    ("window_size", (-1, -1)),
    ("softcap", 0.0),
    ("alibi_slopes", None),
    ("deterministic", False),
    ("return_attn_probs", False),
]

SPEC = {
    "flash_attn_qkvpacked_func": [("qkv", _EMPTY)] + _COMMON_TAIL,
    "flash_attn_kvpacked_func": [("q", _EMPTY), ("kv", _EMPTY)] + _COMMON_TAIL,
    "flash_attn_func": [("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY)] + _COMMON_TAIL,
    "flash_attn_varlen_qkvpacked_func": [("qkv", _EMPTY), ("cu_seqlens", _EMPTY), ("max_seqlen", _EMPTY)]
    + _COMMON_TAIL,
    "flash_attn_varlen_kvpacked_func": [
        ("q", _EMPTY), ("kv", _EMPTY), ("cu_seqlens_q", _EMPTY), ("cu_seqlens_k", _EMPTY),
        ("max_seqlen_q", _EMPTY), ("max_seqlen_k", _EMPTY),
    ] + _COMMON_TAIL,
    "flash_attn_varlen_func": [
        ("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("cu_seqlens_q", _EMPTY), ("cu_seqlens_k", _EMPTY),
        ("max_seqlen_q", _EMPTY), ("max_seqlen_k", _EMPTY),
    ] + _COMMON_TAIL + [("block_table", None)],
    "flash_attn_with_kvcache": [
        ("q", _EMPTY),
        ("k_cache", _EMPTY),
        ("v_cache", _EMPTY),
        ("k", None),
        ("v", None),
        ("rotary_cos", None),
        ("rotary_sin", None),
        ("cache_seqlens", None),
        ("cache_batch_idx", None),
        ("cache_leftpad", None),
        ("block_table", None),
        ("softmax_scale", None),
        ("causal", False),
        ("window_size", (-1, -1)),
        ("softcap", 0.0),
        ("rotary_interleaved", True),
        ("alibi_slopes", None),
        ("num_splits", 0),
        ("return_softmax_lse", False),
    ],
}


# name -> the keyword-only parameters after flash-attn 2.8's (all default None)
_SINK, _MLA = ["learnable_sink"], ["qv", "learnable_sink"]
EXTENSIONS = {
    "flash_attn_qkvpacked_func": _SINK,
    "flash_attn_kvpacked_func": _SINK,
    "flash_attn_func": _MLA,
    "flash_attn_varlen_qkvpacked_func": _SINK,
    "flash_attn_varlen_kvpacked_func": _SINK,
    "flash_attn_varlen_func": _MLA,
    "flash_attn_with_kvcache": _MLA,
}


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def test_version_matches_distribution_metadata():
    assert isinstance(flash_attn.__version__, str)
    assert flash_attn.__version__ == importlib.metadata.version("flash-attn")


def test_version_is_at_least_2_8():
    assert _parse_version(flash_attn.__version__) >= (2, 8)


def test_every_public_name_is_importable_from_both_modules():
    for name in SPEC:
        top = getattr(flash_attn, name)
        assert callable(top)
        assert getattr(interface, name) is top
        assert name in flash_attn.__all__
        assert name in interface.__all__
    # `from flash_attn import *` gives exactly the public names (plus __version__)
    ns: dict = {}
    exec("from flash_attn import *", ns)
    assert set(SPEC) <= set(ns)
    exec("from flash_attn.flash_attn_interface import *", ns)


@pytest.mark.parametrize("name", sorted(SPEC))
def test_signature_matches_flash_attn_2_8(name):
    sig = inspect.signature(getattr(flash_attn, name))
    positional = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    got = [(p.name, p.default) for p in positional]
    assert got == SPEC[name], f"{name}{sig}"
    for p in positional:
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{name}: {p.name} is {p.kind}"
    extra = [(p.name, p.default) for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert extra == [(n, None) for n in EXTENSIONS[name]], f"{name}{sig}"


@pytest.mark.parametrize("name", sorted(SPEC))
def test_public_functions_are_documented(name):
    """Every argument of a public function is explained in its docstring, by name or through a
    public function it refers to (":func:`flash_attn_func`": the other arguments as there)."""

    def explained(function_name: str, seen: frozenset = frozenset()) -> set[str]:
        doc = getattr(flash_attn, function_name).__doc__ or ""
        names = set(re.findall(r"\w+", doc))
        for other in set(re.findall(r":func:`(\w+)`", doc)) - seen - {function_name}:
            names |= explained(other, seen | {function_name})
        return names

    parameters = inspect.signature(getattr(flash_attn, name)).parameters
    missing = [p for p in parameters if p not in explained(name)]
    assert not missing, f"{name}'s docstring does not explain {missing}"


def test_submodules_import_cleanly():
    for mod in ("flash_attn.flash_attn_interface", "flash_attn.custom_ops", "flash_attn.dispatch", "flash_attn.validation"):
        importlib.import_module(mod)
