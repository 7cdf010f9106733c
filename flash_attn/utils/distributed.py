"""Collectives for the tensor-parallel modules, with upstream's names.

``all_gather`` / ``reduce_scatter`` / ``all_reduce`` work on dimension 0 and carry autograd:
the backward of a gather is a reduce-scatter and the other way round; the backward of
``all_reduce`` is the identity (each rank then holds the gradient of the summed output).
The ``*_raw`` forms do no autograd and can run asynchronously (they return the work handle).
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def _world(process_group: Optional[ProcessGroup]) -> int:
    return dist.get_world_size(process_group)


def all_gather_raw(input_: Tensor, process_group: ProcessGroup, async_op: bool = False):
    """Concatenate every rank's ``input_`` along dimension 0; returns ``(output, handle)``."""
    world = _world(process_group)
    output = input_.new_empty((world * input_.shape[0], *input_.shape[1:]))
    handle = dist.all_gather_into_tensor(output, input_.contiguous(), group=process_group,
                                         async_op=async_op)
    return output, handle


def reduce_scatter_raw(input_: Tensor, process_group: ProcessGroup, async_op: bool = False):
    """Sum over ranks, then keep this rank's slice of dimension 0; returns ``(output, handle)``."""
    world = _world(process_group)
    if input_.shape[0] % world != 0:
        raise ValueError(
            f"reduce_scatter: input_.shape[0] ({input_.shape[0]}) must be divisible by the "
            f"world size ({world})"
        )
    output = input_.new_empty((input_.shape[0] // world, *input_.shape[1:]))
    # reduce_scatter_tensor is deprecated in favour of reduce_scatter_single where that exists.
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    handle = scatter(output, input_.contiguous(), group=process_group, async_op=async_op)
    return output, handle


def all_reduce_raw(input_: Tensor, process_group: ProcessGroup, async_op: bool = False):
    """Sum ``input_`` over ranks (in place on a contiguous copy); returns ``(output, handle)``."""
    input_ = input_.contiguous()
    handle = dist.all_reduce(input_, group=process_group, async_op=async_op)
    return input_, handle


class AllGatherFunc(torch.autograd.Function):
    """Gather the sequence-parallel shards; the gradient is reduce-scattered back."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: ProcessGroup) -> Tensor:
        ctx.process_group = process_group
        return all_gather_raw(input_, process_group)[0]

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return reduce_scatter_raw(grad_output, ctx.process_group)[0], None


class ReduceScatterFunc(torch.autograd.Function):
    """Sum partial results and scatter them; the gradient is all-gathered back."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: ProcessGroup) -> Tensor:
        ctx.process_group = process_group
        return reduce_scatter_raw(input_, process_group)[0]

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return all_gather_raw(grad_output, ctx.process_group)[0], None


class AllReduceFunc(torch.autograd.Function):
    """Sum partial results over ranks; every rank's output is the same sum, so the gradient
    with respect to each rank's partial input is the output's gradient unchanged."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: ProcessGroup) -> Tensor:
        return all_reduce_raw(input_.clone(), process_group)[0]

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return grad_output, None


all_gather = AllGatherFunc.apply
reduce_scatter = ReduceScatterFunc.apply
all_reduce = AllReduceFunc.apply


def sync_shared_params(model: torch.nn.Module, process_group: ProcessGroup) -> None:
    """Broadcast, from the group's first rank, every parameter marked ``_shared_params``
    (sorted by name, so that every rank walks them in the same order)."""
    shared = sorted(
        (name, p) for name, p in model.named_parameters() if getattr(p, "_shared_params", False)
    )
    src = dist.get_global_rank(process_group, 0)
    with torch.no_grad():
        for _, p in shared:
            dist.broadcast(p, src=src, group=process_group)


def allreduce_sequence_parallel_grad(model: torch.nn.Module, process_group: ProcessGroup) -> None:
    """Sum over ranks the gradients of parameters marked ``_sequence_parallel`` (norm weights
    whose inputs are split along the sequence: each rank holds a partial gradient)."""
    grads = [
        p.grad
        for _, p in sorted(model.named_parameters())
        if getattr(p, "_sequence_parallel", False) and p.grad is not None
    ]
    if not grads:
        return
    with torch.no_grad():
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=process_group)
        for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)


def get_dim_for_local_rank(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """This rank's share of ``dim`` split over ``world_size`` ranks in units of ``multiple_of``;
    the first ``(dim // multiple_of) % world_size`` ranks get one unit more."""
    units = dim // multiple_of
    share, extra = divmod(units, world_size)
    return (share + int(local_rank < extra)) * multiple_of


def get_start_for_local_rank(dim: int, world_size: int, local_rank: int,
                             multiple_of: int = 1) -> int:
    """Where this rank's share of ``dim`` (as ``get_dim_for_local_rank`` splits it) begins."""
    return sum(get_dim_for_local_rank(dim, world_size, r, multiple_of) for r in range(local_rank))
