"""Upstream's ``flash_attn.utils.pretrained``: ``state_dict_from_pretrained``, a checkpoint's
tensors as a plain ``{name: tensor}`` dict, from a local directory or the Hugging Face Hub.

The checkpoint file is looked for, in upstream's order, as ``pytorch_model.bin``, its sharded index
``pytorch_model.bin.index.json``, ``model.safetensors`` and ``model.safetensors.index.json``.
Upstream's Hub fallback stops after the two ``.bin`` forms; ours goes on to the safetensors forms
(most Hub repositories now ship only those). Files are resolved with ``transformers``'
``cached_file`` (so the Hub cache, ``HF_HUB_OFFLINE``, tokens and mirrors behave as in
``transformers``) and read with ``safetensors`` or ``torch.load(weights_only=True)``.

``transformers`` and ``safetensors`` are imported on the first call: the package imports without
them, and the call then raises ``ImportError`` saying what to install.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, NamedTuple

import torch

__all__ = ["state_dict_from_pretrained"]


class _Candidate(NamedTuple):
    filename: str
    sharded: bool
    safetensors: bool


def _hub():
    """``(candidates in upstream's order, cached_file, get_checkpoint_shard_files)``."""
    try:
        from transformers.utils import (  # noqa: PLC0415
            SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME,
        )
        from transformers.utils.hub import cached_file, get_checkpoint_shard_files  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(
            "state_dict_from_pretrained needs the transformers package (pip/conda install transformers)"
        ) from exc
    candidates = (
        _Candidate(WEIGHTS_NAME, False, False),
        _Candidate(WEIGHTS_INDEX_NAME, True, False),
        _Candidate(SAFE_WEIGHTS_NAME, False, True),
        _Candidate(SAFE_WEIGHTS_INDEX_NAME, True, True),
    )
    return candidates, cached_file, get_checkpoint_shard_files


def _resolve(model_name: str):
    """The first checkpoint file of ``model_name`` that exists: ``(path, candidate)``.
    A local directory is searched alone; anything else is a Hub repository id."""
    candidates, cached_file, _ = _hub()
    local = os.path.isdir(model_name)
    for candidate in candidates:
        if local and not os.path.isfile(os.path.join(model_name, candidate.filename)):
            continue
        path = cached_file(model_name, candidate.filename, _raise_exceptions_for_missing_entries=False)
        if path is not None:
            return path, candidate
    raise EnvironmentError(f"Model name {model_name} was not found.")


def _loader(candidate: _Candidate, map_location) -> Callable[[str], Dict[str, torch.Tensor]]:
    if candidate.safetensors:
        try:
            from safetensors.torch import load_file  # noqa: PLC0415
        except ImportError as exc:
            raise ImportError("reading .safetensors checkpoints needs the safetensors package") from exc
        return lambda path: load_file(path, device=str(map_location))
    return lambda path: torch.load(path, map_location=map_location, weights_only=True)


def state_dict_from_pretrained(model_name, device=None, dtype=None):
    """All tensors of the checkpoint ``model_name`` (a local directory or a Hub repository id),
    every shard merged into one dict, converted to ``dtype`` (if given) and moved to ``device``.

    Tensors that are converted are read onto the CPU first and converted before the move, so
    that the device never holds the checkpoint in its original (e.g. fp32) precision. Raises
    ``EnvironmentError`` (``OSError``) when no checkpoint file is found."""
    path, candidate = _resolve(str(model_name))
    map_location = "cpu" if dtype not in (torch.float32, None) or device is None else device
    load = _loader(candidate, map_location)
    if candidate.sharded:
        _, _, get_checkpoint_shard_files = _hub()
        shard_paths, _ = get_checkpoint_shard_files(str(model_name), path)
        state_dict = {}
        for shard in shard_paths:
            state_dict.update(load(shard))
    else:
        state_dict = load(path)
    if dtype is not None:
        state_dict = {k: v.to(dtype=dtype) for k, v in state_dict.items()}
    return {k: v.to(device=device) for k, v in state_dict.items()}
