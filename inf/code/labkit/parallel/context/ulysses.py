"""DeepSpeed-Ulysses (Jacobs et al. 2023, §3): one all-to-all turns sequence shards into head shards (each rank
gets ``n_heads/cp`` heads of the whole sequence), attention runs locally, a second all-to-all turns the output
back into sequence shards. Backward runs the same two all-to-alls the other way.

The per-rank volume falls as 1/cp, but cp can never exceed n_heads (``cp`` must divide ``n_heads``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.parallel.context.blocks import _span


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x)  # like x: (cp, ...), row d for / from group rank d
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_head(x, group, timeline, name):
    """[*, h, T/cp, d] sequence-sharded -> [*, h/cp, T, d] head-sharded (sequence in group-rank order)."""
    cp = dist.get_world_size(group)
    send = x.unflatten(-3, (cp, x.shape[-3] // cp)).movedim(-4, 0).contiguous()  # (cp_dst, *, h/cp, T/cp, d)
    with _span(timeline, name, "comm", nbytes=send.numel() * send.element_size()):
        recv = _all_to_all(send, group)  # (cp_src, *, h/cp, T/cp, d)
    return recv.movedim(0, -3).flatten(-3, -2)  # (*, h/cp, T, d)


def _head_to_seq(y, group, timeline, name):
    """Inverse of :func:`_seq_to_head`: [*, h/cp, T, d] -> [*, h, T/cp, d]."""
    cp = dist.get_world_size(group)
    send = y.unflatten(-2, (cp, y.shape[-2] // cp)).movedim(-3, 0).contiguous()  # (cp_dst, *, h/cp, T/cp, d)
    with _span(timeline, name, "comm", nbytes=send.numel() * send.element_size()):
        recv = _all_to_all(send, group)  # (cp_src, *, h/cp, T/cp, d)
    return recv.movedim(0, -4).flatten(-4, -3)  # (*, h, T/cp, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, timeline):
        # x (3, B, heads, T/cp, head_dim) -> (3, B, heads/cp, T, head_dim): q, k, v stacked
        ctx.meta = (group, timeline)
        return _seq_to_head(x, group, timeline, "all_to_all qkv")

    @staticmethod
    def backward(ctx, g):
        # g (3, B, heads/cp, T, head_dim) -> (3, B, heads, T/cp, head_dim)
        group, timeline = ctx.meta
        return _head_to_seq(g, group, timeline, "all_to_all dqkv"), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, timeline):
        # y (B, heads/cp, T, head_dim) -> (B, heads, T/cp, head_dim): the attention output
        ctx.meta = (group, timeline)
        return _head_to_seq(y, group, timeline, "all_to_all out")

    @staticmethod
    def backward(ctx, g):
        # g (B, heads, T/cp, head_dim) -> (B, heads/cp, T, head_dim)
        group, timeline = ctx.meta
        return _seq_to_head(g, group, timeline, "all_to_all dout"), None, None
