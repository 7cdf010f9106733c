"""Autoregressive generation helpers with upstream's names: ``InferenceParams`` (the kv-cache
state that ``MHA`` reads and writes), top-k / top-p sampling, ``decode``, speculative decoding
(``sample_speculative``, ``decode_speculative``) and decoding through CUDA graphs (``cg=True``,
``update_graph_cache``, ``capture_graph``: CUDA models only).

``enable_timing`` logs the time (logger ``flash_attn.utils.generation``, level INFO) where upstream
prints it: the package never writes to stdout.
"""

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

log = logging.getLogger(__name__)


@dataclass
class InferenceParams:
    """What a model needs to decode step by step: the kv caches (``key_value_memory_dict``,
    by layer index) and where the next tokens go (``seqlen_offset``, or per sequence
    ``lengths_per_sample``)."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[Tensor] = None

    def reset(self, max_seqlen, max_batch_size):
        """Start a new generation; the allocated caches are kept for reuse."""
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


@dataclass
class GreedySearchDecoderOnlyOutput:
    """``decode``'s result with greedy decoding (``top_k == 1``)."""

    sequences: Tensor
    scores: Optional[tuple] = None


@dataclass
class SampleDecoderOnlyOutput:
    """``decode``'s result when sampling."""

    sequences: Tensor
    scores: Optional[tuple] = None


def modify_logits_for_top_k_filtering(logits, top_k):
    """In place: set every logit below the row's ``top_k``-th largest to ``-inf``."""
    kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    logits.masked_fill_(logits < kth_largest, float("-inf"))


def modify_logits_for_top_p_filtering(logits, top_p):
    """In place: keep the smallest set of largest logits whose probabilities add up to more than
    ``top_p`` (nucleus sampling); the rest become ``-inf``. ``top_p`` outside (0, 1) is a no-op."""
    if top_p <= 0.0 or top_p >= 1.0:
        return
    ascending, order = torch.sort(logits, dim=-1)
    mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
    # A token is dropped when it and all smaller ones together hold at most 1 - top_p.
    drop_sorted = mass_below <= (1 - top_p)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    logits.masked_fill_(drop, float("-inf"))


def sample(logits, top_k=1, top_p=0.0, temperature=1.0):
    """One token per row of ``logits`` ``(batch, vocab)``: greedy with ``top_k == 1``; otherwise
    sampled after top-k (``top_k > 0``), temperature and top-p filtering."""
    if top_k == 1:
        return logits.argmax(dim=-1)
    if top_p > 1.0:
        raise ValueError(f"top_p should be in (0, 1], got {top_p}")
    if top_k > 0:
        top_k = min(top_k, logits.size(-1))
        candidates, indices = torch.topk(logits, top_k, dim=-1)
        if temperature != 1.0:
            candidates = candidates / temperature
        modify_logits_for_top_p_filtering(candidates, top_p)
        pick = torch.multinomial(torch.softmax(candidates, dim=-1), num_samples=1)
        return indices.gather(-1, pick).squeeze(-1)
    # Filtering is in place: work on a copy so the caller's logits stay as they were.
    candidates = logits / temperature if temperature != 1.0 else logits.clone()
    modify_logits_for_top_p_filtering(candidates, top_p)
    return torch.multinomial(torch.softmax(candidates, dim=-1), num_samples=1).squeeze(-1)


