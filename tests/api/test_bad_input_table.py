"""The bad-input suite, generated from one table: for every parameter of every public function
(``flash_attn_*``, the low-level API and ``flash_attn_gpu``, ``bert_padding``, ``layers.rotary``,
``ops.triton.*``, ``losses``, ``modules.mha``, FlashAttention-3's interface ``fa3.*``, upstream's
autograd classes ``FlashAttn*Func`` / ``ApplyRotaryEmb*`` / ``ops.triton.cross_entropy.CrossEntropyLoss``,
``ops.layer_norm``, ``ops.rms_norm``, ``ops.fused_dense``) a bad type, a bad value where a value can be bad,
and a bad shape or device where the parameter is a tensor, each with the exception type it must
raise and the words its message must contain (the argument's name, what is accepted).

Each function has a control: a valid call (:data:`CONTROLS`), which must run; every row of
:data:`TABLE` is that call with one argument replaced. :func:`test_every_public_parameter_has_rows`
enumerates the public functions from their modules (``__all__``, or the public names of
``modules.mha``; :data:`PUBLIC_CLASSES` for autograd classes outside an ``__all__``) and their parameters from their signatures: a function or a parameter without
rows fails it, so a new one gets its rows (and its checks) before it ships.
"""

from __future__ import annotations

import enum
import inspect
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

import flash_attn
from flash_attn import bert_padding, entry_points, flash_attn_interface, lowlevel
from flash_attn.layers import rotary as layers_rotary
from flash_attn.losses import cross_entropy as losses_cross_entropy
from flash_attn.modules import mha
from flash_attn.ops.triton import cross_entropy as ops_cross_entropy
from flash_attn.ops.triton import k_activations, layer_norm, linear, mlp
from flash_attn.ops.triton import rotary as ops_rotary

from support.options import test_device

NAN, INF = float("nan"), float("inf")
F16, F32 = torch.float16, torch.float32


def dev():
    return test_device()


def t(*shape, dtype=F16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(dev())


def i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=dev())


# ---------------------------------------------------------------------------------------------
# Controls: one valid call per public function, as keyword arguments (positional for autograd
# Functions' .apply, in their forward's order).


@dataclass
class Control:
    fn: Callable  # called with the arguments; for a module's forward, the module is made first
    args: Callable[[], dict]
    make: Callable[[], Any] = None  # a module's forward: makes the module (its control's instance)
    positional: bool = False  # autograd Function .apply: arguments by position


def _attn():
    return dict(q=t(2, 5, 4, 32), k=t(2, 7, 2, 32, seed=1), v=t(2, 7, 2, 32, seed=2))


def _varlen():
    return dict(q=t(7, 4, 32), k=t(7, 2, 32, seed=1), v=t(7, 2, 32, seed=2), cu_seqlens_q=i32(0, 3, 7),
                cu_seqlens_k=i32(0, 5, 7), max_seqlen_q=4, max_seqlen_k=5)


def _kvcache():
    return dict(q=t(2, 1, 4, 32), k_cache=t(2, 16, 2, 32, seed=1), v_cache=t(2, 16, 2, 32, seed=2),
                k=t(2, 1, 2, 32, seed=3), v=t(2, 1, 2, 32, seed=4), rotary_cos=t(16, 8, seed=5),
                rotary_sin=t(16, 8, seed=6), cache_seqlens=i32(3, 5), cache_batch_idx=i32(1, 0),
                cache_leftpad=i32(0, 1))


def _lowlevel_forward():
    a = _attn()
    return dict(a, dropout_p=0.0, softmax_scale=0.2, causal=False, window_size_left=-1, window_size_right=-1,
                softcap=0.0, alibi_slopes=None, return_softmax=False)


def _lowlevel_varlen_forward():
    return dict(_varlen(), dropout_p=0.0, softmax_scale=0.2, causal=False, window_size_left=-1, window_size_right=-1,
                softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                seqused_k=None, zero_tensors=False, num_splits=0)


def _lowlevel_backward():
    a = _attn()
    out, lse, _, rng = lowlevel._flash_attn_forward(a["q"], a["k"], a["v"], 0.0, 0.2, False, -1, -1, 0.0, None, False)
    return dict(dout=t(2, 5, 4, 32, seed=9), **a, out=out, softmax_lse=lse, dq=torch.empty_like(a["q"]),
                dk=torch.empty_like(a["k"]), dv=torch.empty_like(a["v"]), dropout_p=0.0, softmax_scale=0.2,
                causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                deterministic=False, rng_state=rng)


def _lowlevel_varlen_backward():
    a = _varlen()
    out, lse, _, rng = lowlevel._flash_attn_varlen_forward(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                                          4, 5, 0.0, 0.2, False)
    return dict(dout=t(7, 4, 32, seed=9), q=a["q"], k=a["k"], v=a["v"], out=out, softmax_lse=lse,
                dq=torch.empty_like(a["q"]), dk=torch.empty_like(a["k"]), dv=torch.empty_like(a["v"]),
                cu_seqlens_q=a["cu_seqlens_q"], cu_seqlens_k=a["cu_seqlens_k"], max_seqlen_q=4, max_seqlen_k=5,
                dropout_p=0.0, softmax_scale=0.2, causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                alibi_slopes=None, deterministic=False, rng_state=rng, zero_tensors=False)


def _gpu(args: dict, renames: dict, **extra) -> dict:
    """Upstream's ``flash_attn_gpu`` names for the low-level arguments."""
    return {renames.get(k, k): v for k, v in args.items()} | extra


_GPU_NAMES = {"dropout_p": "p_dropout", "causal": "is_causal"}


def _gpu_fwd():
    return _gpu(_lowlevel_forward(), _GPU_NAMES, out=None, unused_generator_compat=None)


def _gpu_varlen_fwd():
    return _gpu(_lowlevel_varlen_forward(), _GPU_NAMES, out=None, unused_generator_compat=None)


def _gpu_bwd():
    return _gpu(_lowlevel_backward(), _GPU_NAMES, unused_generator_compat=None)


def _gpu_varlen_bwd():
    return _gpu(_lowlevel_varlen_backward(), _GPU_NAMES, unused_generator_compat=None)


def _gpu_fwd_kvcache():
    a = _kvcache()
    return dict(q=a["q"], kcache=a["k_cache"], vcache=a["v_cache"], k=a["k"], v=a["v"], seqlens_k=a["cache_seqlens"],
                rotary_cos=a["rotary_cos"], rotary_sin=a["rotary_sin"], cache_batch_idx=a["cache_batch_idx"],
                leftpad_k=a["cache_leftpad"], block_table=None, alibi_slopes=None, out=None, softmax_scale=0.2,
                is_causal=True, window_size_left=-1, window_size_right=-1, softcap=0.0, is_rotary_interleaved=True,
                num_splits=0)


def _packed_dense():
    a = _attn()
    return dict(qkv=torch.stack([a["q"]] * 3, dim=2))


def _kv_dense():
    a = _attn()
    return dict(q=a["q"], kv=torch.stack([a["k"], a["v"]], dim=2))


def _packed_varlen():
    a = _varlen()
    return dict(qkv=torch.stack([a["q"]] * 3, dim=1), cu_seqlens=a["cu_seqlens_q"], max_seqlen=4)


def _kv_varlen():
    a = _varlen()
    return dict(q=a["q"], kv=torch.stack([a["k"], a["v"]], dim=1), cu_seqlens_q=a["cu_seqlens_q"],
                cu_seqlens_k=a["cu_seqlens_k"], max_seqlen_q=4, max_seqlen_k=5)


def _attention_options(**args):
    return dict(args, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None, deterministic=False, return_attn_probs=False)


CONTROLS: dict[str, Control] = {
    "flash_attn_func": Control(flash_attn.flash_attn_func, lambda: _attention_options(**_attn())),
    "flash_attn_qkvpacked_func": Control(flash_attn.flash_attn_qkvpacked_func,
                                         lambda: _attention_options(**_packed_dense())),
    "flash_attn_kvpacked_func": Control(flash_attn.flash_attn_kvpacked_func, lambda: _attention_options(**_kv_dense())),
    "flash_attn_varlen_func": Control(flash_attn.flash_attn_varlen_func,
                                      lambda: _attention_options(**_varlen(), block_table=None)),
    "flash_attn_varlen_qkvpacked_func": Control(flash_attn.flash_attn_varlen_qkvpacked_func,
                                                lambda: _attention_options(**_packed_varlen())),
    "flash_attn_varlen_kvpacked_func": Control(flash_attn.flash_attn_varlen_kvpacked_func,
                                               lambda: _attention_options(**_kv_varlen())),
    "flash_attn_with_kvcache": Control(flash_attn.flash_attn_with_kvcache, lambda: dict(
        _kvcache(), block_table=None, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
        rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False)),
    "_flash_attn_forward": Control(lowlevel._flash_attn_forward, _lowlevel_forward),
    "_flash_attn_varlen_forward": Control(lowlevel._flash_attn_varlen_forward, _lowlevel_varlen_forward),
    "_flash_attn_backward": Control(lowlevel._flash_attn_backward, _lowlevel_backward),
    "_flash_attn_varlen_backward": Control(lowlevel._flash_attn_varlen_backward, _lowlevel_varlen_backward),
    "flash_attn_gpu.fwd": Control(entry_points.fwd, _gpu_fwd),
    "flash_attn_gpu.varlen_fwd": Control(entry_points.varlen_fwd, _gpu_varlen_fwd),
    "flash_attn_gpu.bwd": Control(entry_points.bwd, _gpu_bwd),
    "flash_attn_gpu.varlen_bwd": Control(entry_points.varlen_bwd, _gpu_varlen_bwd),
    "flash_attn_gpu.fwd_kvcache": Control(entry_points.fwd_kvcache, _gpu_fwd_kvcache),
}

# ---------------------------------------------------------------------------------------------
# The table.


@dataclass
class Row:
    function: str
    parameter: str
    kind: str  # "type", "value", "shape" or "device"
    bad: Any  # the value, or a function of the control's arguments returning it
    error: type
    words: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.function}.{self.parameter}:{self.kind}:{_describe(self.bad)}"


def _describe(bad) -> str:
    if callable(bad) and getattr(bad, "__name__", "") == "<lambda>":
        return getattr(bad, "label", "fn")
    return repr(bad)[:24]


def bad(label: str, fn: Callable) -> Callable:
    fn.label = label
    return fn


TABLE: list[Row] = []


def rows(function: str, parameter: str, *specs) -> None:
    """Rows of one parameter: each spec ``(kind, bad, error, *words)``; the parameter's name is
    always among the words."""
    for kind, value, error, *words in specs:
        TABLE.append(Row(function, parameter, kind, value, error, (parameter, *words)))


def not_a(accepted: str, error=TypeError, value="not this"):
    return ("type", value, error, accepted)


def as_dtype(parameter: str, dtype, error=TypeError, *words):
    return ("value", bad(f"{dtype}", lambda a: a[parameter].to(dtype)), error, *words)


def with_rank(parameter: str, change: Callable, error=ValueError, *words):
    return ("shape", bad("another shape", lambda a: change(a[parameter])), error, *words)


def on_meta(parameter: str, error=ValueError):
    return ("device", bad("on meta", lambda a: a[parameter].to("meta")), error, "meta")


def value(v, error=ValueError, *words):
    return ("value", v, error, *words)


# The attention functions' shared options.
def attention_options(function: str, dropout=True, deterministic=True, probs=True) -> None:
    if dropout:
        rows(function, "dropout_p", not_a("float"), value(1.5, ValueError, "[0, 1)"), value(True, TypeError))
    rows(function, "softmax_scale", not_a("float"), value(NAN, ValueError, "finite"), value(True, TypeError))
    rows(function, "causal", not_a("bool", value="yes"))
    rows(function, "window_size", not_a("pair", value=4), value((NAN, 0), TypeError, "int"),
         value(("a", 0), TypeError, "int"), value((2.7, 0), TypeError, "int"), value((1, 2, 3), ValueError, "pair"),
         value((-2, 0), ValueError, "-1"))
    rows(function, "softcap", not_a("float"), value(NAN, ValueError, ">= 0"), value(True, TypeError, "float"),
         value(-1.0, ValueError, ">= 0"), value(1e-45, ValueError, "too small"))
    rows(function, "alibi_slopes", not_a("float32", value="slopes"),
         ("value", bad("fp16", lambda a: torch.ones(4, dtype=F16, device=dev())), TypeError, "float32"),
         ("shape", bad("(3,)", lambda a: torch.ones(3, device=dev())), ValueError, "shape"),
         ("device", bad("meta", lambda a: torch.ones(4, device="meta")), ValueError, "meta"))
    if deterministic:
        rows(function, "deterministic", not_a("bool", value="yes"))
    if probs:
        rows(function, "return_attn_probs", not_a("bool", value="yes"))


