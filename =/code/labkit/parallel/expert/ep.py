"""Expert parallelism: the :class:`~labkit.parallel.expert.moe.MoE` layer with its experts sharded over ``ep``
ranks (rank r holds experts ``r·E/ep .. (r+1)·E/ep − 1``) and the router replicated.

Dispatch and combine use ``all_to_all_single`` with split sizes (an all-to-all-v); the per-expert counts are
exchanged FIRST (a small all-to-all), so every rank knows how many rows it will receive. Uneven counts, zero
counts, and ranks with no tokens at all work; equal-shape all-to-all with per-rank capacities (shapes
differing between ranks, e.g. [4, 3, 32] vs [4, 4, 32]) is the bug this avoids.

Capacity is applied per rank to the rank's own tokens (GShard's per-group capacity, Lepikhin et al. 2020): the
EP layer gives exactly what the single-process layer gives on each rank's tokens. With no capacity
(``capacity_factor=None``) nothing is dropped and the result equals the single-process layer on the whole
batch, for any placement of tokens.

Shapes: N tokens on this rank, H hidden size, E experts, E/ep local experts, A kept assignments, R rows
received from all ranks.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.checks import check_divides, positive_float
from labkit.parallel.expert.moe import MoE, _kept_assignments, _run_experts
from labkit.parallel.expert.routing import Routing, load_balancing_loss, route


@contextlib.contextmanager
def _span(timeline, name, kind, **tags):
    if timeline is None:
        yield
    else:
        with timeline.span(name, kind, **tags):
            yield


class _AllToAllV(torch.autograd.Function):
    """Rows of x [sum(in_splits), H] to the ranks of ``group`` (in_splits[d] rows to rank d) -> the rows
    received [sum(out_splits), H], in source-rank order. Backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, timeline, name):
        ctx.meta = (out_splits, in_splits, group, timeline, name)
        return _all_to_all_v(x, out_splits, in_splits, group, timeline, name)  # (sum(out_splits), H)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits, group, timeline, name = ctx.meta
        # g (sum(out_splits), H) -> (sum(in_splits), H)
        return _all_to_all_v(g, in_splits, out_splits, group, timeline, name + " bwd"), None, None, None, None, None


def _all_to_all_v(x, out_splits, in_splits, group, timeline, name):
    x = x.contiguous()  # (sum(in_splits), H)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))  # (sum(out_splits), H)
    with _span(timeline, name, "comm", nbytes=x.numel() * x.element_size()):
        dist.all_to_all_single(out, x, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
                               group=group)
    return out


