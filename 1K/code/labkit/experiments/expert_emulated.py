"""Expert parallelism, emulated (chapter 08): one MoE layer step per (ep, router skew) on subgroups of the
launch, timed as a named cluster would run it, and charged as a real model's MoE layer.

* :func:`moe_charge` — the :class:`~labkit.theory.replay.Charge` of one lab MoE layer as ``model``'s;
* :func:`ep_a2a_rank` — the rank function (run it with ``launch(..., emulate=...)``);
* :func:`a2a_table` — the all-to-all time, the step and the busiest receiver per (ep, skew), emulated beside the
  cost model's uniform-router prediction.
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.distributed as dist

from labkit.checks import check_divides, positive_int
from labkit.experiments.expert import _full_moe
from labkit.parallel.expert import ExpertParallelMoE
from labkit.runtime import timeline as tl


def moe_charge(*, model: str = "mixtral-8x7b", tokens_per_rank: int = 4096, lab_tokens_per_rank: int,
               lab_hidden_size: int, lab_ffn_hidden_size: int, dtype: str = "bf16", lab_dtype: str = "fp32"):
    """The Charge that makes one step of the lab's MoE layer (``lab_tokens_per_rank`` tokens of
    ``lab_hidden_size`` per rank, experts of ``lab_ffn_hidden_size``, ``lab_dtype``) cost what one MoE layer of
    ``model`` would with ``tokens_per_rank`` tokens per GPU in ``dtype``, forward + backward:

    * compute FLOPs x (T/T_l) · (H·F)/(H_l·F_l) (the expert matmuls dominate: rows x H x F);
    * compute bytes and every all-to-all's bytes x (T/T_l) · H/H_l · e/e_l (rows of H elements), once
      (one layer), on groups of dim ``ep``.

    Pure Python. Raises ValueError for a preset that is not an MoE, a size < 1 or an unknown dtype."""
    from labkit.theory.cluster import DTYPE_BYTES
    from labkit.theory.expert import moe_spec
    from labkit.theory.replay import Charge

    spec = moe_spec(model)
    t, tl_, hl, fl = (positive_int(n, v) for n, v in (("tokens_per_rank", tokens_per_rank),
                                                       ("lab_tokens_per_rank", lab_tokens_per_rank),
                                                       ("lab_hidden_size", lab_hidden_size),
                                                       ("lab_ffn_hidden_size", lab_ffn_hidden_size)))
    for name, d in (("dtype", dtype), ("lab_dtype", lab_dtype)):
        if d not in DTYPE_BYTES:
            raise ValueError(f"{name}={d!r} is not one of {', '.join(DTYPE_BYTES)}")
    e = DTYPE_BYTES[dtype] / DTYPE_BYTES[lab_dtype]
    ffn = spec.expert_ffn_hidden_size or spec.ffn_hidden_size
    f_flops = t / tl_ * spec.hidden_size * ffn / (hl * fl)
    f_rows = t / tl_ * spec.hidden_size / hl * e
    details = {"model": spec.name, "what": "one MoE layer, forward + backward", "tokens_per_rank": t,
               "dtype": dtype, "lab_tokens_per_rank": tl_, "lab_hidden_size": hl, "lab_ffn_hidden_size": fl,
               "flops_factor": f_flops, "bytes_factor": f_rows}
    return Charge(f"as {spec.name}", f_flops, f_rows, dtype, {"ep": (f_rows, 1.0)}, "ep", {}, details)


def _skew_hook(n_experts: int, skew: float):
    bias = torch.zeros(n_experts)
    bias[0] = skew  # expert 0 (on the group's rank 0) favoured by every token

    def hook(_module, _inputs, logits):
        return logits + bias.to(logits)

    return hook


def ep_a2a_rank(ctx, *, eps, skews, tokens_per_rank: int = 256, hidden_size: int = 64, ffn_hidden_size: int = 128,
                n_experts: int = 8, top_k: int = 2, seed: int = 0) -> list[dict]:
    """Rank function: for each ep of ``eps`` (divisors of world_size: world_size/ep independent EP groups of
    consecutive ranks, side by side) and each router ``skew`` of ``skews`` (added to expert 0's router logit:
    0 = the untrained router, larger = more tokens to expert 0, whose rank receives them), one forward +
    backward of :class:`~labkit.parallel.expert.ExpertParallelMoE` without a capacity limit, between barriers,
    its events on ``ctx.timeline``. Rows: ``ep, skew, rank, window_ns, recv_rows, send_rows, iter_ns``.
    Raises ValueError (before any collective) for an ep that does not divide world_size or n_experts."""
    for ep in eps:
        check_divides("ep", ep, "world_size", ctx.world_size)
        check_divides("ep", ep, "n_experts", n_experts)
    groups = {ep: dist.new_subgroups(group_size=ep)[0] for ep in eps}  # the same order on every rank
    x = torch.randn(tokens_per_rank, hidden_size, generator=torch.Generator().manual_seed(seed + 100 + ctx.rank))
    rows = []
    for ep in eps:
        for skew in skews:
            moe = ExpertParallelMoE(_full_moe(seed, hidden_size, ffn_hidden_size, n_experts, top_k, "position"),
                                    group=groups[ep], timeline=ctx.timeline)
            moe.capacity_factor = None
            handle = moe.router.register_forward_hook(_skew_hook(n_experts, float(skew)))
            ctx.barrier()
            w0 = tl.now_ns()
            xl = x.clone().requires_grad_()
            (xl + moe(xl)).square().mean().backward()
            w1 = tl.now_ns()
            ctx.barrier()
            handle.remove()
            s = moe.last_stats
            rows.append({"ep": ep, "skew": float(skew), "rank": ctx.rank, "recv_rows": sum(s["recv_rows"]),
                         "send_rows": sum(s["send_rows"]), "iter_ns": [w1 - w0],
                         "window_ns": (w0 - ctx.clock_offset_ns, w1 - ctx.clock_offset_ns)})
    return rows


def a2a_table(result, *, tokens_per_rank: int, hidden_size: int, top_k: int, element_size: int = 4):
    """Per (ep, skew) of an emulated :func:`ep_a2a_rank` launch (deterministic):

    * ``a2a_ms`` — emulated: the longest time any rank spends in the step's all-to-alls (the union of its
      replayed all-to-all intervals: counts, dispatch and combine, forward and backward);
    * ``step_ms`` — emulated: the slowest rank's step;
    * ``busiest_recv_over_mean`` — counted: the rows the busiest rank received / the mean;
    * ``predicted_a2a_ms`` — the cost model (the profile's :meth:`Cluster.collective_s`) for the four token
      all-to-alls of a *uniform* router: S = tokens_per_rank · top_k · H · e, charged as the run is;
    * ``label`` — ``emulated (<profile>[, as <model>])``."""
    em = result.emulation
    frame = result.emulated
    comm = frame[(frame["stream"] == "comm") & (frame["op"] == "all_to_all")]
    fb, rep = em.plan.charge.comm.get("ep", (1.0, 1.0))
    rows = []
    df = pd.DataFrame([r for rank_rows in result for r in rank_rows])
    for (ep, skew), g in df.groupby(["ep", "skew"], sort=True):
        a2a, step = [], []
        for r in g.itertuples():
            a, b = (em.map_ns(r.rank, t) for t in r.window_ns)
            mine = comm[(comm["rank"] == r.rank) & (comm["start_ns"] >= a) & (comm["end_ns"] <= b)]
            spans = sorted(zip(mine["start_ns"], mine["end_ns"]))
            total, end = 0, None
            for s0, s1 in spans:  # union of intervals
                if end is None or s0 > end:
                    total, end = total + (s1 - s0), s1
                elif s1 > end:
                    total, end = total + (s1 - end), s1
            a2a.append(total / 1e6)
            step.append((b - a) / 1e6)
        recv = g["recv_rows"]
        s = tokens_per_rank * top_k * hidden_size * element_size * fb
        pred = 4 * rep * em.cluster.collective_s("all_to_all", s, tuple(range(int(ep)))) * 1e3
        rows.append({"ep": int(ep), "skew": float(skew), "a2a_ms": max(a2a), "step_ms": max(step),
                     "busiest_recv_over_mean": float(recv.max() / recv.mean()), "predicted_a2a_ms": pred,
                     "label": em.label})
    return pd.DataFrame(rows)
