"""Upstream's ``flash_attn.ops.fused_dense`` (the ``fused_dense_lib`` CUDA extension's Python API;
conda-forge's ``flash-attn-fused-dense``), in PyTorch: the same classes, functions, arguments,
defaults and returns, so that upstream's models with ``fused_dense`` / ``fused_mlp`` run.

Upstream fuses the bias into cuBLASLt's matmul epilogue (and the activation into the first matmul
of the MLP); here each is ``F.linear`` and the activation in PyTorch, differentiated by autograd,
on every device. ``heuristic`` (upstream's cuBLASLt algorithm choice) changes nothing;
``checkpoint_lvl`` 1 and 2 recompute the activation (and the first matmul) in the backward with
``torch.utils.checkpoint``, saving memory as upstream's. With a ``process_group`` the input is
all-gathered first (``sequence_parallel``) or its gradient all-reduced (not), as upstream; the
parallel layers are those of :mod:`flash_attn.modules.tensor_parallel`. The ``*Func`` classes keep
upstream's ``.apply`` argument order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from flash_attn import validation
from flash_attn.modules.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    _CopyToParallelRegion,
    check_linear,
    check_parallel_options,
)
from flash_attn.utils.distributed import all_gather, all_reduce, reduce_scatter

__all__ = ["ColumnParallelLinear", "FusedDense", "FusedDenseFunc", "FusedMLP", "FusedMLPFunc", "ParallelFusedMLP",
           "RowParallelLinear", "fused_dense_func", "fused_mlp_func"]

ACTIVATIONS = {
    "gelu_approx": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "sqrelu": lambda x: F.relu(x).square(),
}


def _parallel_input(x: Tensor, process_group: Optional[ProcessGroup], sequence_parallel: bool) -> Tensor:
    """Upstream's tensor parallelism on the input: this rank's rows all-gathered (sequence
    parallel), or the replicated input whose gradient is summed over the ranks."""
    if process_group is None:
        return x
    return all_gather(x, process_group) if sequence_parallel else _CopyToParallelRegion.apply(x, process_group)


def fused_dense_func(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, return_residual: bool = False,
                     process_group: Optional[ProcessGroup] = None, sequence_parallel: bool = True):
    """``x @ weight.T + bias``; with ``return_residual`` also ``x`` (the input, not gathered)."""
    check_linear(x, weight, bias, ("x", "weight", "bias"))
    validation.check_flag(return_residual, "return_residual")
    check_parallel_options(process_group, sequence_parallel)
    out = F.linear(_parallel_input(x, process_group, sequence_parallel), weight, bias)
    return out if not return_residual else (out, x)


class FusedDenseFunc:
    """Upstream's autograd class, by its ``apply``: ``(x, weight, bias, return_residual=False,
    process_group=None, sequence_parallel=True)``."""

    apply = staticmethod(fused_dense_func)


class FusedDense(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, return_residual: bool = False,
                 device=None, dtype=None) -> None:
        _check_mlp_init(in_features, None, out_features, bias=bias, return_residual=return_residual)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.return_residual = return_residual

    def forward(self, x, process_group=None):
        """With ``process_group`` the input is this rank's rows, all-gathered first (sequence parallel)."""
        return fused_dense_func(x, self.weight, self.bias, return_residual=self.return_residual,
                                process_group=process_group)


def _check_mlp_options(activation, checkpoint_lvl, heuristic, module: bool = False) -> None:
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if isinstance(checkpoint_lvl, bool) or checkpoint_lvl not in (0, 1, 2):
        raise ValueError(f"checkpoint_lvl must be 0, 1 or 2, got {checkpoint_lvl!r}")
    if not (module and heuristic == "auto"):  # upstream's cuBLASLt algorithm index (changes nothing here)
        validation.check_int(heuristic, "heuristic", minimum=-1)


def _check_mlp_init(in_features, hidden_features, out_features, **flags) -> None:
    validation.check_int(in_features, "in_features", minimum=1)
    for name, value in (("hidden_features", hidden_features), ("out_features", out_features)):
        if value is not None:
            validation.check_int(value, name, minimum=1)
    for name, value in flags.items():
        validation.check_flag(value, name)


def _mlp(x, weight1, weight2, bias1, bias2, activation, checkpoint_lvl):
    act = ACTIVATIONS[activation]
    if checkpoint_lvl == 2:  # recompute the first matmul and the activation in the backward
        hidden = checkpoint(lambda t: act(F.linear(t, weight1, bias1)), x, use_reentrant=False)
    else:
        pre_act = F.linear(x, weight1, bias1)
        hidden = checkpoint(act, pre_act, use_reentrant=False) if checkpoint_lvl == 1 else act(pre_act)
    return F.linear(hidden, weight2, bias2)


