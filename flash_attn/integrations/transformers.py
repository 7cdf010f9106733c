"""Hugging Face Transformers on this package, on any device.

**On a CUDA machine** nothing is needed: transformers' ``attn_implementation="flash_attention_2"``
checks that a distribution named ``flash-attn`` >= 2.3.3 is installed and CUDA is available, then
does ``from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache``
and ``from flash_attn.bert_padding import pad_input, unpad_input``, which is this package.

**Anywhere else** (CPU, or to be independent of that check) transformers refuses
``"flash_attention_2"`` ("FlashAttention2 is not available on CPU"), so :func:`register` adds an
implementation named :data:`IMPLEMENTATION` (``"flash_attention_2_portable"``)::

    from flash_attn.integrations.transformers import register
    name = register()  # "flash_attention_2_portable"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)

It is transformers' own flash-attention path end to end, only with this package's functions:

* the attention function registered in transformers' ``AttentionInterface`` is a thin wrapper of
  ``transformers.integrations.flash_attention.flash_attention_forward`` (the function transformers
  registers for ``"flash_attention_2"``), so un-padding of padded batches (the varlen path), packed
  sequences from ``position_ids``, sliding windows, softcap and the KV cache of ``generate()``
  are handled by transformers exactly as with upstream flash-attn;
* the mask function registered in ``AttentionMaskInterface`` is the one of ``"flash_attention_2"``
  (a 2-D padding mask or ``None``);
* the functions that path calls are this package's: transformers caches the flash-attn functions
  it imported per implementation name (``modeling_flash_attention_utils._loaded_implementation``
  and the ``_flash_fn``... slots next to it); :func:`register` fills that cache for the new name,
  the same way transformers fills it after importing upstream flash-attn, and the wrapper fills
  it again if another implementation took the slot since. Two of them are thin adapters that
  convert what transformers passes and upstream tolerates (int32 ``pad_input`` indices, 0-d tensor
  ``max_seqlen``; a GPU one is bounded from the shapes instead of read: no device sync per layer,
  :func:`flash_attn.validation.varlen_max_seqlens`).

The name contains ``flash`` so transformers treats the model as a flash-attention model everywhere
(masks, ``generate``, packed sequences, continuous batching) and contains neither ``/`` nor ``:``
(which would make transformers look for a kernel on the Hub). Which backend computes (reference on
CPU, the GPU kernels on CUDA) is decided by ``FLASH_ATTN_BACKEND`` as for every other call.

Needs transformers >= 5 (checked by :func:`register`, with the reason when it cannot work).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, Callable, Optional

from flash_attn import validation
from flash_attn.flash_attn_interface import flash_attn_varlen_func

IMPLEMENTATION = "flash_attention_2_portable"

# The parts of transformers this integration relies on; a transformers without them is refused
# with this list in the message (they are internal to transformers, so a release may move them).
_REQUIRED_FLASH_UTILS = (
    "_loaded_implementation",
    "_flash_fn",
    "_flash_varlen_fn",
    "_pad_fn",
    "_unpad_fn",
    "_process_flash_kwargs_fn",
    "_lazy_define_process_function",
    "lazy_import_flash_attention",
)

# Set where this transformers has them (newer 5.x releases; 5.17 has no
# _process_with_kvcache_kwargs_fn).
_OPTIONAL_FLASH_UTILS = ("_flash_with_kvcache_fn", "_process_with_kvcache_kwargs_fn")

log = logging.getLogger(__name__)
_registered: set[str] = set()


class TransformersIntegrationError(RuntimeError):
    """The installed transformers cannot be hooked (missing, too old, or changed internals)."""


def _modules() -> dict[str, Any]:
    """The transformers modules used here, or TransformersIntegrationError saying what is wrong."""
    try:
        import transformers  # noqa: PLC0415
        from transformers import modeling_flash_attention_utils as flash_utils  # noqa: PLC0415
        from transformers.integrations import flash_attention  # noqa: PLC0415
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface  # noqa: PLC0415
        from transformers.modeling_utils import AttentionInterface  # noqa: PLC0415
    except ImportError as exc:
        raise TransformersIntegrationError(
            f"flash_attn.integrations.transformers needs transformers >= 5 ({exc}); `pip install 'transformers>=5'`"
        ) from exc
    missing = [name for name in _REQUIRED_FLASH_UTILS if not hasattr(flash_utils, name)]
    if not hasattr(flash_attention, "flash_attention_forward"):
        missing.append("integrations.flash_attention.flash_attention_forward")
    if "flash_attention_2" not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        missing.append("the 'flash_attention_2' mask function")
    if missing:
        raise TransformersIntegrationError(
            f"transformers {transformers.__version__} does not have what flash_attn's integration uses "
            f"({', '.join(missing)}); it was written for transformers 5.x. On CUDA, "
            "attn_implementation='flash_attention_2' still uses this package without register()."
        )
    return {
        "transformers": transformers,
        "flash_utils": flash_utils,
        "flash_attention_forward": flash_attention.flash_attention_forward,
        "AttentionInterface": AttentionInterface,
        "AttentionMaskInterface": AttentionMaskInterface,
        "ALL_MASK_ATTENTION_FUNCTIONS": ALL_MASK_ATTENTION_FUNCTIONS,
    }


def _check_name(name: str) -> None:
    if not isinstance(name, str) or "flash" not in name:
        raise ValueError(f"implementation name {name!r} must contain 'flash' (transformers keys flash-attention behaviour on it)")
    if "/" in name or ":" in name or "|" in name:
        raise ValueError(f"implementation name {name!r} must not contain '/', ':' or '|' (transformers reads those as Hub kernels)")
    if re.fullmatch(r"flash_attention_\d", name):
        raise ValueError(f"{name!r} is transformers' own name, which it only allows where upstream flash-attn can run; pick another")


def _fill_function_cache(name: str) -> None:
    """Point transformers' cache of imported flash-attn functions at this package, under ``name``."""
    import torch  # noqa: PLC0415

    from flash_attn import flash_attn_func, flash_attn_with_kvcache  # noqa: PLC0415
    from flash_attn.bert_padding import unpad_input  # noqa: PLC0415

    flash_utils = _modules()["flash_utils"]
    flash_utils._flash_fn = flash_attn_func
    flash_utils._flash_varlen_fn = _varlen_with_int_lengths
    flash_utils._pad_fn = _pad_input_int64
    flash_utils._unpad_fn = unpad_input
    flash_utils._process_flash_kwargs_fn = flash_utils._lazy_define_process_function(flash_attn_varlen_func)
    optional = {
        # transformers wraps the paged (KV cache) function like this when it imports it itself.
        "_flash_with_kvcache_fn": torch.compiler.disable(flash_attn_with_kvcache),
        "_process_with_kvcache_kwargs_fn": flash_utils._lazy_define_process_function(flash_attn_with_kvcache),
    }
    for attr in _OPTIONAL_FLASH_UTILS:
        if hasattr(flash_utils, attr):
            setattr(flash_utils, attr, optional[attr])
    flash_utils._loaded_implementation = name


