"""Mixture of experts (MoE) and expert parallelism (EP): experts spread over ranks, tokens routed with all-to-all.

* :func:`route` — the top-k router (Shazeer et al. 2017; GShard, Lepikhin et al. 2020 §2.2; Switch
  Transformer, Fedus et al. 2022 §2.1): softmax over expert logits, the top_k experts per token, gates = their
  probabilities (optionally renormalised to sum to 1, as Mixtral does), and a capacity per expert with a drop
  policy. Capacity = ceil(capacity_factor · tokens · top_k / n_experts) (Switch §2.1 "expert capacity", with
  GShard's top_k factor); assignments beyond it are dropped.
* :class:`MoE` — the single-process layer: router + ``n_experts`` MLPs. A dropped assignment contributes
  nothing, so a token dropped by every expert gets a zero MoE output: the layer must sit on a residual path
  (``x + moe(norm(x))``, as in :class:`labkit.models.Block`) so the token passes through unchanged instead of
  becoming a zero vector.
* :class:`ExpertParallelMoE` — the same layer with the experts sharded over ``ep`` ranks (rank r holds
  experts ``r·E/ep .. (r+1)·E/ep − 1``) and the router replicated. Dispatch and combine use
  ``all_to_all_single`` with split sizes; the per-expert counts are exchanged FIRST (a small all-to-all), so
  every rank knows how many rows it will receive. Uneven counts, zero counts, and ranks with no tokens at all
  work; equal-shape all-to-all with per-rank capacities (shapes differing between ranks, e.g. [4, 3, 32]
  vs [4, 4, 32]) is the bug this avoids.

Capacity is applied per rank to the rank's own tokens (GShard's per-group capacity): the EP layer gives exactly
what the single-process layer gives on each rank's tokens. With no capacity (``capacity_factor=None``) nothing
is dropped and the result equals the single-process layer on the whole batch, for any placement of tokens.

Validation (:func:`check_expert_parallel`): ep divides n_experts, 1 <= top_k <= n_experts, capacity_factor > 0.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.checks import check_choice, check_divides, positive_float, positive_int

DROP_POLICIES = ("position", "score")


# ------------------------------------------------------------------------------------------------------
# validation and capacity
# ------------------------------------------------------------------------------------------------------
def check_expert_parallel(n_experts: int, *, ep: int = 1, top_k: int = 1, capacity_factor: float | None = None,
                          drop_policy: str = "position") -> None:
    """Raise ValueError unless ``ep`` divides ``n_experts``, ``1 <= top_k <= n_experts``, ``capacity_factor`` is
    None or > 0, and ``drop_policy`` is one of :data:`DROP_POLICIES`."""
    n_experts = positive_int("n_experts", n_experts)
    top_k = positive_int("top_k", top_k)
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} must be <= n_experts={n_experts}; valid top_k: 1..{n_experts}")
    check_divides("ep", ep, "n_experts", n_experts, hint="each rank holds n_experts/ep whole experts")
    if capacity_factor is not None:
        positive_float("capacity_factor", capacity_factor)
    check_choice("drop_policy", drop_policy, DROP_POLICIES)


def moe_spec(spec_name: str):
    """The :class:`~labkit.theory.spec.ModelSpec` preset ``spec_name``, which must be a mixture of experts.

    Raises ValueError for an unknown preset or a dense one (the message lists the MoE presets)."""
    from labkit.theory.spec import get_spec, presets

    spec = get_spec(spec_name)
    if not spec.is_moe:
        moe = sorted(name for name, p in presets().items() if p.is_moe)
        raise ValueError(f"spec={spec_name!r} has n_experts=0 (a dense model); choose an MoE preset: "
                         f"{', '.join(moe)}")
    return spec


def check_chapter(*, world_size: int, tokens_per_rank: int, hidden_size: int, ffn_hidden_size: int,
                  n_experts: int, top_k: int, capacity_factor: float | None, capacity_factors, repeats: int,
                  spec: str, backend: str = "auto") -> None:
    """Validate chapter 08's parameters before anything is launched (the chapter's first code cell).

    Raises ValueError naming the value and the fix: world_size < 2 (expert parallelism needs ranks to move
    tokens between), ep = world_size not dividing n_experts, top_k outside 1..n_experts, a capacity factor
    that is not > 0, ``capacity_factors`` empty or not increasing (the sweep's check reads the dropped
    fraction falling along it), non-positive sizes or repeats, a ``spec`` that is not an MoE preset, or a
    backend the machine cannot run (:func:`labkit.runtime.launcher.resolve_backend`).
    """
    from labkit.runtime.launcher import resolve_backend

    world_size = positive_int("world_size", world_size)
    if world_size < 2:
        raise ValueError(f"chapter 08 needs world_size >= 2: expert parallelism spreads the experts over ranks "
                         f"and moves tokens between them with all-to-all; got world_size={world_size}")
    for name, value in (("tokens_per_rank", tokens_per_rank), ("hidden_size", hidden_size),
                        ("ffn_hidden_size", ffn_hidden_size), ("repeats", repeats)):
        positive_int(name, value)
    if positive_int("n_experts", n_experts) % world_size:
        valid = chapter_ep_degrees(n_experts)
        fix = (f"world_size (= ep) values that pass every rule of chapter 08 with n_experts={n_experts}: "
               f"{', '.join(map(str, valid))}" if valid else
               f"no world_size >= 2 divides n_experts={n_experts}: choose an n_experts with a divisor >= 2, e.g. "
               "n_experts=8")
        raise ValueError(f"ep=world_size={world_size} does not divide n_experts={n_experts} (chapter 08 runs ep = "
                         f"world_size, each rank holding n_experts/ep experts); {fix}; or choose an n_experts it "
                         "divides")
    check_expert_parallel(n_experts, ep=world_size, top_k=top_k, capacity_factor=capacity_factor)
    if isinstance(capacity_factors, (str, bytes)) or not hasattr(capacity_factors, "__iter__"):
        raise ValueError(f"capacity_factors={capacity_factors!r} must be a list of numbers > 0, e.g. [0.5, 1.0, 2.0]")
    cfs = [positive_float("capacity_factors[]", c) for c in capacity_factors]
    if not cfs:
        raise ValueError("capacity_factors=[] is empty; give at least one number > 0, e.g. [0.5, 1.0, 2.0]")
    if any(b <= a for a, b in zip(cfs, cfs[1:])):
        raise ValueError(f"capacity_factors={list(capacity_factors)!r} must be strictly increasing (the sweep reads "
                         f"the dropped fraction falling as capacity grows); e.g. {sorted(set(cfs))}")
    moe_spec(spec)
    resolve_backend(backend, world_size)


def chapter_ep_degrees(n_experts: int) -> list[int]:
    """The world_size (= ep) values chapter 08 accepts for ``n_experts`` (the backend aside): ep >= 2 dividing
    n_experts. Raises ValueError for n_experts < 1."""
    n_experts = positive_int("n_experts", n_experts)
    return [e for e in range(2, n_experts + 1) if n_experts % e == 0]


def parity_tokens(world_size: int, n_experts: int, top_k: int) -> int:
    """Tokens for :func:`ep_parity_rank`: at least 40, and enough that with an even placement every rank
    routes ``4·n_experts`` assignments or more. Then a capacity factor of 0.5 must drop some: a rank with A
    assignments keeps at most ``ceil(A/(2E))·E <= A/2 + E <= 3A/4`` of them."""
    return max(40, math.ceil(4 * n_experts * positive_int("world_size", world_size) / top_k))


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Slots per expert: ``ceil(capacity_factor · n_tokens · top_k / n_experts)`` (Switch Transformer §2.1,
    times top_k as in GShard §2.2); None when ``capacity_factor`` is None (no limit).

    Raises:
        ValueError: n_tokens not an integer >= 0, n_experts not an integer >= 1, top_k outside 1..n_experts,
            or capacity_factor neither None nor a finite number > 0 (each message names the value).
    """
    n_tokens = positive_int("n_tokens", n_tokens, minimum=0)
    check_expert_parallel(n_experts, top_k=top_k, capacity_factor=capacity_factor)
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def predicted_dropped_fraction(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> float:
    """Expected fraction of the n_tokens·top_k assignments dropped when routing is uniform and independent per
    token: each expert's load is X ~ Binomial(n_tokens, top_k/n_experts) (a token picks a given expert with
    probability top_k/n_experts), and E[dropped] = n_experts · E[max(0, X − C)] with C from
    :func:`expert_capacity`. Pure Python. A model of an untrained (near-uniform) router, not of a trained one.

    Raises ValueError as :func:`expert_capacity` does."""
    cap = expert_capacity(n_tokens, n_experts, top_k, capacity_factor)
    if cap is None or n_tokens == 0:
        return 0.0
    p = top_k / n_experts
    if p >= 1.0:
        return max(0, n_tokens - cap) / n_tokens
    expected_over = 0.0
    for x in range(cap + 1, n_tokens + 1):
        log_pmf = (math.lgamma(n_tokens + 1) - math.lgamma(x + 1) - math.lgamma(n_tokens - x + 1)
                   + x * math.log(p) + (n_tokens - x) * math.log1p(-p))
        expected_over += (x - cap) * math.exp(log_pmf)
    return n_experts * expected_over / (n_tokens * top_k)


# ------------------------------------------------------------------------------------------------------
# routing
# ------------------------------------------------------------------------------------------------------
@dataclass
class Routing:
    """The router's decisions for N tokens.

    ``probs`` [N, E] softmax of the router logits; ``expert`` int64 [N, k] chosen experts (best first);
    ``gate`` [N, k] their weights (differentiable); ``keep`` bool [N, k] False where capacity dropped the
    assignment; ``capacity`` slots per expert (None = unlimited).
    """

    probs: torch.Tensor
    expert: torch.Tensor
    gate: torch.Tensor
    keep: torch.Tensor
    capacity: int | None

    @property
    def n_experts(self) -> int:
        """E, the number of experts (the last dimension of ``probs``)."""
        return self.probs.shape[-1]

    def tokens_per_expert(self) -> torch.Tensor:
        """int64 [E]: assignments routed to each expert before capacity."""
        return torch.bincount(self.expert.reshape(-1), minlength=self.n_experts)

    def kept_per_expert(self) -> torch.Tensor:
        """int64 [E]: assignments each expert processes (after capacity)."""
        return torch.bincount(self.expert[self.keep], minlength=self.n_experts)

    def stats(self) -> dict:
        """Plain numbers: ``tokens`` N, ``assignments`` N·k, ``tokens_per_expert``, ``kept_per_expert``,
        ``overflow_per_expert`` (routed − capacity, ≥ 0), ``dropped`` (assignments), ``dropped_tokens`` (tokens
        with every assignment dropped), ``capacity``, ``entropy`` (mean router entropy per token, nats;
        ln E = uniform) and ``aux_loss`` (:func:`load_balancing_loss`)."""
        routed, kept = self.tokens_per_expert(), self.kept_per_expert()
        n = self.probs.shape[0]
        probs = self.probs.detach()
        ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        return {"tokens": n, "assignments": int(self.expert.numel()),
                "tokens_per_expert": routed.tolist(), "kept_per_expert": kept.tolist(),
                "overflow_per_expert": (routed - kept).tolist(), "dropped": int((routed - kept).sum()),
                "dropped_tokens": int((~self.keep.any(-1)).sum()) if n else 0, "capacity": self.capacity,
                "entropy": float(ent.mean()) if n else 0.0,
                "aux_loss": float(load_balancing_loss(self).detach()) if n else 0.0}


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None = None, *,
          drop_policy: str = "position", normalize: bool = False) -> Routing:
    """Top-k routing with a capacity per expert.

    ``logits`` [N, E] -> :class:`Routing`. Gates are the softmax probabilities of the chosen experts
    (``normalize=True``: divided by their sum). Capacity: :func:`expert_capacity` of N tokens. Drop policy
    ``"position"``: every token's first choice before any second choice, earlier tokens first (GShard §2.2);
    ``"score"``: highest router probability first (Riquelme et al. 2021, "batch prioritized routing").
    Raises ValueError for top_k outside 1..E, capacity_factor <= 0, unknown drop_policy.
    """
    n, e = logits.shape
    check_expert_parallel(e, top_k=top_k, capacity_factor=capacity_factor, drop_policy=drop_policy)
    probs = torch.softmax(logits.float(), dim=-1).to(logits.dtype)
    gate, expert = torch.topk(probs, top_k, dim=-1)
    if normalize:
        gate = gate / gate.sum(-1, keepdim=True)
    cap = expert_capacity(n, e, top_k, capacity_factor)
    if cap is None or n == 0:
        keep = torch.ones_like(expert, dtype=torch.bool)
    else:
        flat_expert = expert.t().reshape(-1)  # slot-major: every token's 1st choice, then every 2nd choice
        if drop_policy == "position":
            order = torch.arange(flat_expert.numel(), device=logits.device)
        else:
            order = torch.argsort(gate.detach().t().reshape(-1), descending=True, stable=True)
        onehot = F.one_hot(flat_expert[order], e)
        slot = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # position of each assignment in its expert's queue
        keep_flat = torch.empty_like(flat_expert, dtype=torch.bool)
        keep_flat[order] = slot < cap
        keep = keep_flat.view(top_k, n).t()
    return Routing(probs, expert, gate, keep, cap)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch Transformer auxiliary loss (Fedus et al. 2022, eq. 4–6): ``E · Σ_e f_e · P_e`` with f_e the
    fraction of assignments routed to expert e and P_e the mean router probability of e. 1.0 when routing is
    uniform; differentiable through P. Multiply by a small coefficient (Switch: 1e-2) and add to the loss."""
    f = routing.tokens_per_expert().to(routing.probs.dtype) / max(1, routing.expert.numel())
    p = routing.probs.mean(0)
    return routing.n_experts * (f * p).sum()


# ------------------------------------------------------------------------------------------------------
# the single-process layer
# ------------------------------------------------------------------------------------------------------
def _make_expert(hidden_size: int, ffn_hidden_size: int, mlp: str, bias: bool) -> nn.Module:
    from labkit.models import GeluMLP, SwiGLU

    if mlp == "swiglu":
        return SwiGLU(hidden_size, ffn_hidden_size, bias)
    return GeluMLP(hidden_size, ffn_hidden_size, bias)


def _kept_assignments(routing: Routing):
    """(token, expert, gate) of kept assignments, sorted by expert (stable)."""
    tok, slot = routing.keep.nonzero(as_tuple=True)
    exp = routing.expert[tok, slot]
    order = torch.argsort(exp, stable=True)
    return tok[order], exp[order], routing.gate[tok[order], slot[order]]


def _run_experts(experts, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """rows grouped by expert (sizes[i] rows for experts[i]) -> each expert's output, same order.

    Every expert is called, also on zero rows, so the output is always connected to the experts' weights:
    under EP every rank then runs the combine all-to-all's backward (a rank skipping it would hang the rest)."""
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, rows.split(sizes))])


