"""Cross-entropy over a large vocabulary without an fp32 copy of the logits (upstream's
``flash_attn.ops.triton.cross_entropy.cross_entropy_loss``).

For each row the loss needs only three numbers of the scaled logits ``z = logit_scale * logits``:
``lse = logsumexp(z)``, ``sum(z)`` (label smoothing) and ``z[label]``. The forward computes them row
by row and keeps ``lse``; the backward recomputes the softmax from the saved logits and ``lse``:

    loss     = lse - (1 - s) * z[label] - s * sum(z) / C + lse_square_scale * lse**2
    dloss/dz = softmax(z) * (1 + 2 * lse_square_scale * lse) - (1 - s) * onehot(label) - s / C

so the only memory beyond the logits and their gradient is a few numbers per row (and, on the
PyTorch path, one bounded block of rows in the compute dtype). ``inplace_backward=True`` writes the
gradient over the logits, which then need no second buffer at all.

Where the arithmetic runs:

* CUDA tensors (fp16/bf16/fp32): two Triton kernels, compiled by Triton's JIT on first use (no
  ahead-of-time images are built for them);
* every other device, and float64: the same formulas in PyTorch, in float32 (float64 for float64
  logits), block of rows by block of rows, with PyTorch's fused (log-)softmax kernels.

``process_group`` (vocabulary-parallel logits, each rank holding the columns
``[rank * n_cols, (rank + 1) * n_cols)`` of the same rows): the local ``lse`` are combined with an
all-gather, the label and smoothing terms with an all-reduce, and every rank gets the full loss; the
backward needs no communication. Ignored rows (``labels == ignore_index``) have loss, z-loss and
gradient 0.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from flash_attn import validation
from flash_attn.ops.triton import cuda_launch, triton_modules

triton, tl = triton_modules()  # Triton is optional: without it (or without CUDA) the PyTorch path runs

__all__ = ["cross_entropy_loss"]

# Rows per block of the PyTorch path: about 1M elements (4 MiB in fp32) at a time bounds the
# temporary memory whatever the number of tokens, and keeps a block's passes in the CPU's caches.
_BLOCK_ELEMENTS = 1 << 20


# --- Triton kernels ------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _row_stats_kernel(logits_ptr, labels_ptr, lse_ptr, sum_ptr, label_logit_ptr,
                          n_cols, row_stride, class_start, logit_scale,
                          BLOCK: tl.constexpr, WANT_LSE: tl.constexpr, WANT_SUM: tl.constexpr):
        """One program per row: an online logsumexp over column blocks, the row sum (0 without
        WANT_SUM) and the label's logit (0 when the label is not among this rank's columns)."""
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        if WANT_LSE:
            running_max = -float("inf")
            running_sum = 0.0
        total = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_cols
            z = tl.load(base + cols, mask=inside, other=-float("inf")).to(tl.float32) * logit_scale
            if WANT_SUM:
                total += tl.sum(tl.where(inside, z, 0.0))
            if WANT_LSE:
                new_max = tl.maximum(running_max, tl.max(z))
                running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max))
                running_max = new_max
        if WANT_LSE:
            tl.store(lse_ptr + row, running_max + tl.log(running_sum))
        tl.store(sum_ptr + row, total)  # 0 without WANT_SUM: the loss adds 0 * total
        label = tl.load(labels_ptr + row).to(tl.int64) - class_start
        ours = (label >= 0) & (label < n_cols)
        z_label = tl.load(base + tl.where(ours, label, 0)).to(tl.float32) * logit_scale
        tl.store(label_logit_ptr + row, tl.where(ours, z_label, 0.0))

    @triton.jit
    def _grad_kernel(dlogits_ptr, logits_ptr, labels_ptr, lse_ptr, row_grad_ptr,
                     n_cols, row_stride, drow_stride, class_start, logit_scale,
                     lse_square_scale, smooth_label, smooth_uniform,
                     BLOCK: tl.constexpr):
        """Program (row, column block): the gradient of that block. ``row_grad`` is the incoming
        gradient times ``logit_scale``, already 0 on ignored rows."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        z = tl.load(logits_ptr + row.to(tl.int64) * row_stride + cols, mask=inside,
                    other=0.0).to(tl.float32) * logit_scale
        lse = tl.load(lse_ptr + row)
        g = tl.load(row_grad_ptr + row)
        label = tl.load(labels_ptr + row).to(tl.int64) - class_start
        d = tl.exp(z - lse) * (1.0 + 2.0 * lse_square_scale * lse) - smooth_uniform
        d = tl.where(cols == label, d - smooth_label, d)
        tl.store(dlogits_ptr + row.to(tl.int64) * drow_stride + cols, d * g, mask=inside)