@torch.inference_mode()
def decode(
    input_ids,
    model,
    max_length,
    top_k=1,
    top_p=0.0,
    temperature=1.0,
    eos_token_id=None,
    teacher_outputs=None,
    vocab_size=None,
    tensor_parallel=1,
    cg=False,
    enable_timing=False,
):
    """Generate up to ``max_length`` tokens (prompt included) from ``input_ids`` ``(batch,
    seqlen)``: the prompt in one forward, then one token per step through the kv cache.

    ``model(input_ids, position_ids=..., inference_params=..., num_last_tokens=1)`` must return
    an object with ``.logits`` ``(batch, 1, vocab)``. ``teacher_outputs`` ``(batch, n)`` forces
    the first ``n`` tokens (useful for tests). Stops early when every sequence emits
    ``eos_token_id``. Returns ``GreedySearchDecoderOnlyOutput`` (``top_k == 1``) or
    ``SampleDecoderOnlyOutput`` with ``sequences`` and ``scores`` (one ``(batch, vocab)`` per step).
    """
    batch_size = input_ids.shape[0]
    teacher_len = teacher_outputs.shape[1] if teacher_outputs is not None else 0
    if cg:
        inference_params = _graphs_for(model, batch_size, input_ids.shape[1], max_length, (1,), tensor_parallel)
    else:
        inference_params = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)

    def next_logits(tokens):
        position_ids = None
        if inference_params.seqlen_offset > 0:
            position_ids = torch.full((batch_size, 1), inference_params.seqlen_offset,
                                      dtype=torch.long, device=tokens.device)
        logits = _model_logits(model, tokens, position_ids, inference_params, 1, cg).squeeze(dim=1)
        return logits[..., :vocab_size] if vocab_size is not None else logits

    def next_token(logits):
        if inference_params.seqlen_offset < teacher_len:
            return teacher_outputs[:, inference_params.seqlen_offset].unsqueeze(1)
        return sample(logits, top_k=top_k, top_p=top_p, temperature=temperature).unsqueeze(1)

    def finished(last):
        if inference_params.seqlen_offset == 0:
            return False
        if eos_token_id is not None and bool((last == eos_token_id).all()):
            return True
        return inference_params.seqlen_offset >= max_length - 1

    if enable_timing and tensor_parallel > 1:
        torch.distributed.barrier()
    start = time.perf_counter()
    scores, sequences = [], [input_ids]
    while not finished(sequences[-1]):
        scores.append(next_logits(sequences[-1]))
        inference_params.seqlen_offset += sequences[-1].shape[1]
        sequences.append(next_token(scores[-1]))
    if enable_timing:
        if tensor_parallel > 1:
            torch.distributed.barrier()
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        log.info("Prompt processing + decoding time: %.0fms", (time.perf_counter() - start) * 1000)
    output_cls = GreedySearchDecoderOnlyOutput if top_k == 1 else SampleDecoderOnlyOutput
    return output_cls(sequences=torch.cat(sequences, dim=1), scores=tuple(scores))


class GenerationMixin:
    """``generate`` for a model that implements ``allocate_inference_cache`` and the forward
    that ``decode`` calls."""

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        raise NotImplementedError

    def generate(self, input_ids, max_length, top_k=1, top_p=0.0, temperature=1.0,
                 return_dict_in_generate=False, output_scores=False, **kwargs):
        output = decode(input_ids, self, max_length, top_k=top_k, top_p=top_p,
                        temperature=temperature, **kwargs)
        if not output_scores:
            output.scores = None
        return output if return_dict_in_generate else output.sequences


