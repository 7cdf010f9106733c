"""Upstream's separately built CUDA extensions' APIs (``flash_attn.ops.layer_norm``, ``ops.rms_norm``,
``ops.fused_dense``) against naive float64 PyTorch, forward and gradients; calls modelled on
upstream's tests (tests/ops/test_dropout_layer_norm.py, tests/ops/test_fused_dense.py).

The float64 oracle below is written from the formulas (dropout with the mask the call returns,
``x0 * rowscale * layerscale``, the norms, ``x @ W^T + b``, the activations), not through the code
under test. Tolerances: fp32 results against float64, a few hundred fp32 ulps of values of order 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.options import test_device

from flash_attn.ops.fused_dense import (
    FusedDense, FusedDenseFunc, FusedMLP, FusedMLPFunc, fused_dense_func, fused_mlp_func,
)
from flash_attn.ops.layer_norm import (
    DropoutAddLayerNorm, DropoutAddLayerNormFn, dropout_add_layer_norm, dropout_add_layer_norm_parallel_residual,
    layer_norm, maybe_align,
)
from flash_attn.ops.rms_norm import (
    DropoutAddRMSNorm, RMSNorm, dropout_add_rms_norm, dropout_add_rms_norm_parallel_residual, rms_norm,
)

F64 = torch.float64
TOL = dict(rtol=2e-5, atol=2e-5)


def randn(*shape, seed, dtype=torch.float32, grad=True):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(test_device())
    return t.requires_grad_(grad)


def norm64(z, weight, bias, eps, rms):
    z = z.to(F64)
    if rms:
        y = z * torch.rsqrt(z.square().mean(-1, keepdim=True) + eps)
    else:
        y = (z - z.mean(-1, keepdim=True)) * torch.rsqrt(z.var(-1, unbiased=False, keepdim=True) + eps)
    y = y * weight.to(F64)
    return y if bias is None else y + bias.to(F64)


def grads(outputs, inputs, seed):
    gs = [randn(*o.shape, seed=seed + i, grad=False) for i, o in enumerate(outputs)]
    return torch.autograd.grad(outputs, inputs, gs, allow_unused=True), gs


def check_against(ours, ref, inputs, seed=50):
    """Outputs equal, then the gradients of both for the same output gradients."""
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o.to(F64), r, **TOL)
    got, gs = grads(ours, inputs, seed)
    want = torch.autograd.grad(ref, inputs, [g.to(F64) for g in gs], allow_unused=True)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None or not a.abs().any(), i
        else:
            torch.testing.assert_close(a.to(F64), b.to(F64), **TOL, msg=lambda m, i=i: f"input {i}: {m}")


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("case", ["plain", "residual_prenorm", "rowscale_layerscale", "dropout", "residual_fp32"])
def test_dropout_add_norm_against_float64(rms, case):
    rows, hidden, eps, p = 12, 96, 1e-5, 0.0
    x0, residual = randn(rows, hidden, seed=1), randn(rows, hidden, seed=2)
    weight, bias = randn(hidden, seed=3), None if rms else randn(hidden, seed=4)
    rowscale = layerscale = None
    prenorm = case in ("residual_prenorm", "dropout", "residual_fp32")
    if case == "plain":
        residual = None
    if case == "rowscale_layerscale":
        rowscale, layerscale = randn(rows, seed=5, grad=False), randn(hidden, seed=6)
    if case == "dropout":
        p = 0.37
    fn = dropout_add_rms_norm if rms else dropout_add_layer_norm
    torch.manual_seed(0)
    result = fn(x0, residual, weight, bias, p, eps, rowscale=rowscale, layerscale=layerscale, prenorm=prenorm,
                residual_in_fp32=case == "residual_fp32", return_dropout_mask=True)
    *outs, mask = result
    assert mask.dtype == torch.uint8 and mask.shape == x0.shape
    if p == 0.0:
        assert bool(mask.all())
    else:
        assert 0.5 < mask.float().mean() < 0.75  # about 1 - p kept
    z = x0.to(F64) * mask.to(F64) / (1 - p)
    if rowscale is not None:
        z = z * rowscale.to(F64)[:, None] * layerscale.to(F64)
    if residual is not None:
        z = z + residual.to(F64)
    ref = [norm64(z, weight, bias, eps, rms)] + ([z] if prenorm else [])
    if case == "residual_fp32":
        assert outs[1].dtype == torch.float32
    inputs = [t for t in (x0, residual, weight, bias, layerscale) if t is not None]
    check_against(outs, ref, inputs)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_parallel_residual_against_float64(rms):
    rows, hidden, eps = 10, 64, 1e-6
    x0, x1, residual = randn(rows, hidden, seed=1), randn(rows, hidden, seed=2), randn(rows, hidden, seed=3)
    w0, w1 = randn(hidden, seed=4), randn(hidden, seed=5)
    b0, b1 = (None, None) if rms else (randn(hidden, seed=6), randn(hidden, seed=7))
    fn = dropout_add_rms_norm_parallel_residual if rms else dropout_add_layer_norm_parallel_residual
    out0, out1, z_out = fn(x0, x1, residual, w0, b0, w1, b1, 0.0, eps, prenorm=True)
    z = x0.to(F64) + x1.to(F64) + residual.to(F64)
    inputs = [t for t in (x0, x1, residual, w0, w1, b0, b1) if t is not None]
    check_against([out0, out1, z_out], [norm64(z, w0, b0, eps, rms), norm64(z, w1, b1, eps, rms), z], inputs)
    # without a second norm: (out0, None)
    out0, none = fn(x0, x1, None, w0, b0, None, None, 0.0, eps)
    assert none is None
    torch.testing.assert_close(out0.to(F64), norm64(x0.to(F64) + x1.to(F64), w0, b0, eps, rms), **TOL)


def test_norm_functions_and_modules():
    x = randn(3, 5, 32, seed=1)
    ln, rn = DropoutAddLayerNorm(32, prenorm=True, p=0.1), RMSNorm(32, eps=1e-6)
    ln.eval()  # dropout off in evaluation, as upstream's module
    out, res = ln(x, x)
    torch.testing.assert_close(out.to(F64), norm64(2 * x.to(F64), ln.weight, ln.bias, 1e-5, False), **TOL)
    torch.testing.assert_close(res, 2 * x)
    torch.testing.assert_close(rn(x).to(F64), norm64(x, rn.weight, None, 1e-6, True), **TOL)
    torch.testing.assert_close(layer_norm(x, ln.weight, ln.bias, 1e-5).to(F64),
                               norm64(x, ln.weight, ln.bias, 1e-5, False), **TOL)
    torch.testing.assert_close(rms_norm(x, rn.weight, 1e-6), rn(x))
    assert DropoutAddRMSNorm(32).eval()(x).shape == x.shape
    # the autograd class's apply with upstream's argument order
    same = DropoutAddLayerNormFn.apply(x, None, ln.weight, ln.bias, None, None, 0.0, 1e-5, False)
    torch.testing.assert_close(same, layer_norm(x, ln.weight, ln.bias, 1e-5))
    assert maybe_align(x.detach()).data_ptr() % 16 == 0


@pytest.mark.parametrize("return_residual", [False, True])
def test_fused_dense_against_float64(return_residual):
    x, w, b = randn(4, 6, 16, seed=1), randn(24, 16, seed=2), randn(24, seed=3)
    out = fused_dense_func(x, w, b, return_residual=return_residual)
    if return_residual:
        out, residual = out
        assert residual is x
    check_against([out], [x.to(F64) @ w.to(F64).T + b.to(F64)], [x, w, b])
    layer = FusedDense(16, 24, bias=False).to(test_device())
    torch.testing.assert_close(layer(x), x @ layer.weight.T)
    torch.testing.assert_close(FusedDenseFunc.apply(x, w, b), out)


ACT64 = {"gelu_approx": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu, "sqrelu": lambda t: F.relu(t) ** 2}


@pytest.mark.parametrize("activation", sorted(ACT64))
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
def test_fused_mlp_against_float64(activation, checkpoint_lvl):
    x = randn(3, 5, 16, seed=1)
    w1, b1, w2, b2 = randn(40, 16, seed=2), randn(40, seed=3), randn(16, 40, seed=4), randn(16, seed=5)
    out = fused_mlp_func(x, w1, w2, b1, b2, activation=activation, checkpoint_lvl=checkpoint_lvl)
    hidden = ACT64[activation](x.to(F64) @ w1.to(F64).T + b1.to(F64))
    check_against([out], [hidden @ w2.to(F64).T + b2.to(F64)], [x, w1, b1, w2, b2])
    torch.testing.assert_close(FusedMLPFunc.apply(x, w1, b1, w2, b2, activation), fused_mlp_func(x, w1, w2, b1, b2, activation))


def test_fused_mlp_module_and_bad_arguments():
    m = FusedMLP(16, 32, activation="relu", return_residual=True).to(test_device())
    x = randn(2, 16, seed=1)
    out, same = m(x)
    assert same is x
    torch.testing.assert_close(out, m.fc2(F.relu(m.fc1(x))))
    with pytest.raises(ValueError, match="activation"):
        FusedMLP(16, activation="swish")
    with pytest.raises(ValueError, match="checkpoint_lvl"):
        fused_mlp_func(x, m.fc1.weight, m.fc2.weight, checkpoint_lvl=3)


def _droppath_subset(keep_batch, seqlen):
    """Upstream's test helper: rows of the kept batch entries numbered 1, 2, ... (0: dropped)."""
    rows = keep_batch.repeat_interleave(seqlen)
    return torch.cumsum(rows, 0, dtype=torch.int32).masked_fill(~rows, 0).view(len(keep_batch), seqlen), int(rows.sum())


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_subset_against_float64(rms):
    """upstream's test_dropout_layer_norm_subset_training: stochastic depth as row subsets of x0 and
    of the output, with dropout, a layerscale and a residual."""
    from flash_attn.ops.layer_norm import dropout_add_layer_norm_subset
    from flash_attn.ops.rms_norm import dropout_add_rms_norm_subset

    batch, seqlen, hidden, eps, p, scale = 4, 3, 32, 1e-5, 0.25, 1.5
    x0_keep, out_keep = torch.tensor([True, False, True, True]), torch.tensor([False, True, True, False])
    x0_subset, x0_rows = _droppath_subset(x0_keep, seqlen)
    out_subset, out_rows = _droppath_subset(out_keep, seqlen)
    x_full = randn(batch, seqlen, hidden, seed=1, grad=False)
    x0 = x_full[x0_keep.to(x_full.device)].reshape(-1, hidden).clone().requires_grad_()
    residual, layerscale = randn(batch, seqlen, hidden, seed=2), randn(hidden, seed=3)
    weight, bias = randn(hidden, seed=4), None if rms else randn(hidden, seed=5)
    fn = dropout_add_rms_norm_subset if rms else dropout_add_layer_norm_subset
    out, z, dmask = fn(x0, residual, weight, bias, p, eps, layerscale=layerscale, x0_subset=x0_subset.to(x0.device),
                       out_subset=out_subset.to(x0.device), rowscale_const=scale, out_numrows=out_rows, prenorm=True,
                       return_dropout_mask=True)
    assert out.shape == (out_rows, hidden) and z.shape == (batch * seqlen, hidden) and dmask.shape == x0.shape
    mask_full = torch.zeros(batch, seqlen, hidden, dtype=F64, device=x0.device)
    mask_full[x0_keep.to(x0.device)] = dmask.to(F64).view(-1, seqlen, hidden)
    x0_full = torch.zeros(batch, seqlen, hidden, dtype=F64, device=x0.device)
    x0_full[x0_keep.to(x0.device)] = x0.to(F64).view(-1, seqlen, hidden)
    z_ref = (x0_full * layerscale.to(F64) * scale * mask_full / (1 - p) + residual.to(F64)).view(-1, hidden)
    out_ref = norm64(z_ref, weight, bias, eps, rms).view(batch, seqlen, hidden)[out_keep.to(x0.device)].view(-1, hidden)
    inputs = [t for t in (x0, residual, weight, bias, layerscale) if t is not None]
    check_against([out, z], [out_ref, z_ref], inputs)
