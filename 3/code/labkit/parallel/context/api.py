"""The entry points: :func:`context_parallel_attention` (one call, any method), :class:`ContextParallelAttention`
(a drop-in ``Attention.core``) and :func:`apply_context_parallel` (swap it into every layer of a model)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.checks import check_choice, check_divides
from labkit.parallel.context.allgather import _AllGatherSeq
from labkit.parallel.context.blocks import _ChunkAttention
from labkit.parallel.context.ring import _RingAttention
from labkit.parallel.context.ulysses import _HeadToSeq, _SeqToHead
from labkit.theory.context import METHODS, chunk_ids


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, method: str = "ring",
                               causal: bool = True, load_balance: bool = False, group=None,
                               timeline=None) -> torch.Tensor:
    """Attention of this rank's sequence shard, equal to the matching rows of full-sequence attention.

    Args:
        q, k, v: [B, heads, seq_len/cp, head_dim], the shard given by
            :func:`~labkit.parallel.context.sharding.shard_sequence` with the same ``load_balance`` (k/v with
            as many heads as q: repeat grouped-query K/V heads first).
        method: ``"ring"``, ``"allgather"`` or ``"ulysses"`` (:mod:`labkit.parallel.context`).
        causal: causal (decoder) masking by global position; False attends to every token.
        load_balance: shards are zigzag (chunks r and 2·cp−1−r of 2·cp); must match how q/k/v were sharded.
        group: the CP process group (default: the whole world); every rank of it must call.
        timeline: a :class:`~labkit.runtime.timeline.Timeline` (``ctx.timeline``) to record compute/comm events
            (``stage`` = ring step for ring attention).

    Returns: [B, heads, seq_len/cp, head_dim]. Differentiable in q, k, v.
    Raises ValueError: bad method, mismatched shard shapes, an odd shard with load balancing, heads not
    divisible by cp for Ulysses.
    """
    check_choice("method", method, METHODS)
    cp = dist.get_world_size(group)
    r = dist.get_rank(group)
    per_rank = len(chunk_ids(r, cp, load_balance))
    if q.shape[-2] % per_rank or k.shape[-2] != q.shape[-2] or v.shape != k.shape or q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected equal [B, heads, "
                         f"seq_len/cp, head_dim] shards (repeat grouped K/V heads first) with seq_len/cp divisible "
                         f"by {per_rank} (load_balance={load_balance})")
    if cp == 1:
        ids = chunk_ids(0, 1, load_balance)
        return _ChunkAttention.apply(q, k, v, ids, ids, causal, timeline)  # (B, heads, T, head_dim)
    if method == "ring":
        return _RingAttention.apply(q, k, v, causal, load_balance, group, timeline)  # (B, heads, T/cp, head_dim)
    all_ids = [c for s in range(cp) for c in chunk_ids(s, cp, load_balance)]  # chunks in group-rank order
    if method == "allgather":
        kv = _AllGatherSeq.apply(torch.stack([k, v]), group, timeline)  # (2, B, heads, T, head_dim)
        return _ChunkAttention.apply(q, kv[0], kv[1], chunk_ids(r, cp, load_balance), all_ids, causal,
                                     timeline)  # (B, heads, T/cp, head_dim)
    check_divides("cp", cp, "n_heads", q.shape[-3], hint="Ulysses gives each rank n_heads/cp heads")
    qkv = _SeqToHead.apply(torch.stack([q, k, v]), group, timeline)  # (3, B, heads/cp, T, head_dim)
    out = _ChunkAttention.apply(qkv[0], qkv[1], qkv[2], all_ids, all_ids, causal, timeline)  # (B, heads/cp, T, d)
    return _HeadToSeq.apply(out, group, timeline)  # (B, heads, T/cp, head_dim)


class ContextParallelAttention:
    """A drop-in ``Attention.core`` (see :class:`labkit.models.Attention`) running
    :func:`context_parallel_attention`. Raises ValueError when called with dropout in training mode
    (attention dropout is not implemented by these kernels)."""

    def __init__(self, method: str = "ring", *, load_balance: bool = False, group=None, timeline=None):
        check_choice("method", method, METHODS)
        self.method, self.load_balance, self.group, self.timeline = method, load_balance, group, timeline

    def __call__(self, q, k, v, *, causal: bool = True, dropout_p: float = 0.0, training: bool = False):
        # q, k, v (B, heads, T/cp, head_dim) -> (B, heads, T/cp, head_dim)
        if dropout_p and training:
            raise ValueError(f"dropout_p={dropout_p} in attention is not supported with context parallelism; "
                             "use a spec with dropout=0.0 or model.eval()")
        return context_parallel_attention(q, k, v, method=self.method, causal=causal,
                                          load_balance=self.load_balance, group=self.group,
                                          timeline=self.timeline)

    def __repr__(self) -> str:
        return f"ContextParallelAttention(method={self.method!r}, load_balance={self.load_balance})"


def apply_context_parallel(model, method: str = "ring", *, load_balance: bool = False, group=None,
                           timeline=None):
    """Swap every layer's attention kernel (``layer.attn.core``) of a :class:`labkit.models.Transformer`
    for :class:`ContextParallelAttention`. Then call ``model(tokens_shard, positions=positions_shard)``
    with the shards of :func:`~labkit.parallel.context.sharding.shard_sequence` /
    :func:`~labkit.parallel.context.sharding.shard_positions`; per-token layers need no change.
    Gradients of the (replicated) weights must be summed over the CP group afterwards. Returns ``model``."""
    core = ContextParallelAttention(method, load_balance=load_balance, group=group, timeline=timeline)
    for layer in model.layers:
        layer.attn.core = core
    return model