def allocate_inference_cache(
    max_batch_size,
    max_seqlen,
    nheads,
    headdim,
    layers: Union[int, Sequence],
    device,
    dtype=torch.float16,
):
    """One empty kv cache ``(max_batch_size, max_seqlen, 2, nheads, headdim)`` per layer, keyed by
    layer index (``layers``: a count or the indices)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    shape = (max_batch_size, max_seqlen, 2, nheads, headdim)
    indices = range(layers) if isinstance(layers, int) else layers
    return {i: torch.empty(shape, device=device, dtype=dtype) for i in indices}


# ----------------------------------------------------------------------------------------------
# The model's logits, eagerly or through its CUDA graphs
# ----------------------------------------------------------------------------------------------


def _model_logits(model, tokens, position_ids, inference_params, num_last_tokens, cg):
    """``(batch, num_last_tokens, vocab)`` logits of ``tokens`` after the cached ones. With ``cg``,
    decoding steps replay the graph captured for ``tokens``' length (``update_graph_cache``),
    which returns the logits of every token it was given."""
    if cg and inference_params.seqlen_offset > 0:
        logits = model._decoding_cache.run(tokens, position_ids, inference_params.seqlen_offset)
        return logits[:, -num_last_tokens:]
    return model(tokens, position_ids=position_ids, inference_params=inference_params,
                 num_last_tokens=num_last_tokens).logits


def _graphs_for(model, batch_size, seqlen_og, max_length, decoding_seqlens, tensor_parallel) -> InferenceParams:
    """The inference state of ``model``'s CUDA graphs for these lengths (captured if missing),
    reset for a new generation."""
    model._decoding_cache = update_graph_cache(model, getattr(model, "_decoding_cache", None), batch_size,
                                               seqlen_og, max_length, decoding_seqlens=decoding_seqlens,
                                               tensor_parallel=tensor_parallel)
    inference_params = model._decoding_cache.inference_params
    inference_params.reset(max_length, batch_size)
    return inference_params


# ----------------------------------------------------------------------------------------------
# Speculative decoding
# ----------------------------------------------------------------------------------------------


def _filtered_probs(logits: Tensor, top_k: int, top_p: float, temperature: float) -> Tensor:
    """Softmax of ``logits`` after temperature, top-k (``top_k > 0``) and top-p filtering: the
    distribution ``sample`` draws from."""
    logits = logits / temperature if temperature != 1.0 else logits.clone()
    if top_k > 0:
        modify_logits_for_top_k_filtering(logits, min(top_k, logits.size(-1)))
    modify_logits_for_top_p_filtering(logits, top_p)
    return torch.softmax(logits, dim=-1)


def _check_speculative_inputs(logits: Tensor, logits_draft: Tensor, tokens_draft: Tensor, top_p: float) -> None:
    if tokens_draft.dim() != 2 or tokens_draft.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"tokens_draft must be int32/int64 (batch, seqlen), got {tokens_draft.dtype} "
                         f"{tuple(tokens_draft.shape)}")
    batch, seqlen = tokens_draft.shape
    vocab = logits.shape[-1]
    if logits.shape != (batch, seqlen + 1, vocab) or logits_draft.shape != (batch, seqlen, vocab):
        raise ValueError(f"expected logits (batch, seqlen + 1, vocab) and logits_draft (batch, seqlen, vocab) for "
                         f"tokens_draft {tuple(tokens_draft.shape)}, got {tuple(logits.shape)} and "
                         f"{tuple(logits_draft.shape)}")
    if top_p > 1.0:
        raise ValueError(f"top_p should be in (0, 1], got {top_p}")


def sample_speculative(logits, logits_draft, tokens_draft, top_k=1, top_p=0.0, temperature=1.0):
    """Speculative sampling (Leviathan, Kalman and Matias, "Fast Inference from Transformers via
    Speculative Decoding", 2023, Algorithm 1): tokens distributed exactly as sampling the main
    model token by token.

    ``logits`` ``(batch, n + 1, vocab)``: the main model's logits at the positions of the ``n``
    draft tokens and one past them; ``logits_draft`` ``(batch, n, vocab)``: the draft model's
    logits the draft tokens were sampled from; ``tokens_draft`` ``(batch, n)``. Draft token ``i``
    is kept with probability ``min(1, p_i / q_i)`` while all before it were kept; the first one
    rejected is replaced by a sample of ``max(p - q, 0)`` (normalised), and when all are kept one
    more token is sampled from the main model. Returns ``(tokens (batch, n + 1),
    num_generated_tokens (batch,))``: the first ``num_generated_tokens[b]`` (1 to ``n + 1``) of row
    ``b`` are its new tokens.
    """
    _check_speculative_inputs(logits, logits_draft, tokens_draft, top_p)
    batch, seqlen = tokens_draft.shape
    p = _filtered_probs(logits, top_k, top_p, temperature)
    q = _filtered_probs(logits_draft, top_k, top_p, temperature)
    drafted = tokens_draft.long().unsqueeze(-1)
    p_drafted, q_drafted = p[:, :-1].gather(-1, drafted).squeeze(-1), q.gather(-1, drafted).squeeze(-1)
    # u < p/q with u uniform in [0, 1): kept with probability min(1, p/q), never when p = 0
    kept = torch.rand(batch, seqlen, device=p.device) * q_drafted < p_drafted
    first_rejected = kept.int().cumprod(dim=-1).sum(dim=-1)  # n when every draft token is kept
    rows = torch.arange(batch, device=p.device)
    residual = torch.cat([(p[:, :-1] - q).clamp(min=0.0), p[:, -1:]], dim=1)[rows, first_rejected]
    # a rejection means p < q at the drafted token, so the residual has mass; rounding aside
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, first_rejected])
    tokens = torch.cat([tokens_draft, tokens_draft.new_zeros(batch, 1)], dim=1)
    tokens[rows, first_rejected] = torch.multinomial(residual, num_samples=1).squeeze(-1).to(tokens.dtype)
    return tokens, first_rejected + 1


class _Decoder:
    """One model's side of speculative decoding: its kv cache, how many tokens of the sequence
    it holds (``inference_params.seqlen_offset``), its logits for the tokens it has not seen."""

    def __init__(self, model, inference_params, vocab_size, cg):
        self.model, self.params, self.vocab_size, self.cg = model, inference_params, vocab_size, cg

    def logits(self, tokens: Tensor, num_last_tokens: int) -> Tensor:
        """Logits of the last ``num_last_tokens`` of ``tokens``, which follow the cached ones."""
        offset = self.params.seqlen_offset
        position_ids = None
        if offset > 0:
            position_ids = offset + torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        logits = _model_logits(self.model, tokens, position_ids, self.params, num_last_tokens, self.cg)
        self.params.seqlen_offset += tokens.shape[1]
        return logits[..., :self.vocab_size] if self.vocab_size is not None else logits

    def sample(self, sequence: Tensor, num_tokens: int, sample_fn) -> tuple[Tensor, Tensor]:
        """``num_tokens`` tokens sampled one by one after ``sequence`` (its uncached tail is fed
        first), and the logits each was drawn from: ``(1, num_tokens)``, ``(1, num_tokens, vocab)``."""
        tokens, scores = [], []
        step = sequence[:, self.params.seqlen_offset:]
        for _ in range(num_tokens):
            scores.append(self.logits(step, 1)[:, -1])
            step = sample_fn(scores[-1]).unsqueeze(1)
            tokens.append(step)
        return torch.cat(tokens, dim=1), torch.stack(scores, dim=1)


@torch.inference_mode()
def decode_speculative(
    input_ids,
    model,
    model_draft,
    max_length,
    speculative_lookahead=3,
    top_k=1,
    top_p=0.0,
    temperature=1.0,
    eos_token_id=None,
    vocab_size=None,
    tensor_parallel=1,
    cg=False,
    enable_timing=False,
    debug=False,
):
    """Generate up to ``max_length`` tokens (prompt included) from ``input_ids`` ``(1, seqlen)``
    with speculative decoding: ``model_draft`` proposes up to ``speculative_lookahead`` tokens one
    by one, ``model`` scores them in one forward and :func:`sample_speculative` keeps a prefix of
    them plus one token of its own, so the tokens are distributed as ``decode(input_ids, model,
    ...)``'s (greedy with ``top_k == 1``: the same tokens, up to rounding between one forward of
    several tokens and several of one). Both models follow ``decode``'s interface and share the
    vocabulary. Batch size 1 and no ``eos_token_id``, as upstream. ``debug`` is accepted for
    upstream's signature (it printed comparisons); nothing is printed.

    Returns ``GreedySearchDecoderOnlyOutput`` (``top_k == 1``) or ``SampleDecoderOnlyOutput``:
    ``sequences`` ``(1, max_length)`` and ``scores`` ``(1, max_length - seqlen, vocab)``, the main
    model's logits at each generated token.
    """
    batch_size, seqlen_og = input_ids.shape
    if batch_size != 1:
        raise ValueError(f"decode_speculative supports batch size 1 only (as upstream), got {batch_size}")
    if eos_token_id is not None:
        raise ValueError("decode_speculative does not support eos_token_id (as upstream)")
    if speculative_lookahead < 1:
        raise ValueError(f"speculative_lookahead must be >= 1, got {speculative_lookahead}")
    if cg:
        params = _graphs_for(model, 1, seqlen_og, max_length, range(1, speculative_lookahead + 2), tensor_parallel)
        # the draft model is given one token per step, two after all its tokens were kept
        params_draft = _graphs_for(model_draft, 1, seqlen_og, max_length, (1, 2), tensor_parallel)
    else:
        params = InferenceParams(max_seqlen=max_length, max_batch_size=1)
        params_draft = InferenceParams(max_seqlen=max_length, max_batch_size=1)
    main, draft = _Decoder(model, params, vocab_size, cg), _Decoder(model_draft, params_draft, vocab_size, cg)
    sampling = dict(top_k=top_k, top_p=top_p, temperature=temperature)
    sample_fn = lambda logits: sample(logits, **sampling)  # noqa: E731

    start = time.perf_counter()
    sequence, scores, calls, drafted, kept = input_ids, [], 0, 0, 0
    while sequence.shape[1] < max_length or not scores:  # one token at least, as decode
        lookahead = max(0, min(speculative_lookahead, max_length - sequence.shape[1] - 1))
        if lookahead == 0:  # room for one token only: the main model's own
            tokens, new_scores = main.sample(sequence, 1, sample_fn)
        else:
            tokens_draft, scores_draft = draft.sample(sequence, lookahead, sample_fn)
            unseen = torch.cat([sequence[:, params.seqlen_offset:], tokens_draft], dim=1)
            logits = main.logits(unseen, lookahead + 1)
            tokens, generated = sample_speculative(logits, scores_draft, tokens_draft, **sampling)
            count = int(generated[0])
            tokens, new_scores = tokens[:, :count], logits[:, :count]
            drafted, kept = drafted + lookahead, kept + count - 1
        calls += 1
        scores.append(new_scores)
        sequence = torch.cat([sequence, tokens], dim=1)
        # Each model keeps the cache rows of the tokens that stayed; the newest token (and, for
        # the draft model, the rows it never computed) are fed next time, overwriting stale rows.
        params.seqlen_offset = sequence.shape[1] - 1
        params_draft.seqlen_offset = min(params_draft.seqlen_offset, sequence.shape[1] - 1)
    if enable_timing:
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        log.info("Prompt processing + decoding time: %.0fms; %d calls to the main model; acceptance rate %.2f%%",
                 (time.perf_counter() - start) * 1000, calls, 100.0 * kept / max(drafted, 1))
    output_cls = GreedySearchDecoderOnlyOutput if top_k == 1 else SampleDecoderOnlyOutput
    return output_cls(sequences=sequence, scores=torch.cat(scores, dim=1))


# ----------------------------------------------------------------------------------------------
# CUDA graphs of the decoding steps
# ----------------------------------------------------------------------------------------------


@dataclass
class DecodingCGCache:
    """A model's captured decoding steps: one graph per ``(batch size, tokens per step)`` in
    ``callables``, all sharing ``mempool`` and the kv caches of ``inference_params``; ``run(input_ids,
    position_ids, seqlen_offset)`` replays the one for ``input_ids``' shape."""

    max_batch_size: int = 0
    max_seqlen: int = 0
    device: Optional[torch.device] = None
    dtype: Optional[torch.dtype] = None
    callables: dict = field(default_factory=dict)
    mempool: object = None
    inference_params: Optional[InferenceParams] = None
    run: Optional[Callable] = None


