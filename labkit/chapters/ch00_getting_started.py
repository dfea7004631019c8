"""Chapter 00 (getting started): its parameter check, the straggler run (measured, and emulated on a named
cluster), the wait table, the sentences written from it, and its figure.

The rank functions it launches are :func:`labkit.experiments.basics.hello` and
:func:`labkit.experiments.basics.straggler_steps`.
"""

from __future__ import annotations

import pandas as pd

from labkit.chapters.common import as_emulate, check_prediction, check_steps, check_world_size
from labkit.checks import positive_float

#: the collective's own cost (time inside all_reduce beyond the predicted wait) counts as "small" below this
#: share of the straggler's predicted wait: the free-communication prediction then explains the wait
SMALL_GAP_SHARE = 0.1


def check_emulate(emulate, world_size: int) -> None:
    """``emulate`` off (:func:`as_emulate`) or what ``launch(..., emulate=...)`` accepts for ``world_size`` ranks
    (ValueError from :func:`labkit.runtime.emulate.resolve`, naming the valid profiles or world sizes,
    otherwise)."""
    emulate = as_emulate(emulate)
    if emulate is not None:
        from labkit.runtime.emulate import resolve

        resolve(emulate, world_size)


def check_chapter(*, world_size: int, emulate, my_prediction, work_ms: float, steps: int, timeout_s: float) -> None:
    """Validate chapter 00's parameters before any launch. Raises ValueError naming the value and the fix:
    world_size >= 2 (section 4 makes rank 1 fail, and a collective needs a peer), ``emulate`` a profile the
    world size fits (or None), ``my_prediction`` None or a number, work_ms > 0 (the straggler experiment needs
    unequal work), steps >= 1, timeout_s > 0."""
    world_size = check_world_size("00", world_size, why="a collective needs a peer, and section 4 makes rank 1 fail")
    check_emulate(emulate, world_size)
    check_prediction(my_prediction, what="a number of milliseconds (rank 0's wait inside all_reduce in section 3, "
                                    "e.g. 40)")
    positive_float("work_ms", work_ms)
    check_steps("steps", steps)
    positive_float("timeout_s", timeout_s)


def straggler_run(world_size: int, *, work_ms: float, steps: int, emulate="dgx-h100", timeout_s: float = 120.0,
                  keep_warm: bool = True) -> dict:
    """Section 3's runs: :func:`~labkit.experiments.basics.straggler_steps` measured on this machine (real
    matmuls for (r+1) x ``work_ms``), and, unless ``emulate`` is None, the same program emulated on that cluster
    with the compute as ``time.sleep`` stand-ins (exactly (r+1) x ``work_ms`` of work on any hardware; the
    all-reduce charged as the cluster's link would).

    Returns ``{"result": measured LaunchResult, "waits": wait_table(measured), "emulated_result": LaunchResult or
    None, "emulated_waits": wait_table(emulated) or None, "label": "emulated (<profile>)" or None,
    "findings": straggler_findings(...)}``."""
    from labkit.experiments.basics import straggler_steps
    from labkit.runtime.launcher import launch

    emulate = as_emulate(emulate)
    res = launch(straggler_steps, world_size, work_ms=work_ms, steps=steps, timeout_s=timeout_s, keep_warm=keep_warm)
    out = {"result": res, "waits": wait_table(res.timeline), "emulated_result": None, "emulated_waits": None,
           "label": None}
    if emulate is not None:
        em = launch(straggler_steps, world_size, work_ms=work_ms, steps=steps, compute="sleep", emulate=emulate,
                    timeout_s=timeout_s, keep_warm=keep_warm)
        out.update(emulated_result=em, emulated_waits=wait_table(em.emulated), label=em.emulation.label)
    out["findings"] = straggler_findings(out["waits"], work_ms, emulated=out["emulated_waits"], label=out["label"])
    return out


