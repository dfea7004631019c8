"""All-gather KV (Llama 3, Dubey et al. 2024, §3.3.2 "Context parallelism"): all-gather K and V over the CP
group, attend this rank's queries to the whole sequence locally, reduce-scatter dK/dV in backward.

Simpler than the ring and one collective per direction, but every rank keeps the whole K/V (memory does not
fall with cp); Llama 3 accepts that because with grouped-query attention K/V are a fraction of Q.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.parallel.comm import all_gather_tensor, reduce_scatter_tensor
from labkit.parallel.context.blocks import _span


class _AllGatherSeq(torch.autograd.Function):
    """[*, T/cp, d] -> [*, T, d] concatenated in group-rank order; backward reduce-scatters (sums) the
    gradient back to the shards."""

    @staticmethod
    def forward(ctx, x, group, timeline):
        # x (2, B, heads, T/cp, head_dim): K and V stacked
        cp = dist.get_world_size(group)
        x = x.contiguous()
        buf = torch.empty((cp, *x.shape), dtype=x.dtype, device=x.device)  # (cp, 2, B, heads, T/cp, head_dim)
        with _span(timeline, "all_gather kv", "comm", nbytes=buf.numel() * buf.element_size()):
            all_gather_tensor(buf.view(-1), x.view(-1), group=group)
        ctx.meta = (group, timeline, cp)
        return buf.movedim(0, -3).flatten(-3, -2)  # (2, B, heads, T, head_dim), shards in group-rank order

    @staticmethod
    def backward(ctx, g):
        # g (2, B, heads, T, head_dim): dK, dV of the whole sequence from this rank's queries
        group, timeline, cp = ctx.meta
        parts = g.unflatten(-2, (cp, g.shape[-2] // cp)).movedim(-3, 0).contiguous()  # (cp, 2, B, heads, T/cp, d)
        out = torch.empty(parts.shape[1:], dtype=g.dtype, device=g.device)  # (2, B, heads, T/cp, head_dim)
        with _span(timeline, "reduce_scatter dkv", "comm", nbytes=parts.numel() * parts.element_size()):
            reduce_scatter_tensor(out.view(-1), parts.view(-1), group=group)  # summed over the group's queries
        return out, None, None