def attention_tensor(function: str, parameter: str, rank_words=("dims",), device=True) -> None:
    specs = [not_a("torch.Tensor", value="x"), as_dtype(parameter, torch.int32, TypeError, "float16"),
             with_rank(parameter, lambda x: x.unsqueeze(0), ValueError, *rank_words)]
    if device:
        specs.append(on_meta(parameter))
    rows(function, parameter, *specs)


def cu_seqlens(function: str, parameter: str, error_type=TypeError) -> None:
    rows(function, parameter, not_a("int32", value=[0, 3, 7]), as_dtype(parameter, torch.int64, TypeError, "int32"),
         with_rank(parameter, lambda x: x[None], ValueError, "batch_size + 1"), on_meta(parameter),
         value(bad("decreasing", lambda a: a[parameter].flip(0)), ValueError))


def max_seqlen(function: str, parameter: str) -> None:
    rows(function, parameter, not_a("int", ValueError, value="four"), value(-1, ValueError, "non-negative"),
         value(1, ValueError, "smaller than the longest"))


for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func"):
    attention_tensor(name, "q")
    attention_options(name)
for name in ("flash_attn_func", "flash_attn_varlen_func"):
    attention_tensor(name, "k")
    attention_tensor(name, "v")
for name in ("flash_attn_qkvpacked_func", "flash_attn_varlen_qkvpacked_func"):
    attention_tensor(name, "qkv", device=False)
    attention_options(name)
for name in ("flash_attn_kvpacked_func", "flash_attn_varlen_kvpacked_func"):
    attention_tensor(name, "kv")
for name in ("flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func"):
    cu_seqlens(name, "cu_seqlens_q")
    cu_seqlens(name, "cu_seqlens_k")
    max_seqlen(name, "max_seqlen_q")
    max_seqlen(name, "max_seqlen_k")
cu_seqlens("flash_attn_varlen_qkvpacked_func", "cu_seqlens")
max_seqlen("flash_attn_varlen_qkvpacked_func", "max_seqlen")
rows("flash_attn_varlen_func", "block_table", not_a("int32", value=[[0]]),
     ("value", bad("fp32 table", lambda a: torch.zeros(2, 1, device=dev())), TypeError, "int32"))

# flash_attn_with_kvcache
K = "flash_attn_with_kvcache"
attention_tensor(K, "q", device=False)
for p in ("k_cache", "v_cache", "k", "v"):
    attention_tensor(K, p)
rows(K, "k", value(None, ValueError, "together"))
rows(K, "rotary_cos", not_a("shape", ValueError, value="cos"),
     as_dtype("rotary_cos", torch.int32, TypeError, "floating"),
     with_rank("rotary_cos", lambda x: x[None], ValueError, "seqlen_ro"), on_meta("rotary_cos"))
rows(K, "rotary_sin", not_a("shape", ValueError, value="sin"),
     as_dtype("rotary_sin", torch.int32, TypeError, "floating"),
     with_rank("rotary_sin", lambda x: x[None], ValueError, "seqlen_ro"), on_meta("rotary_sin"),
     value(None, ValueError, "together"))
for p in ("cache_seqlens", "cache_batch_idx", "cache_leftpad"):
    rows(K, p, not_a("int32", value="lengths"), as_dtype(p, torch.int64, TypeError, "int32"),
         with_rank(p, lambda x: x[None], TypeError, "shape"), on_meta(p))
rows(K, "cache_seqlens", value(bad("past the cache", lambda a: i32(3, 16)), ValueError, "cache"),
     value(bad("negative", lambda a: i32(-1, 3)), ValueError, ">= 0"))
rows(K, "cache_batch_idx", value(bad("out of range", lambda a: i32(0, 2)), IndexError, "batch"))
rows(K, "cache_leftpad", value(bad("past the length", lambda a: i32(0, 6)), ValueError, "cache_seqlens"))
rows(K, "block_table", not_a("int32", value=[[0]]),
     ("value", bad("with cache_batch_idx", lambda a: torch.zeros(2, 1, dtype=torch.int32, device=dev())), ValueError,
      "cache_batch_idx"))
attention_options(K, dropout=False, deterministic=False, probs=False)
rows(K, "rotary_interleaved", not_a("bool", value="yes"))
rows(K, "num_splits", not_a("int", ValueError, value="two"), value(-1, ValueError, ">= 0"))
rows(K, "return_softmax_lse", not_a("bool", value="yes"))


# The low-level functions are torch.library custom ops: PyTorch checks each argument's type
# against the op's schema and names it ("Expected a value of type 'bool' for argument 'causal'").
def schema(accepted: str, value="x"):
    return ("type", value, RuntimeError, "Expected a value of type", accepted)


def lowlevel_scalars(function: str, gpu: bool = False) -> None:
    if gpu:  # upstream's names, checked under them before the call
        rows(function, "p_dropout", not_a("float"), value(1.5, ValueError, "[0, 1)"))
        rows(function, "is_causal", not_a("bool", value="yes"))
    else:
        rows(function, "dropout_p", schema("float"), value(1.5, ValueError, "[0, 1)"))
        rows(function, "causal", schema("bool", value="yes"))
    rows(function, "softmax_scale", schema("float"), value(NAN, ValueError, "finite"))
    for side in ("window_size_left", "window_size_right"):
        rows(function, side, schema("int", value="wide"))
    rows(function, "softcap", schema("float"), value(NAN, ValueError, ">= 0"), value(-1.0, ValueError, ">= 0"))
    rows(function, "alibi_slopes", schema("Tensor", value="slopes"),
         ("value", bad("fp16", lambda a: torch.ones(4, dtype=F16, device=dev())), TypeError, "float32"),
         ("shape", bad("(3,)", lambda a: torch.ones(3, device=dev())), ValueError, "shape"))


for function, gpu in (("_flash_attn_forward", False), ("_flash_attn_varlen_forward", False),
                      ("_flash_attn_backward", False), ("_flash_attn_varlen_backward", False),
                      ("flash_attn_gpu.fwd", True), ("flash_attn_gpu.varlen_fwd", True),
                      ("flash_attn_gpu.bwd", True), ("flash_attn_gpu.varlen_bwd", True)):
    varlen, backward = "varlen" in function, "bwd" in function or "backward" in function
    for p in ("q", "k", "v"):
        rows(function, p, schema("Tensor"), as_dtype(p, torch.int32, TypeError, "float16"),
             with_rank(p, lambda x: x.unsqueeze(0), ValueError, "dims"))
    for p in ("k", "v"):
        rows(function, p, on_meta(p))
    lowlevel_scalars(function, gpu)
    if varlen:
        for p in ("cu_seqlens_q", "cu_seqlens_k"):
            rows(function, p, schema("Tensor", value=[0, 3]), as_dtype(p, torch.int64, TypeError, "int32"),
                 with_rank(p, lambda x: x[None], ValueError, "batch_size + 1"), on_meta(p),
                 value(bad("decreasing", lambda a, p=p: a[p].flip(0)), ValueError))
        for p in ("max_seqlen_q", "max_seqlen_k"):
            rows(function, p, schema("int", value="four"), value(-1, ValueError, "non-negative"))
        rows(function, "zero_tensors", schema("bool", value="yes"))
    if backward:
        for p in ("dout", "out"):
            rows(function, p, schema("Tensor"), as_dtype(p, F32, TypeError, "dtype"),
                 with_rank(p, lambda x: x.unsqueeze(0), ValueError, "shape"), on_meta(p))
        rows(function, "softmax_lse", schema("Tensor"), as_dtype("softmax_lse", F16, TypeError, "float32"),
             with_rank("softmax_lse", lambda x: x.unsqueeze(0), ValueError, "shape"), on_meta("softmax_lse"))
        for p in ("dq", "dk", "dv"):
            rows(function, p, schema("Tensor"), as_dtype(p, F32, TypeError, "dtype"),
                 with_rank(p, lambda x: x.unsqueeze(0), ValueError, "shape"), on_meta(p))
        rows(function, "deterministic", schema("bool", value="yes"))
        rows(function, "rng_state", schema("Tensor", value="seed"), as_dtype("rng_state", torch.int32, TypeError, "int64"),
             on_meta("rng_state"))
    else:
        rows(function, "return_softmax", schema("bool", value="yes"))
    if varlen and not backward:
        rows(function, "block_table", schema("Tensor", value=[[0]]))
        for p in ("leftpad_k", "seqused_k"):
            rows(function, p, schema("Tensor", value=[0, 0]),
                 ("value", bad("int64", lambda a: torch.zeros(2, dtype=torch.int64, device=dev())), TypeError, "int32"),
                 ("shape", bad("(3,)", lambda a: torch.zeros(3, dtype=torch.int32, device=dev())), TypeError, "shape"),
                 ("device", bad("meta", lambda a: torch.zeros(2, dtype=torch.int32, device="meta")), ValueError,
                  "meta"))
        rows(function, "num_splits", schema("int", value="two"))
    if gpu:
        rows(function, "unused_generator_compat", ("type", "a generator", RuntimeError, "generator", "None"),
             value(torch.Generator(), RuntimeError, "generator", "None"))
    if gpu and not backward:
        rows(function, "out", not_a("tensor", ValueError, value="out"),
             ("shape", bad("another shape", lambda a: torch.empty(1, device=dev())), ValueError, "shape"))

G = "flash_attn_gpu.fwd_kvcache"
attention_tensor(G, "q", device=False)
for p in ("kcache", "vcache", "k", "v"):
    attention_tensor(G, p)
for p in ("seqlens_k", "cache_batch_idx", "leftpad_k"):
    rows(G, p, not_a("int32", value="lengths"))
rows(G, "rotary_cos", not_a("shape", ValueError, value="cos"), as_dtype("rotary_cos", torch.int32, TypeError))
rows(G, "rotary_sin", not_a("shape", ValueError, value="sin"), as_dtype("rotary_sin", torch.int32, TypeError))
rows(G, "block_table", not_a("int32", value=[[0]]))
rows(G, "alibi_slopes", not_a("float32", value="slopes"))
rows(G, "out", not_a("tensor", ValueError, value="out"))
rows(G, "softmax_scale", not_a("float"), value(NAN, ValueError, "finite"))
rows(G, "is_causal", not_a("bool", value="yes"))
for side in ("window_size_left", "window_size_right"):
    rows(G, side, not_a("int", value="wide"))
rows(G, "softcap", not_a("float"), value(NAN, ValueError, ">= 0"))
rows(G, "is_rotary_interleaved", not_a("bool", value="yes"))
rows(G, "num_splits", not_a("int", ValueError, value="two"))


# ---------------------------------------------------------------------------------------------
# bert_padding


def _rows_and_indices():
    return dict(input=t(6, 4), indices=torch.tensor([0, 2, 5], device=dev()))


CONTROLS.update({
    "IndexFirstAxis": Control(bert_padding.IndexFirstAxis.apply, _rows_and_indices, positional=True),
    "index_first_axis": Control(bert_padding.index_first_axis, _rows_and_indices, positional=True),
    "IndexFirstAxisResidual": Control(bert_padding.IndexFirstAxisResidual.apply, _rows_and_indices, positional=True),
    "index_first_axis_residual": Control(bert_padding.index_first_axis_residual, _rows_and_indices,
                                         positional=True),
    "IndexPutFirstAxis": Control(bert_padding.IndexPutFirstAxis.apply, lambda: dict(
        values=t(3, 4), indices=torch.tensor([0, 2, 5], device=dev()), first_axis_dim=6), positional=True),
    "index_put_first_axis": Control(bert_padding.index_put_first_axis, lambda: dict(
        values=t(3, 4), indices=torch.tensor([0, 2, 5], device=dev()), first_axis_dim=6), positional=True),
    "pad_input": Control(bert_padding.pad_input, lambda: dict(
        hidden_states=t(3, 4), indices=torch.tensor([0, 2, 5], device=dev()), batch=2, seqlen=3)),
    "unpad_input": Control(bert_padding.unpad_input, lambda: dict(
        hidden_states=t(2, 3, 4), attention_mask=torch.tensor([[1, 1, 0], [1, 0, 0]], device=dev()),
        unused_mask=torch.tensor([[0, 0, 1], [0, 0, 0]], device=dev()))),
    "unpad_input_for_concatenated_sequences": Control(bert_padding.unpad_input_for_concatenated_sequences, lambda: dict(
        hidden_states=t(2, 3, 4), attention_mask_in_length=torch.tensor([[2, 1, 0], [3, 0, 0]], device=dev()))),
})