def fused_mlp_func(x: Tensor, weight1: Tensor, weight2: Tensor, bias1: Optional[Tensor] = None,
                   bias2: Optional[Tensor] = None, activation: str = "gelu_approx", save_pre_act: bool = True,
                   return_residual: bool = False, checkpoint_lvl: int = 0, heuristic: int = 0,
                   process_group: Optional[ProcessGroup] = None, sequence_parallel: bool = True):
    """``fc2(activation(fc1(x)))`` with ``activation`` in gelu_approx (GELU, tanh approximation),
    relu, sqrelu (squared ReLU); with ``return_residual`` also ``x``. With a ``process_group`` the
    output is this rank's partial sum: the caller reduces it, as upstream's."""
    _check_mlp_options(activation, checkpoint_lvl, heuristic)
    check_linear(x, weight1, bias1, ("x", "weight1", "bias1"))
    check_linear(x.new_empty((0, weight1.shape[0])), weight2, bias2, ("the hidden activation (weight1's out_features)",
                                                                      "weight2", "bias2"))
    validation.check_flag(save_pre_act, "save_pre_act")
    validation.check_flag(return_residual, "return_residual")
    check_parallel_options(process_group, sequence_parallel)
    gathered = _parallel_input(x, process_group, sequence_parallel)
    out = _mlp(gathered, weight1, weight2, bias1, bias2, activation, checkpoint_lvl)
    return out if not return_residual else (out, x)


class FusedMLPFunc:
    """Upstream's autograd class, by its ``apply``: ``(x, weight1, bias1, weight2, bias2,
    activation="gelu_approx", save_pre_act=True, return_residual=False, checkpoint_lvl=0,
    heuristic=0, process_group=None, sequence_parallel=True)`` (biases beside their weights, as
    upstream's ``apply``)."""

    @staticmethod
    def apply(x, weight1, bias1, weight2, bias2, activation="gelu_approx", save_pre_act=True, return_residual=False,
              checkpoint_lvl=0, heuristic=0, process_group=None, sequence_parallel=True):
        return fused_mlp_func(x, weight1, weight2, bias1, bias2, activation, save_pre_act, return_residual,
                              checkpoint_lvl, heuristic, process_group, sequence_parallel)


class FusedMLP(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, bias1=True, bias2=True,
                 activation="gelu_approx", return_residual=False, checkpoint_lvl=0, heuristic="auto", device=None,
                 dtype=None):
        _check_mlp_options(activation, checkpoint_lvl, heuristic, module=True)
        _check_mlp_init(in_features, hidden_features, out_features, bias1=bias1, bias2=bias2,
                        return_residual=return_residual)
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features * 4
        self.activation, self.return_residual = activation, return_residual
        self.checkpoint_lvl, self.heuristic = checkpoint_lvl, heuristic
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x, process_group=None):
        out = fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                             activation=self.activation, return_residual=self.return_residual,
                             checkpoint_lvl=self.checkpoint_lvl, process_group=process_group)
        if self.return_residual:
            out, x = out
        if process_group is not None:
            out = reduce_scatter(out, process_group)
        return out if not self.return_residual else (out, x)


class ParallelFusedMLP(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, activation="gelu_approx",
                 process_group: ProcessGroup = None, bias1=True, bias2=True, sequence_parallel=True, checkpoint_lvl=0,
                 heuristic="auto", device=None, dtype=None):
        if process_group is None:
            raise ValueError("ParallelFusedMLP needs a process_group")
        check_parallel_options(process_group, sequence_parallel)
        _check_mlp_options(activation, checkpoint_lvl, heuristic, module=True)
        _check_mlp_init(in_features, hidden_features, out_features, bias1=bias1, bias2=bias2)
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features * 4
        self.activation, self.process_group, self.sequence_parallel = activation, process_group, sequence_parallel
        self.checkpoint_lvl, self.heuristic = checkpoint_lvl, heuristic
        self.fc1 = ColumnParallelLinear(in_features, hidden_features, process_group, bias=bias1, **factory)
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2, **factory)

    def forward(self, x):
        out = fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                             activation=self.activation, checkpoint_lvl=self.checkpoint_lvl,
                             process_group=self.process_group, sequence_parallel=self.sequence_parallel)
        reduce = reduce_scatter if self.sequence_parallel else all_reduce
        return reduce(out, self.process_group)
