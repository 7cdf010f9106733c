"""flash_attn.utils.generation: top-k / top-p filtering against loop-by-loop float64 oracles,
``sample``'s distribution, and ``decode`` on a tiny language model built from flash_attn.modules
(the kv cache through ``InferenceParams``): greedy decoding gives the tokens and logits of
re-running the whole sequence without a cache, ``teacher_outputs`` and ``eos_token_id`` work,
speculative decoding gives the main model's greedy tokens and draws from its distribution, and
CUDA-graph decoding gives eager decoding's tokens (on a CUDA device; elsewhere a clear error).
"""

from __future__ import annotations

import math
import os
from collections import namedtuple

import pytest
import torch
from torch import nn

from support.options import test_device
from flash_attn.modules.block import Block
from flash_attn.modules.embedding import GPT2Embeddings
from flash_attn.modules.mha import MHA
from flash_attn.modules.mlp import Mlp
from flash_attn.utils import generation
from flash_attn.utils.generation import (
    GenerationMixin,
    InferenceParams,
    allocate_inference_cache,
    decode,
    modify_logits_for_top_k_filtering,
    modify_logits_for_top_p_filtering,
    sample,
)

VOCAB, E, H = 37, 32, 2


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(test_device())


# ---------------------------------------------------------------------------------------------
# filtering and sampling
# ---------------------------------------------------------------------------------------------


def top_k_oracle(row, k):
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return [v if v >= kth else -math.inf for v in row.tolist()]


def top_p_oracle(row, p):
    """Drop, from the smallest up, every token whose probability plus that of all smaller tokens
    is at most ``1 - p``."""
    values = row.double().tolist()
    peak = max(values)
    probs = [math.exp(v - peak) for v in values]
    total = sum(probs)
    order = sorted(range(len(values)), key=lambda i: values[i])
    out, mass = list(values), 0.0
    for i in order:
        mass += probs[i] / total
        if mass <= 1 - p:
            out[i] = -math.inf
    return out


def test_top_k_filtering_matches_oracle():
    logits = randn(3, 11)
    for k in (1, 4, 11):
        filtered = logits.clone()
        modify_logits_for_top_k_filtering(filtered, k)  # in place
        for row, ref in zip(filtered, (top_k_oracle(r, k) for r in logits)):
            assert row.tolist() == pytest.approx(ref)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_filtering_matches_oracle(p):
    logits = randn(4, 13, seed=1) * 2
    filtered = logits.clone()
    modify_logits_for_top_p_filtering(filtered, p)
    for row, ref in zip(filtered, (top_p_oracle(r, p) for r in logits)):
        assert row.tolist() == pytest.approx(ref)
        assert math.isfinite(max(row.tolist()))  # the most likely token always stays


@pytest.mark.parametrize("p", [0.0, 1.0, -1.0])
def test_top_p_outside_open_interval_is_a_no_op(p):
    logits = randn(2, 5)
    filtered = logits.clone()
    modify_logits_for_top_p_filtering(filtered, p)
    assert torch.equal(filtered, logits)


def test_sample_greedy_is_argmax():
    logits = randn(5, 9, seed=2)
    assert torch.equal(sample(logits), logits.argmax(-1))
    assert torch.equal(sample(logits, top_k=1, top_p=0.5, temperature=0.1), logits.argmax(-1))


@pytest.mark.parametrize("top_k,top_p,temperature", [(3, 0.0, 1.0), (0, 0.0, 1.0), (0, 0.8, 0.7),
                                                     (4, 0.7, 2.0)])
def test_sample_follows_the_filtered_softmax(top_k, top_p, temperature):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5]], device=test_device())
    ref = logits.double()[0].cpu() / temperature  # the oracle on the host, where the draws are counted
    if top_k:
        ref = torch.tensor(top_k_oracle(ref, top_k), dtype=torch.float64)
    if top_p:
        ref = torch.tensor(top_p_oracle(ref, top_p), dtype=torch.float64)
    probs = torch.softmax(ref, -1)
    before = logits.clone()
    torch.manual_seed(0)
    n = 6000
    draws = torch.stack([sample(logits, top_k=top_k, top_p=top_p, temperature=temperature)
                         for _ in range(n)]).flatten().cpu()
    assert torch.equal(logits, before)  # the caller's logits are left alone
    freq = torch.bincount(draws, minlength=6).double() / n
    assert (freq[probs == 0] == 0).all(), f"filtered tokens drawn: {freq} vs {probs}"
    # 4.5 standard deviations of a binomial proportion
    sd = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 4.5 * sd + 1e-9).all(), f"{freq} vs {probs}"


def test_sample_rejects_top_p_above_one():
    with pytest.raises(ValueError, match="top_p"):
        sample(randn(1, 4), top_k=0, top_p=1.5)