def indices_rows(function, size_word="rows"):
    rows(function, "indices", not_a("integer tensor", ValueError, value=[0, 2]),
         as_dtype("indices", F32, ValueError, "int"), with_rank("indices", lambda x: x[None], ValueError, "1-D"),
         on_meta("indices"), value(bad("out of range", lambda a: torch.tensor([0, 6], device=dev())), IndexError,
                                   size_word))


for name in ("IndexFirstAxis", "index_first_axis", "IndexFirstAxisResidual", "index_first_axis_residual"):
    rows(name, "input", not_a("tensor", TypeError, value="rows"),
         ("shape", bad("0-d", lambda a: torch.tensor(1.0, device=dev())), ValueError, "dimension"))
    indices_rows(name)
for name in ("IndexPutFirstAxis", "index_put_first_axis"):
    rows(name, "values", not_a("tensor", TypeError, value="rows"),
         with_rank("values", lambda x: x[:2], ValueError, "one row per index"), on_meta("values"))
    indices_rows(name, "first_axis_dim")
    rows(name, "first_axis_dim", not_a("int", TypeError, value="six"), value(-1, ValueError, ">= 0"))
rows("pad_input", "hidden_states", not_a("tensor", TypeError, value="rows"),
     with_rank("hidden_states", lambda x: x[:2], ValueError, "one row per index"), on_meta("hidden_states"))
indices_rows("pad_input", "batch * seqlen")
for p in ("batch", "seqlen"):
    rows("pad_input", p, not_a("int", TypeError, value="two"), value(-1, ValueError, ">= 0"))
rows("unpad_input", "hidden_states", not_a("tensor", TypeError, value="rows"),
     with_rank("hidden_states", lambda x: x[0], ValueError, "(batch, seqlen"), on_meta("hidden_states"))
for p in ("attention_mask", "unused_mask"):
    rows("unpad_input", p, not_a("tensor", TypeError, value="mask"),
         with_rank(p, lambda x: x[None], ValueError, "shape"), on_meta(p))
rows("unpad_input_for_concatenated_sequences", "hidden_states", not_a("tensor", TypeError, value="rows"),
     with_rank("hidden_states", lambda x: x[0], ValueError, "(batch, seqlen"), on_meta("hidden_states"))
rows("unpad_input_for_concatenated_sequences", "attention_mask_in_length", not_a("tensor", TypeError, value="lengths"),
     with_rank("attention_mask_in_length", lambda x: x[None], ValueError, "shape"), on_meta("attention_mask_in_length"),
     as_dtype("attention_mask_in_length", F32, ValueError, "integer"),
     value(bad("negative", lambda a: torch.tensor([[2, -1, 0], [3, 0, 0]], device=dev())), ValueError, "non-negative"))

# ---------------------------------------------------------------------------------------------
# Rotary: layers.rotary and ops.triton.rotary


def _rotary():
    return dict(x=t(2, 5, 4, 16), cos=t(8, 4, dtype=F32, seed=1), sin=t(8, 4, dtype=F32, seed=2))


def _rotary_varlen():
    return dict(x=t(7, 4, 16), cos=t(8, 4, dtype=F32, seed=1), sin=t(8, 4, dtype=F32, seed=2),
                cu_seqlens=i32(0, 3, 7), max_seqlen=4)


CONTROLS.update({
    "apply_rotary_emb": Control(layers_rotary.apply_rotary_emb, lambda: dict(
        _rotary_varlen(), interleaved=False, inplace=False, seqlen_offsets=i32(0, 1))),
    "apply_rotary_emb_func": Control(layers_rotary.apply_rotary_emb_func, lambda: dict(
        _rotary_varlen(), interleaved=False, inplace=False, seqlen_offsets=i32(0, 1))),
    "apply_rotary": Control(ops_rotary.apply_rotary, lambda: dict(
        _rotary_varlen(), seqlen_offsets=i32(0, 1), interleaved=False, inplace=False, conjugate=False)),
    "apply_rotary_emb_qkv_": Control(layers_rotary.apply_rotary_emb_qkv_, lambda: dict(
        qkv=t(2, 5, 3, 4, 16), cos=t(8, 4, dtype=F32, seed=1), sin=t(8, 4, dtype=F32, seed=2),
        cos_k=t(8, 4, dtype=F32, seed=3), sin_k=t(8, 4, dtype=F32, seed=4), interleaved=False, seqlen_offsets=0,
        num_heads_q=None)),
    "apply_rotary_emb_kv_": Control(layers_rotary.apply_rotary_emb_kv_, lambda: dict(
        kv=t(2, 5, 2, 4, 16), cos=t(8, 4, dtype=F32, seed=1), sin=t(8, 4, dtype=F32, seed=2), interleaved=False,
        seqlen_offsets=0)),
    "apply_rotary_emb_torch": Control(layers_rotary.apply_rotary_emb_torch, lambda: dict(
        x=t(2, 5, 4, 16), cos=t(5, 4, seed=1), sin=t(5, 4, seed=2), interleaved=False)),
    "rotate_half": Control(layers_rotary.rotate_half, lambda: dict(x=t(2, 5, 4, 16), interleaved=False)),
    "RotaryEmbedding.__init__": Control(layers_rotary.RotaryEmbedding, lambda: dict(
        dim=8, base=10000.0, interleaved=False, scale_base=None, device=None)),
    "RotaryEmbedding.forward": Control(layers_rotary.RotaryEmbedding.forward, lambda: dict(
        qkv=t(2, 5, 4, 16), kv=t(2, 5, 2, 4, 16, seed=1), seqlen_offset=0, max_seqlen=None, num_heads_q=None),
        make=lambda: layers_rotary.RotaryEmbedding(8, device=dev())),
})


def _in_forward_order(cls, args: Callable[[], dict]) -> Callable[[], dict]:
    """An autograd class's control: ``args`` in its forward's order (for ``.apply``, by position)."""
    order = list(inspect.signature(cls.forward).parameters)[1:]
    return lambda: {k: args()[k] for k in order}


# Upstream's autograd classes (outside the modules' __all__; PUBLIC_CLASSES names them)
CONTROLS.update({
    name: Control(getattr(layers_rotary, name).apply, _in_forward_order(getattr(layers_rotary, name),
                                                                        CONTROLS[of].args), positional=True)
    for name, of in (("ApplyRotaryEmb", "apply_rotary_emb"), ("ApplyRotaryEmbQKV_", "apply_rotary_emb_qkv_"),
                     ("ApplyRotaryEmbKV_", "apply_rotary_emb_kv_"))
})


def table_rows(function, parameter):
    rows(function, parameter, not_a("tensor", ValueError, value="table"),
         as_dtype(parameter, torch.int32, ValueError, "floating"),
         with_rank(parameter, lambda x: x[None], ValueError, "shape"), on_meta(parameter))


def offsets_rows(function, parameter="seqlen_offsets"):
    rows(function, parameter, not_a("int or a tensor", ValueError, value="one"),
         value(bad("negative tensor", lambda a: i32(-1, 0)), ValueError, ">= 0"),
         value(-1, ValueError, ">= 0"), as_dtype(parameter, F32, ValueError, "int32"),
         with_rank(parameter, lambda x: x[None], ValueError, "shape"), on_meta(parameter))


for name in ("apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary", "ApplyRotaryEmb"):
    rows(name, "x", not_a("floating", ValueError, value="x"), as_dtype("x", torch.int32, ValueError, "floating"),
         with_rank("x", lambda x: x[None], ValueError, "shape"))
    table_rows(name, "cos")
    table_rows(name, "sin")
    offsets_rows(name)
    rows(name, "cu_seqlens", not_a("int32", ValueError, value=[0, 3]), as_dtype("cu_seqlens", F32, ValueError, "int32"),
         with_rank("cu_seqlens", lambda x: x[None], ValueError, "1-D"), on_meta("cu_seqlens"),
         value(bad("decreasing", lambda a: i32(0, 7, 3)), ValueError, "non-decreasing"))
    rows(name, "max_seqlen", not_a("int", ValueError, value="four"), value(-1, ValueError, ">= 0"),
         value(2, ValueError, "longest"))
    rows(name, "interleaved", not_a("bool", TypeError, value="yes"))
    rows(name, "inplace", not_a("bool", TypeError, value="yes"))
rows("apply_rotary", "conjugate", not_a("bool", TypeError, value="yes"))
for name in ("apply_rotary_emb_qkv_", "ApplyRotaryEmbQKV_"):
    rows(name, "qkv", not_a("tensor", ValueError, value="qkv"),
         as_dtype("qkv", torch.int32, ValueError, "floating"), with_rank("qkv", lambda x: x[0], ValueError, "shape"))
    rows(name, "cos_k", value(None, ValueError, "together"))
    rows(name, "num_heads_q", not_a("int", TypeError, value="four"), value(0, ValueError, "heads"))
for name in ("apply_rotary_emb_kv_", "ApplyRotaryEmbKV_"):
    rows(name, "kv", not_a("tensor", ValueError, value="kv"),
         as_dtype("kv", torch.int32, ValueError, "floating"), with_rank("kv", lambda x: x[0], ValueError, "shape"))
for name, tables in (("apply_rotary_emb_qkv_", ("cos", "sin", "cos_k", "sin_k")), ("apply_rotary_emb_kv_", ("cos", "sin")),
                     ("ApplyRotaryEmbQKV_", ("cos", "sin", "cos_k", "sin_k")), ("ApplyRotaryEmbKV_", ("cos", "sin"))):
    for p in tables:
        table_rows(name, p)
    rows(name, "interleaved", not_a("bool", TypeError, value="yes"))
    rows(name, "seqlen_offsets", not_a("int or a tensor", ValueError, value="one"), value(-1, ValueError, ">= 0"),
         value(bad("negative tensor", lambda a: i32(-1, 0)), ValueError, ">= 0"))
rows("apply_rotary_emb_torch", "x", not_a("tensor", ValueError, value="x"),
     as_dtype("x", torch.int32, ValueError, "floating"), with_rank("x", lambda x: x[0, 0], ValueError, "shape"))
for p in ("cos", "sin"):
    rows("apply_rotary_emb_torch", p, not_a("tensor", ValueError, value="table"),
         as_dtype(p, torch.int32, ValueError, "floating"), with_rank(p, lambda x: x[:2], ValueError, "shape"),
         on_meta(p))
rows("apply_rotary_emb_torch", "interleaved", not_a("bool", TypeError, value="yes"))
rows("rotate_half", "x", not_a("tensor", ValueError, value="x"),
     ("shape", bad("odd last dim", lambda a: t(2, 5, 4, 15)), ValueError, "even"))
rows("rotate_half", "interleaved", not_a("bool", TypeError, value="yes"))
rows("RotaryEmbedding.__init__", "dim", not_a("int", TypeError, value="eight"), value(7, ValueError, "even"))
rows("RotaryEmbedding.__init__", "base", not_a("float", TypeError, value="ten"), value(NAN, ValueError, "> 0"),
     value(-1.0, ValueError, "> 0"))
rows("RotaryEmbedding.__init__", "interleaved", not_a("bool", TypeError, value="yes"))
rows("RotaryEmbedding.__init__", "scale_base", not_a("float", TypeError, value="big"), value(0.0, ValueError, "> 0"))
rows("RotaryEmbedding.__init__", "device", not_a("device", RuntimeError, value="nowhere"))
rows("RotaryEmbedding.forward", "qkv", not_a("tensor", TypeError, value="qkv"),
     with_rank("qkv", lambda x: x[0], ValueError, "shape"))
rows("RotaryEmbedding.forward", "kv", not_a("tensor", ValueError, value="kv"),
     with_rank("kv", lambda x: x[0], ValueError, "shape"), on_meta("kv"))
