"""Transformer blocks with upstream flash-attn's names and signatures.

``Block``: prenorm (``Dropout -> Add -> LN -> mixer -> Dropout -> Add -> LN -> MLP``, returning
the MLP's output and the residual, so that the next block can fuse its dropout + add + norm) or
postnorm (``mixer -> Dropout -> Add -> LN -> MLP -> Dropout -> Add -> LN``). ``ParallelBlock``:
mixer and MLP side by side on the normalised residual (GPT-J / GPT-NeoX / PaLM).

``fused_dropout_add_ln`` runs dropout + add + norm through
``flash_attn.ops.triton.layer_norm.layer_norm_fn``. Stochastic depth (``drop_path``) is
``StochasticDepth`` below, with the behaviour of torchvision's ``StochasticDepth(p, "row")``
that upstream imports (torchvision is not a dependency of this package).
"""

from functools import partial
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from flash_attn.modules.mha import MHA
from flash_attn.modules.mlp import Mlp
from flash_attn.ops.triton.layer_norm import RMSNorm, layer_norm_fn  # noqa: F401  (upstream's names here)


class StochasticDepth(nn.Module):
    """Drop whole rows (``mode="row"``: each sample of dimension 0) or the whole batch
    (``mode="batch"``) with probability ``p`` in training, scaling survivors by ``1 / (1 - p)``."""

    def __init__(self, p: float, mode: str = "row") -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"drop probability p must be between 0 and 1, got {p}")
        if mode not in ("row", "batch"):
            raise ValueError(f"mode must be 'row' or 'batch', got {mode!r}")
        self.p = p
        self.mode = mode

    def forward(self, input: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return input
        keep = 1.0 - self.p
        shape = (input.shape[0],) + (1,) * (input.ndim - 1) if self.mode == "row" else (1,) * input.ndim
        noise = input.new_empty(shape).bernoulli_(keep)
        if keep > 0.0:
            noise.div_(keep)
        return input * noise

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode}"


def _layer_norm_api():
    try:
        from flash_attn.ops.triton.layer_norm import RMSNorm, layer_norm_fn
    except ImportError as exc:
        raise ImportError(
            "fused_dropout_add_ln=True needs flash_attn.ops.triton.layer_norm "
            f"(layer_norm_fn, RMSNorm), which could not be imported: {exc}"
        ) from exc
    return layer_norm_fn, RMSNorm


def _check_fusable(norm, dropout, rms_norm_cls):
    if not isinstance(norm, (nn.LayerNorm, rms_norm_cls)) or not isinstance(dropout, nn.Dropout):
        raise ValueError(
            "fused_dropout_add_ln=True needs norm_cls to build nn.LayerNorm or "
            "flash_attn.ops.triton.layer_norm.RMSNorm and dropout_cls to build nn.Dropout; got "
            f"{type(norm).__name__} and {type(dropout).__name__}"
        )


def _mark_norm_params(norms, sequence_parallel, mark_shared_params):
    # Sequence parallel: each rank's norm sees a slice of the tokens, so the gradients of the
    # norm weights must be summed over ranks (allreduce_sequence_parallel_grad); shared: synced
    # at init (sync_shared_params).
    for norm in norms:
        for p in norm.parameters():
            if sequence_parallel:
                p._sequence_parallel = True
            if mark_shared_params:
                p._shared_params = True


def _default_mixer_mlp(dim, mixer_cls, mlp_cls):
    """Upstream's defaults: ``MHA`` with ``dim // 64`` heads, ``Mlp`` with ``4 * dim`` hidden."""
    mixer_cls = mixer_cls if mixer_cls is not None else partial(MHA, num_heads=dim // 64)
    mlp_cls = mlp_cls if mlp_cls is not None else partial(Mlp, hidden_features=4 * dim)
    return mixer_cls, mlp_cls


class _BlockBase(nn.Module):
    """What ``Block`` and ``ParallelBlock`` share besides their layouts."""

    def _finish_norms(self, fused_dropout_add_ln, sequence_parallel, mark_shared_params):
        """Once norm1 (and norm2, if any) are built: check that the fused path can run them (it
        takes norm1's kind and eps and dropout1's p for both) and mark their parameters."""
        if fused_dropout_add_ln:
            self._layer_norm_fn, rms_norm_cls = _layer_norm_api()
            _check_fusable(self.norm1, self.dropout1, rms_norm_cls)
            self._is_rms_norm = isinstance(self.norm1, rms_norm_cls)
        norms = [self.norm1] + ([self.norm2] if hasattr(self, "norm2") else [])
        _mark_norm_params(norms, sequence_parallel, mark_shared_params)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)