# ---------------------------------------------------------------------------------------------
# decode on a tiny model
# ---------------------------------------------------------------------------------------------

Output = namedtuple("Output", ["logits"])


class TinyLM(nn.Module, GenerationMixin):
    """Embeddings, two prenorm blocks of causal MHA (rotary) + MLP, final norm, LM head: the
    interface ``decode`` expects (``inference_params``, ``num_last_tokens``)."""

    def __init__(self, use_flash_attn):
        super().__init__()
        self.embeddings = GPT2Embeddings(E, VOCAB, 0)
        self.layers = nn.ModuleList(
            Block(E, mixer_cls=lambda d, i=i: MHA(d, H, num_heads_kv=1, causal=True, layer_idx=i,
                                                  rotary_emb_dim=16, use_flash_attn=use_flash_attn),
                  mlp_cls=lambda d: Mlp(d, hidden_features=2 * d))
            for i in range(2)
        )
        self.norm = nn.LayerNorm(E)
        self.lm_head = nn.Linear(E, VOCAB, bias=False)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype)
                for i, layer in enumerate(self.layers)}

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0):
        hidden, residual = self.embeddings(input_ids, position_ids=position_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual,
                                     mixer_kwargs={"inference_params": inference_params})
        hidden = self.norm(hidden + residual)
        if num_last_tokens > 0:
            hidden = hidden[:, -num_last_tokens:]
        return Output(logits=self.lm_head(hidden))


def _model(use_flash_attn):
    torch.manual_seed(0)
    return TinyLM(use_flash_attn).to(test_device()).eval()


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
def test_greedy_decode_matches_recomputing_the_whole_sequence(use_flash_attn):
    model = _model(use_flash_attn)
    prompt = torch.tensor([[1, 5, 9], [2, 2, 30]], device=test_device())
    out = decode(prompt, model, max_length=9)
    assert isinstance(out, generation.GreedySearchDecoderOnlyOutput)
    assert out.sequences.shape == (2, 9) and len(out.scores) == 6
    assert torch.equal(out.sequences[:, :3], prompt)
    # Without a cache: the whole sequence so far, every step.
    seq = prompt
    with torch.no_grad():
        for step in range(6):
            logits = model(seq).logits[:, -1]
            torch.testing.assert_close(out.scores[step], logits, rtol=1e-4, atol=1e-5)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, seq)


def test_decode_teacher_outputs_eos_and_vocab_size():
    model = _model(True)
    prompt = torch.tensor([[4, 8]], device=test_device())
    teacher = torch.tensor([[4, 8, 11, 12, 13]], device=test_device())
    out = decode(prompt, model, max_length=7, teacher_outputs=teacher)
    assert out.sequences[0, :5].tolist() == teacher[0].tolist()
    # eos: stop as soon as every sequence emitted it
    eos = int(out.sequences[0, 3])
    stopped = decode(prompt, model, max_length=7, teacher_outputs=teacher, eos_token_id=eos)
    assert stopped.sequences[0].tolist() == teacher[0, :4].tolist()
    narrow = decode(prompt, model, max_length=5, vocab_size=10)
    assert all(s.shape[-1] == 10 for s in narrow.scores)
    assert (narrow.sequences[0, 2:] < 10).all()


def test_sampled_decode_returns_sample_output():
    model = _model(False)
    torch.manual_seed(0)
    out = decode(torch.tensor([[3]], device=test_device()), model, max_length=6, top_k=5,
                 temperature=0.8)
    assert isinstance(out, generation.SampleDecoderOnlyOutput)
    assert out.sequences.shape == (1, 6)


def test_generate_and_enable_timing(caplog):
    model = _model(True)
    prompt = torch.tensor([[7, 7]], device=test_device())
    sequences = model.generate(prompt, max_length=5)
    assert torch.equal(sequences, decode(prompt, model, max_length=5).sequences)
    with caplog.at_level("INFO", logger="flash_attn.utils.generation"):
        full = model.generate(prompt, max_length=5, return_dict_in_generate=True, output_scores=False,
                              enable_timing=True)
    assert full.scores is None and torch.equal(full.sequences, sequences)
    assert "decoding time" in caplog.text