rows("RotaryEmbedding.forward", "seqlen_offset", not_a("int or a tensor", ValueError, value="one"),
     value(-1, ValueError, ">= 0"))
rows("RotaryEmbedding.forward", "max_seqlen", not_a("int", TypeError, value="long"), value(-1, ValueError, ">= 0"))
rows("RotaryEmbedding.forward", "num_heads_q", not_a("int", TypeError, value="four"))


# ---------------------------------------------------------------------------------------------
# ops.triton: layer_norm, cross_entropy, linear, mlp, k_activations; losses


def _norm_args(ref=False):
    a = dict(x=t(4, 32, dtype=F32), weight=t(32, dtype=F32, seed=1), bias=t(32, dtype=F32, seed=2),
             residual=t(4, 32, dtype=F32, seed=3), x1=t(4, 32, dtype=F32, seed=4), weight1=t(32, dtype=F32, seed=5),
             bias1=t(32, dtype=F32, seed=6), eps=1e-6, dropout_p=0.0, rowscale=None, prenorm=False)
    if ref:
        return dict(a, zero_centered_weight=False, dropout_mask=None, dropout_mask1=None, upcast=False)
    return dict(a, residual_in_fp32=False, zero_centered_weight=False, is_rms_norm=False, return_dropout_mask=False,
                out_dtype=None, out=None, residual_out=None)


def _rms_args():
    a = _norm_args()
    del a["is_rms_norm"]
    return a


def _norm_linear_args():
    return dict(x=t(4, 32, dtype=F32), norm_weight=t(32, dtype=F32, seed=1), norm_bias=t(32, dtype=F32, seed=2),
                linear_weight=t(8, 32, dtype=F32, seed=3), linear_bias=t(8, dtype=F32, seed=4),
                residual=t(4, 32, dtype=F32, seed=5), eps=1e-6, prenorm=False, residual_in_fp32=False,
                is_rms_norm=False)


def _loss_args():
    return dict(logits=t(4, 10, dtype=F32), labels=torch.tensor([1, 2, 3, -100], device=dev()), precomputed_lse=None,
                label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0, ignore_index=-100, inplace_backward=False,
                process_group=None)


def _mlp_args():
    return dict(x=t(4, 16, dtype=F32), weight1=t(32, 16, dtype=F32, seed=1), bias1=t(32, dtype=F32, seed=2),
                weight2=t(16, 32, dtype=F32, seed=3), bias2=t(16, dtype=F32, seed=4), checkpoint_lvl=0)


CONTROLS.update({
    "layer_norm_fn": Control(layer_norm.layer_norm_fn, _norm_args),
    "rms_norm_fn": Control(layer_norm.rms_norm_fn, _rms_args),
    "LayerNormFn": Control(layer_norm.LayerNormFn.apply, _norm_args, positional=True),
    "layer_norm_ref": Control(layer_norm.layer_norm_ref, lambda: _norm_args(ref=True)),
    "rms_norm_ref": Control(layer_norm.rms_norm_ref, lambda: _norm_args(ref=True)),
    "RMSNorm.__init__": Control(layer_norm.RMSNorm, lambda: dict(hidden_size=32, eps=1e-5, dropout_p=0.0,
                                                                 zero_centered_weight=False, device=None, dtype=None)),
    "RMSNorm.forward": Control(layer_norm.RMSNorm.forward, lambda: dict(
        x=t(4, 32, dtype=F32), residual=t(4, 32, dtype=F32, seed=1), prenorm=False, residual_in_fp32=False),
        make=lambda: layer_norm.RMSNorm(32, device=dev())),
    "LayerNormLinearFn": Control(layer_norm.LayerNormLinearFn.apply, _norm_linear_args, positional=True),
    "layer_norm_linear_fn": Control(layer_norm.layer_norm_linear_fn, _norm_linear_args),
    "cross_entropy_loss": Control(ops_cross_entropy.cross_entropy_loss, _loss_args),
    "CrossEntropyLoss.__init__": Control(losses_cross_entropy.CrossEntropyLoss, lambda: dict(
        ignore_index=-100, reduction="mean", label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
        inplace_backward=False, process_group=None, return_z_loss=False)),
    "CrossEntropyLoss.forward": Control(losses_cross_entropy.CrossEntropyLoss.forward, lambda: dict(
        input=t(4, 10, dtype=F32), target=torch.tensor([1, 2, 3, -100], device=dev()), precomputed_lse=None),
        make=losses_cross_entropy.CrossEntropyLoss),
    "triton_linear_act": Control(linear.triton_linear_act, lambda: dict(
        x=t(4, 16, dtype=F32), weight=t(8, 16, dtype=F32, seed=1), bias=t(8, dtype=F32, seed=2), activation="gelu",
        save_act_input=False)),
    "triton_dgrad_act": Control(linear.triton_dgrad_act, lambda: dict(
        grad_output=t(4, 8, dtype=F32), weight=t(8, 16, dtype=F32, seed=1), activation="gelu",
        act_input=t(4, 16, dtype=F32, seed=2))),
    "FusedDenseSqreluDenseFunc": Control(mlp.FusedDenseSqreluDenseFunc.apply, _mlp_args, positional=True),
    "fused_dense_sqrelu_dense_function": Control(mlp.fused_dense_sqrelu_dense_function, _mlp_args, positional=True),
    "FusedDenseSqreluDense.__init__": Control(mlp.FusedDenseSqreluDense, lambda: dict(
        in_features=16, hidden_features=32, out_features=None, bias1=True, bias2=True, checkpoint_lvl=0, device=None,
        dtype=None)),
    "FusedDenseSqreluDense.forward": Control(mlp.FusedDenseSqreluDense.forward, lambda: dict(x=t(4, 16, dtype=F32)),
                                             make=lambda: mlp.FusedDenseSqreluDense(16, 32, device=dev())),
    "Activation": Control(k_activations.Activation, lambda: dict(value="gelu")),
    "get_triton_activation_kernel": Control(k_activations.get_triton_activation_kernel,
                                            lambda: dict(activation="gelu")),
    "get_triton_activation_bwd_kernel": Control(k_activations.get_triton_activation_bwd_kernel,
                                                lambda: dict(activation="gelu")),
})


def float_tensor_rows(function, parameter, error_type=TypeError, shape_words=("shape",)):
    rows(function, parameter, not_a("floating-point tensor", error_type, value="t"),
         as_dtype(parameter, torch.int32, error_type, "floating-point"),
         with_rank(parameter, lambda x: x[..., :3], ValueError, *shape_words), on_meta(parameter))


def flag_rows(function, *parameters):
    for parameter in parameters:
        rows(function, parameter, not_a("bool", TypeError, value="yes"))


for name, ref in (("layer_norm_fn", False), ("rms_norm_fn", False), ("LayerNormFn", False), ("layer_norm_ref", True),
                  ("rms_norm_ref", True)):
    rows(name, "x", not_a("floating-point tensor", TypeError, value="t"),
         as_dtype("x", torch.int32, TypeError, "floating-point"),
         with_rank("x", lambda x: x[..., :0], ValueError, "non-empty"))
    for p in ("weight", "bias", "residual", "x1", "weight1", "bias1"):
        float_tensor_rows(name, p)
    rows(name, "eps", not_a("float", ValueError, value="tiny"), value(-1.0, ValueError, "non-negative"))
    rows(name, "dropout_p", not_a("float", ValueError, value="some"), value(1.5, ValueError, "[0, 1)"))
    rows(name, "rowscale", not_a("floating-point tensor", TypeError, value="t"),
         ("shape", bad("(3,)", lambda a: torch.ones(3, device=dev())), ValueError, "shape"),
         ("device", bad("meta", lambda a: torch.ones(4, device="meta")), ValueError, "meta"))
    flag_rows(name, "prenorm", "zero_centered_weight")
    if ref:
        for p in ("dropout_mask", "dropout_mask1"):
            rows(name, p, not_a("bool tensor", TypeError, value="mask"),
                 ("value", bad("float", lambda a: torch.ones(4, 32, device=dev())), TypeError, "bool"),
                 ("shape", bad("(3,)", lambda a: torch.ones(3, dtype=torch.bool, device=dev())), ValueError, "shape"),
                 ("device", bad("meta", lambda a: torch.ones(4, 32, dtype=torch.bool, device="meta")), ValueError,
                  "meta"))
        flag_rows(name, "upcast")
    else:
        flag_rows(name, "residual_in_fp32", "return_dropout_mask")
        if name != "rms_norm_fn":
            flag_rows(name, "is_rms_norm")
        rows(name, "out_dtype", not_a("dtype", TypeError, value="fp16"), value(torch.int32, ValueError, "floating"))
        for p in ("out", "residual_out"):
            rows(name, p, not_a("floating-point tensor", TypeError, value="t"),
                 ("shape", bad("(3,)", lambda a: torch.ones(3, device=dev())), ValueError, "shape"),
                 ("device", bad("meta", lambda a: torch.ones(4, 32, device="meta")), ValueError, "meta"))
rows("RMSNorm.__init__", "hidden_size", not_a("int", TypeError, value="wide"), value(0, ValueError, ">= 1"))
rows("RMSNorm.__init__", "eps", not_a("float", ValueError, value="tiny"), value(-1.0, ValueError, "non-negative"))
rows("RMSNorm.__init__", "dropout_p", not_a("float", ValueError, value="some"), value(1.5, ValueError, "[0, 1)"))
flag_rows("RMSNorm.__init__", "zero_centered_weight")
rows("RMSNorm.__init__", "device", not_a("device", RuntimeError, value="nowhere"))
rows("RMSNorm.__init__", "dtype", not_a("dtype", TypeError, value="fp32"), value(torch.int32, ValueError, "floating"))
rows("RMSNorm.forward", "x", not_a("floating-point tensor", TypeError, value="t"),
     with_rank("x", lambda x: x[..., :3], ValueError, "shape"))
float_tensor_rows("RMSNorm.forward", "residual")
flag_rows("RMSNorm.forward", "prenorm", "residual_in_fp32")
for name in ("LayerNormLinearFn", "layer_norm_linear_fn"):
    rows(name, "x", not_a("floating-point tensor", TypeError, value="t"),
         as_dtype("x", torch.int32, TypeError, "floating-point"))
    for p in ("norm_weight", "norm_bias", "residual"):
        float_tensor_rows(name, p)
    rows(name, "linear_weight", not_a("floating-point tensor", TypeError, value="t"),
         with_rank("linear_weight", lambda x: x[:, :3], ValueError, "shape"), on_meta("linear_weight"))
    rows(name, "linear_bias", not_a("tensor", TypeError, value="t"),
         with_rank("linear_bias", lambda x: x[:3], ValueError, "shape"), on_meta("linear_bias"))
    rows(name, "eps", not_a("float", ValueError, value="tiny"), value(-1.0, ValueError, "non-negative"))
    flag_rows(name, "prenorm", "residual_in_fp32", "is_rms_norm")

CE = "ops.triton.cross_entropy.CrossEntropyLoss"  # the autograd class behind cross_entropy_loss
CONTROLS[CE] = Control(ops_cross_entropy.CrossEntropyLoss.apply, _in_forward_order(
    ops_cross_entropy.CrossEntropyLoss, lambda: _loss_args() | {"smoothing": 0.0}), positional=True)
for L, smoothing in (("cross_entropy_loss", "label_smoothing"), (CE, "smoothing")):
    rows(L, "logits", not_a("floating-point tensor", ValueError, value="t"),
         as_dtype("logits", torch.int32, ValueError, "floating-point"), with_rank("logits", lambda x: x[0], ValueError, "shape"))
    rows(L, "labels", not_a("integer tensor", ValueError, value=[1]), as_dtype("labels", F32, ValueError, "integer"),
         with_rank("labels", lambda x: x[:2], ValueError, "shape"), on_meta("labels"),
         value(bad("out of range", lambda a: torch.tensor([1, 2, 3, 10], device=dev())), ValueError, "vocab"))
    rows(L, "precomputed_lse", not_a("tensor", ValueError, value="lse"),
         ("value", bad("int64", lambda a: torch.zeros(4, dtype=torch.int64, device=dev())), TypeError, "floating"),
         ("shape", bad("(3,)", lambda a: torch.zeros(3, device=dev())), ValueError, "shape"),
         ("device", bad("meta", lambda a: torch.zeros(4, device="meta")), ValueError, "meta"))
    for p, bad_value in ((smoothing, 1.5), ("logit_scale", 0.0), ("lse_square_scale", -1.0)):
        rows(L, p, not_a("float", TypeError, value="some"), value(bad_value, ValueError), value(NAN, ValueError))
    rows(L, "ignore_index", not_a("int", ValueError, value="none"))
    flag_rows(L, "inplace_backward")
    rows(L, "process_group", not_a("ProcessGroup", TypeError, value="world"))
