"""Expert parallelism, measured: the rank functions that tests, benchmarks and chapter 08 launch, and the
tables that read their results (measured beside :mod:`labkit.theory.expert`'s predictions).

* :func:`ep_parity_rank` — :class:`~labkit.parallel.expert.ExpertParallelMoE` against the single-process
  :class:`~labkit.parallel.expert.MoE`, for every placement of tokens on ranks and capacity factor;
* :func:`ep_profile_rank` — routing statistics, a capacity-factor sweep, the all-to-all bytes and a timed step;
* :func:`dense_vs_moe` — memory and compute of an MoE model beside its dense twin, in this process.
"""

from __future__ import annotations

import collections
import math
import statistics
import time

import pandas as pd
import torch
import torch.distributed as dist

from labkit.checks import check_choice, positive_int
from labkit.parallel.expert import ExpertParallelMoE, MoE
from labkit.runtime import timeline as tl
from labkit.runtime.commlog import CommLog
from labkit.theory.expert import check_expert_parallel, moe_spec, predicted_dropped_fraction


# ------------------------------------------------------------------------------------------------------
# rank functions (launch(labkit.experiments.expert.<fn>, world_size, ...))
# ------------------------------------------------------------------------------------------------------
def parity_tokens(world_size: int, n_experts: int, top_k: int) -> int:
    """Tokens for :func:`ep_parity_rank`: at least 40, and enough that with an even placement every rank
    routes ``4·n_experts`` assignments or more. Then a capacity factor of 0.5 must drop some: a rank with A
    assignments keeps at most ``ceil(A/(2E))·E <= A/2 + E <= 3A/4`` of them."""
    return max(40, math.ceil(4 * n_experts * positive_int("world_size", world_size) / top_k))


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
    total = 0
    for row in rows:
        if row["capacity_factor"] is None:
            continue
        cap = math.ceil(row["capacity_factor"] * row["n_local"] * top_k / n_experts)
        counts = collections.Counter(e for choices in row["expert"] for e in choices)
        total += sum(max(0, c - cap) for c in counts.values())
    return total


def global_stats(local: dict, group=None) -> dict:
    """Sum a rank's :attr:`~labkit.parallel.expert.ExpertParallelMoE.last_stats` counts over the group
    (collective: every rank calls).
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
# tables of what ran (measured beside predicted)
# ------------------------------------------------------------------------------------------------------
def sweep_table(result, *, tokens_per_rank: int, n_experts: int, top_k: int):
    """Dropped fraction vs capacity factor from an :func:`ep_profile_rank` launch: ``measured`` (global, all
    ranks) beside ``predicted`` (:func:`~labkit.theory.expert.predicted_dropped_fraction` for one rank's tokens:
    capacity is per rank)."""
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
    (forward, :func:`labkit.models.flops_per_token`), ``flops_per_token_counted`` (independent of that formula:
    torch's FlopCounterMode on one forward of the same model and tokens, :func:`labkit.experiments.scaling.
    count_flops`, with eager attention, whose matmuls the counter sees — on CPU it cannot see inside the fused
    sdpa kernel), ``forward_ms_measured`` (median of ``repeats`` forward passes of [batch, seq_len] tokens on one
    torch thread, after one warm-up).

    Raises ValueError for an unknown preset or a dense one (:func:`~labkit.theory.expert.moe_spec`)."""
    from labkit.experiments.scaling import count_flops
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
            eager = build_model(spec, seed, attention="eager").eval()
            times = []
            with torch.no_grad():
                counted = count_flops(lambda eager=eager: eager(tokens))["flops_counted"] / tokens.numel()
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
                         "flops_per_token_counted": counted,
                         "forward_ms_measured": statistics.median(times) * 1e3})
    finally:
        torch.set_num_threads(threads)
    return pd.DataFrame(rows)
