"""Tensor-parallel linear layers in plain PyTorch over ``torch.distributed``.

Upstream keeps ``ColumnParallelLinear`` / ``RowParallelLinear`` in ``flash_attn.ops.fused_dense``,
a CUDA extension that this package does not ship; these have the same constructor signatures and
the same sharding, computed with ``F.linear`` and the collectives of ``flash_attn.utils.distributed``.

Sharding: the output features (column parallel) or input features (row parallel) are split into
units of ``multiple_of`` and dealt out in order, the first ranks taking one unit more when the
count does not divide (``get_dim_for_local_rank``).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from flash_attn import validation

from flash_attn.utils.distributed import (
    all_gather,
    all_reduce,
    all_reduce_raw,
    get_dim_for_local_rank,
    reduce_scatter,
)


class _CopyToParallelRegion(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ranks, because every rank used
    the same (replicated) input for its own slice of the output."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: ProcessGroup) -> Tensor:
        ctx.process_group = process_group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return all_reduce_raw(grad_output.clone(), ctx.process_group)[0], None


def check_linear(x, weight, bias, names=("x", "weight", "bias")) -> None:
    """``F.linear(x, weight, bias)``'s arguments under the caller's names (PyTorch's own errors
    name ``input`` and ``mat1``): tensors, shapes that multiply, one dtype, one device."""
    x_name, weight_name, bias_name = names
    for name, t in ((x_name, x), (weight_name, weight)):
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got {validation._describe(t)}")
    if weight.dim() != 2:
        raise ValueError(f"{weight_name} must have shape (out_features, in_features), got {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{x_name} must have shape (..., in_features = {weight.shape[1]}) to match {weight_name}, "
                         f"got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"{x_name} ({x.dtype}) and {weight_name} ({weight.dtype}) must have the same dtype")
    if weight.device != x.device:
        raise ValueError(f"{weight_name} is on {weight.device} but {x_name} is on {x.device}")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"{bias_name} must be None or a torch.Tensor, got {validation._describe(bias)}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{bias_name} must have shape (out_features,) = ({weight.shape[0]},), got "
                             f"{tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"{bias_name} is on {bias.device} but {x_name} is on {x.device}")


def check_parallel_options(process_group, sequence_parallel) -> None:
    if process_group is not None and not isinstance(process_group, ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(process_group).__name__}")
    validation.check_flag(sequence_parallel, "sequence_parallel")


def _check_parallel_linear(in_features, out_features, process_group, bias, sequence_parallel, multiple_of) -> None:
    validation.check_int(in_features, "in_features", minimum=1)
    validation.check_int(out_features, "out_features", minimum=1)
    if not isinstance(process_group, ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup, got {type(process_group).__name__}")
    check_parallel_options(process_group, sequence_parallel)
    validation.check_flag(bias, "bias")
    validation.check_int(multiple_of, "multiple_of", minimum=1)


def _local_features(total: int, multiple_of: int, what: str, process_group: ProcessGroup) -> int:
    """This rank's share of ``total`` features (see the module docstring)."""
    if total % multiple_of:
        raise ValueError(f"{what} ({total}) must be a multiple of {multiple_of}")
    return get_dim_for_local_rank(total, dist.get_world_size(process_group),
                                  dist.get_rank(process_group), multiple_of)


class ColumnParallelLinear(nn.Linear):
    """This rank's slice of the output features. With ``sequence_parallel`` the input is this
    rank's slice of dimension 0 (batch * seqlen) and is all-gathered first; otherwise every rank
    gets the whole input."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        process_group: ProcessGroup,
        bias: bool = True,
        sequence_parallel=True,
        multiple_of=1,
        device=None,
        dtype=None,
    ) -> None:
        _check_parallel_linear(in_features, out_features, process_group, bias, sequence_parallel, multiple_of)
        local = _local_features(out_features, multiple_of, "out_features", process_group)
        super().__init__(in_features, local, bias=bias, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        check_linear(x, self.weight, None)
        if self.sequence_parallel:
            x = all_gather(x, self.process_group)
        else:
            x = _CopyToParallelRegion.apply(x, self.process_group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """This rank's slice of the input features; the partial products are summed over ranks
    (reduce-scattered along dimension 0 with ``sequence_parallel``, all-reduced otherwise).
    Only rank 0 holds the bias, so that it is added once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        process_group: ProcessGroup,
        bias: bool = True,
        sequence_parallel=True,
        multiple_of=1,
        device=None,
        dtype=None,
    ) -> None:
        _check_parallel_linear(in_features, out_features, process_group, bias, sequence_parallel, multiple_of)
        local = _local_features(in_features, multiple_of, "in_features", process_group)
        rank = dist.get_rank(process_group)
        super().__init__(local, out_features, bias=bias and rank == 0, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        check_linear(x, self.weight, None)
        out = F.linear(x, self.weight, self.bias)
        reduce = reduce_scatter if self.sequence_parallel else all_reduce
        return reduce(out, self.process_group)