# The tests swap these for Triton's interpreter on CPU tensors (flash_attn.backends._interpreter).
_launch: Callable = cuda_launch


def _kernels_apply(logits: Tensor) -> bool:
    return triton is not None and logits.is_cuda and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _block(n_cols: int) -> int:
    return min(triton.next_power_of_2(n_cols), 4096)


def _row_stats_triton(logits, labels, class_start, logit_scale, want_lse, want_sum, block=None):
    n_rows, n_cols = logits.shape
    stats = torch.empty(3, n_rows, dtype=torch.float32, device=logits.device)
    lse, total, label_logit = stats[0], stats[1], stats[2]
    block = block or _block(n_cols)
    _launch(_row_stats_kernel, (n_rows,), logits_ptr=logits, labels_ptr=labels, lse_ptr=lse,
            sum_ptr=total, label_logit_ptr=label_logit, n_cols=n_cols, row_stride=logits.stride(0),
            class_start=class_start, logit_scale=float(logit_scale), BLOCK=block, WANT_LSE=want_lse,
            WANT_SUM=want_sum, num_warps=8 if block >= 2048 else 4)
    return lse, total, label_logit


def _grad_triton(dlogits, logits, labels, lse, row_grad, class_start, logit_scale, lse_square_scale,
                 smoothing, total_classes, block=None):
    n_rows, n_cols = logits.shape
    block = block or _block(n_cols)
    _launch(_grad_kernel, (n_rows, triton.cdiv(n_cols, block)), dlogits_ptr=dlogits, logits_ptr=logits,
            labels_ptr=labels, lse_ptr=lse, row_grad_ptr=row_grad, n_cols=n_cols, row_stride=logits.stride(0),
            drow_stride=dlogits.stride(0), class_start=class_start, logit_scale=float(logit_scale),
            lse_square_scale=float(lse_square_scale), smooth_label=1.0 - smoothing,
            smooth_uniform=smoothing / total_classes, BLOCK=block, num_warps=8 if block >= 2048 else 4)


