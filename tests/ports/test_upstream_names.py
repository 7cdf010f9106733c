"""The names restored to match upstream's module surface (tests/ports/test_upstream_surface.py),
each exercised by a call modelled on upstream's own tests or on the code outside the package that
uses it (sink and context-parallel extensions call ``FlashAttn*Func.apply`` and the
``_wrapped_flash_attn_*`` ops), against the float64 oracle of tests/support/oracle.py or naive
PyTorch. The fused ops: tests/ports/test_fused_ops.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from support.inputs import cu_from_lens, gen, randn
from support.oracle import attention_ref, attention_varlen_ref, oracle_pair, rotary
from support.options import test_device
from support.tolerance import backward_floor, check_close

from flash_attn import flash_attn_interface as fai
from flash_attn.layers import rotary as rotary_layer

F32 = torch.float32


def _grads(out, leaves, seed):
    dout = randn(out.shape, F32, seed)
    return dout, torch.autograd.grad(out, leaves, dout)


def test_flash_attn_func_class_against_the_oracle():
    """``FlashAttnFunc.apply`` with upstream's arguments (dropout_p, softmax_scale, causal,
    window_size, softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled)."""
    g = gen(1)
    q, k, v = randn((2, 7, 4, 16), F32, g), randn((2, 9, 2, 16), F32, g), randn((2, 9, 2, 16), F32, g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = fai.FlashAttnFunc.apply(*leaves, 0.0, None, True, (-1, -1), 0.0, None, False, True, True)
    dout, grads = _grads(out, leaves, 2)
    oracle = lambda q, k, v, compute_dtype=None: attention_ref(q, k, v, causal=True, compute_dtype=compute_dtype)  # noqa: E731
    ref, ref_grads, naive, naive_grads = oracle_pair(oracle, [q, k, v], dout)
    check_close(out, ref.out, naive.out, F32, "out")
    check_close(lse, ref.lse, naive.lse, F32, "lse")
    for name, a, b, c in zip("qkv", grads, ref_grads, naive_grads):
        check_close(a, b, c, F32, f"d{name}", grad=True, floor=backward_floor(q, k, v, dout))


@pytest.mark.parametrize("packing", ["qkv", "kv"])
def test_packed_classes_equal_the_unpacked_one(packing):
    g = gen(3)
    qkv = randn((2, 6, 3, 2, 16), F32, g)
    args = (0.0, 0.25, False, (2, 1), 0.0, None, False, False, True)
    if packing == "qkv":
        leaf = qkv.clone().requires_grad_()
        out = fai.FlashAttnQKVPackedFunc.apply(leaf, *args)
        q, k, v = qkv.unbind(2)
    else:
        leaf = qkv[:, :, 1:].clone().requires_grad_()
        q = qkv[:, :, 0]
        out = fai.FlashAttnKVPackedFunc.apply(q, leaf, *args)
        k, v = qkv[:, :, 1], qkv[:, :, 2]
    unpacked = [t.clone().requires_grad_() for t in (q, k, v)]
    want = fai.FlashAttnFunc.apply(*unpacked, *args)
    torch.testing.assert_close(out, want)
    dout = randn(out.shape, F32, 4)
    (got,) = torch.autograd.grad(out, [leaf], dout)
    expected = torch.stack(torch.autograd.grad(want, unpacked, dout), dim=2)
    torch.testing.assert_close(got, expected if packing == "qkv" else expected[:, :, 1:])


@pytest.mark.parametrize("packing", ["none", "qkv", "kv"])
def test_varlen_classes_against_the_oracle(packing):
    lens = [3, 5, 4]
    cu = cu_from_lens(lens)
    g = gen(5)
    q, k, v = (randn((12, 2, 16), F32, g) for _ in range(3))
    oracle = lambda q, k, v, compute_dtype=None: attention_varlen_ref(q, k, v, cu.tolist(), cu.tolist(), causal=True,  # noqa: E731
                                                                      compute_dtype=compute_dtype)
    opts = (0.0, None, True, (-1, -1), 0.0, None, False, False)
    if packing == "none":
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fai.FlashAttnVarlenFunc.apply(*leaves, cu, cu, 5, 5, *opts, None, True)
    elif packing == "qkv":
        leaves = [torch.stack([q, k, v], dim=1).requires_grad_()]
        out = fai.FlashAttnVarlenQKVPackedFunc.apply(leaves[0], cu, 5, *opts, True)
    else:
        leaves = [q.clone().requires_grad_(), torch.stack([k, v], dim=1).requires_grad_()]
        out = fai.FlashAttnVarlenKVPackedFunc.apply(*leaves, cu, cu, 5, 5, *opts, True)
    dout, grads = _grads(out, leaves, 6)
    ref, ref_grads, naive, naive_grads = oracle_pair(oracle, [q, k, v], dout)
    check_close(out, ref.out, naive.out, F32, "out")
    flat = torch.cat([gr.flatten(1) if gr.dim() == 4 else gr.unsqueeze(1).flatten(1) for gr in grads], dim=1)
    want = torch.cat([r.unsqueeze(1).flatten(1) for r in ref_grads], dim=1)
    rough = torch.cat([r.unsqueeze(1).flatten(1) for r in naive_grads], dim=1)
    check_close(flat, want, rough, F32, "dqkv", grad=True, floor=backward_floor(q, k, v, dout))


def test_wrapped_ops_and_fakes():
    """``_wrapped_flash_attn_*`` are the ``torch.ops.flash_attn`` custom ops (what upstream's are
    with torch >= 2.4); the fakes give the outputs' shapes on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = gen(7)
    q = randn((1, 5, 2, 16), F32, g)
    out, lse, _, rng = fai._wrapped_flash_attn_forward(q, q, q, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    assert torch.equal(out, fai.flash_attn_func(q, q, q, softmax_scale=0.25, causal=True))
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    fai._wrapped_flash_attn_backward(torch.ones_like(out), q, q, q, out, lse, dq, dk, dv, 0.0, 0.25, True, -1, -1,
                                     0.0, None, False, rng)
    leaf = q.clone().requires_grad_()
    fai.flash_attn_func(leaf, q, q, softmax_scale=0.25, causal=True).sum().backward()
    torch.testing.assert_close(dq, leaf.grad)
    assert fai._wrapped_flash_attn_varlen_forward is torch.ops.flash_attn._flash_attn_varlen_forward
    assert fai._wrapped_flash_attn_varlen_backward is torch.ops.flash_attn._flash_attn_varlen_backward
    with FakeTensorMode():
        fq = torch.empty(2, 7, 4, 32)
        fout, flse, _, _ = fai._flash_attn_forward_fake(fq, fq, fq, 0.0, 0.2, False, -1, -1, 0.0, None, False)
        assert fout.shape == (2, 7, 4, 32) and flse.shape == (2, 4, 7)
        vq = torch.empty(9, 4, 32)
        cu_fake = torch.empty(3, dtype=torch.int32)
        vout, vlse, _, _ = fai._flash_attn_varlen_forward_fake(vq, vq, vq, cu_fake, cu_fake, 5, 5, 0.0, 0.2, False)
        assert vout.shape == (9, 4, 32) and vlse.shape == (4, 9)


def test_interface_helpers():
    x = torch.randn(4, 6).t()
    assert fai.maybe_contiguous(x).stride(-1) == 1 and fai.maybe_contiguous(None) is None
    y = torch.randn(3, 4)
    assert fai.maybe_contiguous(y) is y
    assert fai.round_multiple(5, 8) == 8 and fai.round_multiple(16, 8) == 16
    assert fai.USE_TRITON_ROCM is (os.getenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "FALSE") == "TRUE")
    assert fai._torch_custom_op_wrapper is torch.library.custom_op
    assert fai._torch_register_fake_wrapper is torch.library.register_fake

    def f(t):
        return t

    assert fai.noop_custom_op_wrapper("x::f", mutates_args=())(f) is f
    assert fai.noop_register_fake_wrapper("x::f", f) is f
    assert fai._get_block_size_n(torch.device("cpu"), 128, False, True) >= 1


