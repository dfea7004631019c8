"""Replicas vs tensor parallelism across concurrency, emulated on a named cluster (chapter 10).

The same closed-loop serving engine as :mod:`labkit.experiments.serving` (real prefill + decode of the lab's
model, real all-reduces), one run per (mode, concurrency), each inside a timeline span named
``"<mode>@<concurrency>"``; launched with ``emulate=`` the run is re-timed as the named cluster would run it
(:mod:`labkit.runtime.emulate`). The engine's admission is closed-loop (every request queued at time 0,
admitted when fewer than ``concurrency`` are in flight), so its control flow does not depend on real time and
the emulated timeline is the program's.
"""

from __future__ import annotations

import pandas as pd

from labkit.checks import positive_int


def crossover_rank(ctx, plan: dict) -> dict:
    """Rank function: for every concurrency of ``plan["concurrencies"]`` and both modes, serve
    ``plan["n_requests"]`` requests of ``prompt_len`` + ``output_len`` tokens, inside one span each."""
    import torch
    import torch.distributed as dist

    from labkit.experiments import serving as sx

    torch.manual_seed(plan.get("seed", 0))
    full = sx.build(plan).to(ctx.device)
    n, p, o = plan["n_requests"], plan["prompt_len"], plan["output_len"]
    requests = sx.make_workload(n, short_prompt=p, long_prompt=p, output_len=o)
    group = dist.group.WORLD
    for conc in plan["concurrencies"]:
        for mode in ("replicas", "tp"):
            ctx.barrier()
            with ctx.timeline.span(f"{mode}@{conc}", "other", step=conc):
                sx.serve_mode(ctx, plan, full, mode, requests, conc, group)
    return {"rank": ctx.rank}


def default_concurrencies(world_size: int) -> list[int]:
    """world_size x (1, 2, 4): total concurrencies the replicas can share evenly (kept short: an emulated
    launch traces every operation)."""
    return [world_size * k for k in (1, 2, 4)]


def make_crossover_plan(world_size: int, *, model: str, concurrencies=None, prompt_len: int = 16,
                        output_len: int = 6, n_requests: int | None = None) -> dict:
    """The plan :func:`crossover_rank` runs. ``concurrencies`` default :func:`default_concurrencies`;
    ``n_requests`` default the largest concurrency (every request in flight at the top). Raises ValueError for
    a concurrency that is not a multiple of world_size, or sizes < 1."""
    ws = positive_int("world_size", world_size)
    concs = list(concurrencies) if concurrencies is not None else default_concurrencies(ws)
    for c in concs:
        if positive_int("concurrency", c) % ws:
            raise ValueError(f"concurrency={c} is not a multiple of world_size={ws} (the replicas share it evenly): "
                             f"use e.g. {', '.join(str(ws * k) for k in (1, 2, 4))}")
    return {"model": model, "seed": 0, "dtype": "float32", "attention": "sdpa", "concurrencies": concs,
            "prompt_len": positive_int("prompt_len", prompt_len), "output_len": positive_int("output_len", output_len),
            "n_requests": positive_int("n_requests", n_requests or max(concs))}


def spans_throughput(frame: pd.DataFrame, plan: dict, source: str) -> pd.DataFrame:
    """Per (mode, concurrency): the run's duration (first start to last end over the ranks of its
    ``"<mode>@<c>"`` span) and its total throughput, n_requests x output_len tokens / duration."""
    rows = []
    tokens = plan["n_requests"] * plan["output_len"]
    for conc in plan["concurrencies"]:
        for mode in ("replicas", "tp"):
            g = frame[frame["name"] == f"{mode}@{conc}"]
            if g.empty:
                continue
            dur = (g["end_ns"].max() - g["start_ns"].min()) / 1e9
            rows.append({"mode": mode, "concurrency": conc, "duration_s": dur,
                         "throughput_tok_s": tokens / dur if dur > 0 else float("nan"), "source": source})
    return pd.DataFrame(rows)


def run_crossover(world_size: int, *, model: str, emulate="dgx-h100", concurrencies=None, prompt_len: int = 16,
                  output_len: int = 6, n_requests: int | None = None, timeout_s: float = 300.0) -> dict:
    """One emulated launch of :func:`crossover_rank`. Returns ``{"emulated": table, "label", "plan",
    "wall_s"}`` with ``table`` from :func:`spans_throughput` on the emulated timeline (source = the
    emulation's label, e.g. ``"emulated (dgx-h100)"``)."""
    from labkit.runtime.launcher import launch

    plan = make_crossover_plan(world_size, model=model, concurrencies=concurrencies, prompt_len=prompt_len,
                               output_len=output_len, n_requests=n_requests)
    res = launch(crossover_rank, world_size, plan, emulate=emulate, timeout_s=timeout_s, echo=False)
    label = res.emulation.label
    return {"emulated": spans_throughput(res.emulated, plan, label), "label": label, "plan": plan,
            "wall_s": res.wall_s}