# --- the PyTorch path ----------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_blocks(n_rows: int, n_cols: int):
    step = max(1, _BLOCK_ELEMENTS // max(n_cols, 1))
    return [(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


def _local_labels(labels: Tensor, class_start: int, n_cols: int) -> Tuple[Tensor, Tensor]:
    """Column of each row's label among this rank's columns (clamped) and whether it is there."""
    local = labels.long() - class_start
    ours = (local >= 0) & (local < n_cols)
    return local.clamp(0, n_cols - 1), ours


def _scaled(block: Tensor, logit_scale: float, dtype: torch.dtype) -> Tensor:
    """``logit_scale * block`` in ``dtype`` (may be ``block`` itself: callers never write into it).

    The conversion is its own step on purpose: PyTorch's ``softmax(x, dtype=...)`` on a bf16 input
    is several times slower on the CPU than converting first and running the fp32 kernel."""
    z = block.to(dtype)
    return z * logit_scale if logit_scale != 1.0 else z


def _row_stats_torch(logits, labels, class_start, logit_scale, want_lse, want_sum):
    """Per row: the logsumexp (always: the backward's softmax is normalised by it), the row sum
    and the label's logit, of the scaled logits.

    PyTorch's fused log-softmax kernel is faster than ``logsumexp``'s chain of ops on the CPU; the
    logsumexp is read off it at the row's maximum, ``lse = max(z) - max(log_softmax(z))``, where
    ``-max(log_softmax(z)) = log(sum(exp(z - max(z))))`` is in ``[0, log(n_cols)]``: nothing cancels."""
    del want_lse  # computed anyway (see above)
    n_rows, n_cols = logits.shape
    dtype = _compute_dtype(logits.dtype)
    lse, total, label_logit = torch.zeros(3, n_rows, dtype=dtype, device=logits.device).unbind(0)
    column, ours = _local_labels(labels, class_start, n_cols)
    for start, stop in _row_blocks(n_rows, n_cols):
        z = _scaled(logits[start:stop], logit_scale, dtype)
        lse[start:stop] = z.amax(dim=-1) - torch.log_softmax(z, dim=-1).amax(dim=-1)
        if want_sum:
            total[start:stop] = z.sum(dim=-1)
        picked = z.gather(1, column[start:stop, None]).squeeze(1)
        label_logit[start:stop] = torch.where(ours[start:stop], picked, torch.zeros_like(picked))
    return lse, total, label_logit


def _grad_torch(dlogits, logits, labels, lse, row_grad, class_start, logit_scale, lse_square_scale,
                smoothing, total_classes, local_lse):
    """``softmax`` of the block (normalised by the rows' own ``local_lse``) rescaled to the
    ``lse`` the loss used (the group's, or a given one): ``exp(z - lse)``."""
    n_rows, n_cols = logits.shape
    column, ours = _local_labels(labels, class_start, n_cols)
    dtype = lse.dtype
    # the z-loss factor, the incoming gradient and the normaliser are per row: one multiplier
    row_factor = (row_grad * (1.0 + 2.0 * lse_square_scale * lse) * torch.exp(local_lse - lse))[:, None]
    uniform = (smoothing / total_classes) * row_grad[:, None]
    hit = (-(1.0 - smoothing) * row_grad * ours.to(dtype))[:, None]
    for start, stop in _row_blocks(n_rows, n_cols):
        rows = slice(start, stop)
        d = torch.softmax(_scaled(logits[rows], logit_scale, dtype), dim=-1).mul_(row_factor[rows])
        if smoothing:
            d.sub_(uniform[rows])
        d.scatter_add_(1, column[rows, None], hit[rows])
        dlogits[rows] = d


# --- the loss ------------------------------------------------------------------------------------


def _world(process_group) -> Tuple[int, int]:
    if process_group is None:
        return 1, 0
    return torch.distributed.get_world_size(process_group), torch.distributed.get_rank(process_group)


def _global_lse(lse: Tensor, world: int, process_group) -> Tensor:
    # flat output: gloo wants it as ``world`` chunks shaped like the input (NCCL takes either)
    gathered = torch.empty(world * lse.numel(), dtype=lse.dtype, device=lse.device)
    # all_gather_into_tensor was renamed all_gather_single (PyTorch 2.13); either exists
    all_gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    all_gather(gathered, lse.contiguous(), group=process_group)
    return torch.logsumexp(gathered.view(world, -1), dim=0)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, precomputed_lse, smoothing, logit_scale, lse_square_scale,
                ignore_index, inplace_backward, process_group):
        # every argument checked here, so that upstream's CrossEntropyLoss.apply gets
        # cross_entropy_loss's errors (which calls only this)
        _check(logits, labels, precomputed_lse, smoothing, logit_scale, lse_square_scale, ignore_index,
               inplace_backward, process_group)
        smoothing, logit_scale, lse_square_scale = float(smoothing), float(logit_scale), float(lse_square_scale)
        inplace_backward = bool(inplace_backward)
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        labels = labels.contiguous()  # the kernels read label i at labels + i
        n_rows, n_cols = logits.shape
        world, rank = _world(process_group)
        total_classes, class_start = world * n_cols, rank * n_cols
        # Like upstream, a given lse is only used where it is the lse of the unscaled logits and
        # no row sum is needed anyway.
        use_given_lse = precomputed_lse is not None and logit_scale == 1.0 and smoothing == 0.0
        kernels = _kernels_apply(logits)
        row_stats = _row_stats_triton if kernels else _row_stats_torch
        local_lse, total, label_logit = row_stats(logits, labels, class_start, logit_scale,
                                                  not use_given_lse, smoothing > 0.0)
        lse = local_lse
        if use_given_lse:
            lse = precomputed_lse.to(device=lse.device, dtype=lse.dtype)
        # The parts of the loss that are sums over the vocabulary: split over ranks, added up.
        partial = -(1.0 - smoothing) * label_logit - (smoothing / total_classes) * total
        if world > 1:
            lse = _global_lse(lse, world, process_group)
            torch.distributed.all_reduce(partial, group=process_group)
        keep = labels != ignore_index
        z_losses = torch.where(keep, lse_square_scale * lse * lse, torch.zeros_like(lse))
        losses = torch.where(keep, lse + partial + z_losses, torch.zeros_like(lse))

        ctx.save_for_backward(logits, labels, lse, local_lse)
        ctx.mark_non_differentiable(z_losses)
        ctx.kernels = kernels
        ctx.args = (class_start, logit_scale, lse_square_scale, smoothing, total_classes)
        ctx.ignore_index = ignore_index
        ctx.inplace_backward = inplace_backward
        return losses, z_losses

    @staticmethod
    def backward(ctx, grad_losses, grad_z_losses):
        del grad_z_losses  # the z-loss output is for logging; its part is already in the loss
        logits, labels, lse, local_lse = ctx.saved_tensors
        logit_scale = ctx.args[1]
        keep = labels != ctx.ignore_index
        row_grad = torch.where(keep, grad_losses.to(lse.dtype) * logit_scale, torch.zeros_like(lse))
        dlogits = logits if ctx.inplace_backward else torch.empty_like(logits)
        if ctx.kernels:
            _grad_triton(dlogits, logits, labels, lse, row_grad.contiguous(), *ctx.args)
        else:
            _grad_torch(dlogits, logits, labels, lse, row_grad, *ctx.args, local_lse=local_lse)
        return dlogits, None, None, None, None, None, None, None, None


# Upstream's name of the autograd class (same ``apply`` arguments: logits, labels, precomputed_lse,
# smoothing, logit_scale, lse_square_scale, ignore_index, inplace_backward, process_group).
CrossEntropyLoss = _CrossEntropy


def check_options(label_smoothing, logit_scale, lse_square_scale, ignore_index, inplace_backward,
                  process_group) -> None:
    """The loss's scalar options (also :class:`flash_attn.losses.cross_entropy.CrossEntropyLoss`'s)."""
    for name, value, ok, accepted in (("label_smoothing", label_smoothing, lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
                                      ("logit_scale", logit_scale, lambda v: v > 0.0, "> 0"),
                                      ("lse_square_scale", lse_square_scale, lambda v: v >= 0.0, ">= 0")):
        number = validation._real(value, name, f"a float {accepted}")
        if not ok(number) or math.isinf(number):
            raise ValueError(f"{name} must be a finite float {accepted}, got {value!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    validation.check_flag(inplace_backward, "inplace_backward")
    if process_group is not None and not isinstance(process_group, torch.distributed.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(process_group).__name__}")


def _check(logits, labels, precomputed_lse, label_smoothing, logit_scale, lse_square_scale, ignore_index,
           inplace_backward, process_group, names=("logits", "labels")) -> None:
    """Every argument; ``names``: what the caller calls the logits and the labels."""
    logits_name, labels_name = names
    if not isinstance(logits, Tensor) or logits.ndim != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"{logits_name} must be a floating-point tensor of shape (batch, vocab_size), got "
                         f"{getattr(logits, 'dtype', type(logits))} {tuple(getattr(logits, 'shape', ()))}")
    if logits.shape[1] == 0:
        raise ValueError(f"{logits_name} must have at least one column (vocab_size >= 1)")
    if (not isinstance(labels, Tensor) or labels.shape != logits.shape[:1]
            or labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex()):
        raise ValueError(f"{labels_name} must be an integer tensor of shape ({logits.shape[0]},), got "
                         f"{getattr(labels, 'dtype', type(labels))} {tuple(getattr(labels, 'shape', ()))}")
    if labels.device != logits.device:
        raise ValueError(f"{labels_name} is on {labels.device} but {logits_name} is on {logits.device}")
    if precomputed_lse is not None:
        if not isinstance(precomputed_lse, Tensor) or precomputed_lse.shape != logits.shape[:1]:
            raise ValueError(f"precomputed_lse must be a tensor of shape ({logits.shape[0]},), got "
                             f"{validation._describe(precomputed_lse)}")
        if not precomputed_lse.dtype.is_floating_point:
            raise TypeError(f"precomputed_lse must be a floating-point tensor, got {precomputed_lse.dtype}")
        if precomputed_lse.device != logits.device:
            raise ValueError(f"precomputed_lse is on {precomputed_lse.device} but {logits_name} is on {logits.device}")
    check_options(label_smoothing, logit_scale, lse_square_scale, ignore_index, inplace_backward, process_group)
    # Out-of-range labels would silently lose their label term: checked on the host for CPU
    # tensors, on the device otherwise (no synchronisation).
    if labels.numel():
        vocab = _world(process_group)[0] * logits.shape[1]
        ok = ((labels == ignore_index) | ((labels >= 0) & (labels < vocab))).all()
        validation.check_values(ok, ValueError, f"{labels_name} must be in [0, {vocab}) (0 to vocab_size - 1) or "
                                                f"equal ignore_index ({ignore_index})")


def cross_entropy_loss(
    logits: Tensor,
    labels: Tensor,
    precomputed_lse: Optional[Tensor] = None,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    process_group=None,
) -> Tuple[Tensor, Tensor]:
    """Per-row cross-entropy of ``logit_scale * logits`` against ``labels``.

    Arguments:
        logits: ``(batch, vocab_size)`` (with ``process_group``: this rank's ``vocab_size`` columns).
        labels: ``(batch,)`` integer class indices (global ones with ``process_group``).
        precomputed_lse: ``(batch,)`` logsumexp of the logits, used instead of computing it when
            ``logit_scale == 1`` and ``label_smoothing == 0`` (ignored otherwise, as upstream).
        label_smoothing: ``s``: the target is ``(1 - s) * onehot + s / vocab_size``.
        logit_scale: multiplies the logits before everything else.
        lse_square_scale: adds ``lse_square_scale * logsumexp(z)**2`` to each loss ("z-loss").
        ignore_index: rows with this label have loss, z-loss and gradient 0.
        inplace_backward: the backward writes the gradient into ``logits`` (saves its memory; the
            logits are overwritten).
        process_group: vocabulary-parallel logits over this group; every rank gets the full loss.

    Returns:
        ``(losses, z_losses)``, both ``(batch,)`` float32 (float64 for float64 logits); ``losses``
        includes the z-loss; ``z_losses`` is for logging and carries no gradient.
    """
    return _CrossEntropy.apply(logits, labels, precomputed_lse, label_smoothing, logit_scale, lse_square_scale,
                               ignore_index, inplace_backward, process_group)  # its forward checks them