class MoE(nn.Module):
    """A mixture-of-experts MLP: [..., H] -> [..., H] (the MoE contribution only; add the residual outside).

    Attributes: ``router`` (nn.Linear H -> n_experts, no bias), ``experts`` (nn.ModuleList of SwiGLU/GELU MLPs
    with ``ffn_hidden_size`` each), ``top_k``, ``capacity_factor`` (None = no limit; may be changed between
    calls), ``drop_policy``, ``normalize``; after each call ``last_routing`` (:class:`Routing`) and
    ``aux_loss`` (:func:`load_balancing_loss`, differentiable).

    Raises ValueError for top_k outside 1..n_experts, capacity_factor <= 0 or an unknown mlp / drop policy.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, n_experts: int, top_k: int, *, mlp: str = "swiglu",
                 bias: bool = False, capacity_factor: float | None = None, drop_policy: str = "position",
                 normalize: bool = False):
        super().__init__()
        check_choice("mlp", mlp, ("swiglu", "gelu"))
        check_expert_parallel(n_experts, top_k=top_k, capacity_factor=capacity_factor, drop_policy=drop_policy)
        self.hidden_size, self.n_experts, self.top_k = hidden_size, n_experts, top_k
        self.capacity_factor, self.drop_policy, self.normalize = capacity_factor, drop_policy, normalize
        self.router = nn.Linear(hidden_size, n_experts, bias=False)
        self.experts = nn.ModuleList(_make_expert(hidden_size, ffn_hidden_size, mlp, bias) for _ in range(n_experts))
        self.last_routing: Routing | None = None
        self.aux_loss: torch.Tensor | None = None

    @classmethod
    def from_spec(cls, spec, **kwargs) -> MoE:
        """The MoE layer of a :class:`~labkit.theory.spec.ModelSpec` with ``n_experts > 0``."""
        return cls(spec.hidden_size, spec.expert_ffn_hidden_size, spec.n_experts, spec.top_k, mlp=spec.mlp,
                   bias=spec.bias, **kwargs)

    def route(self, x: torch.Tensor) -> Routing:
        """Routing of x [N, H] with this layer's router and settings."""
        return route(self.router(x), self.top_k, self.capacity_factor, drop_policy=self.drop_policy,
                     normalize=self.normalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routing = self.route(flat)
        tok, exp, gate = _kept_assignments(routing)
        sizes = torch.bincount(exp, minlength=self.n_experts).tolist()
        out = _run_experts(self.experts, flat[tok], sizes)
        y = torch.zeros_like(flat).index_add(0, tok, out * gate[:, None].to(out.dtype))
        self.last_routing, self.aux_loss = routing, load_balancing_loss(routing)
        return y.view_as(x)


def set_capacity_factor(model: nn.Module, capacity_factor: float | None) -> None:
    """Set ``capacity_factor`` on every :class:`MoE` / :class:`ExpertParallelMoE` inside ``model``."""
    if capacity_factor is not None:
        positive_float("capacity_factor", capacity_factor)
    for m in model.modules():
        if isinstance(m, (MoE, ExpertParallelMoE)):
            m.capacity_factor = capacity_factor


# ------------------------------------------------------------------------------------------------------
# expert parallel
# ------------------------------------------------------------------------------------------------------
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
        return _all_to_all_v(x, out_splits, in_splits, group, timeline, name)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits, group, timeline, name = ctx.meta
        return _all_to_all_v(g, in_splits, out_splits, group, timeline, name + " bwd"), None, None, None, None, None


def _all_to_all_v(x, out_splits, in_splits, group, timeline, name):
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
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
    Raises ValueError if ep does not divide n_experts.
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
        flat = x.reshape(-1, x.shape[-1])
        with _span(tl, "route", "compute"):
            routing = route(self.router(flat), self.top_k, self.capacity_factor, drop_policy=self.drop_policy,
                            normalize=self.normalize)
            tok, exp, gate = _kept_assignments(routing)
            send_counts = torch.bincount(exp, minlength=self.n_experts)  # [E], grouped by destination rank
        # 1. exchange the counts first: every rank learns what it will receive (no shape guessing, no stall)
        recv_counts = torch.empty_like(send_counts)
        with _span(tl, "a2a counts", "comm", nbytes=send_counts.numel() * send_counts.element_size()):
            dist.all_to_all_single(recv_counts, send_counts, group=g)
        send_rows = send_counts.view(ep, n_local).sum(1).tolist()
        recv_matrix = recv_counts.view(ep, n_local)  # [source rank, local expert]
        recv_rows = recv_matrix.sum(1).tolist()
        # 2. dispatch the token rows
        received = _AllToAllV.apply(flat[tok], recv_rows, send_rows, g, tl, "dispatch")
        # 3. regroup by local expert (received rows are ordered by source rank, then local expert)
        with _span(tl, "experts", "compute"):
            row_expert = torch.repeat_interleave(torch.arange(n_local, device=flat.device).repeat(ep),
                                                 recv_matrix.reshape(-1))
            perm = torch.argsort(row_expert, stable=True)
            out_grouped = _run_experts(self.experts, received[perm], recv_matrix.sum(0).tolist())
            out_recv = torch.empty_like(out_grouped).index_copy(0, perm, out_grouped) if len(perm) else out_grouped
        # 4. combine: send results back, weight by the gates, sum per token
        back = _AllToAllV.apply(out_recv, send_rows, recv_rows, g, tl, "combine")
        with _span(tl, "weighted sum", "compute"):
            y = torch.zeros_like(flat).index_add(0, tok, back * gate[:, None].to(back.dtype))
        row_bytes = flat.shape[-1] * flat.element_size()
        me = self.ep_rank
        self.last_routing, self.aux_loss = routing, load_balancing_loss(routing)
        self.last_stats = {**routing.stats(), "send_counts": send_counts.tolist(), "send_rows": send_rows,
                           "recv_rows": recv_rows,
                           "dispatch_bytes": sum(n for d, n in enumerate(send_rows) if d != me) * row_bytes,
                           "combine_bytes": sum(n for s, n in enumerate(recv_rows) if s != me) * row_bytes,
                           "dispatch_total_bytes": sum(send_rows) * row_bytes}
        return y.view_as(x)

    def sync_router_grads(self) -> None:
        """Sum the router's gradient over the EP group (each rank saw only its own tokens)."""
        for p in self.router.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)