def test_rotary_classes_against_the_float64_rotation():
    """Upstream's tests/test_rotary.py pattern: rotate, compare with the reference rotation, and
    backpropagate (the backward is the rotation by minus the angle)."""
    g = gen(8)
    b, s, h, d, rd = 2, 6, 2, 16, 8
    angles = torch.rand(s, rd // 2, generator=g)
    cos, sin = angles.cos().to(test_device()), angles.sin().to(test_device())
    x = randn((b, s, h, d), F32, g).requires_grad_()
    out = rotary_layer.ApplyRotaryEmb.apply(x, cos, sin, False, False, 0, None, None)
    want = torch.stack([rotary(x[i].detach(), range(s), cos, sin, False) for i in range(b)])
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    (dx,) = torch.autograd.grad(out, [x], out.detach())  # R^T R = I: the gradient of |R x|^2 / 2 is x
    torch.testing.assert_close(dx, x.detach(), rtol=1e-5, atol=1e-5)

    qkv = randn((b, s, 3, h, d), F32, g)
    rotated = rotary_layer.ApplyRotaryEmbQKV_.apply(qkv.clone(), cos, sin, None, None, True)
    for part in (0, 1):
        want = torch.stack([rotary(qkv[i, :, part], range(s), cos, sin, True) for i in range(b)])
        torch.testing.assert_close(rotated[:, :, part].double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotated[:, :, 2], qkv[:, :, 2])
    kv = qkv[:, :, 1:].clone()
    rotated_kv = rotary_layer.ApplyRotaryEmbKV_.apply(kv, cos, sin, True)
    torch.testing.assert_close(rotated_kv[:, :, 0], rotated[:, :, 1])
    copy = rotary_layer._apply_rotary_emb_qkv(qkv, cos, sin, interleaved=True)
    torch.testing.assert_close(copy, rotated)
    back = rotary_layer._apply_rotary_emb_qkv(copy, cos, sin, interleaved=True, conjugate=True)
    torch.testing.assert_close(back, qkv, rtol=1e-5, atol=1e-5)


def test_cross_entropy_autograd_class_against_float64():
    from flash_attn.ops.triton.cross_entropy import CrossEntropyLoss

    g = gen(9)
    logits = randn((6, 11), F32, g).requires_grad_()
    labels = torch.tensor([0, 3, -100, 10, 5, 2], device=test_device())
    losses, z_losses = CrossEntropyLoss.apply(logits, labels, None, 0.1, 1.0, 0.0, -100, False, None)
    want = F.cross_entropy(logits.double(), labels, reduction="none", label_smoothing=0.1, ignore_index=-100)
    torch.testing.assert_close(losses.double(), want, rtol=1e-5, atol=1e-5)
    (dlogits,) = torch.autograd.grad(losses.sum(), [logits])
    (want_grad,) = torch.autograd.grad(want.sum(), [logits])
    torch.testing.assert_close(dlogits.double(), want_grad.double(), rtol=1e-5, atol=1e-5)


def test_constants_and_module_level_names_are_upstreams():
    import math

    from flash_attn.layers.patch_embed import FusedDense as PatchFusedDense
    from flash_attn.losses.cross_entropy import CrossEntropyLoss
    from flash_attn.models import bert, gpt, vit
    from flash_attn.modules import block, mha, mlp, tensor_parallel
    from flash_attn.ops import activations, fused_dense
    from flash_attn.ops.triton import k_activations, layer_norm, mlp as triton_mlp

    assert k_activations._sqrt2pi == pytest.approx(math.sqrt(2 / math.pi))
    assert k_activations._sqrt1_2 == pytest.approx(1 / math.sqrt(2))
    assert k_activations._gaussian_pdf_normalization == pytest.approx(1 / math.sqrt(2 * math.pi))
    assert PatchFusedDense is bert.FusedDense is fused_dense.FusedDense
    assert bert.CrossEntropyLoss is CrossEntropyLoss
    assert bert.layer_norm_fn is vit.layer_norm_fn is block.layer_norm_fn is layer_norm.layer_norm_fn
    assert block.RMSNorm is layer_norm.RMSNorm and gpt.FusedDenseSqreluDense is triton_mlp.FusedDenseSqreluDense
    assert gpt.ColumnParallelLinear is mha.ColumnParallelLinear is mlp.ColumnParallelLinear is tensor_parallel.ColumnParallelLinear
    assert mha.RowParallelLinear is mlp.RowParallelLinear is fused_dense.RowParallelLinear is tensor_parallel.RowParallelLinear
    assert mha.RotaryEmbedding is rotary_layer.RotaryEmbedding and mlp.swiglu is activations.swiglu
    x = torch.randn(3, 5)
    assert layer_norm.maybe_contiguous(x) is x and layer_norm.maybe_contiguous_lastdim(x.t()).stride(-1) == 1
    for code, name in ((activations.swiglu_fwd_codestring, "swiglu_fwd"), (activations.swiglu_bwd_codestring, "swiglu_bwd")):
        assert f" {name}(" in code  # jiterator finds the function by this name


@pytest.mark.gpu
def test_swiglu_jiterator_sources_compile_and_agree():
    """What upstream does with them on CUDA: jiterator functions equal to swiglu_fwd / swiglu_bwd."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch.cuda.jiterator)")
    from flash_attn.ops import activations

    x, y, g = (torch.randn(64, device="cuda") for _ in range(3))
    fwd = torch.cuda.jiterator._create_jit_fn(activations.swiglu_fwd_codestring)
    bwd = torch.cuda.jiterator._create_multi_output_jit_fn(activations.swiglu_bwd_codestring, num_outputs=2)
    torch.testing.assert_close(fwd(x, y), activations.swiglu_fwd(x, y))
    for a, b in zip(bwd(x, y, g), activations.swiglu_bwd(x, y, g)):
        torch.testing.assert_close(a, b)
