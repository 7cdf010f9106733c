"""Token / position embeddings with upstream flash-attn's names and signatures, and their
tensor-parallel forms over ``torch.distributed``: ``VocabParallelEmbedding`` (each rank holds a
slice of the vocabulary; the partial lookups are summed), ``ColumnParallelEmbedding`` (each rank
holds a slice of the embedding dimension), ``ParallelGPT2Embeddings``."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from flash_attn.utils.distributed import all_reduce, reduce_scatter


def _positions(input_ids, position_ids):
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], dtype=torch.long, device=input_ids.device)


class GPT2Embeddings(nn.Module):
    """Word embeddings plus learned position embeddings (none if
    ``max_position_embeddings <= 0``). With ``word_embed_proj_dim`` (e.g. OPT-350m) words are
    embedded in that dimension and projected up to ``embed_dim`` (no bias)."""

    def __init__(
        self,
        embed_dim,
        vocab_size,
        max_position_embeddings,
        padding_idx=None,
        word_embed_proj_dim=None,
        device=None,
        dtype=None,
    ):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        word_dim = embed_dim if word_embed_proj_dim is None else word_embed_proj_dim
        self.word_embeddings = nn.Embedding(vocab_size, word_dim, padding_idx=padding_idx, **factory)
        self.project_in = (
            None
            if word_embed_proj_dim is None
            else nn.Linear(word_embed_proj_dim, embed_dim, bias=False, **factory)
        )
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = nn.Embedding(max_position_embeddings, embed_dim, **factory)

    def forward(self, input_ids, position_ids=None):
        """input_ids, position_ids: ``(batch, seqlen)``; returns ``(batch, seqlen, embed_dim)``."""
        embeddings = self.word_embeddings(input_ids)
        if self.project_in is not None:
            embeddings = self.project_in(embeddings)
        if self.max_position_embeddings > 0:
            embeddings = embeddings + self.position_embeddings(_positions(input_ids, position_ids))
        return embeddings


class BertEmbeddings(nn.Module):
    """Word + position (if ``max_position_embeddings > 0``) + token type (if
    ``type_vocab_size > 0``; type 0 when not given) embeddings."""

    def __init__(
        self,
        embed_dim,
        vocab_size,
        max_position_embeddings,
        type_vocab_size,
        padding_idx=None,
        device=None,
        dtype=None,
    ):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx,
                                            **factory)
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        if max_position_embeddings > 0:
            self.position_embeddings = nn.Embedding(max_position_embeddings, embed_dim, **factory)
        if type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(type_vocab_size, embed_dim, **factory)

    def forward(self, input_ids, position_ids=None, token_type_ids=None):
        """input_ids, position_ids, token_type_ids: ``(batch, seqlen)``."""
        embeddings = self.word_embeddings(input_ids)
        if self.max_position_embeddings > 0:
            embeddings = embeddings + self.position_embeddings(_positions(input_ids, position_ids))
        if self.type_vocab_size > 0:
            if token_type_ids is None:
                token_type_ids = torch.zeros(input_ids.shape[1], dtype=torch.long,
                                             device=input_ids.device)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        return embeddings


def _world_size(process_group):
    return 1 if process_group is None else dist.get_world_size(process_group)


def _local_share(total, what, process_group):
    """``total / world_size``: this rank's rows (vocabulary) or columns (embedding dim)."""
    world = _world_size(process_group)
    if total % world != 0:
        raise ValueError(f"{what} ({total}) must be divisible by world_size ({world})")
    return total // world


class VocabParallelEmbedding(nn.Embedding):
    """This rank's ``num_embeddings / world_size`` rows of the vocabulary (rank ``r`` holds ids
    ``[r * n, (r + 1) * n)``); ids outside the slice embed to zeros, so that summing over ranks
    (done by the caller, e.g. ``ParallelGPT2Embeddings``) gives the full lookup."""

    def __init__(self, num_embeddings, *args, process_group=None, padding_idx=None, **kwargs):
        self.process_group = process_group
        local = _local_share(num_embeddings, "num_embeddings", process_group)
        if _world_size(process_group) > 1 and padding_idx is not None:
            raise RuntimeError("ParallelEmbedding does not support padding_idx")
        super().__init__(local, *args, padding_idx=padding_idx, **kwargs)

    def forward(self, input: Tensor) -> Tensor:
        if self.process_group is None:
            return super().forward(input)
        start = dist.get_rank(self.process_group) * self.num_embeddings
        outside = (input < start) | (input >= start + self.num_embeddings)
        local_ids = torch.where(outside, torch.zeros_like(input), input - start)
        embeddings = super().forward(local_ids)
        return embeddings.masked_fill(outside.unsqueeze(-1), 0.0)


class ColumnParallelEmbedding(nn.Embedding):
    """This rank's ``embedding_dim / world_size`` columns of every embedding."""

    def __init__(self, num_embeddings, embedding_dim, *args, process_group=None, **kwargs):
        self.process_group = process_group
        local = _local_share(embedding_dim, "embedding_dim", process_group)
        super().__init__(num_embeddings, local, *args, **kwargs)


class ParallelGPT2Embeddings(nn.Module):
    """``GPT2Embeddings`` over ``process_group``: vocabulary-parallel words and column-parallel
    positions, summed over ranks (all-reduced, or reduce-scattered along dimension 0 with
    ``sequence_parallel``: then pass ``combine_batch_seqlen_dim=True`` to scatter the
    ``batch * seqlen`` tokens)."""

    def __init__(
        self,
        embed_dim,
        vocab_size,
        max_position_embeddings,
        process_group,
        padding_idx=None,
        sequence_parallel=True,
        device=None,
        dtype=None,
    ):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, embed_dim, padding_idx=padding_idx, process_group=process_group, **factory
        )
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = ColumnParallelEmbedding(
                max_position_embeddings, embed_dim, process_group=process_group, **factory
            )

    def forward(self, input_ids, position_ids=None, combine_batch_seqlen_dim=False):
        """input_ids, position_ids: ``(batch, seqlen)``."""
        world = dist.get_world_size(self.process_group)
        embeddings = self.word_embeddings(input_ids)
        if self.max_position_embeddings > 0:
            positions = self.position_embeddings(_positions(input_ids, position_ids))
            if world <= 1:
                embeddings = embeddings + positions
            else:
                # Each rank adds its columns of the position embeddings: after the sum over
                # ranks every column is added exactly once.
                width = self.position_embeddings.embedding_dim
                start = dist.get_rank(self.process_group) * width
                pad = (start, embeddings.shape[-1] - start - width)
                embeddings = embeddings + nn.functional.pad(positions, pad)
        if combine_batch_seqlen_dim:
            embeddings = embeddings.flatten(0, 1)
        if world <= 1:
            return embeddings
        reduce = reduce_scatter if self.sequence_parallel else all_reduce
        return reduce(embeddings, self.process_group)
