"""``flash_attn.ops.triton.cross_entropy.cross_entropy_loss`` and
``flash_attn.losses.cross_entropy.CrossEntropyLoss`` against a float64 oracle written from the
formulas (the target distribution ``(1 - s) * onehot + s / C`` against a hand-made log-softmax, plus
the z-loss; its gradient by autograd in float64): loss and gradient with smoothing, ``logit_scale``,
z-loss and ``ignore_index``; the module's reductions; ``inplace_backward``; the Triton kernels in
Triton's interpreter; ``torch.compile(fullgraph=True)``; bad input; peak memory (no fp32 copy of the
logits); ``process_group`` over gloo with 2 CPU ranks against the single-process loss; a short
hypothesis fuzz. The tensors live on ``--flash-device`` (on a GPU the Triton kernels run).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from support import gloo_ranks
from support.options import skip_unless_the_interpreter_runs
from support.poison import poisoned_empty
from flash_attn.backends import _interpreter
from flash_attn.losses.cross_entropy import CrossEntropyLoss
from flash_attn.ops.triton import cross_entropy as ce
from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

IGNORE = -100
# one ulp (at the largest value) of the output dtype: the rounding of an exact answer, with room
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def oracle(logits, labels, smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0, ignore_index=IGNORE):
    """float64 per-row losses, z-losses and the gradient of ``sum(losses * weight)``."""
    x = logits.detach().double().requires_grad_()
    z = x * logit_scale
    peak = z.max(dim=1, keepdim=True).values.detach()
    lse = (z - peak).exp().sum(dim=1).log() + peak.squeeze(1)
    log_probs = z - lse[:, None]
    n_classes = z.shape[1]
    keep = labels != ignore_index
    target = torch.full_like(z, smoothing / n_classes)
    rows = torch.arange(z.shape[0])[keep]
    target[rows, labels[keep].long()] += 1.0 - smoothing
    z_loss = lse_square_scale * lse**2 * keep
    loss = (-(target * log_probs).sum(dim=1) + z_loss) * keep
    return loss, z_loss.detach(), x


def make_inputs(rows, cols, dtype, device, seed=0, n_ignored=2):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, cols, generator=gen)).to(dtype).to(device)
    labels = torch.randint(0, cols, (rows,), generator=gen)
    labels[torch.randperm(rows, generator=gen)[:n_ignored]] = IGNORE
    return logits, labels.to(device)


def check(ours, ref, dtype, what):
    err = (ours.double().cpu() - ref.double().cpu()).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} (tolerance {TOL[dtype] * scale:.3g})"


def run_and_compare(logits, labels, dtype, **options):
    x = logits.detach().clone().requires_grad_()
    loss, z_loss = cross_entropy_loss(x, labels, **options)
    weight = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (loss * weight.to(loss)).sum().backward()
    names = ("label_smoothing", "logit_scale", "lse_square_scale", "ignore_index")
    kwargs = {k: v for k, v in options.items() if k in names}
    if "label_smoothing" in kwargs:
        kwargs["smoothing"] = kwargs.pop("label_smoothing")
    ref_loss, ref_z, x_ref = oracle(logits.cpu(), labels.cpu(), **kwargs)
    (ref_loss * weight).sum().backward()
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    check(loss, ref_loss, torch.float32 if dtype != torch.float64 else dtype, "loss")
    check(z_loss, ref_z, torch.float32 if dtype != torch.float64 else dtype, "z-loss")
    assert x.grad.dtype == dtype
    check(x.grad, x_ref.grad, dtype, "gradient")
    assert not z_loss.requires_grad
    return loss, x.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("logit_scale", [1.0, 0.7])
@pytest.mark.parametrize("lse_square_scale", [0.0, 1e-2])
def test_loss_and_gradient_match_the_oracle(dtype, smoothing, logit_scale, lse_square_scale, device):
    logits, labels = make_inputs(9, 37, dtype, device)
    run_and_compare(logits, labels, dtype, label_smoothing=smoothing, logit_scale=logit_scale,
                    lse_square_scale=lse_square_scale)


def test_other_ignore_index_and_ignored_rows_are_zero(device):
    logits, labels = make_inputs(6, 13, torch.float32, device, n_ignored=0)
    labels[1] = 5
    loss, grad = run_and_compare(logits, labels, torch.float32, ignore_index=5, label_smoothing=0.1,
                                 lse_square_scale=0.1)
    assert loss[1].item() == 0.0 and torch.all(grad[1] == 0)
    assert (loss != 0).sum().item() == 5


def test_vocabulary_larger_than_one_row_block(monkeypatch, device):
    # the PyTorch path works on blocks of rows; make it use several, with a short last one
    monkeypatch.setattr(ce, "_BLOCK_ELEMENTS", 3 * 50)
    logits, labels = make_inputs(10, 50, torch.float32, device)
    run_and_compare(logits, labels, torch.float32, label_smoothing=0.3, lse_square_scale=1e-3)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_module_reductions_and_z_loss(reduction, device):
    logits, labels = make_inputs(8, 21, torch.float32, device, n_ignored=3)
    module = CrossEntropyLoss(reduction=reduction, label_smoothing=0.1, logit_scale=1.3, lse_square_scale=0.05,
                              return_z_loss=True)
    loss, z_loss = module(logits, labels)
    ref, ref_z, _ = oracle(logits.cpu(), labels.cpu(), 0.1, 1.3, 0.05)
    if reduction == "mean":
        ref, ref_z = ref.sum() / 5, ref_z.sum() / 5
    elif reduction == "sum":
        ref, ref_z = ref.sum(), ref_z.sum()
    check(loss, ref, torch.float32, "loss")
    check(z_loss, ref_z, torch.float32, "z-loss")
    plain = CrossEntropyLoss(reduction=reduction, label_smoothing=0.1, logit_scale=1.3, lse_square_scale=0.05)
    assert torch.equal(plain(logits, labels), loss)  # without return_z_loss: the loss alone


def test_module_mean_equals_pytorch_cross_entropy(device):
    logits, labels = make_inputs(8, 21, torch.float64, device, n_ignored=3)
    ours = CrossEntropyLoss(label_smoothing=0.25)(logits, labels)
    theirs = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.25, ignore_index=IGNORE)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_module_rejects_an_unknown_reduction():
    with pytest.raises(NotImplementedError, match="reduction"):
        CrossEntropyLoss(reduction="batchmean")


def test_inplace_backward_writes_the_gradient_into_the_logits(device):
    logits, labels = make_inputs(5, 17, torch.float32, device)
    ref_loss, _, x_ref = oracle(logits.cpu(), labels.cpu(), 0.1)
    ref_loss.sum().backward()
    x = logits.clone().requires_grad_()
    hidden = x * 1.0  # a non-leaf, as a model's output would be
    loss, _ = cross_entropy_loss(hidden, labels, label_smoothing=0.1, inplace_backward=True)
    storage = hidden.data_ptr()
    loss.sum().backward()
    check(x.grad, x_ref.grad, torch.float32, "gradient")
    check(hidden.detach(), x_ref.grad, torch.float32, "logits overwritten by the gradient")
    assert hidden.data_ptr() == storage


def test_precomputed_lse_is_used_only_where_upstream_uses_it(device):
    logits, labels = make_inputs(4, 9, torch.float64, device, n_ignored=0)
    true_lse = torch.logsumexp(logits, dim=1)
    plain, _ = cross_entropy_loss(logits, labels)
    shifted, _ = cross_entropy_loss(logits, labels, precomputed_lse=true_lse + 1.0)
    torch.testing.assert_close(shifted, plain + 1.0)  # used: logit_scale 1, no smoothing
    smoothed, _ = cross_entropy_loss(logits, labels, label_smoothing=0.1)
    ignored, _ = cross_entropy_loss(logits, labels, precomputed_lse=true_lse + 1.0, label_smoothing=0.1)
    torch.testing.assert_close(ignored, smoothed)


@pytest.mark.parametrize("kwargs, match", [
    (dict(logits=torch.randn(2, 3, 4)), "logits"),
    (dict(logits=torch.randint(0, 3, (2, 3))), "logits"),
    (dict(logits=torch.randn(2, 0)), "vocab_size"),
    (dict(labels=torch.zeros(3, dtype=torch.long)), "labels"),
    (dict(labels=torch.zeros(2)), "labels"),
    (dict(labels=torch.tensor([0, 3])), r"labels must be in \[0, 3\)"),
    (dict(labels=torch.tensor([-1, 0])), "labels must be in"),
    (dict(label_smoothing=1.5), "label_smoothing"),
    (dict(logit_scale=0.0), "logit_scale"),
    (dict(lse_square_scale=-1.0), "lse_square_scale"),
    (dict(ignore_index=1.5), "ignore_index"),
    (dict(precomputed_lse=torch.zeros(3)), "precomputed_lse"),
])
def test_bad_input_raises_naming_the_argument(kwargs, match):
    args = dict(logits=torch.randn(2, 3), labels=torch.tensor([0, 2]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        cross_entropy_loss(**args)


# --- the Triton kernels, in Triton's interpreter ---------------------------------------------------


@pytest.fixture
def interpreted_kernels(monkeypatch):
    """Route the loss through its Triton kernels, run by the interpreter on CPU tensors, with
    uninitialised memory poisoned (an output the kernels leave unwritten shows on every run); the
    names of the kernels launched, checked after the test."""
    skip_unless_the_interpreter_runs()
    launched = []

    def launch(kernel, grid, **kwargs):
        launched.append(kernel.fn.__name__)
        _interpreter.launch(kernel, grid, **kwargs)

    monkeypatch.setattr(ce, "_launch", launch)
    monkeypatch.setattr(ce, "_kernels_apply", lambda logits: logits.dtype != torch.float64)
    with poisoned_empty():
        yield
    assert launched.count("_row_stats_kernel") == 1 and launched.count("_grad_kernel") == 1, launched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("smoothing, logit_scale, lse_square_scale", [(0.0, 1.0, 0.0), (0.2, 0.7, 1e-2)])
def test_triton_kernels_in_the_interpreter(interpreted_kernels, dtype, smoothing, logit_scale, lse_square_scale):
    logits, labels = make_inputs(5, 37, dtype, "cpu")
    run_and_compare(logits, labels, dtype, label_smoothing=smoothing, logit_scale=logit_scale,
                    lse_square_scale=lse_square_scale)


def test_triton_kernels_with_a_precomputed_lse(interpreted_kernels):
    # the forward kernel computes neither the logsumexp nor the row sum then
    logits, labels = make_inputs(5, 37, torch.float32, "cpu")
    lse = torch.logsumexp(logits.double(), dim=1).float()
    run_and_compare(logits, labels, torch.float32, precomputed_lse=lse, lse_square_scale=1e-2)


def test_triton_kernels_loop_over_column_blocks(monkeypatch, interpreted_kernels):
    # blocks of 16 columns: the forward's online logsumexp runs 5 steps with a ragged last one,
    # the backward runs 5 programs per row
    monkeypatch.setattr(ce, "_block", lambda n_cols: 16)
    logits, labels = make_inputs(4, 70, torch.float32, "cpu")
    labels[0] = 69  # the label in the ragged last block
    run_and_compare(logits, labels, torch.float32, label_smoothing=0.1, lse_square_scale=1e-2)


def test_triton_row_statistics_of_a_vocabulary_slice():
    # a rank of a vocabulary-parallel group: labels outside its columns contribute no label logit
    skip_unless_the_interpreter_runs()
    logits, _ = make_inputs(4, 12, torch.float32, "cpu")
    labels = torch.tensor([12, 15, 23, 3])  # columns 12..23 are this rank's
    stats = ce._row_stats_torch(logits, labels, 12, 0.5, True, True)
    ce._launch, saved = _interpreter.launch, ce._launch
    try:
        kernel_stats = ce._row_stats_triton(logits, labels, 12, 0.5, True, True, block=8)
    finally:
        ce._launch = saved
    z = logits.double() * 0.5
    torch.testing.assert_close(stats[0].double(), torch.logsumexp(z, 1))
    torch.testing.assert_close(stats[1].double(), z.sum(1))
    expected_label = torch.tensor([z[0, 0], z[1, 3], z[2, 11], 0.0], dtype=torch.float64)
    torch.testing.assert_close(stats[2].double(), expected_label)
    for ours, theirs in zip(kernel_stats, stats):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# --- torch.compile, memory, hypothesis ---------------------------------------------------------------


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    logits, labels = make_inputs(6, 19, torch.float32, device)

    def step(x, y):
        loss, z_loss = cross_entropy_loss(x, y, label_smoothing=0.1, logit_scale=0.9, lse_square_scale=1e-2)
        return loss.sum(), z_loss

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x_eager, x_comp = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    eager_loss, eager_z = step(x_eager, labels)
    comp_loss, comp_z = compiled(x_comp, labels)
    eager_loss.backward()
    comp_loss.backward()
    torch.testing.assert_close(comp_loss, eager_loss)
    torch.testing.assert_close(comp_z, eager_z)
    torch.testing.assert_close(x_comp.grad, x_eager.grad)


def _peak_growth_mib(fn) -> float:
    from flash_attn.bench import cpu as bench_cpu

    bench_cpu._release_freed_memory()
    base = bench_cpu._status_kib("VmRSS")
    if base is None or not bench_cpu._reset_peak():
        pytest.skip("needs Linux's /proc/self/status and clear_refs to measure peak memory")
    fn()
    return (bench_cpu._peak_kib() - base) / 1024


def test_peak_memory_has_no_fp32_copy_of_the_logits():
    """2,048 tokens x 32k vocabulary in bf16 (128 MiB of logits; an fp32 copy is 256 MiB)."""
    torch.manual_seed(0)
    rows, cols = 2048, 32768
    logits = torch.randn(rows, cols).to(torch.bfloat16)
    labels = torch.randint(0, cols, (rows,))
    logits_mib = logits.numel() * 2 / 2**20
    fp32_copy_mib = 2 * logits_mib

    def naive():
        x = logits.clone().requires_grad_()
        torch.nn.functional.cross_entropy(x.float(), labels).backward()

    def ours(inplace):
        def run():
            x = logits.clone()  # the clone's memory is counted the same way in every case
            x.requires_grad_()
            hidden = x * 1 if inplace else x
            loss, _ = cross_entropy_loss(hidden, labels, inplace_backward=inplace)
            loss.sum().backward()
        return run

    naive_mib = _peak_growth_mib(naive)
    inplace_mib = _peak_growth_mib(ours(True))
    plain_mib = _peak_growth_mib(ours(False))
    # the measurement sees an fp32 copy (the naive loss has one, and its log-softmax, at least)
    assert naive_mib > logits_mib + fp32_copy_mib, naive_mib
    # ours: the clone, the leaf's gradient, the hidden (inplace) or gradient buffer, plus a bounded block
    budget = 3 * logits_mib + fp32_copy_mib / 4
    assert inplace_mib < budget, (inplace_mib, budget)
    assert plain_mib < budget, (plain_mib, budget)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(rows=st.integers(1, 9), cols=st.integers(1, 40), smoothing=st.sampled_from([0.0, 0.05, 1.0]),
       logit_scale=st.sampled_from([1.0, 0.3, 2.5]), lse_square_scale=st.sampled_from([0.0, 1e-3]),
       n_ignored=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_fuzz_against_the_oracle(rows, cols, smoothing, logit_scale, lse_square_scale, n_ignored, seed):
    logits, labels = make_inputs(rows, cols, torch.float32, "cpu", seed=seed, n_ignored=min(n_ignored, rows))
    run_and_compare(logits, labels, torch.float32, label_smoothing=smoothing, logit_scale=logit_scale,
                    lse_square_scale=lse_square_scale)


# --- process_group: vocabulary-parallel logits over gloo ------------------------------------------


PARALLEL_OPTIONS = dict(label_smoothing=0.1, logit_scale=0.8, lse_square_scale=1e-2)


def parallel_inputs():
    logits, labels = make_inputs(6, 20, torch.float64, "cpu", seed=3)
    labels[0], labels[1] = 0, 19  # labels on the first and on the last rank's columns
    return logits, labels


def parallel_worker(rank, world, init_file, result_dir):
    logits, labels = parallel_inputs()
    cols = logits.shape[1] // world
    with gloo_ranks.process_group(rank, world, init_file):
        group = torch.distributed.group.WORLD
        x = logits[:, rank * cols:(rank + 1) * cols].clone().requires_grad_()
        loss, z_loss = cross_entropy_loss(x, labels, process_group=group, **PARALLEL_OPTIONS)
        loss.sum().backward()
        module_loss = CrossEntropyLoss(process_group=group, **PARALLEL_OPTIONS)(
            logits[:, rank * cols:(rank + 1) * cols], labels)
    gloo_ranks.write_result(result_dir, rank, {"loss": loss.tolist(), "z_loss": z_loss.tolist(),
                                               "grad": x.grad.tolist(), "module_loss": module_loss.item()})


def test_process_group_over_gloo_equals_the_single_process_loss(tmp_path, monkeypatch):
    gloo_ranks.skip_unless_cpu_ranks_can_run(monkeypatch)
    world = 2
    results = gloo_ranks.spawn(parallel_worker, world, tmp_path)
    logits, labels = parallel_inputs()
    x = logits.clone().requires_grad_()
    loss, z_loss = cross_entropy_loss(x, labels, **PARALLEL_OPTIONS)
    loss.sum().backward()
    module_loss = CrossEntropyLoss(**PARALLEL_OPTIONS)(logits, labels)
    grads = [torch.tensor(results[rank]["grad"], dtype=torch.float64) for rank in range(world)]
    for rank in range(world):
        torch.testing.assert_close(torch.tensor(results[rank]["loss"], dtype=torch.float64), loss.detach())
        torch.testing.assert_close(torch.tensor(results[rank]["z_loss"], dtype=torch.float64), z_loss)
        assert results[rank]["module_loss"] == pytest.approx(module_loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.cat(grads, dim=1), x.grad)
    ref_loss, _, _ = oracle(logits, labels, 0.1, 0.8, 1e-2)
    torch.testing.assert_close(loss.detach(), ref_loss.detach())