C = "CrossEntropyLoss.__init__"
rows(C, "ignore_index", not_a("int", ValueError, value="none"))
rows(C, "reduction", not_a("reduction", NotImplementedError, value=3), value("max", NotImplementedError))
for p, bad_value in (("label_smoothing", 1.5), ("logit_scale", 0.0), ("lse_square_scale", -1.0)):
    rows(C, p, not_a("float", TypeError, value="some"), value(bad_value, ValueError))
flag_rows(C, "inplace_backward", "return_z_loss")
rows(C, "process_group", not_a("ProcessGroup", TypeError, value="world"))
rows("CrossEntropyLoss.forward", "input", not_a("floating-point tensor", ValueError, value="t"),
     with_rank("input", lambda x: x[0], ValueError, "shape"))
rows("CrossEntropyLoss.forward", "target", not_a("integer tensor", ValueError, value=[1]),
     with_rank("target", lambda x: x[:2], ValueError, "shape"), on_meta("target"))
rows("CrossEntropyLoss.forward", "precomputed_lse", not_a("tensor", ValueError, value="lse"),
     ("shape", bad("(3,)", lambda a: torch.zeros(3, device=dev())), ValueError, "shape"))

for name, x_name in (("triton_linear_act", "x"), ("triton_dgrad_act", "grad_output")):
    rows(name, x_name, not_a("tensor", AssertionError, value="t"),
         as_dtype(x_name, torch.float64, AssertionError, "dtype"),
         with_rank(x_name, lambda x: x[:, :3], AssertionError, "dimensions"), on_meta(x_name, AssertionError))
    rows(name, "weight", not_a("tensor", AssertionError, value="w"),
         with_rank("weight", lambda x: x[0], AssertionError, "2-D"), on_meta("weight", AssertionError))
    rows(name, "activation", not_a("activation", AssertionError, value=3), value("swish", AssertionError, "one of"))
rows("triton_linear_act", "bias", not_a("tensor", AssertionError, value="b"),
     with_rank("bias", lambda x: x[:3], AssertionError, "dimensions"), on_meta("bias", AssertionError))
rows("triton_linear_act", "save_act_input", not_a("bool", AssertionError, value="yes"))
rows("triton_dgrad_act", "act_input", not_a("tensor", AssertionError, value="a"), value(None, AssertionError, "required"),
     with_rank("act_input", lambda x: x[:, :3], AssertionError, "shape"), on_meta("act_input", AssertionError))
for name in ("FusedDenseSqreluDenseFunc", "fused_dense_sqrelu_dense_function"):
    rows(name, "x", not_a("tensor", AssertionError, value="t"), with_rank("x", lambda x: x[:, :3], AssertionError,
                                                                            "dimensions"))
    for p in ("weight1", "weight2"):
        rows(name, p, not_a("tensor", AssertionError, value="w"), with_rank(p, lambda x: x[0], AssertionError, "2-D"),
             on_meta(p, AssertionError))
    for p in ("bias1", "bias2"):
        rows(name, p, not_a("tensor", AssertionError, value="b"), with_rank(p, lambda x: x[:3], AssertionError,
                                                                            "dimensions"), on_meta(p, AssertionError))
    rows(name, "checkpoint_lvl", not_a("checkpoint_lvl", AssertionError, value="none"), value(3, AssertionError, "one of"))
F = "FusedDenseSqreluDense.__init__"
for p in ("in_features", "hidden_features", "out_features"):
    rows(F, p, not_a("int", TypeError, value="wide"), value(-1, ValueError, ">= 1"))
for p in ("bias1", "bias2"):
    rows(F, p, not_a("bool", TypeError, value="yes"), value(False, AssertionError, "bias"))
rows(F, "checkpoint_lvl", not_a("checkpoint_lvl", AssertionError, value="none"), value(3, AssertionError, "one of"))
rows(F, "device", not_a("device", RuntimeError, value="nowhere"))
rows(F, "dtype", not_a("dtype", TypeError, value="fp32"))
rows("FusedDenseSqreluDense.forward", "x", not_a("tensor", AssertionError, value="t"),
     with_rank("x", lambda x: x[:, :3], AssertionError, "dimensions"), on_meta("x", AssertionError))
rows("Activation", "value", not_a("Activation", ValueError, value=3), value("swish", ValueError, "Activation"))
for name in ("get_triton_activation_kernel", "get_triton_activation_bwd_kernel"):
    rows(name, "activation", not_a("Activation", ValueError, value=3), value("swish", ValueError, "Activation"))


# ---------------------------------------------------------------------------------------------
# modules.mha


