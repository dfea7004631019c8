"""Chapter 06 (pipeline parallelism): its parameter check, the micro-batch counts it accepts, and its figures.

The runs it launches are :func:`labkit.experiments.pipeline.run_pipelines` (the hand-written runner of
:mod:`labkit.parallel.pipeline.runner` beside ``torch.distributed.pipelining``); the predictions are
:mod:`labkit.theory.simulate`'s. Figures use plotly (imported lazily).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from labkit.chapters.common import as_emulate, check_fits_in_memory, check_prediction, check_steps, check_world_size
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


#: the keys a dict ``my_prediction`` may have: the schedules of the fixed-compute run at ``m``, and the unequal split
PREDICTION_KEYS = ("gpipe", "1f1b", "interleaved", "zb-h1", "unequal")


def check_chapter(*, world_size, emulate=None, my_prediction=None, n_microbatches=None, op_ms=20.0, sweep=(1, 2),
                  steps=2, spec_name: str = "lab-tiny-llama", vocab_size=8192, global_batch_size=None, seq_len=32,
                  bubble_tol=0.05, timeout_s=180.0) -> dict:
    """Chapter 06's parameters, all checked before any launch (the chapter's first cell after its parameters).

    Resolves the defaults (``n_microbatches`` None -> 2 pp: twice the fewest every schedule runs with, so that
    1F1B holds fewer micro-batches in flight than GPipe — at m = pp both hold all of them; the sweep keeps
    m = pp, where the bubble is largest; ``global_batch_size`` None -> m, one sequence per micro-batch) and checks,
    each with a ValueError naming the value and the fix: world_size = pp >= 2; m enough for every schedule and
    a multiple of pp (interleaved); every sweep factor k a positive integer (m = k·pp); op_ms, bubble_tol
    (below 1) and timeout_s positive; steps >= 1; a dense, known ``spec_name`` with ``vocab_size`` and
    n_layers = 2·pp (one layer per interleaved stage); m dividing global_batch_size; seq_len within
    max_seq_len. Every job the chapter launches (fixed and real compute, ours and torch's) passes
    :func:`labkit.theory.pipeline.check_job`. ``emulate`` (None: measured only) must be a profile the
    cluster can hold ``world_size`` ranks on (:func:`labkit.runtime.emulate.resolve`: ValueError naming the valid
    profiles and sizes); ``my_prediction`` None, a number or a dict of numbers.

    Returns ``{"pp", "n_microbatches", "global_batch_size", "sweep_microbatches", "costs" (OpCosts, s),
    "spec" (the real-compute ModelSpec)}``.
    """
    from labkit.theory.spec import get_spec

    p = check_world_size("06", world_size, why="a pipeline needs at least two stages, one per rank")
    emulate = as_emulate(emulate)
    if emulate is not None:
        from labkit.runtime.emulate import resolve

        try:
            resolve(emulate, p)
        except ValueError as e:
            raise ValueError(f"emulate={emulate!r} with world_size={p}: {e}; or emulate=None (measured only)") from None
    check_prediction(my_prediction, what="a number (1F1B's bubble with the last stage twice as slow, a fraction of "
                     "total time, e.g. 0.3) or a dict of them keyed " + ", ".join(PREDICTION_KEYS),
                     keys=PREDICTION_KEYS)
    m = (positive_int("n_microbatches", n_microbatches) if n_microbatches is not None
         else 2 * _min_chapter_microbatches(p))
    gbs = positive_int("global_batch_size", global_batch_size) if global_batch_size is not None else m
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
    steps = check_steps("steps", steps)
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
            "spec": spec, "emulate": emulate}



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


# ------------------------------------------------------------------------------------------------------
# the fixed-compute launch: measured on this machine and, in the same launch, emulated on a named cluster
# ------------------------------------------------------------------------------------------------------
def fixed_jobs(plan: dict, steps: int) -> list[dict]:
    """Chapter 06's fixed-compute jobs for a :func:`check_chapter` plan: GPipe and 1F1B at every m of the sweep,
    interleaved (v = 2, ops half as long: the same work per rank) and ZB-H1 at m, and last a 1F1B pipeline
    whose last stage is twice as slow (label ``"1f1b unequal stages"``)."""
    p, m, costs = plan["pp"], plan["n_microbatches"], plan["costs"]
    half = OpCosts(costs.f / 2, costs.b / 2, costs.w / 2)
    slow_last = OpCosts(f=[costs.f] * (p - 1) + [2 * costs.f], b=[costs.b] * (p - 1) + [2 * costs.b],
                        w=[costs.w] * (p - 1) + [2 * costs.w])
    jobs = [dict(schedule=s, n_microbatches=mm, steps=steps, costs=costs)
            for mm in plan["sweep_microbatches"] for s in ("gpipe", "1f1b")]
    jobs += [dict(schedule="interleaved", n_microbatches=m, v=2, costs=half, steps=steps),
             dict(schedule="zb-h1", n_microbatches=m, costs=costs, steps=steps)]
    jobs.append(dict(schedule="1f1b", n_microbatches=m, costs=slow_last, steps=steps, label="1f1b unequal stages"))
    return jobs


def run_fixed(plan: dict, *, steps: int = 2, emulate=None, timeout_s: float = 180.0) -> dict:
    """Run :func:`fixed_jobs` in ONE launch of ``pp`` ranks; with ``emulate`` (a profile name or dict, as
    ``launch``'s) the same launch is also emulated (:func:`labkit.runtime.emulate.emulation`).

    Returns ``{"runs": [PipelineRun], "emulation": Emulation | None, "label": its label or None,
    "emulated": [emulated timeline frame per run] (or Nones), "table": DataFrame}``: the table has one row per
    run: ``run``, ``schedule``, ``m``, ``measured``, ``emulated`` (NaN without emulation), ``predicted
    (simulator)``, ``predicted (formula)``, ``peak in flight, rank 0 (measured)`` — bubble fractions of total
    time (measured: median of the timed steps; emulated: median of the emulated steps)."""
    import contextlib

    from labkit.experiments.pipeline import bubble_from_timeline, run_pipelines
    from labkit.runtime import emulate as em

    p = plan["pp"]
    ctx = em.emulation(emulate) if emulate is not None else contextlib.nullcontext()
    with ctx as session:
        runs = run_pipelines(fixed_jobs(plan, steps), p, timeout_s=timeout_s, echo=False)
    emu = session.last if emulate is not None else None
    frames = [emu.retime(r.timeline) if emu is not None else None for r in runs]
    rows = []
    for r, f in zip(runs, frames):
        e = float(bubble_from_timeline(f, p)["bubble_fraction"].median()) if f is not None else float("nan")
        rows.append({"run": r.job["label"], "schedule": r.job["schedule"], "m": r.schedule.m,
                     "measured": r.bubble_measured, "emulated": e,
                     "predicted (simulator)": r.predicted.bubble_fraction,
                     "predicted (formula)": r.formula if "unequal" not in r.job["label"] else float("nan"),
                     "peak in flight, rank 0 (measured)": r.peak_inflight[0]})
    table = pd.DataFrame(rows)
    table.attrs["pp"] = p
    return {"runs": runs, "emulation": emu, "label": emu.label if emu is not None else None, "emulated": frames,
            "table": table}


def at_m(fixed: dict, m: int) -> dict:
    """``{schedule: (PipelineRun, emulated frame or None)}`` of the equal-stage runs at ``m`` micro-batches."""
    return {r.job["schedule"]: (r, f) for r, f in zip(fixed["runs"], fixed["emulated"])
            if r.schedule.m == m and "unequal" not in r.job["label"]}


def unequal(fixed: dict):
    """The unequal-stage run of :func:`run_fixed` and its emulated frame (or None)."""
    return next((r, f) for r, f in zip(fixed["runs"], fixed["emulated"]) if "unequal" in r.job["label"])


def prediction_inputs(fixed: dict, m: int) -> dict:
    """Keyword arguments for :func:`labkit.chapters.common.compare_prediction`: the reader guessed the bubble
    (fraction of total time) of 1F1B with the last stage twice as slow; a dict guess may name every schedule at
    ``m`` too (keys ``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``, ``unequal``)."""
    t = fixed["table"]
    eq = t[(t["m"] == m) & ~t["run"].str.contains("unequal")].set_index("schedule")
    un = t[t["run"].str.contains("unequal")].iloc[0]
    measured = {**eq["measured"].to_dict(), "unequal": float(un["measured"])}
    predicted = {**eq["predicted (simulator)"].to_dict(), "unequal": float(un["predicted (simulator)"])}
    return dict(measured=measured, predicted=predicted, what="unequal", unit="of total time",
                predicted_label="predicted (simulator)")


# ------------------------------------------------------------------------------------------------------
# sentences computed from the runs
# ------------------------------------------------------------------------------------------------------
def memory_findings(p: int, m: int, gpipe_inflight: int, f1b_inflight: int) -> str:
    """What the fixed runs showed about activation memory: the most micro-batches rank 0 held at once (measured)
    under GPipe and 1F1B, and what that means at this (p, m)."""
    text = f"Rank 0 held at most {gpipe_inflight} micro-batches under GPipe and {f1b_inflight} under 1F1B (measured)."
    if f1b_inflight < gpipe_inflight:
        text += (f" 1F1B starts backwards after p = {p} forwards, so it keeps {f1b_inflight} of the m = {m} "
                 f"micro-batches' activations: {gpipe_inflight / f1b_inflight:.1f}x less activation memory on "
                 "rank 0 for the same bubble.")
    elif f1b_inflight == gpipe_inflight:
        text += (f" With m = {m} not above p = {p}, 1F1B cannot start a backward any earlier than GPipe: both "
                 "hold every micro-batch, and 1F1B saves memory only once m > p.")
    else:
        text += " 1F1B held more than GPipe here, which its schedule does not allow: check the run."
    return text


def fixed_findings(table: pd.DataFrame, m: int, label: str | None) -> str:
    """Sentences on the fixed-compute bubbles at ``m`` (from :func:`run_fixed`'s table): how far the laptop's
    measurement and the emulated cluster sit from the simulator, which schedule had the smallest bubble, and
    what the slow last stage cost."""
    t = table[(table["m"] == m) & ~table["run"].str.contains("unequal")].set_index("schedule")
    un = table[table["run"].str.contains("unequal")].iloc[0]
    gap = (t["measured"] - t["predicted (simulator)"])
    worst = gap.abs().idxmax()
    text = (f"Measured on this machine, the bubble is {gap.mean():+.3f} from the simulator on average "
            f"(largest gap: {worst}, {gap[worst]:+.3f})")
    if label and t["emulated"].notna().all():
        eg = (t["emulated"] - t["predicted (simulator)"]).abs().max()
        text += f"; {label} lands within {eg:.4f} of it"
    text += "."
    src = "emulated" if label and t["emulated"].notna().all() else "measured"
    best = t[src].idxmin()
    text += (f" The smallest bubble ({src}) is {best}'s, {t.loc[best, src]:.3f} of total time, against 1F1B's "
             f"{t.loc['1f1b', src]:.3f}.")
    base = float(t.loc["1f1b", "measured"])
    grow = float(un["measured"]) - base
    text += (f" Making the last stage twice as slow {'raised' if grow > 0 else 'lowered'} 1F1B's measured bubble "
             f"from {base:.3f} to {float(un['measured']):.3f} (the simulator, fed the per-stage costs, says "
             f"{float(un['predicted (simulator)']):.3f}): every other rank waits for the slow stage.")
    return text


def stage_busy_ms(run) -> list[float]:
    """Per rank, the milliseconds it spent in F/B/W per timed step (median over the steps, measured)."""
    df = run.timeline
    comp = df[df["name"].isin(("F", "B", "W")) & (df["step"] >= 0)]
    per = (comp["end_ns"] - comp["start_ns"]).groupby([comp["rank"], comp["step"]]).sum()
    return [float(per.loc[r].median()) / 1e6 if r in per.index.get_level_values(0) else 0.0
            for r in range(run.schedule.p)]


def balance_findings(layer_s: Sequence[float], equal: Sequence[int], balanced: Sequence[int],
                     eq_busy_ms: Sequence[float], bal_busy_ms: Sequence[float], eq_step_s: float, bal_step_s: float,
                     *, m: int | None = None, near: float = 0.05, spread: float = 0.0) -> str:
    """Why the balanced split did or did not pay, from the numbers: the slowest stage predicted from the layer
    times measured in one process (``layer_s``, s per layer) for each split, the busiest rank's F/B/W time per
    step measured in the pipeline runs (``*_busy_ms``), and the two median step times. ``near``: relative
    difference treated as "about the same"; ``m`` (micro-batches per step) lets it say how much longer the busiest
    rank computed in the pipeline than the isolated layer times predict. ``spread``: the runs' own timing spread
    (:func:`step_spread`, relative); a step difference inside ``max(near, spread)`` is "about as fast", never
    "paid" or "slower"."""
    equal, balanced = tuple(equal), tuple(balanced)
    if equal == balanced:
        return (f"balance_layers kept the equal split {equal}: the measured layer times are even enough that "
                "moving a layer would not shorten the slowest stage, so both runs are the same split.")
    pe = max(sim.stage_costs_from_layers(layer_s, equal)) * 1e3
    pb = max(sim.stage_costs_from_layers(layer_s, balanced)) * 1e3
    me, mb = max(eq_busy_ms), max(bal_busy_ms)
    text = (f"From the layer times measured in one process, the balanced split {balanced} should cut the slowest "
            f"stage from {pe:.2f} to {pb:.2f} ms per micro-batch (predicted). In the pipeline the busiest rank "
            f"computed {me:.1f} ms per step with the equal split and {mb:.1f} ms with the balanced one, and the "
            f"step took {eq_step_s * 1e3:.1f} vs {bal_step_s * 1e3:.1f} ms (measured).")
    ratio = bal_step_s / eq_step_s
    near = max(near, float(spread))
    noise = f" (inside this run's timing spread of {spread:.0%})" if spread > 0 and abs(ratio - 1) <= near else ""
    slower_inside = (f" (the busiest rank computed {me / (m * pe):.1f}x longer per step than m = {m} micro-batches of "
                     "its isolated layer times predict)" if m else "")
    if ratio < 1 - near:
        return text + f" Balancing paid: the step is {1 - ratio:.0%} shorter."
    if mb >= me * (1 - near):
        why = ("the split chosen from isolated layer times did not lighten the busiest rank in the run: inside the "
               "pipeline the layers did not cost what they cost alone in one process" + slower_inside + ", so the "
               "prediction the split was chosen from does not hold here.")
    else:
        why = ("the busiest rank did get lighter, yet the step did not follow: what does not depend on the split "
               "(p2p hops, Python per op, the optimizer, ranks waiting for a core" + slower_inside + ") sets the "
               "step.")
    verdict = "slower" if ratio > 1 + near else "about as fast"
    return text + f" The balanced split ran {verdict} ({ratio:.2f}x the equal split's step{noise}): " + why


def step_spread(run) -> float:
    """The relative spread of a :class:`~labkit.experiments.pipeline.PipelineRun`'s timed steps (measured):
    (slowest - fastest) / median of ``run.steps["step_s"]``; 0 for one step."""
    s = run.steps["step_s"]
    return float((s.max() - s.min()) / s.median()) if len(s) > 1 and s.median() > 0 else 0.0


# ------------------------------------------------------------------------------------------------------
# figures with the bubble drawn as idle
# ------------------------------------------------------------------------------------------------------
def with_idle(df: pd.DataFrame, step: int = 0) -> pd.DataFrame:
    """One step of a pipeline timeline as what each rank computed and when it sat idle: its F/B/W rows, and an
    ``idle`` row for every gap between the step's first op and its last, on every rank (the fill and the drain
    too). Waiting on a receive is idle time: the ``recv``/``send`` rows are dropped."""
    comp = df[df["name"].isin(("F", "B", "W")) & (df["step"] == step)]
    if comp.empty:
        return comp
    lo, hi = int(comp["start_ns"].min()), int(comp["end_ns"].max())
    rows = []
    for r in sorted(df["rank"].unique()):
        t = lo
        for s, e in sorted(zip(comp.loc[comp["rank"] == r, "start_ns"], comp.loc[comp["rank"] == r, "end_ns"])):
            if s > t:
                rows.append({"rank": int(r), "name": "idle", "kind": "idle", "start_ns": t, "end_ns": int(s),
                             "step": step, "microbatch": -1, "stage": -1, "nbytes": 0})
            t = max(t, int(e))
        if hi > t:
            rows.append({"rank": int(r), "name": "idle", "kind": "idle", "start_ns": t, "end_ns": hi, "step": step,
                         "microbatch": -1, "stage": -1, "nbytes": 0})
    cols = list(tl.COLUMNS)
    out = pd.concat([comp[cols], pd.DataFrame(rows, columns=cols)], ignore_index=True)
    return out.sort_values(["rank", "start_ns"], kind="stable").reset_index(drop=True)


def idle_gantt(df: pd.DataFrame, title: str, step: int = 0):
    """:func:`labkit.plots.timeline_figure` of :func:`with_idle`: F/B/W bars labelled by micro-batch, the bubble
    in the idle colour."""
    from labkit.plots import timeline_figure

    return timeline_figure(with_idle(df, step), color_by="name", label="microbatch", title=title)


def run_gantt(run, frame=None, label: str | None = None, step: int = 0):
    """The Gantt of one step of a :class:`~labkit.experiments.pipeline.PipelineRun`: measured, or emulated when
    ``frame`` (its emulated timeline) and ``label`` are given; bubble drawn as idle, its fraction in the title."""
    from labkit.experiments.pipeline import bubble_from_timeline

    df = frame if frame is not None else run.timeline
    per_step = bubble_from_timeline(df, run.schedule.p)["bubble_fraction"]
    b, med = float(per_step.iloc[step]), float(per_step.median())
    what = label if frame is not None else run.title().split(" — ", 1)[-1]
    of = (f"bubble of step {step}: {b:.3f} of total time (the table's median over {len(per_step)} steps: "
          f"{med:.3f})" if len(per_step) > 1 and f"{b:.3f}" != f"{med:.3f}" else f"bubble {b:.3f} of total time")
    return idle_gantt(df, f"{run.job['label']} — {what}; {of}; grey: idle", step)


def sim_gantt(schedule: str, p: int, m: int, costs: OpCosts, v: int = 1):
    """The simulator's Gantt of ``schedule`` (predicted), bubble drawn as idle."""
    res = sim.simulate(sim.make_schedule(schedule, p, m, v), costs)
    df = pd.DataFrame(res.timeline_rows(), columns=tl.COLUMNS)
    vs = f" v={v}" if v > 1 else ""
    return idle_gantt(df, f"{schedule} pp={p} m={m}{vs} — predicted (simulator); bubble {res.bubble_fraction:.3f} "
                          "of total time (grey: idle)")


def bubble_compare_figure(table: pd.DataFrame, m: int, label: str | None = None):
    """The headline: bubble fraction per schedule at ``m`` (and the unequal-stage 1F1B), measured on this machine,
    emulated on the named cluster (when run) and predicted by the simulator, side by side."""
    import plotly.graph_objects as go

    from labkit.style import label_color

    t = table[(table["m"] == m) | table["run"].str.contains("unequal")]
    x = [r if "unequal" in r else s for r, s in zip(t["run"], t["schedule"])]
    fig = go.Figure()
    series = [("measured", "measured")] + ([(label, "emulated")] if label else []) + [
        ("predicted (simulator)", "predicted (simulator)")]
    for name, col in series:
        fig.add_trace(go.Bar(x=x, y=t[col], name=name, marker_color=label_color(name),
                             text=[f"{v:.3f}" for v in t[col]], textposition="outside"))
    p = int(table.attrs.get("pp", 0)) or None
    fig.update_layout(barmode="group", yaxis_title="bubble (fraction of total time)",
                      title=f"Bubble per schedule{f', pp={p}' if p else ''}, m={m}, fixed compute")  # legend: sources
    return fig


def sweep_figure(table: pd.DataFrame, p: int, label: str | None = None):
    """Bubble fraction vs m for GPipe and 1F1B (one panel each): measured, emulated, the simulator and the
    closed form (p-1)/(m+p-1)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from labkit.style import label_color

    names = ["gpipe", "1f1b"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=names, shared_yaxes=True)
    formula = "predicted ((p-1)/(m+p-1))"
    for i, s in enumerate(names):
        g = table[(table["schedule"] == s) & ~table["run"].str.contains("unequal")].sort_values("m")
        series = [("measured", "measured", "markers"), (label, "emulated", "markers"),
                  ("predicted (simulator)", "predicted (simulator)", "lines"),
                  (formula, "predicted (formula)", "lines")]
        for name, col, mode in series:
            if name is None:
                continue
            fig.add_trace(go.Scatter(x=g["m"], y=g[col], mode=mode, name=name, legendgroup=name, showlegend=i == 0,
                                     marker={"size": 10, "color": label_color(name)},
                                     line={"color": label_color(name), "dash": "dot" if col.endswith("(formula)")
                                           else "solid"}), row=1, col=i + 1)
    fig.update_xaxes(title_text="micro-batches m", type="log")
    fig.update_yaxes(title_text="bubble (fraction of total time)", col=1)
    fig.update_layout(title=f"Bubble vs micro-batches, pp={p}, fixed compute")
    return fig


def schedule_panel(p: int, m: int, op_ms: float):
    """An ipywidgets panel over the simulator: pick the schedule, the micro-batches and how much slower the last
    stage is; the Gantt (bubble as idle) and its bubble fraction redraw on every change. Returns the VBox."""
    import ipywidgets as w

    from labkit.widgets import headless, show_in

    style = {"description_width": "120px"}
    ctl = {"schedule": w.Dropdown(options=list(sim.SCHEDULES), value="1f1b", description="schedule", style=style),
           "m": w.SelectionSlider(options=[k * p for k in range(1, 9)], value=m if m % p == 0 and m <= 8 * p else p,
                                  description="micro-batches", style=style),
           "slow": w.SelectionSlider(options=[1.0, 1.5, 2.0, 3.0], value=1.0, description="last stage x",
                                     style=style)}
    out = w.Output()

    def redraw(*_):
        s, mm, k = ctl["schedule"].value, ctl["m"].value, ctl["slow"].value
        v = 2 if s == "interleaved" else 1
        op = op_ms / 1e3 / v
        per = [op] * (p * v - 1) + [k * op]
        show_in(out, sim_gantt(s, p, mm, OpCosts(f=per, b=per, w=per), v))

    for c in ctl.values():
        c.observe(redraw, names="value")
    redraw()
    return headless(w.VBox([w.HBox(list(ctl.values())), out]))  # an executed copy shows the figure