def global_stats(local: dict, group=None) -> dict:
    """Sum a rank's :attr:`ExpertParallelMoE.last_stats` counts over the group (collective: every rank calls).
    Returns tokens, assignments, tokens_per_expert, kept_per_expert, overflow_per_expert, dropped,
    dropped_tokens (all global sums) and dropped_fraction (dropped / assignments)."""
    keys = ("tokens_per_expert", "kept_per_expert", "overflow_per_expert")
    scalars = ("tokens", "assignments", "dropped", "dropped_tokens")
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    vec = torch.tensor([v for k in keys for v in local[k]] + [local[k] for k in scalars], dtype=torch.int64,
                       device=device)
    dist.all_reduce(vec, group=group)
    vals = vec.tolist()
    e = len(local["tokens_per_expert"])
    out = {k: vals[i * e:(i + 1) * e] for i, k in enumerate(keys)}
    out.update({k: vals[len(keys) * e + i] for i, k in enumerate(scalars)})
    out["dropped_fraction"] = out["dropped"] / out["assignments"] if out["assignments"] else 0.0
    return out


# ------------------------------------------------------------------------------------------------------
# rank functions (launch(labkit.parallel.expert.<fn>, world_size, ...))
# ------------------------------------------------------------------------------------------------------
PLACEMENTS = ("even", "random", "skewed", "one_rank")