def _single_rank_group():
    """A torch.distributed group of this one process (ParallelMHA needs one), made once."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this PyTorch build")
    if not dist.is_initialized():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.group.WORLD


def _mha_init(**extra):
    return dict(embed_dim=32, num_heads=4, num_heads_kv=None, cross_attn=False, qkv_proj_bias=True,
                out_proj_bias=True, dropout=0.0, softmax_scale=None, causal=False, layer_idx=None, dwconv=False,
                rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_scale_base=None, rotary_emb_interleaved=False,
                use_alibi=False, window_size=(-1, -1), fused_bias_fc=False, use_flash_attn=False, return_residual=False,
                checkpointing=False, device=None, dtype=None, **extra)


def _parallel_mha_init():
    a = _mha_init(process_group=_single_rank_group(), sequence_parallel=False)
    for p in ("cross_attn", "dwconv", "fused_bias_fc", "return_residual"):
        del a[p]
    return a


def _attention_module_init(flash: bool):
    a = dict(causal=False, softmax_scale=None, attention_dropout=0.0)
    return dict(a, window_size=(-1, -1), alibi_slopes=None, deterministic=False) if flash else a


CONTROLS.update({
    "get_alibi_slopes": Control(mha.get_alibi_slopes, lambda: dict(nheads=4)),
    "MHA.__init__": Control(mha.MHA, _mha_init),
    "MHA.forward": Control(mha.MHA.forward, lambda: dict(
        x=t(2, 5, 32, dtype=F32), x_kv=None, key_padding_mask=torch.ones(2, 5, dtype=torch.bool, device=dev()),
        cu_seqlens=None, max_seqlen=None, mixer_subset=None, inference_params=None),
        make=lambda: mha.MHA(32, 4, device=dev())),
    "ParallelMHA.__init__": Control(mha.ParallelMHA, _parallel_mha_init),
    "ParallelMHA.forward": Control(mha.ParallelMHA.forward, lambda: dict(
        x=t(2, 5, 32, dtype=F32), seqlen=None, inference_params=None),
        make=lambda: mha.ParallelMHA(32, 4, _single_rank_group(), sequence_parallel=False, device=dev())),
    "FlashSelfAttention.__init__": Control(mha.FlashSelfAttention, lambda: _attention_module_init(True)),
    "FlashSelfAttention.forward": Control(mha.FlashSelfAttention.forward, lambda: dict(
        qkv=t(7, 3, 4, 32), causal=None, cu_seqlens=i32(0, 3, 7), max_seqlen=4), make=mha.FlashSelfAttention),
    "FlashCrossAttention.__init__": Control(mha.FlashCrossAttention, lambda: _attention_module_init(True)),
    "FlashCrossAttention.forward": Control(mha.FlashCrossAttention.forward, lambda: dict(
        q=t(7, 4, 32), kv=t(7, 2, 2, 32, seed=1), causal=None, cu_seqlens=i32(0, 3, 7), max_seqlen=4,
        cu_seqlens_k=i32(0, 5, 7), max_seqlen_k=5), make=mha.FlashCrossAttention),
    "SelfAttention.__init__": Control(mha.SelfAttention, lambda: _attention_module_init(False)),
    "SelfAttention.forward": Control(mha.SelfAttention.forward, lambda: dict(
        qkv=t(2, 5, 3, 4, 32, dtype=F32), causal=None, key_padding_mask=torch.ones(2, 5, dtype=torch.bool,
                                                                                 device=dev())),
        make=mha.SelfAttention),
    "CrossAttention.__init__": Control(mha.CrossAttention, lambda: _attention_module_init(False)),
    "CrossAttention.forward": Control(mha.CrossAttention.forward, lambda: dict(
        q=t(2, 5, 4, 32, dtype=F32), kv=t(2, 7, 2, 2, 32, dtype=F32, seed=1), causal=None,
        key_padding_mask=torch.ones(2, 7, dtype=torch.bool, device=dev())), make=mha.CrossAttention),
    "LinearResidual.__init__": Control(mha.LinearResidual, lambda: dict(in_features=8, out_features=4, bias=True,
                                                                         device=None, dtype=None)),
    "LinearResidual.forward": Control(mha.LinearResidual.forward, lambda: dict(input=t(3, 8, dtype=F32)),
                                      make=lambda: mha.LinearResidual(8, 4, device=dev())),
})

rows("get_alibi_slopes", "nheads", not_a("int", TypeError, value="four"), value(0, ValueError, ">= 1"))


def module_options(function, flash: bool):
    rows(function, "causal", not_a("bool", TypeError, value="yes"))
    rows(function, "softmax_scale", not_a("float", TypeError, value="x"), value(NAN, ValueError, "finite"))
    rows(function, "attention_dropout", not_a("float", TypeError, value="some"), value(1.5, ValueError, "[0, 1)"))
    if flash:
        rows(function, "window_size", not_a("pair", TypeError, value=4), value((-2, 0), ValueError, "-1"))
        rows(function, "alibi_slopes", not_a("tensor", TypeError, value="slopes"),
             ("shape", bad("2-D", lambda a: torch.ones(2, 2, device=dev())), ValueError, "shape"))
        rows(function, "deterministic", not_a("bool", TypeError, value="yes"))


for name, flash in (("FlashSelfAttention", True), ("FlashCrossAttention", True), ("SelfAttention", False),
                    ("CrossAttention", False)):
    module_options(f"{name}.__init__", flash)
    rows(f"{name}.forward", "causal", not_a("bool", TypeError, value="yes"))


def varlen_module_rows(function, cu, max_name):
    rows(function, cu, not_a("int32", TypeError, value=[0, 3]), as_dtype(cu, torch.int64, ValueError, "int32"))
    rows(function, max_name, not_a("int", ValueError, value="four"))


rows("FlashSelfAttention.forward", "qkv", not_a("torch.Tensor", TypeError, value="x"),
     with_rank("qkv", lambda x: x[None], ValueError, "qkv"))
varlen_module_rows("FlashSelfAttention.forward", "cu_seqlens", "max_seqlen")
rows("FlashSelfAttention.forward", "max_seqlen", value(None, ValueError, "int"))
rows("FlashCrossAttention.forward", "q", not_a("torch.Tensor", TypeError, value="x"),
     with_rank("q", lambda x: x[None], ValueError, "dims"))
rows("FlashCrossAttention.forward", "kv", not_a("torch.Tensor", TypeError, value="x"),
     with_rank("kv", lambda x: x[None], ValueError, "kv"), on_meta("kv"))
for cu, max_name in (("cu_seqlens", "max_seqlen"), ("cu_seqlens_k", "max_seqlen_k")):
    varlen_module_rows("FlashCrossAttention.forward", cu, max_name)
rows("FlashCrossAttention.forward", "cu_seqlens_k", value(None, ValueError, "required"))
for name, p, layout in (("SelfAttention.forward", "qkv", "(batch, seqlen, 3, nheads, headdim)"),
                        ("CrossAttention.forward", "q", "(batch, seqlen_q, nheads, headdim)"),
                        ("CrossAttention.forward", "kv", "(batch, seqlen_k, 2, nheads_k, headdim)")):
    rows(name, p, not_a("tensor", TypeError, value="x"), as_dtype(p, torch.int32, TypeError, "floating"),
         with_rank(p, lambda x: x[0], ValueError, layout))
rows("CrossAttention.forward", "kv", on_meta("kv"))
for name in ("SelfAttention.forward", "CrossAttention.forward"):
    rows(name, "key_padding_mask", not_a("bool tensor", TypeError, value="mask"),
         as_dtype("key_padding_mask", F32, TypeError, "bool"),
         with_rank("key_padding_mask", lambda x: x[:, :3], ValueError, "(batch, seqlen"), on_meta("key_padding_mask"))
rows("LinearResidual.__init__", "in_features", not_a("int", TypeError, value="eight"), value(-1, ValueError, ">= 0"))
rows("LinearResidual.__init__", "out_features", not_a("int", TypeError, value="four"), value(-1, ValueError, ">= 0"))
rows("LinearResidual.__init__", "bias", not_a("bool", TypeError, value="yes"))
rows("LinearResidual.__init__", "device", not_a("device", RuntimeError, value="nowhere"))
rows("LinearResidual.__init__", "dtype", not_a("dtype", TypeError, value="fp32"))
rows("LinearResidual.forward", "input", not_a("Tensor", TypeError, value="x"),
     with_rank("input", lambda x: x[:, :3], ValueError, "in_features"))


def mha_options(function, parallel=False):
    int_rows = (("embed_dim", 1), ("num_heads", 1), ("num_heads_kv", 1), ("rotary_emb_dim", 0), ("layer_idx", 0))
    for p, least in int_rows:
        rows(function, p, not_a("int", TypeError, value="x"), value(-1, ValueError, f">= {least}"))
    rows(function, "num_heads", value(0, ValueError, ">= 1"), value(5, ValueError, "divisible"))
    rows(function, "num_heads_kv", value(3, ValueError, "divisible"))
    rows(function, "rotary_emb_dim", value(5, ValueError, "even"))
    flags = ["qkv_proj_bias", "out_proj_bias", "causal", "rotary_emb_interleaved", "use_alibi", "use_flash_attn",
             "checkpointing"]
    flags += ["sequence_parallel"] if parallel else ["cross_attn", "dwconv", "fused_bias_fc", "return_residual"]
    for p in flags:
        rows(function, p, not_a("bool", TypeError, value="yes"))
    rows(function, "dropout", not_a("float", TypeError, value="some"), value(1.5, ValueError, "[0, 1)"))
    rows(function, "softmax_scale", not_a("float", TypeError, value="x"), value(NAN, ValueError, "finite"))
    rows(function, "rotary_emb_base", not_a("float", TypeError, value="ten"), value(-1.0, ValueError, "> 0"))
    rows(function, "rotary_emb_scale_base", not_a("float", TypeError, value="big"), value(0.0, ValueError, "> 0"))
    rows(function, "window_size", not_a("pair", TypeError, value=4), value((-2, 0), ValueError, "-1"),
         value((4, 0), ValueError, "use_flash_attn"))
    rows(function, "device", not_a("device", RuntimeError, value="nowhere"))
    rows(function, "dtype", not_a("dtype", TypeError, value="fp32"), value(torch.int32, ValueError, "floating"))
    if parallel:
        rows(function, "process_group", not_a("ProcessGroup", TypeError, value="world"))


mha_options("MHA.__init__")
mha_options("ParallelMHA.__init__", parallel=True)
M = "MHA.forward"
rows(M, "x", not_a("floating-point tensor", TypeError, value="x"), as_dtype("x", torch.int32, TypeError, "floating"),
     with_rank("x", lambda x: x[0], ValueError, "(batch, seqlen, embed_dim)"),
     ("value", bad("wrong width", lambda a: t(2, 5, 31, dtype=F32)), ValueError, "embed_dim"))
rows(M, "x_kv", not_a("cross_attn", ValueError, value="x"),
     ("value", bad("a tensor", lambda a: a["x"]), ValueError, "cross_attn"))
rows(M, "key_padding_mask", not_a("bool tensor", TypeError, value="mask"),
     as_dtype("key_padding_mask", F32, TypeError, "bool"),
     with_rank("key_padding_mask", lambda x: x[:, :3], ValueError, "(batch, seqlen)"), on_meta("key_padding_mask"))
rows(M, "cu_seqlens", not_a("max_seqlen", ValueError, value=[0, 5]),
     ("value", bad("without flash", lambda a: i32(0, 5, 10)), ValueError, "max_seqlen"))
rows(M, "max_seqlen", not_a("cu_seqlens", ValueError, value="five"), value(5, ValueError, "cu_seqlens"))
rows(M, "mixer_subset", not_a("cross_attn", ValueError, value="first"))
rows(M, "inference_params", not_a("InferenceParams", TypeError, value="params"))
P = "ParallelMHA.forward"
rows(P, "x", not_a("floating-point tensor", TypeError, value="x"), as_dtype("x", torch.int32, TypeError, "floating"),
     with_rank("x", lambda x: x[0], ValueError, "embed_dim"),
     ("value", bad("wrong width", lambda a: t(2, 5, 31, dtype=F32)), ValueError, "embed_dim"))
rows(P, "seqlen", not_a("int", TypeError, value="five"), value(0, ValueError, ">= 1"), value(3, ValueError, "divide"))
rows(P, "inference_params", not_a("InferenceParams", TypeError, value="params"))


# ---------------------------------------------------------------------------------------------
# FlashAttention-3's interface (fa3_interface/, its own distribution: loaded from its file), ids
# ``fa3.NAME``; upstream's autograd classes (flash_attn.autograd_functions), called by ``.apply``


def _fa3():
    from support.fa3 import fa3_interface  # noqa: PLC0415

    return fa3_interface()


FA3 = _fa3()


def _combine():
    return dict(out_partial=t(3, 2, 5, 4, 32, dtype=F32), lse_partial=t(3, 2, 5, 4, dtype=F32, seed=1))


def _scheduler():
    return dict(batch_size=2, max_seqlen_q=1, max_seqlen_k=16, num_heads_q=4, num_heads_kv=2, headdim=32,
                cache_seqlens=i32(3, 5))


CONTROLS.update({
    "fa3.flash_attn_func": Control(FA3.flash_attn_func, _attn),
    "fa3.flash_attn_qkvpacked_func": Control(FA3.flash_attn_qkvpacked_func, _packed_dense),
    "fa3.flash_attn_varlen_func": Control(FA3.flash_attn_varlen_func, _varlen),
    "fa3.flash_attn_with_kvcache": Control(FA3.flash_attn_with_kvcache, _kvcache),
    "fa3.flash_attn_combine": Control(FA3.flash_attn_combine, _combine),
    "fa3.get_scheduler_metadata": Control(FA3.get_scheduler_metadata, _scheduler),
})


def fa3_options(function: str, cache: bool = False) -> None:
    """FA3's options shared by its attention calls (``num_splits``/``pack_gqa`` where the call has them)."""
    rows(function, "softmax_scale", not_a("float"), value(NAN, ValueError, "finite"), value(True, TypeError))
    rows(function, "causal", not_a("bool", value="yes"))
    rows(function, "window_size", not_a("pair", value=4), value(("a", 0), TypeError, "int"),
         value((1, 2, 3), ValueError, "pair"), value((-2, 0), ValueError, "-1"))
    rows(function, "softcap", not_a("float"), value(NAN, ValueError, ">= 0"), value(-1.0, ValueError, ">= 0"))
    for p in ("q_descale", "k_descale", "v_descale"):  # FP8 is not built: any value is refused by name
        rows(function, p, ("type", "x", NotImplementedError, "not supported"),
             value(bad("a scale", lambda a: torch.ones(2, 2, device=dev())), NotImplementedError, "FP8"))
    rows(function, "attention_chunk", ("type", "x", NotImplementedError, "not supported"),
         value(4, NotImplementedError, "chunk"))
    rows(function, "sm_margin", not_a("int", value="x"), value(-1, ValueError, ">= 0"), value(True, TypeError, "int"))
    rows(function, "s_aux", not_a("floating-point", value="sinks"),
         ("value", bad("int32", lambda a: torch.zeros(4, dtype=torch.int32, device=dev())), TypeError, "floating"),
         ("shape", bad("(3,)", lambda a: torch.zeros(3, device=dev())), ValueError, "shape"),
         ("device", bad("meta", lambda a: torch.zeros(4, device="meta")), ValueError, "meta"))
    if function != "fa3.flash_attn_qkvpacked_func":
        rows(function, "num_splits", not_a("int", value="two"), value(-1, ValueError, ">= 0"))
        rows(function, "pack_gqa", not_a("bool", value="yes"), value(1, TypeError, "bool"))
    if not cache:
        rows(function, "deterministic", not_a("bool", value="yes"))
        rows(function, "return_attn_probs", not_a("bool", value="yes"))


for name in ("fa3.flash_attn_func", "fa3.flash_attn_qkvpacked_func", "fa3.flash_attn_varlen_func",
             "fa3.flash_attn_with_kvcache"):
    fa3_options(name, cache=name.endswith("kvcache"))
for name in ("fa3.flash_attn_func", "fa3.flash_attn_varlen_func"):
    for p in ("q", "k", "v"):
        attention_tensor(name, p)
attention_tensor("fa3.flash_attn_qkvpacked_func", "qkv", device=False)
rows("fa3.flash_attn_qkvpacked_func", "num_heads_q", not_a("int", value="four"), value(0, ValueError, ">= 1"),
     value(3, ValueError, "num_heads_q"))
FV = "fa3.flash_attn_varlen_func"
cu_seqlens(FV, "cu_seqlens_q")
cu_seqlens(FV, "cu_seqlens_k")
max_seqlen(FV, "max_seqlen_q")
max_seqlen(FV, "max_seqlen_k")
for p in ("seqused_q", "seqused_k"):
    rows(FV, p, not_a("int32", value=[3, 2]), value(bad("int64", lambda a: torch.ones(2, dtype=torch.int64)), TypeError,
                                                    "int32"),
         ("shape", bad("(3,)", lambda a: i32(1, 1, 1)), TypeError, "shape"),
         ("device", bad("meta", lambda a: torch.zeros(2, dtype=torch.int32, device="meta")), ValueError, "meta"),
         value(bad("past the length", lambda a: i32(9, 1)), ValueError, "between"))
FK = "fa3.flash_attn_with_kvcache"
attention_tensor(FK, "q", device=False)
for p in ("k_cache", "v_cache", "k", "v"):
    attention_tensor(FK, p)
rows(FK, "k", value(None, ValueError, "together"))
for p in ("rotary_cos", "rotary_sin"):
    rows(FK, p, not_a("shape", ValueError, value="table"), as_dtype(p, torch.int32, TypeError, "floating"),
         with_rank(p, lambda x: x[None], ValueError, "seqlen_ro"), on_meta(p))
for p in ("cache_seqlens", "cache_batch_idx", "cache_leftpad"):
    rows(FK, p, not_a("int32", value="lengths"), as_dtype(p, torch.int64, TypeError, "int32"),
         with_rank(p, lambda x: x[None], TypeError, "shape"), on_meta(p))
rows(FK, "cache_seqlens", value(bad("past the cache", lambda a: i32(3, 16)), ValueError, "cache"))
rows(FK, "page_table", not_a("int32", value=[[0]]),
     ("value", bad("fp32 table", lambda a: torch.zeros(2, 1, device=dev())), TypeError, "int32"),
     ("shape", bad("1-D", lambda a: i32(0, 1)), ValueError, "shape"))
rows(FK, "cu_seqlens_q", not_a("int32", value=[0, 1, 2]),
     value(bad("int64", lambda a: torch.tensor([0, 1, 2], device=dev())), TypeError, "int32"),
     ("shape", bad("2-D", lambda a: i32(0, 1, 2)[None]), ValueError, "batch_size + 1"),
     ("device", bad("meta", lambda a: torch.zeros(3, dtype=torch.int32, device="meta")), ValueError, "meta"))
rows(FK, "cu_seqlens_k_new", ("type", "x", NotImplementedError, "cu_seqlens_q"),
     value(bad("without cu_seqlens_q", lambda a: i32(0, 1, 2)), NotImplementedError, "cu_seqlens_q"))
rows(FK, "max_seqlen_q", not_a("int", value="four"), value(-1, ValueError, ">= 0"))
rows(FK, "rotary_seqlens", ("type", "x", NotImplementedError, "not supported"),
     value(bad("lengths", lambda a: i32(3, 5)), NotImplementedError, "cache_seqlens"))