def wait_table(timeline) -> pd.DataFrame:
    """Predicted vs measured (or emulated) collective wait from a :func:`straggler_steps` timeline.

    Per (step, rank), ms from the step's earliest compute start: ``compute_ms`` (the "work" event),
    ``arrival_ms`` (when the rank entered all_reduce: the comm event's start; on an emulated timeline, whose
    all_reduce rows start when the last member issued it, the end of the rank's compute), ``in_all_reduce_ms``
    (arrival to the all_reduce's end), ``predicted_wait_ms`` = the step's last arrival − this rank's arrival (a
    collective cannot finish before the last rank has entered it; communication taken as free) and ``gap_ms`` =
    in_all_reduce − predicted (the collective's own cost plus scheduling; >= 0 up to timer jitter)."""
    df = timeline
    emulated = "stream" in df.columns
    work = df[df["name"] == "work"].copy()
    comm = df[(df["kind"] == "comm") & (df["name"] == "all_reduce")].copy()
    if emulated:  # the replay's rows carry no step: the k-th all_reduce of a rank is its step k
        work = work.sort_values("start_ns")
        comm = comm.sort_values("start_ns")
        work["step"] = work.groupby("rank").cumcount()
        comm["step"] = comm.groupby("rank").cumcount()
    work, comm = work.set_index(["step", "rank"]), comm.set_index(["step", "rank"])
    out = pd.DataFrame(index=work.index)
    origin = work.groupby("step")["start_ns"].transform("min")
    arrival = work["end_ns"] if emulated else comm["start_ns"]
    out["compute_ms"] = (work["end_ns"] - work["start_ns"]) / 1e6
    out["arrival_ms"] = (arrival - origin) / 1e6
    out["in_all_reduce_ms"] = (comm["end_ns"] - arrival) / 1e6
    out["predicted_wait_ms"] = (arrival.groupby("step").transform("max") - arrival) / 1e6
    out["gap_ms"] = out["in_all_reduce_ms"] - out["predicted_wait_ms"]
    return out.reset_index().sort_values(["step", "rank"]).reset_index(drop=True)


def _one(waits: pd.DataFrame, work_ms: float, label: str) -> dict:
    per = waits.groupby("rank").median(numeric_only=True)
    n = len(per)
    asked = {r: (r + 1) * work_ms for r in per.index}
    off = {r: per.loc[r, "compute_ms"] / asked[r] for r in per.index}
    last_in = waits.loc[waits.groupby("step")["arrival_ms"].idxmax(), "rank"].to_numpy()
    least = waits.loc[waits.groupby("step")["in_all_reduce_ms"].idxmin(), "rank"].to_numpy()
    wait0 = float(per.loc[0, "in_all_reduce_ms"])
    pred0 = float(per.loc[0, "predicted_wait_ms"])
    gap = float(waits["gap_ms"].median())
    share = gap / pred0 if pred0 > 0 else float("inf")
    compute = ", ".join(f"rank {r} {per.loc[r, 'compute_ms']:.1f} ms (asked {asked[r]:g})" for r in per.index)
    same = bool((last_in == least).all())
    sentences = [f"{label}: compute per step {compute}.",
                 (f"In every step the last rank to arrive (rank {last_in[0]}) spent the least time in all_reduce."
                  if same else f"In {int((last_in != least).sum())} of {len(last_in)} steps the last rank to arrive "
                  "was NOT the one that spent least time in all_reduce (scheduling noise larger than the wait)."),
                 f"Rank 0 spent {wait0:.3g} ms in all_reduce against a predicted wait of {pred0:.3g} ms; the "
                 f"collective's own cost (median gap) was {gap:.3g} ms, {share:.2%} of that wait: "
                 + ("the free-communication prediction explains almost all of the wait." if share < SMALL_GAP_SHARE
                    else "the collective's own cost is a large part of it, which the free-communication "
                         "prediction leaves out.")]
    return {"n": n, "rank0_wait_ms": wait0, "rank0_predicted_ms": pred0, "gap_ms": gap, "gap_share": share,
            "compute_over_asked": off, "last_waits_least": same, "gap_small": share < SMALL_GAP_SHARE,
            "sentence": " ".join(sentences)}


