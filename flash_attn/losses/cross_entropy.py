"""``CrossEntropyLoss``: upstream flash-attn's module around
:func:`flash_attn.ops.triton.cross_entropy.cross_entropy_loss` (no fp32 copy of the logits, label
smoothing, ``logit_scale``, z-loss, vocabulary-parallel logits). Unlike upstream it also runs on the
CPU (and any other device), through the loss's exact PyTorch path.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from flash_attn import validation
from flash_attn.ops.triton.cross_entropy import _check, check_options, cross_entropy_loss

__all__ = ["CrossEntropyLoss"]

_REDUCTIONS = ("mean", "none", "sum")


class CrossEntropyLoss(nn.Module):
    def __init__(
        self,
        ignore_index=-100,
        reduction="mean",
        label_smoothing=0.0,
        logit_scale=1.0,
        lse_square_scale=0.0,
        inplace_backward=False,
        process_group=None,
        return_z_loss=False,
    ):
        """
        Arguments:
            ignore_index: rows with this target count for nothing (and not in the mean).
            reduction: ``"mean"`` (over the rows that are not ignored), ``"sum"`` or ``"none"``.
            label_smoothing, logit_scale, lse_square_scale, inplace_backward, process_group: as
                :func:`~flash_attn.ops.triton.cross_entropy.cross_entropy_loss`.
            return_z_loss: also return the z-loss part of the loss (reduced the same way), for
                logging; it carries no gradient.
        """
        super().__init__()
        check_options(label_smoothing, logit_scale, lse_square_scale, ignore_index, inplace_backward, process_group)
        validation.check_flag(return_z_loss, "return_z_loss")
        if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
            # upstream's exception type, so code that catches it keeps working
            raise NotImplementedError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.logit_scale = logit_scale
        self.lse_square_scale = lse_square_scale
        self.inplace_backward = inplace_backward
        self.process_group = process_group
        self.return_z_loss = return_z_loss

    def _reduce(self, values: Tensor, target: Tensor) -> Tensor:
        if self.reduction == "mean":
            return values.sum() / (target != self.ignore_index).sum()
        if self.reduction == "sum":
            return values.sum()
        return values

    def forward(self, input: Tensor, target: Tensor, precomputed_lse: Optional[Tensor] = None):
        """
        Arguments:
            input: ``(batch, vocab_size)`` logits; target: ``(batch,)`` class indices.
        Returns:
            the loss (``(batch,)`` for ``reduction="none"``, else a scalar), and the z-loss the same
            way when ``return_z_loss``.
        """
        _check(input, target, precomputed_lse, self.label_smoothing, self.logit_scale, self.lse_square_scale,
               self.ignore_index, self.inplace_backward, self.process_group, names=("input", "target"))
        loss, z_loss = cross_entropy_loss(
            input,
            target,
            precomputed_lse=precomputed_lse,
            label_smoothing=self.label_smoothing,
            logit_scale=self.logit_scale,
            lse_square_scale=self.lse_square_scale,
            ignore_index=self.ignore_index,
            inplace_backward=self.inplace_backward,
            process_group=self.process_group,
        )
        loss = self._reduce(loss, target)
        if not self.return_z_loss:
            return loss
        return loss, self._reduce(z_loss, target)