def test_model_cache_allocation_and_helper():
    caches = allocate_inference_cache(3, 16, 2, 8, layers=[0, 4], device="cpu", dtype=torch.float32)
    assert sorted(caches) == [0, 4] and caches[4].shape == (3, 16, 2, 2, 8)
    assert len(allocate_inference_cache(1, 2, 1, 4, layers=2, device="cpu")) == 2
    with pytest.raises(ValueError, match="dtype"):
        allocate_inference_cache(1, 2, 1, 4, layers=1, device="cpu", dtype=torch.float64)
    model = _model(True)
    caches = model.allocate_inference_cache(2, 12)
    assert caches[1].shape == (2, 12, 2, 1, E // H)
    # decoding through preallocated caches gives the same tokens
    params = InferenceParams(max_seqlen=12, max_batch_size=2, key_value_memory_dict=caches)
    prompt = torch.tensor([[1, 2], [3, 4]], device=test_device())
    with torch.no_grad():
        logits = model(prompt, inference_params=params, num_last_tokens=1).logits
    assert params.key_value_memory_dict[0] is caches[0]
    torch.testing.assert_close(logits[:, -1], model(prompt).logits[:, -1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
def test_caches_sized_for_a_larger_batch_serve_a_smaller_one(use_flash_attn):
    """CUDA graphs captured for batch 2 are reused for batch 1 (``update_graph_cache``): the
    state then holds caches and per-sequence lengths for 2; a batch-1 prompt and the steps after
    it use the first row. (The GPU test replays the graphs; this one runs the same state eagerly,
    on any device.)"""
    model = _model(use_flash_attn)
    caches = model.allocate_inference_cache(2, 8)
    params = InferenceParams(max_seqlen=8, max_batch_size=2, key_value_memory_dict=caches,
                             lengths_per_sample=torch.zeros(2, dtype=torch.int32, device=test_device()))
    seq = torch.tensor([[1, 5, 9]], device=test_device())
    with torch.no_grad():
        logits = model(seq, inference_params=params, num_last_tokens=1).logits[:, -1]
        torch.testing.assert_close(logits, model(seq).logits[:, -1], rtol=1e-4, atol=1e-5)
        params.seqlen_offset = params.lengths_per_sample[:] = seq.shape[1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
        position_ids = torch.full((1, 1), params.seqlen_offset, dtype=torch.long, device=test_device())
        step = model(seq[:, -1:], position_ids=position_ids, inference_params=params, num_last_tokens=1).logits
        torch.testing.assert_close(step[:, -1], model(seq).logits[:, -1], rtol=1e-4, atol=1e-5)


def test_cuda_graph_decoding_needs_a_cuda_model():
    model = _model(True).cpu()  # on a GPU runner too: a model on the host has nothing to capture
    with pytest.raises(ValueError, match="cg=False"):
        decode(torch.tensor([[1]]), model, max_length=3, cg=True)
    with pytest.raises(ValueError, match="CUDA device"):
        generation.update_graph_cache(model, None, 1, 1, 8)


def test_cuda_graph_decode_matches_eager(monkeypatch):
    if test_device().type != "cuda":
        pytest.skip("needs a CUDA device")
    # Captured attention needs a kernel: half precision, and a kernel backend where the run's
    # default (the PyTorch reference, which reads tensor values on the host) cannot be captured.
    if os.environ.get("FLASH_ATTN_BACKEND") == "reference":
        monkeypatch.setenv("FLASH_ATTN_BACKEND", "auto")
    model, draft = _model(True).half(), _model(True).half()
    prompt = torch.tensor([[1, 5, 9], [2, 2, 30]], device=test_device())
    eager = decode(prompt, model, max_length=12)
    graphed = decode(prompt, model, max_length=12, cg=True)
    assert torch.equal(graphed.sequences, eager.sequences)
    for ours, theirs in zip(graphed.scores, eager.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-2)  # fp16: the kernels may split differently
    again = decode(prompt[:1], model, max_length=10, cg=True)  # a smaller batch: the graphs are reused
    assert torch.equal(again.sequences, eager.sequences[:1, :10])
    spec = generation.decode_speculative(prompt[:1], model, draft, max_length=12, cg=True)
    assert torch.equal(spec.sequences, eager.sequences[:1])


# ---------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------


def test_sample_speculative_greedy_keeps_the_drafts_the_main_model_would_pick():
    logits = randn(3, 4, 11, seed=5)
    best = logits.argmax(-1)  # (3, 4): what greedy decoding of the main model picks
    drafts = best[:, :3].clone()
    drafts[1, 1] = (best[1, 1] + 1) % 11  # row 1: its second draft is wrong
    drafts[2, 0] = (best[2, 0] + 1) % 11  # row 2: its first
    # greedy drafts: the draft model's argmax (one-hot logits that agree with the drafts)
    draft_logits = torch.full((3, 3, 11), -30.0, device=logits.device).scatter(-1, drafts.unsqueeze(-1), 30.0)
    tokens, generated = generation.sample_speculative(logits, draft_logits, drafts)
    assert generated.tolist() == [4, 2, 1]
    assert torch.equal(tokens[0], best[0])
    assert torch.equal(tokens[1, :2], best[1, :2]) and torch.equal(tokens[2, :1], best[2, :1])


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 0.0, 1.0), (3, 0.0, 0.7), (0, 0.9, 1.3)])
def test_sample_speculative_draws_from_the_main_model(top_k, top_p, temperature):
    """Whatever the draft proposes, the first new token is distributed as sampling the main
    model (the theorem of speculative sampling), and a draft token is kept with probability
    sum(min(p, q)). Checked on 200k rows against float64 oracles (5 sigma)."""
    torch.manual_seed(7)
    rows, vocab = 200_000, 5
    main = randn(1, 2, vocab, seed=8).expand(rows, 2, vocab).contiguous() * 1.5
    draft = randn(1, 1, vocab, seed=9).expand(rows, 1, vocab).contiguous() * 1.5
    q = generation._filtered_probs(draft.double()[:1, 0], top_k, top_p, temperature)[0]
    p = generation._filtered_probs(main.double()[:1, 0], top_k, top_p, temperature)[0]
    tokens_draft = torch.multinomial(q.float(), rows, replacement=True).view(rows, 1)
    tokens, generated = generation.sample_speculative(main, draft, tokens_draft, top_k=top_k, top_p=top_p,
                                                      temperature=temperature)
    counts = torch.bincount(tokens[:, 0], minlength=vocab).double()
    sigma = (rows * p * (1 - p)).sqrt()
    assert ((counts - rows * p).abs() <= 5 * sigma + 1).all(), (counts / rows, p)
    accept = torch.minimum(p, q).sum()
    kept = (generated == 2).double().sum()
    assert abs(kept - rows * accept) <= 5 * (rows * accept * (1 - accept)).sqrt() + 1


def test_sample_speculative_checks_its_inputs():
    logits, draft, tokens = randn(2, 4, 7), randn(2, 3, 7), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="logits_draft"):
        generation.sample_speculative(logits[:, :3], draft, tokens)
    with pytest.raises(ValueError, match="int32/int64"):
        generation.sample_speculative(logits, draft, tokens.float())
    with pytest.raises(ValueError, match="top_p"):
        generation.sample_speculative(logits, draft, tokens, top_k=0, top_p=1.5)