rows(FK, "rotary_interleaved", not_a("bool", value="yes"))
rows(FK, "scheduler_metadata", not_a("tensor", value="plan"))
rows(FK, "return_softmax_lse", not_a("bool", value="yes"))
FC = "fa3.flash_attn_combine"
for p, rank in (("out_partial", 5), ("lse_partial", 4)):
    rows(FC, p, not_a("float32", value="parts"), as_dtype(p, F16, TypeError, "float32"),
         with_rank(p, lambda x: x[None], ValueError, f"{rank} dims"), on_meta(p))
rows(FC, "lse_partial", ("shape", bad("(3, 2, 5, 3)", lambda a: a["lse_partial"][..., :3]), ValueError, "shape"))
rows(FC, "out", not_a("tensor", value="out"),
     ("shape", bad("(3,)", lambda a: torch.zeros(3, device=dev())), ValueError, "shape"),
     ("device", bad("meta", lambda a: torch.zeros(2, 5, 4, 32, device="meta")), ValueError, "meta"))
rows(FC, "out_dtype", not_a("float32", value="fp16"), value(torch.int32, TypeError, "bfloat16"))
FS = "fa3.get_scheduler_metadata"
for p, least in (("batch_size", 1), ("max_seqlen_q", 0), ("max_seqlen_k", 0), ("num_heads_q", 1), ("num_heads_kv", 1),
                 ("headdim", 1), ("headdim_v", 1), ("page_size", 1), ("max_seqlen_k_new", 0), ("num_splits", 0),
                 ("sm_margin", 0)):
    rows(FS, p, not_a("int", value="x"), value(-1, ValueError, f">= {least}"))
rows(FS, "cache_seqlens", not_a("int32", value=[3, 5]))
rows(FS, "qkv_dtype", not_a("dtype", value="bf16"), value(torch.int32, TypeError, "floating"))
for p in ("cu_seqlens_q", "cu_seqlens_k_new", "cache_leftpad"):
    rows(FS, p, not_a("int32", value=[0, 1]), value(bad("int64", lambda a: torch.zeros(3, dtype=torch.int64)),
                                                    TypeError, "int32"))
rows(FS, "causal", not_a("bool", value="yes"))
rows(FS, "has_softcap", not_a("bool", value="yes"))
rows(FS, "window_size", not_a("pair", value=4), value((-2, 0), ValueError, "-1"))
rows(FS, "attention_chunk", ("type", "x", NotImplementedError, "not supported"), value(4, NotImplementedError, "chunk"))
rows(FS, "pack_gqa", not_a("bool", value="yes"))

# flash_attn.autograd_functions: upstream's positional .apply (is_grad_enabled last)
from flash_attn import autograd_functions  # noqa: E402


def _apply_options(**tensors):
    return dict(tensors, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None, deterministic=False, return_softmax=False)


def _apply_control(cls):
    """A positional control in the class's forward order (its parameters, from its signature)."""
    order = list(inspect.signature(cls.forward).parameters)[1:]
    varlen = "cu_seqlens_q" in order or "cu_seqlens" in order
    options = _apply_options(block_table=None, is_grad_enabled=False)

    def arguments():  # tensors made when a row runs, not at import (collection must not touch the device)
        pools = ({**_varlen(), **_kv_varlen(), **_packed_varlen()} if varlen
                 else {**_attn(), **_kv_dense(), **_packed_dense()})
        return {k: (pools | options)[k] for k in order}

    return Control(cls.apply, arguments, positional=True)


for cls_name in autograd_functions.__all__:
    CONTROLS[cls_name] = _apply_control(getattr(autograd_functions, cls_name))
    function, varlen = cls_name, "Varlen" in cls_name
    parameters = list(inspect.signature(getattr(autograd_functions, cls_name).forward).parameters)[1:]
    for p in ("q", "k", "v", "qkv", "kv"):
        if p in parameters:
            rows(function, p, not_a("torch.Tensor", value="x"), as_dtype(p, torch.int32, TypeError, "float16"),
                 with_rank(p, lambda x: x.unsqueeze(0), ValueError, "shape"))
    for p in ("k", "v"):
        if p in parameters:
            rows(function, p, on_meta(p))
    rows(function, "dropout_p", not_a("float"), value(1.5, ValueError, "[0, 1)"))
    rows(function, "softmax_scale", not_a("float"), value(NAN, ValueError, "finite"))
    rows(function, "window_size", not_a("pair", value=4), value((-2, 0), ValueError, "-1"))
    rows(function, "softcap", not_a("float"), value(NAN, ValueError, ">= 0"))
    rows(function, "alibi_slopes", schema("Tensor", value="slopes"),
         ("value", bad("fp16", lambda a: torch.ones(4, dtype=F16, device=dev())), TypeError, "float32"),
         ("shape", bad("(3,)", lambda a: torch.ones(3, device=dev())), ValueError, "shape"))
    for p in ("causal", "deterministic", "return_softmax", "is_grad_enabled"):
        rows(function, p, not_a("bool", value="yes"))
    for p in ("cu_seqlens_q", "cu_seqlens_k", "cu_seqlens"):
        if p in parameters:
            rows(function, p, schema("Tensor", value=[0, 3]), as_dtype(p, torch.int64, TypeError, "int32"),
                 on_meta(p), value(bad("decreasing", lambda a, p=p: a[p].flip(0)), ValueError))
    for p in ("max_seqlen_q", "max_seqlen_k", "max_seqlen"):
        if p in parameters:
            rows(function, p, schema("int", value="four"), value(-1, ValueError, "non-negative"))
    if "block_table" in parameters:
        rows(function, "block_table", schema("Tensor", value=[[0]]))


# ---------------------------------------------------------------------------------------------
# ops.layer_norm, ops.rms_norm: upstream's dropout_layer_norm API (ids ops.layer_norm.NAME,
# ops.rms_norm.NAME); controls and rows generated from the parameters' names


from flash_attn.ops import layer_norm as ops_layer_norm  # noqa: E402
from flash_attn.ops import rms_norm as ops_rms_norm  # noqa: E402

NORM_MODULES = {"ops.layer_norm.": ops_layer_norm, "ops.rms_norm.": ops_rms_norm}
NORM_INPUTS = ("x0", "x", "x1")
NORM_FEATURES = ("weight", "bias", "gamma", "beta", "weight0", "bias0", "weight1", "bias1", "gamma0", "beta0",
                 "gamma1", "beta1", "colscale", "layerscale")
NORM_FLAGS = ("prenorm", "residual_in_fp32", "is_rms_norm", "return_dmask", "return_dropout_mask")


def _norm_value(name: str, subset: bool, seed: int):
    """A valid value of an upstream norm argument, by its name (4 rows of 32 features; a subset
    call's x0 holds the 4 present rows of 6)."""
    if name in NORM_INPUTS:
        return t(4, 32, dtype=F32, seed=seed)
    if name == "residual":
        return t(6 if subset else 4, 32, dtype=F32, seed=seed)
    if name in NORM_FEATURES:
        return t(32, dtype=F32, seed=seed)
    fixed = {"rowscale": lambda: t(4, dtype=F32, seed=seed), "dropout_p": 0.0, "epsilon": 1e-5, "eps": 1e-5,
             "x0_subset": lambda: torch.tensor([[1, 2, 0], [3, 0, 4]], device=dev()),
             "out_subset": lambda: torch.tensor([[1, 0, 2], [0, 3, 0]], device=dev()), "rowscale_const": 1.0,
             "out_numrows": 3, "hidden_size": 32, "p": 0.0, "device": None, "dtype": None, "alignment_in_bytes": 16}
    if name in NORM_FLAGS:
        return False
    value = fixed[name]
    return value() if callable(value) else value


def _norm_control(fn, parameters, make=None, positional=False):
    subset = "x0_subset" in parameters
    return Control(fn, lambda: {p: _norm_value(p, subset, seed) for seed, p in enumerate(parameters)}, make=make,
                   positional=positional)


def _norm_rows(function: str, parameters) -> None:
    first = next((p for p in parameters if p in NORM_INPUTS), None)
    for p in parameters:
        if p in NORM_INPUTS:
            words = ("hidden_size",) if p == first else ("shape",)
            rows(function, p, not_a("floating-point tensor", TypeError, value="t"),
                 as_dtype(p, torch.int32, TypeError, "floating-point"),
                 with_rank(p, (lambda x: x[..., :0]) if p == first else (lambda x: x[:2]), ValueError, *words),
                 on_meta(p))
        elif p == "residual" or p in NORM_FEATURES or p == "rowscale":
            rows(function, p, not_a("floating-point tensor", TypeError, value="t"),
                 as_dtype(p, torch.int32, TypeError, "floating-point"),
                 with_rank(p, lambda x: x[:3], ValueError, "row" if p == "rowscale" else "shape"), on_meta(p))
        elif p in ("dropout_p", "p"):
            rows(function, p, not_a("float", TypeError, value="some"), value(1.5, ValueError, "[0, 1)"))
        elif p in ("epsilon", "eps"):
            rows(function, p, not_a("float", TypeError, value="tiny"), value(-1.0, ValueError, ">= 0"))
        elif p in NORM_FLAGS:
            rows(function, p, not_a("bool", TypeError, value="yes"))
        elif p in ("x0_subset", "out_subset"):
            rows(function, p, not_a("integer tensor", TypeError, value="rows"),
                 as_dtype(p, F32, TypeError, "integer"), with_rank(p, lambda x: x[:1], ValueError, "shape"),
                 on_meta(p))
        elif p == "rowscale_const":
            rows(function, p, not_a("float", TypeError, value="one"))
        elif p == "out_numrows":
            rows(function, p, not_a("int", TypeError, value="three"), value(-1, ValueError, ">= 0"))
        elif p == "hidden_size":
            rows(function, p, not_a("int", TypeError, value="wide"), value(0, ValueError, ">= 1"))
        elif p == "device":
            rows(function, p, not_a("device", RuntimeError, value="nowhere"))
        elif p == "dtype":
            rows(function, p, not_a("dtype", TypeError, value="fp32"), value(torch.int32, TypeError, "floating"))


for prefix, module in NORM_MODULES.items():
    for name in module.__all__:
        if name == "maybe_align":
            continue
        obj = getattr(module, name)
        if inspect.isclass(obj) and issubclass(obj, torch.nn.Module):
            init = [p for p in inspect.signature(obj).parameters]
            CONTROLS[f"{prefix}{name}.__init__"] = _norm_control(obj, init)
            _norm_rows(f"{prefix}{name}.__init__", init)
            forward = list(inspect.signature(obj.forward).parameters)[1:]
            CONTROLS[f"{prefix}{name}.forward"] = _norm_control(obj.forward, forward, make=lambda obj=obj: obj(32))
            _norm_rows(f"{prefix}{name}.forward", forward)
        else:
            apply = inspect.isclass(obj)
            parameters = list(inspect.signature(obj.apply if apply else obj).parameters)
            CONTROLS[prefix + name] = _norm_control(obj.apply if apply else obj, parameters, positional=apply)
            _norm_rows(prefix + name, parameters)
MA = "ops.layer_norm.maybe_align"
CONTROLS[MA] = Control(ops_layer_norm.maybe_align, lambda: dict(x=t(4, 32), alignment_in_bytes=16))
rows(MA, "x", not_a("torch.Tensor", TypeError, value="x"))
rows(MA, "alignment_in_bytes", not_a("int", TypeError, value="sixteen"), value(0, ValueError, ">= 1"))


# ---------------------------------------------------------------------------------------------
# ops.fused_dense: upstream's fused_dense_lib API on F.linear (ids ops.fused_dense.NAME); its
# ColumnParallelLinear / RowParallelLinear are modules.tensor_parallel's; rows by parameter name


from flash_attn.ops import fused_dense as ops_fused_dense  # noqa: E402

FD = "ops.fused_dense."


def _dense_value(name: str, init: bool, seed: int):
    """A valid value of a fused_dense argument, by its name (16 features in, 32 hidden, 8 out)."""
    tensors = {"x": (4, 16), "weight": (8, 16), "bias": (8,), "weight1": (32, 16), "bias1": (32,),
               "weight2": (16, 32), "bias2": (16,)}
    if name in tensors and not (init and name in ("bias", "bias1", "bias2")):
        return t(*tensors[name], dtype=F32, seed=seed)
    values = {"in_features": 16, "out_features": 8, "hidden_features": None, "activation": "gelu_approx",
              "checkpoint_lvl": 0, "heuristic": "auto" if init else 0, "multiple_of": 1, "device": None, "dtype": None,
              "process_group": _single_rank_group, "sequence_parallel": False}
    if name not in values:
        return True if name in ("bias", "bias1", "bias2", "save_pre_act") else False  # flags
    value = values[name]
    return value() if callable(value) else value