def _row_scale(drop_path, like: Tensor, training: bool) -> Optional[Tensor]:
    """Stochastic depth as the fused norm's per-row scale (None when it would be all ones)."""
    if drop_path.p == 0 or not training:
        return None
    return drop_path(torch.ones(like.shape[:-1], device=like.device, dtype=like.dtype))


class Block(_BlockBase):
    """One transformer block (see the module docstring for the prenorm/postnorm layouts).

    mixer_cls / mlp_cls: called with ``dim``; default ``MHA`` with ``dim // 64`` heads and
    ``Mlp`` with ``4 * dim`` hidden features. ``mlp_cls`` may build ``nn.Identity`` (no MLP).
    return_residual: the mixer and MLP return ``(out, input)`` (postnorm).
    residual_in_fp32: keep the residual stream in float32 (prenorm only).
    """

    def __init__(
        self,
        dim,
        mixer_cls=None,
        mlp_cls=None,
        norm_cls=nn.LayerNorm,
        dropout_cls=nn.Dropout,
        prenorm=True,
        resid_dropout1=0.0,
        resid_dropout2=0.0,
        drop_path1=0.0,
        drop_path2=0.0,
        fused_dropout_add_ln=False,
        return_residual=False,
        residual_in_fp32=False,
        sequence_parallel=False,
        mark_shared_params=False,
    ):
        super().__init__()
        if residual_in_fp32 and not prenorm:
            raise ValueError("residual_in_fp32 is only compatible with prenorm=True")
        self.prenorm = prenorm
        self.fused_dropout_add_ln = fused_dropout_add_ln
        self.return_residual = return_residual
        self.residual_in_fp32 = residual_in_fp32
        mixer_cls, mlp_cls = _default_mixer_mlp(dim, mixer_cls, mlp_cls)
        self.mixer = mixer_cls(dim)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.drop_path1 = StochasticDepth(drop_path1, mode="row")
        self.norm1 = norm_cls(dim)
        self.mlp = mlp_cls(dim)
        if not isinstance(self.mlp, nn.Identity):
            self.dropout2 = dropout_cls(resid_dropout2)
            self.drop_path2 = StochasticDepth(drop_path2, mode="row")
            self.norm2 = norm_cls(dim)
        self._finish_norms(fused_dropout_add_ln, sequence_parallel, mark_shared_params)

    def _add_norm(self, x, residual, dropout, drop_path, norm, prenorm):
        """``norm(drop_path(dropout(x)) + residual)``; with ``prenorm`` also returns the sum."""
        if self.fused_dropout_add_ln:
            return self._layer_norm_fn(
                x,
                norm.weight,
                norm.bias,
                residual=residual,
                eps=norm.eps,
                dropout_p=dropout.p if self.training else 0.0,
                rowscale=_row_scale(drop_path, x, self.training),
                prenorm=prenorm,
                residual_in_fp32=self.residual_in_fp32 if prenorm else False,
                is_rms_norm=self._is_rms_norm,
            )
        dropped = drop_path(dropout(x))
        summed = dropped + residual if residual is not None else dropped
        out = norm(summed.to(dtype=norm.weight.dtype))
        if not prenorm:
            return out
        return out, summed.to(torch.float32) if self.residual_in_fp32 else summed

    def forward(
        self,
        hidden_states: Tensor,
        residual: Optional[Tensor] = None,
        mixer_subset=None,
        mixer_kwargs=None,
    ):
        """Prenorm: returns ``(hidden_states, residual)``; pass ``residual=None`` to the first
        block. Postnorm: ``residual`` must be None; returns ``hidden_states``.
        mixer_subset: cross-attention only, queries from ``hidden_states[:, mixer_subset]``."""
        mixer_kwargs = dict(mixer_kwargs) if mixer_kwargs is not None else {}
        has_mlp = not isinstance(self.mlp, nn.Identity)
        if self.prenorm:
            hidden_states, residual = self._add_norm(
                hidden_states, residual, self.dropout1, self.drop_path1, self.norm1, True
            )
            if mixer_subset is not None:
                mixer_kwargs["mixer_subset"] = mixer_subset
            hidden_states = self.mixer(hidden_states, **mixer_kwargs)
            if mixer_subset is not None:
                residual = residual[:, mixer_subset]
            if has_mlp:
                hidden_states, residual = self._add_norm(
                    hidden_states, residual, self.dropout2, self.drop_path2, self.norm2, True
                )
                hidden_states = self.mlp(hidden_states)
            return hidden_states, residual
        if residual is not None:
            raise ValueError("residual must be None with prenorm=False")
        mixer_out = self.mixer(hidden_states, **mixer_kwargs)
        if self.return_residual:
            mixer_out, hidden_states = mixer_out
        hidden_states = self._add_norm(
            mixer_out, hidden_states, self.dropout1, self.drop_path1, self.norm1, False
        )
        if has_mlp:
            mlp_out = self.mlp(hidden_states)
            if self.return_residual:
                mlp_out, hidden_states = mlp_out
            hidden_states = self._add_norm(
                mlp_out, hidden_states, self.dropout2, self.drop_path2, self.norm2, False
            )
        return hidden_states