def placement(n_tokens: int, world_size: int, kind: str = "even", seed: int = 0) -> torch.Tensor:
    """Which rank holds each of ``n_tokens`` tokens: int64 [n_tokens]. ``"even"``: contiguous equal blocks;
    ``"random"``: each token to a random rank (uneven counts); ``"skewed"``: one token on rank 0, the rest at
    random on the other ranks (rank 0 then sends nothing to most experts); ``"one_rank"``: every token on the
    last rank (the others hold none). Deterministic in ``seed``."""
    check_choice("kind", kind, PLACEMENTS)
    if kind == "even":
        return torch.arange(n_tokens) * world_size // max(1, n_tokens)
    if kind == "one_rank":
        return torch.full((n_tokens,), world_size - 1, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed + 17)
    if kind == "skewed" and world_size > 1:
        owner = 1 + torch.randint(world_size - 1, (n_tokens,), generator=g)
        owner[:1] = 0
        return owner
    return torch.randint(world_size, (n_tokens,), generator=g)


def _full_moe(seed, hidden_size, ffn_hidden_size, n_experts, top_k, drop_policy) -> MoE:
    torch.manual_seed(seed)  # same weights on every rank
    moe = MoE(hidden_size, ffn_hidden_size, n_experts, top_k, drop_policy=drop_policy)
    with torch.no_grad():  # a router with some spread, so top-k choices are not near ties
        moe.router.weight.normal_(0.0, 1.0 / math.sqrt(hidden_size))
    return moe