def straggler_findings(waits: pd.DataFrame, work_ms: float, *, emulated: pd.DataFrame | None = None,
                       label: str | None = None) -> dict:
    """What the straggler runs show, as numbers and sentences written from them: per run (``measured``, and
    ``emulated`` when given) each rank's compute beside the (r+1) x ``work_ms`` it was asked for, whether the last
    rank to arrive spent least time in all_reduce in every step, and rank 0's time in all_reduce beside the
    predicted wait with the collective's own cost as a share of it (``gap_small`` below
    :data:`SMALL_GAP_SHARE`). ``conclusion`` joins the sentences."""
    out = {"measured": _one(waits, work_ms, "measured")}
    if emulated is not None:
        out["emulated"] = _one(emulated, work_ms, label or "emulated")
    out["conclusion"] = "\n".join(v["sentence"] for v in out.values())
    return out


def check_straggler(run: dict, work_ms: float) -> None:
    """Section 3's checks on a :func:`straggler_run` (AssertionError with the conclusion when one fails):

    * measured: each rank computed 0.9-3x the (r+1) x ``work_ms`` asked; every gap (time in all_reduce minus
      the predicted wait) within [-2, 250] ms (timer jitter; a stuck collective); the straggler is there —
      rank 0's predicted wait is at least half the (n-1) x ``work_ms`` the program asks for, and rank 0 really
      spent at least 80 % of it inside all_reduce; at 2 ranks the last to arrive waits least in every step;
    * emulated (deterministic stand-in compute): rank 0's predicted wait is (n-1) x ``work_ms`` within 1 %,
      it spent at least that inside all_reduce, and the last rank to arrive waits least in every step.

    A program without a straggler (equal work) fails the straggler checks, whatever its timings."""
    found, waits = run["findings"], run["waits"]
    m, why = found["measured"], found["conclusion"]
    n = m["n"]
    asked = (n - 1) * work_ms
    for r, ratio in m["compute_over_asked"].items():
        assert 0.9 < ratio < 3.0, f"rank {r} computed {ratio:.2f}x its (r+1)*work_ms"
    assert (waits["gap_ms"] > -2.0).all(), waits[waits["gap_ms"] <= -2.0]  # 2 ms: timer and wake-up jitter
    assert (waits["gap_ms"] < 250.0).all(), waits[waits["gap_ms"] >= 250.0]  # a stuck collective blows this up
    assert m["rank0_predicted_ms"] >= 0.5 * asked, (
        f"no straggler: rank 0's predicted wait {m['rank0_predicted_ms']:.3g} ms, the program asks {asked:g} ms")
    assert m["rank0_wait_ms"] >= 0.8 * m["rank0_predicted_ms"], why
    assert m["last_waits_least"] or n > 2, why
    if "emulated" in found:
        e = found["emulated"]
        assert abs(e["rank0_predicted_ms"] / asked - 1) < 0.01, (
            f"emulated: rank 0's predicted wait {e['rank0_predicted_ms']:.4g} ms, the program asks {asked:g} ms")
        assert e["rank0_wait_ms"] >= e["rank0_predicted_ms"] and e["gap_ms"] >= 0, why
        assert e["last_waits_least"], why


def wait_figure(run: dict):
    """Time inside all_reduce per rank (median over steps): ``measured``, ``predicted (last arrival − arrival)``
    from the measured arrivals, and the emulated run's time beside its own predicted wait, when there is one."""
    import plotly.graph_objects as go

    from labkit.style import label_color

    fig = go.Figure()
    series = [("measured", run["waits"], "in_all_reduce_ms"),
              ("predicted (last arrival − arrival), measured arrivals", run["waits"], "predicted_wait_ms")]
    if run.get("emulated_waits") is not None:
        series.append((run["label"], run["emulated_waits"], "in_all_reduce_ms"))
    for name, df, col in series:
        per = df.groupby("rank")[col].median()
        fig.add_trace(go.Bar(x=[f"rank {r}" for r in per.index], y=per.to_numpy(), name=name,
                             marker_color=label_color(name)))
    fig.update_layout(barmode="group", title="Time inside all_reduce per rank (median over steps)",
                      yaxis_title="ms", legend={"orientation": "h", "y": -0.2})
    return fig
