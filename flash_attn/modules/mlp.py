"""MLP blocks with upstream flash-attn's names and signatures: ``Mlp`` (fc1, activation, fc2),
``GatedMlp`` (GLU family: fc1 produces value and gate), their tensor-parallel forms, and
``FusedMLP`` / ``ParallelFusedMLP`` (:mod:`flash_attn.ops.fused_dense`, upstream's fused dense
extension's API in PyTorch)."""

import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from flash_attn.limits import cdiv
from flash_attn.modules.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from flash_attn.ops.activations import swiglu
from flash_attn.ops.fused_dense import FusedMLP, ParallelFusedMLP  # noqa: F401  (upstream's names here)


def _hidden_gated(in_features, hidden_features, multiple_of):
    hidden = hidden_features if hidden_features is not None else int(8 * in_features / 3)
    return cdiv(hidden, multiple_of) * multiple_of  # rounded up to a multiple of multiple_of


def _gate(y, activation):
    """fc1's output is ``[value, gate]``; returns ``value * activation(gate)``."""
    if activation is F.sigmoid:
        return F.glu(y, dim=-1)  # the same thing, one op
    value, gate = y.chunk(2, dim=-1)
    if activation is F.silu:
        return swiglu(gate, value)  # upstream's fused SwiGLU
    return value * activation(gate)


class Mlp(nn.Module):
    """``fc2(activation(fc1(x)))``; hidden size defaults to ``4 * in_features``. With
    ``return_residual`` returns ``(out, x)``."""

    def __init__(
        self,
        in_features,
        hidden_features=None,
        out_features=None,
        activation=F.gelu,
        bias1=True,
        bias2=True,
        return_residual=False,
        device=None,
        dtype=None,
    ):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.return_residual = return_residual
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x):
        y = self.fc2(self.activation(self.fc1(x)))
        return (y, x) if self.return_residual else y


class GatedMlp(nn.Module):
    """``fc2(value * activation(gate))`` where ``fc1(x) = [value, gate]``; the hidden size
    defaults to ``8 / 3 * in_features``, rounded up to ``multiple_of``. ``F.sigmoid``: GLU,
    ``F.silu``: SwiGLU."""

    def __init__(
        self,
        in_features,
        hidden_features=None,
        out_features=None,
        activation=F.sigmoid,
        bias1=True,
        bias2=True,
        multiple_of=128,
        return_residual=False,
        device=None,
        dtype=None,
    ):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = out_features if out_features is not None else in_features
        hidden_features = _hidden_gated(in_features, hidden_features, multiple_of)
        self.return_residual = return_residual
        self.fc1 = nn.Linear(in_features, 2 * hidden_features, bias=bias1, **factory)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x):
        y = self.fc2(_gate(self.fc1(x), self.activation))
        return (y, x) if self.return_residual else y


class ParallelMLP(nn.Module):
    """``Mlp`` with its hidden features split over ``process_group`` (fc1 column parallel,
    fc2 row parallel)."""

    def __init__(
        self,
        in_features,
        hidden_features=None,
        out_features=None,
        activation=F.gelu,
        process_group: ProcessGroup = None,
        sequence_parallel=True,
        bias1=True,
        bias2=True,
        device=None,
        dtype=None,
    ):

        if process_group is None:
            raise ValueError("ParallelMLP needs a process_group")
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.fc1 = ColumnParallelLinear(in_features, hidden_features, process_group, bias=bias1,
                                        sequence_parallel=sequence_parallel, **factory)
        self.activation = activation
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2,
                                     sequence_parallel=sequence_parallel, **factory)

    def forward(self, x):
        return self.fc2(self.activation(self.fc1(x)))


class ParallelGatedMlp(nn.Module):
    """``GatedMlp`` split over ``process_group``. fc1's rows on each rank are ``[value, gate]``
    of that rank's hidden slice (the same per-rank layout as upstream)."""

    def __init__(
        self,
        in_features,
        process_group,
        hidden_features=None,
        out_features=None,
        activation=F.sigmoid,
        bias1=True,
        bias2=True,
        multiple_of=128,
        sequence_parallel=True,
        device=None,
        dtype=None,
    ):

        factory = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = out_features if out_features is not None else in_features
        hidden_features = _hidden_gated(in_features, hidden_features, multiple_of)
        self.fc1 = ColumnParallelLinear(in_features, 2 * hidden_features, process_group,
                                        bias=bias1, sequence_parallel=sequence_parallel,
                                        **factory)
        self.activation = activation
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2,
                                     sequence_parallel=sequence_parallel, **factory)

    def forward(self, x):
        return self.fc2(_gate(self.fc1(x), self.activation))