def ep_parity_rank(ctx, *, n_tokens: int | None = None, hidden_size: int = 16, ffn_hidden_size: int = 24,
                   n_experts: int | None = None, top_k: int = 2, placements=PLACEMENTS,
                   capacity_factors=(None, 0.5), drop_policy: str = "position", seed: int = 0) -> list[dict]:
    """Rank function: :class:`ExpertParallelMoE` (ep = world_size) vs the single-process :class:`MoE`, output
    and gradients, for every placement of tokens on ranks (:func:`placement`) and capacity factor.
    ``n_tokens`` (all ranks together) defaults to :func:`parity_tokens`, enough that capacity 0.5 drops.

    The layer runs on a residual path, ``y = x + moe(x)``, loss = sum(y · dy) with a fixed random dy.
    Reference: the single-process MoE on the whole batch when ``capacity_factor`` is None; with a capacity, the
    single-process MoE on each rank's tokens (capacity is per rank). Compared (fp32,
    ``labkit.models.TOLERANCES``): y and dx of this rank's tokens, the router gradient (summed over ranks) and
    this rank's experts' gradients. Also checks that tokens every expert dropped come out equal to their input
    (the residual), not zero.

    Returns one row per (placement, capacity_factor): errors, ``ok``, ``n_local``, local ``stats``,
    ``global`` (:func:`global_stats`), ``expert`` (this rank's top-k choices, for an independent recount),
    ``fully_dropped`` and ``residual_ok``.
    """
    from labkit.models import TOLERANCES

    tol = TOLERANCES[torch.float32]
    n_experts = n_experts or 2 * ctx.world_size
    check_expert_parallel(n_experts, ep=ctx.world_size, top_k=top_k, drop_policy=drop_policy)
    n_tokens = parity_tokens(ctx.world_size, n_experts, top_k) if n_tokens is None else n_tokens
    full = _full_moe(seed, hidden_size, ffn_hidden_size, n_experts, top_k, drop_policy).to(ctx.device)
    ep_moe = ExpertParallelMoE(full)
    g = torch.Generator().manual_seed(seed + 1)
    x_all = torch.randn(n_tokens, hidden_size, generator=g).to(ctx.device)
    dy_all = torch.randn(n_tokens, hidden_size, generator=g).to(ctx.device)
    rows = []
    for kind in placements:
        owner = placement(n_tokens, ctx.world_size, kind, seed).to(ctx.device)
        for cf in capacity_factors:
            full.zero_grad(set_to_none=True)
            ep_moe.zero_grad(set_to_none=True)
            full.capacity_factor = ep_moe.capacity_factor = cf
            mine = (owner == ctx.rank).nonzero(as_tuple=True)[0]
            x = x_all[mine].clone().requires_grad_()
            y = x + ep_moe(x)
            (y * dy_all[mine]).sum().backward()
            ep_moe.sync_router_grads()
            # reference: one process, whole batch (or each rank's group when capacity applies)
            groups = [torch.arange(n_tokens)] if cf is None else [(owner == s).nonzero(as_tuple=True)[0]
                                                                 for s in range(ctx.world_size)]
            y_ref, dx_ref = torch.zeros_like(x_all), torch.zeros_like(x_all)
            for idx in groups:
                xr = x_all[idx].clone().requires_grad_()
                yr = xr + full(xr)
                (yr * dy_all[idx]).sum().backward()
                y_ref[idx], dx_ref[idx] = yr.detach(), xr.grad
            pairs = {"y": (y.detach(), y_ref[mine]), "dx": (x.grad, dx_ref[mine]),
                     "router_grad": (ep_moe.router.weight.grad, full.router.weight.grad)}
            for i, ex in enumerate(ep_moe.experts):
                ref_ex = full.experts[ep_moe.expert_offset + i]
                for (name, p), pr in zip(ex.named_parameters(), ref_ex.parameters()):
                    pairs[f"expert{ep_moe.expert_offset + i}.{name}.grad"] = (p.grad, pr.grad)
            err = {k: float((a - b).abs().max()) if a.numel() else 0.0 for k, (a, b) in pairs.items()}
            ok = all(torch.allclose(a, b, **tol) for a, b in pairs.values())
            routing = ep_moe.last_routing
            fully = ~routing.keep.any(-1)
            residual_ok = bool(torch.equal(y.detach()[fully], x.detach()[fully])
                               and (x.detach()[fully].norm(dim=-1) > 0).all())
            rows.append({"placement": kind, "capacity_factor": cf, "rank": ctx.rank, "n_local": len(mine),
                         "err_y": err["y"], "err_dx": err["dx"], "err_router_grad": err["router_grad"],
                         "err_expert_grad": max([v for k, v in err.items() if k.startswith("expert")], default=0.0),
                         "ok": ok, "stats": dict(ep_moe.last_stats),
                         "global": global_stats(ep_moe.last_stats), "expert": routing.expert.tolist(),
                         "fully_dropped": int(fully.sum()), "residual_ok": residual_ok})
    return rows