class ExpertParallelMoE(nn.Module):
    """:class:`MoE` with its experts sharded over the ``ep`` ranks of ``group`` (all ranks must call forward
    together, each with its own tokens, any number including zero).

    Built from a full :class:`MoE` (the same weights on every rank, e.g. from one seed): keeps a copy of the
    router and of this rank's ``n_experts/ep`` experts (``experts[i]`` is global expert
    ``expert_offset + i``). Forward, on x [N_local, H] (or [..., H]):

    1. route locally (capacity from the local token count);
    2. all-to-all the per-expert counts [E] (so each rank learns how many rows it receives per local expert);
    3. dispatch: ``all_to_all_single`` of the token rows with those split sizes;
    4. run the local experts on their rows (grouped by expert);
    5. combine: the reverse ``all_to_all_single``; weight by the gates and sum per token.

    Returns the MoE contribution [N_local, H] (add the residual outside). After a call: ``last_routing``,
    ``aux_loss``, ``last_stats`` (local routing :meth:`Routing.stats` plus ``dispatch_bytes`` /
    ``combine_bytes``: rows sent to OTHER ranks x H x element size, ``send_counts`` per expert,
    ``send_rows`` / ``recv_rows`` per rank).
    The router is replicated: call :meth:`sync_router_grads` after backward (sums its gradient over the group).
    ``timeline`` (e.g. ``ctx.timeline``, anything with ``span``): records route / a2a counts / dispatch /
    experts / combine events. Raises ValueError if ep does not divide n_experts.
    """

    def __init__(self, moe: MoE, group=None, timeline=None):
        super().__init__()
        self.group, self.timeline = group, timeline
        self.ep, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
        check_divides("ep", self.ep, "n_experts", moe.n_experts, hint="each rank holds n_experts/ep whole experts")
        self.hidden_size, self.n_experts, self.top_k = moe.hidden_size, moe.n_experts, moe.top_k
        self.capacity_factor, self.drop_policy, self.normalize = moe.capacity_factor, moe.drop_policy, moe.normalize
        self.n_local = moe.n_experts // self.ep
        self.expert_offset = self.ep_rank * self.n_local
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[self.expert_offset + i]) for i in range(self.n_local))
        self.last_routing: Routing | None = None
        self.aux_loss: torch.Tensor | None = None
        self.last_stats: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tl, g, ep, n_local = self.timeline, self.group, self.ep, self.n_local
        flat = x.reshape(-1, x.shape[-1])  # (N, H)
        with _span(tl, "route", "compute"):
            routing = route(self.router(flat), self.top_k, self.capacity_factor, drop_policy=self.drop_policy,
                            normalize=self.normalize)  # expert, gate, keep: (N, k)
            tok, exp, gate = _kept_assignments(routing)  # (A,) each, grouped by expert = by destination rank
            send_counts = torch.bincount(exp, minlength=self.n_experts)  # (E,), grouped by destination rank
        # 1. exchange the counts first: every rank learns what it will receive (no shape guessing, no stall)
        recv_counts = torch.empty_like(send_counts)  # (E,) = (ep source ranks · E/ep local experts)
        with _span(tl, "a2a counts", "comm", nbytes=send_counts.numel() * send_counts.element_size()):
            dist.all_to_all_single(recv_counts, send_counts, group=g)
        send_rows = send_counts.view(ep, n_local).sum(1).tolist()  # rows to each rank, ep of them
        recv_matrix = recv_counts.view(ep, n_local)  # (ep, E/ep): [source rank, local expert]
        recv_rows = recv_matrix.sum(1).tolist()  # rows from each rank, ep of them
        # 2. dispatch the token rows
        received = _AllToAllV.apply(flat[tok], recv_rows, send_rows, g, tl, "dispatch")  # (R, H)
        # 3. regroup by local expert (received rows are ordered by source rank, then local expert)
        with _span(tl, "experts", "compute"):
            row_expert = torch.repeat_interleave(torch.arange(n_local, device=flat.device).repeat(ep),
                                                 recv_matrix.reshape(-1))  # (R,) local expert of each row
            perm = torch.argsort(row_expert, stable=True)  # (R,)
            out_grouped = _run_experts(self.experts, received[perm], recv_matrix.sum(0).tolist())  # (R, H)
            out_recv = (torch.empty_like(out_grouped).index_copy(0, perm, out_grouped) if len(perm)
                        else out_grouped)  # (R, H), back in received order
        # 4. combine: send results back, weight by the gates, sum per token
        back = _AllToAllV.apply(out_recv, send_rows, recv_rows, g, tl, "combine")  # (A, H)
        with _span(tl, "weighted sum", "compute"):
            y = torch.zeros_like(flat).index_add(0, tok, back * gate[:, None].to(back.dtype))  # (N, H)
        row_bytes = flat.shape[-1] * flat.element_size()
        me = self.ep_rank
        self.last_routing, self.aux_loss = routing, load_balancing_loss(routing)
        self.last_stats = {**routing.stats(), "send_counts": send_counts.tolist(), "send_rows": send_rows,
                           "recv_rows": recv_rows,
                           "dispatch_bytes": sum(n for d, n in enumerate(send_rows) if d != me) * row_bytes,
                           "combine_bytes": sum(n for s, n in enumerate(recv_rows) if s != me) * row_bytes,
                           "dispatch_total_bytes": sum(send_rows) * row_bytes}
        return y.view_as(x)  # (..., H)

    def sync_router_grads(self) -> None:
        """Sum the router's gradient over the EP group (each rank saw only its own tokens)."""
        for p in self.router.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)


def set_capacity_factor(model: nn.Module, capacity_factor: float | None) -> None:
    """Set ``capacity_factor`` on every :class:`MoE` / :class:`ExpertParallelMoE` inside ``model``."""
    if capacity_factor is not None:
        positive_float("capacity_factor", capacity_factor)
    for m in model.modules():
        if isinstance(m, (MoE, ExpertParallelMoE)):
            m.capacity_factor = capacity_factor
