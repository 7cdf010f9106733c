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
        local = _local_features(out_features, multiple_of, "out_features", process_group)
        super().__init__(in_features, local, bias=bias, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
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
        local = _local_features(in_features, multiple_of, "in_features", process_group)
        rank = dist.get_rank(process_group)
        super().__init__(local, out_features, bias=bias and rank == 0, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        reduce = reduce_scatter if self.sequence_parallel else all_reduce
        return reduce(out, self.process_group)