def ep_profile_rank(ctx, *, tokens_per_rank: int = 256, hidden_size: int = 64, ffn_hidden_size: int = 128,
                    n_experts: int = 8, top_k: int = 2, capacity_factors=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
                    capacity_factor: float | None = 1.25, repeats: int = 3, seed: int = 0) -> dict:
    """Rank function: routing statistics and a timed expert-parallel MoE step (ep = world_size).

    Each rank draws its own ``tokens_per_rank`` tokens. Measured, per rank:

    * ``sweep``: for each of ``capacity_factors``, the global dropped fraction (forward only);
    * ``stats`` / ``global``: routing statistics at ``capacity_factor`` (tokens per expert, dropped, overflow,
      routing entropy, aux loss);
    * ``comm``: bytes per all-to-all call of one forward + backward (:class:`labkit.runtime.commlog.CommLog`: S and
      the (n−1)/n ring share) beside the bytes that really left the rank (rows for other ranks × H × e);
    * ``iter_ns`` per timed repeat, with ``route`` / ``a2a counts`` / ``dispatch`` / ``experts`` /
      ``combine`` events in ``ctx.timeline`` (``step`` = repeat).
    """
    from labkit.runtime import timeline as tl
    from labkit.runtime.commlog import CommLog

    check_expert_parallel(n_experts, ep=ctx.world_size, top_k=top_k, capacity_factor=capacity_factor)
    full = _full_moe(seed, hidden_size, ffn_hidden_size, n_experts, top_k, "position").to(ctx.device)
    ep_moe = ExpertParallelMoE(full)
    x = torch.randn(tokens_per_rank, hidden_size,
                    generator=torch.Generator().manual_seed(seed + 100 + ctx.rank)).to(ctx.device)
    sweep = []
    with torch.no_grad():
        for cf in capacity_factors:
            ep_moe.capacity_factor = cf
            ep_moe(x)
            gs = global_stats(ep_moe.last_stats)
            sweep.append({"capacity_factor": cf, "dropped_fraction": gs["dropped_fraction"],
                          "dropped": gs["dropped"], "assignments": gs["assignments"],
                          "local_dropped": ep_moe.last_stats["dropped"]})
    ep_moe.capacity_factor = capacity_factor

    def step(timeline=None):
        ep_moe.timeline = timeline
        xl = x.clone().requires_grad_()
        y = xl + ep_moe(xl)
        y.square().mean().backward()
        ep_moe.sync_router_grads()
        ep_moe.timeline = None

    step()  # warm-up
    with CommLog() as log:
        step()
    stats = dict(ep_moe.last_stats)
    glob = global_stats(stats)
    comm = log.to_frame()
    comm = comm[comm["op"] == "all_to_all"][["nbytes", "group_size", "bytes_per_rank"]].to_dict("records")
    iter_ns = []
    for i in range(repeats):
        ctx.barrier()
        t0 = tl.now_ns()
        n0 = len(ctx.timeline.events)
        step(ctx.timeline)
        iter_ns.append(tl.now_ns() - t0)
        ctx.timeline.events[n0:] = [(*e[:5], i, *e[6:]) for e in ctx.timeline.events[n0:]]
    return {"rank": ctx.rank, "sweep": sweep, "stats": stats, "global": glob, "comm": comm, "iter_ns": iter_ns}