# Two things transformers passes that upstream flash-attn tolerates: int32 indices to pad_input
# (the decode step's ``cu_seqlens[:-1]``) and 0-d tensors as max_seqlen (packed sequences from
# position_ids). These adapters hand this package's functions what their signatures promise.


def _pad_input_int64(hidden_states, indices, batch, seqlen):
    """``flash_attn.bert_padding.pad_input`` with int64 indices."""
    from flash_attn.bert_padding import pad_input  # noqa: PLC0415

    return pad_input(hidden_states, indices.long(), batch, seqlen)


# flash_attn_varlen_func's arguments after max_seqlen_k, in order (the two the adapter reads).
_VARLEN_OPTIONS = ("dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
                   "return_attn_probs", "block_table")


def _option(name: str, args: tuple, kwargs: dict):
    index = _VARLEN_OPTIONS.index(name)
    return args[index] if len(args) > index else kwargs.get(name)


@functools.wraps(flash_attn_varlen_func)
def _varlen_with_int_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **kwargs):
    """``flash_attn.flash_attn_varlen_func`` with ``max_seqlen_q/k`` as Python ints: a 0-d GPU
    tensor is not read (one device sync per layer per step): the packed rows bound it, which the
    kernels need no more than (``return_attn_probs``, whose output it sizes, reads it)."""
    max_seqlen_q, max_seqlen_k = validation.varlen_max_seqlens(
        q, k, _option("block_table", args, kwargs), max_seqlen_q, max_seqlen_k,
        exact=bool(_option("return_attn_probs", args, kwargs)))
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **kwargs)


def _make_attention_function(name: str, flash_utils: Any, forward: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        # Another flash implementation may have taken transformers' single cache slot since.
        if flash_utils._loaded_implementation != name:
            _fill_function_cache(name)
        return forward(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = attention.__qualname__ = "flash_attn_portable_attention_forward"
    attention.__doc__ = (
        f"transformers' flash_attention_forward with flash_attn's functions (implementation {name!r})."
    )
    return attention


def register(name: str = IMPLEMENTATION) -> str:
    """Register ``name`` (default :data:`IMPLEMENTATION`) with transformers; returns it.

    Afterwards ``attn_implementation=name`` (``from_pretrained``, ``from_config``, or
    ``model.set_attn_implementation(name)``) runs transformers' flash-attention path with this
    package's functions on any device. Idempotent; call it again after loading a model that uses
    another flash-attention implementation in the same process.
    """
    _check_name(name)
    mods = _modules()
    _fill_function_cache(name)
    mods["AttentionInterface"].register(
        name, _make_attention_function(name, mods["flash_utils"], mods["flash_attention_forward"])
    )
    mods["AttentionMaskInterface"].register(name, mods["ALL_MASK_ATTENTION_FUNCTIONS"]["flash_attention_2"])
    if name not in _registered:
        log.debug("registered attn_implementation=%r with transformers %s", name, mods["transformers"].__version__)
    _registered.add(name)
    return name


def unregister(name: str = IMPLEMENTATION) -> None:
    """Undo :func:`register` (tests; a process that wants transformers as it was)."""
    mods = _modules()
    mods["AttentionInterface"]._global_mapping.pop(name, None)
    mods["AttentionMaskInterface"]._global_mapping.pop(name, None)
    if mods["flash_utils"]._loaded_implementation == name:
        mods["flash_utils"]._loaded_implementation = None
    _registered.discard(name)


def is_registered(name: str = IMPLEMENTATION) -> bool:
    return name in _registered


def native_flash_attention_2_available() -> Optional[bool]:
    """Whether transformers itself would accept ``attn_implementation="flash_attention_2"`` here
    (a CUDA device and a ``flash-attn`` distribution); ``None`` without transformers."""
    try:
        from transformers.utils import is_flash_attn_2_available  # noqa: PLC0415
    except ImportError:
        return None
    return bool(is_flash_attn_2_available())
