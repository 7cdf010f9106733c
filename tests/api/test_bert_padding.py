"""Padding helpers against hand-computed values and naive loops."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_attn.bert_padding import (
    index_first_axis,
    index_first_axis_residual,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)


def naive_unpad(x, keep):
    """Row-major loop over (batch, seqlen) collecting kept tokens."""
    rows, idx, lengths = [], [], []
    batch, seqlen = keep.shape
    for b in range(batch):
        n = 0
        for s in range(seqlen):
            if keep[b, s]:
                rows.append(x[b, s])
                idx.append(b * seqlen + s)
                n += 1
        lengths.append(n)
    packed = torch.stack(rows) if rows else x.new_zeros((0, *x.shape[2:]))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return packed, idx, cu, max(lengths, default=0)


def test_unpad_hand_computed():
    x = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    packed, indices, cu, max_seqlen, seqused = unpad_input(x, mask)
    assert indices.tolist() == [0, 1, 4, 5, 6, 7]
    assert indices.dtype == torch.int64
    assert cu.tolist() == [0, 2, 6, 6] and cu.dtype == torch.int32
    assert type(max_seqlen) is int and max_seqlen == 4
    assert seqused.tolist() == [2, 4, 0] and seqused.dtype == torch.int32
    assert torch.equal(packed, x.reshape(12, 2)[[0, 1, 4, 5, 6, 7]])


def test_unpad_mask_with_holes_and_int_mask():
    x = torch.randn(2, 5, 3)
    mask = torch.tensor([[0, 1, 0, 1, 1], [1, 0, 0, 0, 1]])
    packed, indices, cu, max_seqlen, seqused = unpad_input(x, mask)
    assert indices.tolist() == [1, 3, 4, 5, 9]
    assert cu.tolist() == [0, 3, 5] and max_seqlen == 3 and seqused.tolist() == [3, 2]
    ref_packed, _, _, _ = naive_unpad(x, mask.bool())
    assert torch.equal(packed, ref_packed)
    # An int mask and the equivalent bool mask give identical results.
    for a, b in zip(unpad_input(x, mask), unpad_input(x, mask.bool())):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_unused_mask():
    x = torch.randn(2, 4, 3)
    attention_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    unused_mask = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    packed, indices, cu, max_seqlen, seqused = unpad_input(x, attention_mask, unused_mask)
    # Unused slots are kept in the packed tensor and in cu_seqlens / max_seqlen ...
    assert indices.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert cu.tolist() == [0, 3, 7] and max_seqlen == 4
    # ... but seqused counts only the real tokens.
    assert seqused.tolist() == [2, 1]
    assert torch.equal(packed, x.reshape(8, 3)[[0, 1, 2, 4, 5, 6, 7]])
    # Without unused_mask, seqused equals the per-row lengths.
    _, _, cu_plain, max_plain, used_plain = unpad_input(x, attention_mask)
    assert cu_plain.tolist() == [0, 2, 3] and max_plain == 2 and used_plain.tolist() == [2, 1]


def test_unused_mask_overlap_counts_once():
    x = torch.randn(1, 3, 2)
    attention_mask = torch.tensor([[1, 1, 0]])
    unused_mask = torch.tensor([[0, 1, 1]])
    _, indices, cu, max_seqlen, seqused = unpad_input(x, attention_mask, unused_mask)
    assert indices.tolist() == [0, 1, 2] and cu.tolist() == [0, 3]
    assert max_seqlen == 3 and seqused.tolist() == [2]


@pytest.mark.parametrize("trailing", [(), (3,), (2, 5)])
def test_roundtrip(trailing):
    torch.manual_seed(0)
    x = torch.randn(4, 6, *trailing)
    mask = torch.rand(4, 6) > 0.4
    mask[2] = False  # an empty row
    packed, indices, cu, max_seqlen, _ = unpad_input(x, mask)
    ref_packed, ref_idx, ref_cu, ref_max = naive_unpad(x, mask)
    assert torch.equal(packed, ref_packed)
    assert indices.tolist() == ref_idx and cu.tolist() == ref_cu and max_seqlen == ref_max
    padded = pad_input(packed, indices, 4, 6)
    assert padded.shape == x.shape
    expected = x * mask.reshape(4, 6, *([1] * len(trailing)))
    assert torch.equal(padded, expected)


def test_empty_inputs():
    x = torch.randn(2, 3, 4)
    packed, indices, cu, max_seqlen, seqused = unpad_input(x, torch.zeros(2, 3, dtype=torch.bool))
    assert packed.shape == (0, 4) and indices.numel() == 0
    assert cu.tolist() == [0, 0, 0] and max_seqlen == 0 and seqused.tolist() == [0, 0]
    assert torch.equal(pad_input(packed, indices, 2, 3), torch.zeros(2, 3, 4))
    packed, _, cu, max_seqlen, _ = unpad_input(torch.randn(0, 3, 4), torch.ones(0, 3))
    assert packed.shape == (0, 4) and cu.tolist() == [0] and max_seqlen == 0


def test_non_contiguous_hidden_states():
    base = torch.randn(6, 3, 4)
    x = base.transpose(0, 1)  # (3, 6, 4), non-contiguous
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0] * 6, [1] * 6], dtype=torch.bool)
    packed, indices, _, _, _ = unpad_input(x, mask)
    assert torch.equal(packed, naive_unpad(x, mask)[0])
    assert torch.equal(pad_input(packed, indices, 3, 6), x * mask[..., None])


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda b: st.integers(1, 6).flatmap(
            lambda s: st.tuples(
                st.just((b, s)), st.lists(st.booleans(), min_size=b * s, max_size=b * s)
            )
        )
    )
)
def test_roundtrip_property(case):
    (batch, seqlen), bits = case
    mask = torch.tensor(bits, dtype=torch.bool).reshape(batch, seqlen)
    x = torch.randn(batch, seqlen, 2)
    packed, indices, cu, max_seqlen, seqused = unpad_input(x, mask)
    ref_packed, ref_idx, ref_cu, ref_max = naive_unpad(x, mask)
    assert torch.equal(packed, ref_packed)
    assert indices.tolist() == ref_idx and cu.tolist() == ref_cu and max_seqlen == ref_max
    assert seqused.tolist() == [ref_cu[i + 1] - ref_cu[i] for i in range(batch)]
    assert torch.equal(pad_input(packed, indices, batch, seqlen), x * mask[..., None])


def test_index_first_axis_gradients():
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([4, 0, 2])
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, indices), (x,))
    out = index_first_axis(x, indices)
    assert torch.equal(out, x.detach()[[4, 0, 2]])
    grad = torch.randn_like(out)
    out.backward(grad)
    expected = torch.zeros_like(x)
    expected[[4, 0, 2]] = grad
    assert torch.equal(x.grad, expected)


def test_index_first_axis_repeated_indices_accumulate():
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([1, 1, 2])
    index_first_axis(x, indices).sum().backward()
    assert x.grad[:, 0].tolist() == [0.0, 2.0, 1.0]
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, indices), (x,))


def test_index_put_first_axis_gradients():
    values = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([5, 1, 3])
    out = index_put_first_axis(values, indices, 6)
    expected = torch.zeros(6, 4, dtype=torch.float64)
    expected[[5, 1, 3]] = values.detach()
    assert torch.equal(out, expected)
    assert torch.autograd.gradcheck(lambda v: index_put_first_axis(v, indices, 6), (values,))
    grad = torch.randn(6, 4, dtype=torch.float64)
    out.backward(grad)
    assert torch.equal(values.grad, grad[[5, 1, 3]])


def test_unpad_pad_gradient_flows_only_to_kept_tokens():
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    packed, indices, *_ = unpad_input(x, mask)
    (pad_input(packed * 3.0, indices, 2, 3)).sum().backward()
    assert torch.equal(x.grad, 3.0 * mask[..., None].double().expand(2, 3, 4))


def test_index_first_axis_residual():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([3, 1, 1])
    gathered, residual = index_first_axis_residual(x, indices)
    assert torch.equal(gathered, x.detach()[[3, 1, 1]]) and torch.equal(residual, x.detach())
    assert torch.autograd.gradcheck(lambda t: index_first_axis_residual(t, indices), (x,))


def test_concatenated_sequences_upstream_example():
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.randn(3, 6, 2)
    packed, indices, cu, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and cu.dtype == torch.int32
    assert type(max_seqlen) is int and max_seqlen == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10] + list(range(12, 18))
    assert torch.equal(packed, x.reshape(18, 2)[indices])


def test_concatenated_sequences_zeros_between_lengths_and_roundtrip():
    # Zeros inside a row are skipped: only nonzero entries are sequence lengths.
    lengths = torch.tensor([[1, 0, 2, 0], [0, 0, 0, 0]], dtype=torch.int32)
    x = torch.randn(2, 4, 3)
    packed, indices, cu, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 1, 3] and max_seqlen == 2 and indices.tolist() == [0, 1, 2]
    keep = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(pad_input(packed, indices, 2, 4), x * keep[..., None])


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: unpad_input(torch.randn(2, 3, 4), torch.ones(6)), "attention_mask"),
        (lambda: unpad_input(torch.randn(2, 3, 4), torch.ones(2, 3, 1)), "attention_mask"),
        (lambda: unpad_input(torch.randn(2, 3, 4), torch.ones(3, 2)), "hidden_states"),
        (lambda: unpad_input(torch.randn(6), torch.ones(2, 3)), "hidden_states"),
        (
            lambda: unpad_input(torch.randn(2, 3, 4), torch.ones(2, 3), torch.ones(2, 2)),
            "unused_mask",
        ),
        (lambda: pad_input(torch.randn(3, 4), torch.tensor([0, 1]), 2, 3), "one row per index"),
        (lambda: pad_input(torch.randn(2, 4), torch.tensor([[0, 1]]), 2, 3), "1-D"),
        (lambda: pad_input(torch.randn(2, 4), torch.tensor([0.0, 1.0]), 2, 3), "int32 or int64"),
        (lambda: index_first_axis(torch.randn(3, 2), torch.tensor([[0]])), "1-D"),
        (
            lambda: unpad_input_for_concatenated_sequences(torch.randn(1, 3, 2), torch.ones(1, 3)),
            "integer",
        ),
        (
            lambda: unpad_input_for_concatenated_sequences(
                torch.randn(1, 3, 2), torch.tensor([[2, 2, 0]])
            ),
            "at most seqlen",
        ),
        (
            lambda: unpad_input_for_concatenated_sequences(
                torch.randn(1, 3, 2), torch.tensor([[1, 2]])
            ),
            "hidden_states",
        ),
    ],
)
def test_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_torch_compile():
    torch._dynamo.reset()

    def fn(x, mask):
        packed, indices, cu, max_seqlen, seqused = unpad_input(x, mask)
        return pad_input(packed * 2.0, indices, x.shape[0], x.shape[1]), cu, seqused, max_seqlen

    x = torch.randn(3, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    compiled = torch.compile(fn, backend="aot_eager")
    got, want = compiled(x, mask), fn(x, mask)
    for a, b in zip(got, want):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