def recount_dropped(rows, *, n_experts: int, top_k: int) -> int:
    """Dropped assignments counted again from the routing decisions alone (plain Python): for each rank's row
    of :func:`ep_parity_rank` (``expert`` = its tokens' top-k choices, ``n_local``, ``capacity_factor``),
    per expert max(0, routed − ceil(capacity_factor · n_local · top_k / n_experts)), summed."""
    import collections

    total = 0
    for row in rows:
        if row["capacity_factor"] is None:
            continue
        cap = math.ceil(row["capacity_factor"] * row["n_local"] * top_k / n_experts)
        counts = collections.Counter(e for choices in row["expert"] for e in choices)
        total += sum(max(0, c - cap) for c in counts.values())
    return total


# ------------------------------------------------------------------------------------------------------
# tables for the chapter
# ------------------------------------------------------------------------------------------------------
def sweep_table(result, *, tokens_per_rank: int, n_experts: int, top_k: int):
    """Dropped fraction vs capacity factor from an :func:`ep_profile_rank` launch: ``measured`` (global, all
    ranks) beside ``predicted`` (:func:`predicted_dropped_fraction` for one rank's tokens: capacity is per
    rank)."""
    import pandas as pd

    df = pd.DataFrame(result[0]["sweep"])[["capacity_factor", "dropped_fraction"]]
    df = df.rename(columns={"dropped_fraction": "measured_dropped_fraction"})
    df["predicted_dropped_fraction"] = [predicted_dropped_fraction(tokens_per_rank, n_experts, top_k, cf)
                                        for cf in df["capacity_factor"]]
    return df