def _graph_kv_caches(model, batch_size, max_seqlen, dtype, tensor_parallel, device) -> dict:
    if hasattr(model, "allocate_inference_cache"):
        return model.allocate_inference_cache(batch_size, max_seqlen, dtype)
    config = model.config
    headdim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return allocate_inference_cache(batch_size, max_seqlen, config.num_attention_heads // tensor_parallel, headdim,
                                    config.num_hidden_layers, device, dtype)


@torch.inference_mode()
def update_graph_cache(model, cache, batch_size, seqlen_og, max_seqlen, decoding_seqlens=(1,), tensor_parallel=1,
                       dtype=None, n_warmups=2):
    """``cache`` (a :class:`DecodingCGCache`, or ``None`` for a new one) with a graph of ``model``'s
    decoding step for each length in ``decoding_seqlens``: the caches are reallocated and every
    graph captured again when the device or dtype changed or the batch or length grew. The
    model must be on a CUDA device and read its positions from ``lengths_per_sample`` (as
    :class:`flash_attn.modules.mha.MHA` does), since a graph replays fixed kernel arguments."""
    cache = DecodingCGCache() if cache is None else cache
    parameter = next(iter(model.parameters()))
    device, dtype = parameter.device, parameter.dtype if dtype is None else dtype
    if device.type != "cuda":
        raise ValueError(f"CUDA-graph decoding (cg=True) needs a model on a CUDA device, not {device}; "
                         "decode with cg=False")
    if (device, dtype) != (cache.device, cache.dtype) or batch_size > cache.max_batch_size \
            or max_seqlen > cache.max_seqlen:
        cache.callables, cache.mempool, cache.inference_params = {}, None, None
        gc.collect()  # the old graphs' memory pool goes before the new one is made
        cache.device, cache.dtype, cache.max_batch_size, cache.max_seqlen = device, dtype, batch_size, max_seqlen
        lengths = torch.full((batch_size,), seqlen_og, dtype=torch.int32, device=device)
        cache.inference_params = InferenceParams(
            max_seqlen=max_seqlen, max_batch_size=batch_size, seqlen_offset=seqlen_og,
            key_value_memory_dict=_graph_kv_caches(model, batch_size, max_seqlen, dtype, tensor_parallel, device),
            lengths_per_sample=lengths)
        cache.mempool = torch.cuda.graphs.graph_pool_handle()
    for decoding_seqlen in decoding_seqlens:
        if (batch_size, decoding_seqlen) not in cache.callables:
            cache.callables[batch_size, decoding_seqlen] = capture_graph(
                model, cache.inference_params, batch_size, max_seqlen, decoding_seqlen=decoding_seqlen,
                mempool=cache.mempool, n_warmups=n_warmups)

    def run(input_ids, position_ids, seqlen_offset):
        return cache.callables[tuple(input_ids.shape[:2])](input_ids, position_ids, seqlen_offset)

    cache.run = run
    cache.inference_params.seqlen_offset = 0
    return cache


