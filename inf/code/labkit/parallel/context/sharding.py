"""Sharding the sequence over ``cp`` ranks: contiguous or load-balanced ("zigzag", head-tail).

Contiguous: the sequence is cut into ``cp`` chunks and rank r holds chunk r. Zigzag (Megatron-LM CP; Llama 3,
Dubey et al. 2024, §3.3.2): ``2·cp`` chunks, rank r holds chunks r and 2·cp−1−r — one early, one late — so
with causal attention every rank has the same work. The chunk arithmetic (:func:`chunk_ids`,
:func:`n_chunks`, :func:`check_context_parallel`) is pure Python and lives in :mod:`labkit.theory.context`,
where the predictions use the same functions; this file turns it into token positions and tensor shards.
"""

from __future__ import annotations

import torch

from labkit.theory.context import check_context_parallel, chunk_ids, n_chunks

__all__ = ["check_context_parallel", "chunk_ids", "n_chunks", "shard_positions", "shard_sequence",
           "unshard_sequence"]


def shard_positions(seq_len: int, cp: int, rank: int, load_balance: bool = False) -> torch.Tensor:
    """Absolute token positions (int64 [seq_len/cp]) held by ``rank``, in local order.

    Raises ValueError if cp (2·cp) does not divide seq_len."""
    check_context_parallel(seq_len, cp, load_balance=load_balance)
    c = seq_len // n_chunks(cp, load_balance)  # tokens per chunk
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, cp, load_balance)])  # (T/cp,)


def shard_sequence(x: torch.Tensor, cp: int, rank: int, load_balance: bool = False, dim: int = -2) -> torch.Tensor:
    """The part of ``x`` (sequence along ``dim``, default -2 as in [B, heads, T, d]) held by ``rank``."""
    pos = shard_positions(x.shape[dim], cp, rank, load_balance).to(x.device)  # (T/cp,)
    return x.index_select(dim, pos)  # (B, heads, T/cp, head_dim) for dim=-2


def unshard_sequence(shards: list[torch.Tensor], load_balance: bool = False, dim: int = -2) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from the ``cp`` shards in rank order."""
    cp = len(shards)
    seq_len = shards[0].shape[dim] * cp
    pos = torch.cat([shard_positions(seq_len, cp, r, load_balance) for r in range(cp)]).to(shards[0].device)  # (T,)
    cat = torch.cat(shards, dim=dim)  # (B, heads, T, head_dim), rank order
    return cat.index_select(dim, torch.argsort(pos))  # (B, heads, T, head_dim), natural order