def _greedy_without_cache(model, prompt, max_length):
    seq, logits_seen = prompt, []
    with torch.no_grad():
        while seq.shape[1] < max_length:
            logits = model(seq).logits[:, -1]
            logits_seen.append(logits)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq, torch.stack(logits_seen, dim=1)


@pytest.mark.parametrize("draft_seed", [0, 1], ids=["same-model", "other-model"])
@pytest.mark.parametrize("lookahead", [1, 3, 5])
def test_greedy_speculative_decoding_gives_the_main_models_tokens(draft_seed, lookahead):
    model = _model(True)
    torch.manual_seed(draft_seed)
    draft = TinyLM(False).to(test_device()).eval()  # another model (its own weights) or the same
    if draft_seed == 0:
        draft.load_state_dict(model.state_dict())
    prompt = torch.tensor([[1, 5, 9]], device=test_device())
    out = generation.decode_speculative(prompt, model, draft, max_length=14, speculative_lookahead=lookahead)
    expected, expected_logits = _greedy_without_cache(model, prompt, 14)
    assert isinstance(out, generation.GreedySearchDecoderOnlyOutput)
    assert torch.equal(out.sequences, expected)
    assert out.scores.shape == (1, 11, VOCAB)
    torch.testing.assert_close(out.scores, expected_logits, rtol=1e-4, atol=1e-4)


def test_speculative_decoding_with_its_own_draft_keeps_every_draft(caplog):
    model = _model(True)
    prompt = torch.tensor([[3, 1]], device=test_device())
    with caplog.at_level("INFO", logger="flash_attn.utils.generation"):
        out = generation.decode_speculative(prompt, model, model, max_length=12, speculative_lookahead=4,
                                            top_k=0, temperature=0.8, enable_timing=True)
    assert isinstance(out, generation.SampleDecoderOnlyOutput) and out.sequences.shape == (1, 12)
    assert int(out.sequences.max()) < VOCAB
    # p == q for every draft token: kept with probability 1; 10 new tokens in rounds of 4 + 1
    assert "acceptance rate 100.00%" in caplog.text and "2 calls to the main model" in caplog.text


def test_speculative_decoding_checks_its_inputs():
    model = _model(True)
    with pytest.raises(ValueError, match="batch size 1"):
        generation.decode_speculative(torch.tensor([[1], [2]]), model, model, max_length=5)
    with pytest.raises(ValueError, match="eos_token_id"):
        generation.decode_speculative(torch.tensor([[1]]), model, model, max_length=5, eos_token_id=0)
    with pytest.raises(ValueError, match="speculative_lookahead"):
        generation.decode_speculative(torch.tensor([[1]]), model, model, max_length=5, speculative_lookahead=0)
