"""Autoregressive generation helpers with upstream's names: ``InferenceParams`` (the kv-cache
state that ``MHA`` reads and writes), top-k / top-p sampling and ``decode``.

Not provided: CUDA-graph decoding (``cg=True``, ``update_graph_cache``, ``capture_graph``) and
speculative decoding (``sample_speculative``, ``decode_speculative``); they raise
``NotImplementedError``. ``enable_timing`` logs the time (logger ``flash_attn.utils.generation``,
level INFO) where upstream prints it: the package never writes to stdout.
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

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
    if cg:
        raise NotImplementedError(
            "decode(cg=True): CUDA-graph decoding is not provided by this flash-attn package; "
            "call decode with cg=False"
        )
    batch_size = input_ids.shape[0]
    teacher_len = teacher_outputs.shape[1] if teacher_outputs is not None else 0
    inference_params = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)

    def next_logits(tokens):
        position_ids = None
        if inference_params.seqlen_offset > 0:
            position_ids = torch.full((batch_size, 1), inference_params.seqlen_offset,
                                      dtype=torch.long, device=tokens.device)
        logits = model(tokens, position_ids=position_ids, inference_params=inference_params,
                       num_last_tokens=1).logits.squeeze(dim=1)
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


def _not_provided(name: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(
            f"flash_attn.utils.generation.{name} is not provided by this flash-attn package "
            "(CUDA-graph and speculative decoding are not ported); use decode(..., cg=False)"
        )

    stub.__name__ = name
    return stub


update_graph_cache = _not_provided("update_graph_cache")
capture_graph = _not_provided("capture_graph")
sample_speculative = _not_provided("sample_speculative")
decode_speculative = _not_provided("decode_speculative")