def capture_graph(model, inference_params, batch_size, max_seqlen, decoding_seqlen=1, mempool=None, n_warmups=2):
    """Capture one decoding step of ``model`` (``decoding_seqlen`` tokens per sequence after the
    cached ones) in a CUDA graph; returns ``run(input_ids, position_ids, seqlen_offset)``, which
    writes its inputs into the graph's, sets ``inference_params.lengths_per_sample`` and replays,
    returning the logits of every given token ``(batch, decoding_seqlen, vocab)``."""
    device = next(iter(model.parameters())).device
    input_ids = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    position_ids = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    offset_before = inference_params.seqlen_offset
    # captured at the longest offset, so that every code path sized by it (rotary tables) is
    inference_params.seqlen_offset = max_seqlen - decoding_seqlen
    inference_params.lengths_per_sample[:] = inference_params.seqlen_offset

    def step():
        return model(input_ids, position_ids=position_ids, inference_params=inference_params,
                     num_last_tokens=decoding_seqlen).logits

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up away from the capturing stream: compiles, allocates
        for _ in range(n_warmups):
            step()
        side.synchronize()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        logits = step()
    inference_params.seqlen_offset = offset_before

    def run(new_input_ids, new_position_ids, seqlen_offset):
        inference_params.lengths_per_sample[:] = seqlen_offset
        input_ids.copy_(new_input_ids)
        position_ids.copy_(new_position_ids)
        graph.replay()
        return logits.clone()

    return run
