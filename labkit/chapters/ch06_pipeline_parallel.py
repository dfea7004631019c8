"""Chapter 06 (pipeline parallelism): its parameter check, the micro-batch counts it accepts, and its figures.

The runs it launches are :func:`labkit.experiments.pipeline.run_pipelines` (the hand-written runner of
:mod:`labkit.parallel.pipeline.runner` beside ``torch.distributed.pipelining``); the predictions are
:mod:`labkit.theory.simulate`'s. Figures use plotly (imported lazily).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from labkit.chapters.common import check_fits_in_memory, check_world_size
from labkit.checks import positive_float, positive_int
from labkit.runtime import timeline as tl
from labkit.theory import simulate as sim
from labkit.theory.pipeline import check_job
from labkit.theory.simulate import OpCosts


# ------------------------------------------------------------------------------------------------------
# parameters, checked before any launch
# ------------------------------------------------------------------------------------------------------
def _min_chapter_microbatches(p: int) -> int:
    """The fewest micro-batches every schedule of chapter 06 runs with on ``p`` ranks (a multiple of p)."""
    need = max(sim.min_microbatches(name, p) for name in sim.SCHEDULES)
    return -(-need // p) * p


def _microbatch_problem(p: int, m: int, gbs: int) -> str | None:
    """Why chapter 06 cannot run ``m`` micro-batches of ``gbs`` sequences on ``p`` ranks, or None."""
    for name in sim.SCHEDULES:
        try:
            sim.check_schedule_args(name, p, m, 2 if name == "interleaved" else 1)
        except ValueError:
            return (f"does not suit every schedule of this chapter on pp={p}: 1F1B needs n_microbatches >= "
                    f"{max(sim.min_microbatches(n, p) for n in sim.SCHEDULES)} and the interleaved schedule a "
                    f"multiple of pp={p} (Narayanan et al. 2021)")
    if gbs % m:
        return f"does not divide global_batch_size={gbs} (micro-batches must be equal)"
    return None


def chapter_microbatches(pp: int, global_batch_size: int) -> list[int]:
    """The n_microbatches chapter 06 accepts for ``global_batch_size`` on ``pp`` ranks: divisors of the batch
    that every schedule runs with (>= :func:`labkit.theory.simulate.min_microbatches`, a multiple of pp for the
    interleaved schedule). Empty when none. Raises ValueError for pp < 2 or a non-positive batch."""
    pp = positive_int("pp", pp, minimum=2)
    gbs = positive_int("global_batch_size", global_batch_size)
    return [d for d in range(1, gbs + 1) if gbs % d == 0 and _microbatch_problem(pp, d, gbs) is None]


def check_chapter(*, world_size, n_microbatches=None, op_ms=20.0, sweep=(1, 2, 4), steps=2,
                  spec_name: str = "lab-tiny-llama", vocab_size=8192, global_batch_size=None, seq_len=32,
                  bubble_tol=0.05, timeout_s=180.0) -> dict:
    """Chapter 06's parameters, all checked before any launch (the chapter's first cell after its parameters).

    Resolves the defaults (``n_microbatches`` None -> 2·pp, ``global_batch_size`` None -> 2·m) and checks,
    each with a ValueError naming the value and the fix: world_size = pp >= 2; m enough for every schedule and
    a multiple of pp (interleaved); every sweep factor k a positive integer (m = k·pp); op_ms, bubble_tol
    (below 1) and timeout_s positive; steps >= 1; a dense, known ``spec_name`` with ``vocab_size`` and
    n_layers = 2·pp (one layer per interleaved stage); m dividing global_batch_size; seq_len within
    max_seq_len. Every job the chapter launches (fixed and real compute, ours and torch's) passes
    :func:`labkit.theory.pipeline.check_job`.

    Returns ``{"pp", "n_microbatches", "global_batch_size", "sweep_microbatches", "costs" (OpCosts, s),
    "spec" (the real-compute ModelSpec)}``.
    """
    from labkit.theory.spec import get_spec

    p = check_world_size("06", world_size, why="a pipeline needs at least two stages, one per rank")
    m = positive_int("n_microbatches", n_microbatches) if n_microbatches is not None else 2 * p
    gbs = positive_int("global_batch_size", global_batch_size) if global_batch_size is not None else 2 * m
    problem = _microbatch_problem(p, m, gbs)
    if problem:
        valid = chapter_microbatches(p, gbs)
        fix = (f"n_microbatches that pass every rule with global_batch_size={gbs} on pp={p}: "
               f"{', '.join(map(str, valid))}" if valid else
               f"no n_microbatches passes every rule with global_batch_size={gbs} on pp={p}; use a "
               f"global_batch_size that is a multiple of {_min_chapter_microbatches(p)}, e.g. "
               f"global_batch_size={2 * _min_chapter_microbatches(p)}")
        raise ValueError(f"n_microbatches={m} {problem}; {fix}")
    ks = [positive_int(f"sweep[{i}]", k) for i, k in enumerate(sweep)]
    if not ks:
        raise ValueError("sweep=[] is empty: give at least one factor k (m = k * world_size), e.g. sweep=[1, 2]")
    op_s = positive_float("op_ms", op_ms) / 1e3
    tol = positive_float("bubble_tol", bubble_tol)
    if tol >= 1:
        raise ValueError(f"bubble_tol={bubble_tol} must be below 1 (a bubble fraction is between 0 and 1); "
                         "e.g. bubble_tol=0.05")
    positive_float("timeout_s", timeout_s)
    steps = positive_int("steps", steps)
    spec = get_spec(spec_name).replace(n_layers=2 * p, vocab_size=positive_int("vocab_size", vocab_size))
    costs = OpCosts(f=op_s, b=op_s, w=op_s)
    ms = sorted({k * p for k in ks} | {m})
    jobs = [dict(schedule=s, n_microbatches=mm, steps=steps, costs=costs) for mm in ms for s in ("gpipe", "1f1b")]
    jobs += [dict(schedule="interleaved", n_microbatches=m, v=2, steps=steps,
                  costs=OpCosts(costs.f / 2, costs.b / 2, costs.w / 2)),
             dict(schedule="zb-h1", n_microbatches=m, costs=costs, steps=steps)]
    real = dict(compute="real", spec=spec, global_batch_size=gbs, seq_len=seq_len, steps=steps, n_microbatches=m)
    jobs += [dict(real, schedule=s) for s in sim.SCHEDULES]
    jobs += [dict(real, schedule=s, impl="torch") for s in ("gpipe", "1f1b", "interleaved")]
    for job in jobs:
        check_job(job, p)
    check_fits_in_memory(spec, p, copies=2, what="chapter 06")
    return {"pp": p, "n_microbatches": m, "global_batch_size": gbs, "sweep_microbatches": ms, "costs": costs,
            "spec": spec}



# ------------------------------------------------------------------------------------------------------
# figures (plotly imported lazily)
# ------------------------------------------------------------------------------------------------------
def gantt(result, step: int = 0, title: str | None = None):
    """Per-rank Gantt of one step: a :class:`labkit.experiments.pipeline.PipelineRun` (measured; its title names
    the compute mode) or a :class:`labkit.theory.simulate.SimResult` (predicted). Bars are coloured by op and
    labelled by micro-batch."""
    from labkit.plots import timeline_figure

    if isinstance(result, sim.SimResult):
        s = result.schedule
        df = pd.DataFrame(result.timeline_rows(step=step), columns=tl.COLUMNS)
        vs = f" v={s.v}" if s.v > 1 else ""
        title = title or (f"{s.name} pp={s.p} m={s.m}{vs} — simulated (bubble "
                          f"{result.bubble_fraction:.3f} of total time)")
    else:
        df = result.timeline[result.timeline["step"] == step]
        title = title or f"{result.title()}; bubble {result.steps['bubble_fraction'].iloc[step]:.3f}"
    return timeline_figure(df, color_by="name", label="microbatch", title=title)


def bubble_figure(runs: Sequence, title: str | None = None):
    """Bubble fraction vs n_microbatches per schedule, from :class:`~labkit.experiments.pipeline.PipelineRun` s:
    measured (markers), simulator and formula (lines)."""
    import plotly.graph_objects as go

    rows = pd.DataFrame([r.summary() for r in runs]).sort_values("n_microbatches")
    fig = go.Figure()
    for name, g in rows.groupby("schedule", sort=False):
        fig.add_trace(go.Scatter(x=g["n_microbatches"], y=g["bubble_measured"], mode="markers",
                                 marker_size=10, name=f"{name} measured"))
        fig.add_trace(go.Scatter(x=g["n_microbatches"], y=g["bubble_simulated"], mode="lines",
                                 name=f"{name} simulator (predicted)"))
        fig.add_trace(go.Scatter(x=g["n_microbatches"], y=g["bubble_formula"], mode="lines",
                                 line_dash="dot", name=f"{name} formula (predicted)"))
    compute = ", ".join(sorted(rows["compute"].unique()))
    fig.update_layout(title=title or f"Bubble fraction (fraction of total time) vs micro-batches — "
                                     f"measured ({compute} compute) beside predictions",
                      xaxis_title="n_microbatches (m)", yaxis_title="bubble_fraction", xaxis_type="log")
    return fig


def memory_figure(runs: Sequence, title: str | None = None):
    """Peak saved activations per rank (MB = 1e6 bytes, measured by saved_tensors_hooks) for each run."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for r in runs:
        if r.peak_saved_bytes[0] is None:
            continue
        fig.add_trace(go.Bar(x=[f"rank {i}" for i in range(r.schedule.p)],
                             y=[b / 1e6 for b in r.peak_saved_bytes], name=r.job["label"],
                             text=[f"{n} in flight" for n in r.peak_inflight], textposition="outside"))
    fig.update_layout(title=title or "Peak saved activations per rank — measured (real compute)",
                      yaxis_title="MB (1e6 bytes)", barmode="group")
    return fig