def _dense_needs_group(name: str) -> bool:
    return name.startswith(("ColumnParallelLinear", "RowParallelLinear", "ParallelFusedMLP"))


def _dense_control(function: str, fn, parameters, make=None, positional=False):
    init = function.endswith(".__init__")
    group = _dense_needs_group(function[len(FD):])

    def args():
        a = {p: _dense_value(p, init, seed) for seed, p in enumerate(parameters)}
        if "process_group" in a and not group:
            a["process_group"] = None  # the single-rank group is for the parallel layers
        return a

    return Control(fn, args, make=make, positional=positional)


def _dense_rows(function: str, parameters) -> None:
    init = function.endswith(".__init__")
    for p in parameters:
        if p == "x":
            rows(function, p, not_a("floating-point", TypeError, value="t"),
                 as_dtype(p, torch.int32, TypeError, "floating-point"),
                 with_rank(p, lambda x: x[:, :3], ValueError, "in_features"), on_meta(p))
        elif p in ("weight", "weight1", "weight2"):
            rows(function, p, not_a("floating-point", TypeError, value="w"),
                 with_rank(p, lambda x: x[0], ValueError, "out_features"), on_meta(p))
        elif p in ("bias", "bias1", "bias2") and not init:
            rows(function, p, not_a("tensor", TypeError, value="b"),
                 with_rank(p, lambda x: x[:3], ValueError, "out_features"), on_meta(p))
        elif p in ("bias", "bias1", "bias2", "return_residual", "sequence_parallel", "save_pre_act"):
            rows(function, p, not_a("bool", TypeError, value="yes"))
        elif p == "activation":
            rows(function, p, not_a("one of", ValueError, value=3), value("swish", ValueError, "one of"))
        elif p == "checkpoint_lvl":
            rows(function, p, not_a("0, 1 or 2", ValueError, value="none"), value(3, ValueError, "0, 1 or 2"))
        elif p == "heuristic":
            rows(function, p, not_a("int", TypeError, value="fast"), value(-2, ValueError, ">= -1"))
        elif p == "process_group":
            rows(function, p, not_a("ProcessGroup", TypeError, value="world"))
        elif p in ("in_features", "out_features", "hidden_features", "multiple_of"):
            rows(function, p, not_a("int", TypeError, value="wide"), value(0, ValueError, ">= 1"))
        elif p == "device":
            rows(function, p, not_a("device", RuntimeError, value="nowhere"))
        elif p == "dtype":
            rows(function, p, not_a("dtype", TypeError, value="fp32"))


def _dense_module(cls):
    a = {"process_group": _single_rank_group()} if _dense_needs_group(cls.__name__) else {}
    if cls.__name__ in ("ColumnParallelLinear", "RowParallelLinear", "FusedDense"):
        return cls(16, 8, device=dev(), **a)
    return cls(16, device=dev(), **a)


for name in ops_fused_dense.__all__:
    obj = getattr(ops_fused_dense, name)
    if inspect.isclass(obj) and issubclass(obj, torch.nn.Module):
        init = list(inspect.signature(obj).parameters)
        CONTROLS[f"{FD}{name}.__init__"] = _dense_control(f"{FD}{name}.__init__", obj, init)
        _dense_rows(f"{FD}{name}.__init__", init)
        forward = list(inspect.signature(obj.forward).parameters)[1:]
        CONTROLS[f"{FD}{name}.forward"] = _dense_control(f"{FD}{name}.forward", obj.forward, forward,
                                                         make=lambda obj=obj: _dense_module(obj))
        _dense_rows(f"{FD}{name}.forward", forward)
    else:
        apply = inspect.isclass(obj)
        parameters = list(inspect.signature(obj.apply if apply else obj).parameters)
        CONTROLS[FD + name] = _dense_control(FD + name, obj.apply if apply else obj, parameters, positional=apply)
        _dense_rows(FD + name, parameters)
rows(f"{FD}ParallelFusedMLP.__init__", "process_group", value(None, ValueError, "needs"))


# ---------------------------------------------------------------------------------------------
# The public functions and their parameters, from their modules.


def _apply_signature(fn) -> inspect.Signature:
    """An autograd Function's (or its ``.apply``'s) parameters: its forward's, after ``ctx``."""
    forward = fn.forward if inspect.isclass(fn) else fn.__self__.forward
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    return inspect.Signature(parameters)


def _parameters(obj) -> dict[str, list[str]]:
    """``callable id suffix -> parameter names`` of a public object: a function; a class's
    ``__init__`` and ``forward``; an autograd Function's forward (its ``.apply``)."""
    def names(sig):
        return [p.name for p in sig.parameters.values() if p.name not in ("self", "ctx")
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        return {"": ["value"]}  # Activation("gelu"): an enum takes its value
    if inspect.isclass(obj) and issubclass(obj, torch.autograd.Function):
        return {"": names(_apply_signature(obj))}
    if getattr(obj, "__self__", None) is not None and inspect.isclass(obj.__self__) \
            and issubclass(obj.__self__, torch.autograd.Function):
        return {"": names(_apply_signature(obj))}
    if inspect.isclass(obj) and "apply" in vars(obj) and not issubclass(obj, torch.nn.Module):
        return {"": names(inspect.signature(obj.apply))}  # upstream's Fn class spelled with a plain apply
    if inspect.isclass(obj):
        found = {".__init__": names(inspect.signature(obj.__init__))}  # inherited ones too (nn.Linear's)
        if "forward" in obj.__dict__:
            found[".forward"] = names(inspect.signature(obj.forward))
        return found
    init = getattr(obj, "_init_fn", None)  # a torch.library custom op: its Python function
    return {"": names(inspect.signature(init or obj))}


PUBLIC_MODULES = {
    "": flash_attn_interface, "flash_attn_gpu.": entry_points, "lowlevel": lowlevel,
}


# Upstream's autograd classes outside the modules' __all__, under their ids here.
PUBLIC_CLASSES = {
    "ApplyRotaryEmb": layers_rotary.ApplyRotaryEmb, "ApplyRotaryEmbQKV_": layers_rotary.ApplyRotaryEmbQKV_,
    "ApplyRotaryEmbKV_": layers_rotary.ApplyRotaryEmbKV_, CE: ops_cross_entropy.CrossEntropyLoss,
}


def public_functions() -> dict[str, list[str]]:
    """Every public callable id and its parameter names."""
    found: dict[str, list[str]] = {}
    for name in flash_attn_interface.__all__:
        found.update({name + k: v for k, v in _parameters(getattr(flash_attn_interface, name)).items()})
    for name in lowlevel.__all__:
        found.update({name + k: v for k, v in _parameters(getattr(lowlevel, name)).items()})
    for name in entry_points.__all__:
        found.update({f"flash_attn_gpu.{name}" + k: v for k, v in _parameters(getattr(entry_points, name)).items()})
    for name in FA3.__all__:  # FA3's names equal flash_attn's own: ids fa3.NAME
        found.update({f"fa3.{name}" + k: v for k, v in _parameters(getattr(FA3, name)).items()})
    for name in autograd_functions.__all__:
        found.update({name + k: v for k, v in _parameters(getattr(autograd_functions, name)).items()})
    for prefix, module in NORM_MODULES.items():
        for name in module.__all__:
            found.update({prefix + name + k: v for k, v in _parameters(getattr(module, name)).items()})
    for name in ops_fused_dense.__all__:
        found.update({FD + name + k: v for k, v in _parameters(getattr(ops_fused_dense, name)).items()})
    for name, cls in PUBLIC_CLASSES.items():
        found.update({name + k: v for k, v in _parameters(cls).items()})
    for module in (bert_padding, layers_rotary, ops_rotary, layer_norm, ops_cross_entropy, linear, mlp,
                   k_activations, losses_cross_entropy):
        for name in module.__all__:
            obj = getattr(module, name)
            if _is_kernel_helper(obj):
                continue  # a @triton.jit helper: called inside kernels only, never from Python
            found.update({name + k: v for k, v in _parameters(obj).items()})
    for name in (n for n in vars(mha) if not n.startswith("_")):  # modules.mha has no __all__: its own public names
        obj = getattr(mha, name)
        if getattr(obj, "__module__", None) == mha.__name__ and callable(obj):
            found.update({name + k: v for k, v in _parameters(obj).items()})
    return found


# Parameters another branch adds (issue 44: attention sinks and MLA's absorbed queries): rows for
# every public function whose signature has one, generated from the parameter's name. A function
# spelling one differently fails test_every_public_parameter_has_rows: add its name to the tuple.
SINK_PARAMETERS = ("learnable_sink",)
QV_PARAMETERS = ("qv",)


def _added_parameter_rows() -> None:
    heads = 4  # every attention control's q has 4 heads
    for function, parameters in public_functions().items():
        for p in set(parameters) & set(SINK_PARAMETERS):
            rows(function, p, not_a("float32", value="sinks"),
                 ("value", bad("fp16", lambda a: torch.zeros(heads, dtype=F16, device=dev())), TypeError, "float32"),
                 ("shape", bad("(3,)", lambda a: torch.zeros(heads - 1, device=dev())), ValueError, "shape"),
                 ("device", bad("meta", lambda a: torch.zeros(heads, device="meta")), ValueError, "meta"))
        for p in set(parameters) & set(QV_PARAMETERS):  # a valid qv is q-shaped here (v's head dim is q's)
            rows(function, p, not_a("torch.Tensor", value="x"),
                 ("value", bad("int32", lambda a: a["q"].to(torch.int32)), TypeError, "float16"),
                 ("shape", bad("another shape", lambda a: a["q"].unsqueeze(0)), ValueError, "dims"),
                 ("device", bad("meta", lambda a: a["q"].to("meta")), ValueError, "meta"))


def _is_kernel_helper(obj) -> bool:
    triton = pytest.importorskip("triton") if False else __import__("importlib").util.find_spec("triton")
    if triton is None:
        return False
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    return isinstance(obj, JITFunction)


@pytest.mark.parametrize("function", sorted(CONTROLS))
def test_control_runs(function):
    control = CONTROLS[function]
    _call(control, control.args())


def _call(control: Control, args: dict):
    if control.make is not None:
        return control.fn(control.make(), **args)
    if control.positional:
        return control.fn(*args.values())
    return control.fn(**args)


_added_parameter_rows()


@pytest.mark.parametrize("row", TABLE, ids=lambda r: r.id)
def test_bad_input_raises_a_clear_error(row, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_DEBUG", "1")  # value checks of device tensors too
    control = CONTROLS[row.function]
    args = control.args()
    # a parameter the control leaves at its default is added: the function must have it
    assert row.parameter in args or row.parameter in public_functions()[row.function], \
        f"{row.function} has no argument {row.parameter}"
    args[row.parameter] = row.bad(args) if callable(row.bad) and not isinstance(row.bad, (torch.Generator,)) else row.bad
    pattern = "".join(f"(?=.*{re.escape(w)})" for w in row.words)
    with pytest.raises(row.error, match=re.compile(pattern, re.IGNORECASE | re.DOTALL)):
        _call(control, args)


def test_every_public_parameter_has_rows():
    """Every public function has a control, and every parameter of it rows: a bad type, plus a
    bad shape or device for a tensor (a function or parameter added later fails here until its
    rows are)."""
    covered: dict[str, set[str]] = {}
    kinds: dict[tuple[str, str], set[str]] = {}
    for row in TABLE:
        covered.setdefault(row.function, set()).add(row.parameter)
        kinds.setdefault((row.function, row.parameter), set()).add(row.kind)
    missing = []
    for function, parameters in public_functions().items():
        if function not in CONTROLS:
            missing.append(f"{function}: no control")
            continue
        for parameter in parameters:
            if parameter not in covered.get(function, ()):
                missing.append(f"{function}({parameter}): no row")
            elif "type" not in kinds[function, parameter]:
                missing.append(f"{function}({parameter}): no bad-type row")
    assert not missing, "\n".join(missing)