class ParallelBlock(_BlockBase):
    """Mixer and MLP in parallel: ``residual += dropout1(h1) + dropout2(h2)``, then
    ``h1 = mixer(norm1(residual))`` and ``h2 = mlp(norm2(residual))`` (``tied_norm``: one norm
    for both). Returns ``(h1, h2, residual)``."""

    def __init__(
        self,
        dim,
        mixer_cls=None,
        mlp_cls=None,
        norm_cls=nn.LayerNorm,
        dropout_cls=nn.Dropout,
        resid_dropout1=0.0,
        resid_dropout2=0.0,
        tied_norm=False,
        fused_dropout_add_ln=False,
        residual_in_fp32=False,
        sequence_parallel=False,
        mark_shared_params=False,
    ):
        super().__init__()
        self.tied_norm = tied_norm
        self.fused_dropout_add_ln = fused_dropout_add_ln
        self.residual_in_fp32 = residual_in_fp32
        mixer_cls, mlp_cls = _default_mixer_mlp(dim, mixer_cls, mlp_cls)
        self.mixer = mixer_cls(dim)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.norm1 = norm_cls(dim)
        self.mlp = mlp_cls(dim)
        self.dropout2 = dropout_cls(resid_dropout2)
        if not tied_norm:
            self.norm2 = norm_cls(dim)
        self._finish_norms(fused_dropout_add_ln, sequence_parallel, mark_shared_params)

    def forward(
        self,
        hidden_states1: Tensor,
        hidden_states2: Optional[Tensor] = None,
        residual: Optional[Tensor] = None,
        mixer_kwargs=None,
    ):
        """hidden_states1: the previous mixer's (or the embedding's) output; hidden_states2: the
        previous MLP's output (None for the first block: one input, dropped once)."""
        if not self.fused_dropout_add_ln:
            summed = self.dropout1(hidden_states1)
            if hidden_states2 is not None:
                summed = summed + self.dropout2(hidden_states2)
            residual = summed + residual if residual is not None else summed
            hidden_states1 = self.norm1(residual.to(dtype=self.norm1.weight.dtype))
            hidden_states2 = (
                hidden_states1
                if self.tied_norm
                else self.norm2(residual.to(dtype=self.norm2.weight.dtype))
            )
            if self.residual_in_fp32:
                residual = residual.to(torch.float32)
        else:
            weight2, bias2 = (None, None) if self.tied_norm else (self.norm2.weight, self.norm2.bias)
            hidden_states1, *second, residual = self._layer_norm_fn(
                hidden_states1,
                self.norm1.weight,
                self.norm1.bias,
                residual=residual,
                x1=hidden_states2,
                weight1=weight2,
                bias1=bias2,
                eps=self.norm1.eps,
                dropout_p=self.dropout1.p if self.training else 0.0,
                prenorm=True,
                residual_in_fp32=self.residual_in_fp32,
                is_rms_norm=self._is_rms_norm,
            )
            hidden_states2 = hidden_states1 if self.tied_norm else second[0]
        hidden_states1 = self.mixer(hidden_states1, **(mixer_kwargs or {}))
        hidden_states2 = self.mlp(hidden_states2)
        return hidden_states1, hidden_states2, residual