def a2a_bytes_table(result):
    """Per rank, bytes of the dispatch all-to-all of one :func:`ep_profile_rank` forward, each column labelled:

    * ``measured_input_bytes`` — S, the rows this rank hands to the dispatch all-to-all (itself included),
      counted from the routing;
    * ``predicted_offrank_bytes`` — S·(n−1)/n, what a *uniform* all-to-all sends to other ranks (the share
      nccl-tests' busbw factor assumes; doc/PERFORMANCE.md): a prediction, not a measurement;
    * ``measured_offrank_bytes`` — rows that really went to other ranks × H × element size;
    * ``measured_combine_offrank_bytes`` — the same for the combine all-to-all (rows received back).
    """
    import pandas as pd

    rows = []
    for r in result:
        s, n = r["stats"], len(r["stats"]["send_rows"])
        rows.append({"rank": r["rank"], "measured_input_bytes": s["dispatch_total_bytes"],
                     "predicted_offrank_bytes": s["dispatch_total_bytes"] * (n - 1) / n,
                     "measured_offrank_bytes": s["dispatch_bytes"],
                     "measured_combine_offrank_bytes": s["combine_bytes"]})
    return pd.DataFrame(rows)


def dense_vs_moe(spec_name: str = "lab-tiny-moe", *, batch: int = 4, seq_len: int = 64, repeats: int = 3,
                 seed: int = 0):
    """Memory and compute of an MoE model beside two dense twins, in this process (no launch):
    ``dense-active`` (same spec, one dense MLP of ffn = top_k · expert_ffn_hidden_size: the same FLOPs per
    token) and the MoE itself. Columns: ``params_predicted`` (:meth:`ModelSpec.n_params`),
    ``params_measured`` (counted in the built module), ``param_bytes`` (fp32, measured),
    ``active_params_predicted`` (:meth:`ModelSpec.n_active_params`), ``flops_per_token_predicted``
    (forward, :func:`labkit.models.flops_per_token`), ``forward_ms_measured`` (median of ``repeats``
    forward passes of [batch, seq_len] tokens on one torch thread, after one warm-up).

    Raises ValueError for an unknown preset or a dense one (:func:`moe_spec`)."""
    import statistics
    import time

    import pandas as pd

    from labkit.models import build_model, flops_per_token

    spec_moe = moe_spec(spec_name)
    dense = spec_moe.replace(name=f"{spec_name}-dense-active", n_experts=0, top_k=0,
                             ffn_hidden_size=spec_moe.top_k * spec_moe.expert_ffn_hidden_size)
    tokens = torch.randint(spec_moe.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: comparable numbers on a shared machine (several threads can thrash)
    try:
        for label, spec in (("dense-active", dense), ("moe", spec_moe)):
            model = build_model(spec, seed).eval()
            times = []
            with torch.no_grad():
                model(tokens)
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    model(tokens)
                    times.append(time.perf_counter() - t0)
            rows.append({"model": label, "params_predicted": spec.n_params(),
                         "params_measured": sum(p.numel() for p in model.parameters()),
                         "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                         "active_params_predicted": spec.n_active_params(),
                         "flops_per_token_predicted": flops_per_token(spec, seq_len, training=False),
                         "forward_ms_measured": statistics.median(times) * 1e3})
    finally:
        torch.set_num_threads(threads)
    return pd.DataFrame(rows)
