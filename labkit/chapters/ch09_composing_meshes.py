"""Chapter 09 (composing meshes): its parameter check, its memory figure, and the published-runs validation
table (the planner and the memory calculator beside published training runs).

The runs it launches are :func:`labkit.experiments.composed.run_composed` (the compositions of
:mod:`labkit.parallel.composed` beside the single-process reference), checked by
:func:`labkit.theory.composed.check_runs`; the plan is :mod:`labkit.theory.planner`'s. Figures use plotly
(imported lazily).
"""

from __future__ import annotations

from labkit.chapters.common import check_fits_in_memory, check_prediction, check_steps, check_world_size
from labkit.checks import positive_float, positive_int
from labkit.theory.composed import check_runs
from labkit.theory.published import MFU_BAND, validate_published, validation_table
from labkit.theory.spec import get_spec


# ------------------------------------------------------------------------------------------------------
# parameters, checked before any launch
# ------------------------------------------------------------------------------------------------------
def check_chapter(*, world_size: int, model: str, steps: int, seq_len: int, n_microbatches: int, plan_model: str,
                  plan_gpus: int, plan_gpu: str, gpus_per_node: int, plan_seq_len: int, plan_global_batch: int,
                  emulate="dgx-h100", my_prediction=None, loop_model: str = "llama-3-8b", loop_seq_len=None,
                  loop_global_batch=None, loop_meshes=None, tolerance: float = 0.05,
                  timeout_s: float = 300.0) -> dict:
    """Validate chapter 09's parameters before anything is launched (the chapter's first code cell) and return
    its real runs: ``{"runs", "dp", "global_batch_size", "loop"}`` — DP x TP (torch and hand-written) and PP x
    DP with tp = pp = 2 and dp = world_size / 2, ``global_batch_size`` = n_microbatches x dp sequences; ``loop``
    the "estimate, then measure" runs (None when ``emulate`` is None): ``{"cluster", "meshes",
    "global_batch_size", "model", "seq_len", "tolerance"}`` — ``loop_meshes`` None chooses three from
    world_size (:func:`labkit.experiments.mesh_loop.default_meshes`), ``loop_global_batch`` None world_size
    sequences, ``loop_seq_len`` None ``plan_seq_len``.

    Raises ValueError naming the value and the fix: world_size odd or < 2 (the 2-D runs put 2 ranks on tp or pp),
    a model or planner GPU that is not a preset, sizes < 1, a mesh the model cannot take (:func:`check_runs`), a
    model this machine's memory cannot hold on world_size ranks, a world that is not a whole number of nodes,
    an ``emulate`` profile that is unknown or cannot hold world_size ranks, a loop mesh that is not valid,
    ``my_prediction`` that is not None or a number, a tolerance outside (0, 1)."""
    from labkit.theory.planner import DEFAULT_INTER_LINK, Topology

    world_size = check_world_size("09", world_size, why="the 2-D runs put 2 ranks on tp (or pp) and the rest on dp")
    if world_size % 2:
        raise ValueError(f"chapter 09 needs an even world_size (tp or pp = 2, dp = world_size / 2), got "
                         f"world_size={world_size}; use {world_size - 1} or {world_size + 1}")
    check_steps("steps", steps)
    for name, value in (("seq_len", seq_len), ("n_microbatches", n_microbatches),
                        ("plan_gpus", plan_gpus), ("gpus_per_node", gpus_per_node), ("plan_seq_len", plan_seq_len),
                        ("plan_global_batch", plan_global_batch)):
        positive_int(name, value)
    positive_float("timeout_s", timeout_s)
    spec = get_spec(model)
    get_spec(plan_model)
    Topology.of(plan_gpu, gpus_per_node, DEFAULT_INTER_LINK).check_whole_nodes(plan_gpus, "plan_gpus")
    dp = world_size // 2
    runs = [{"kind": "dp_tp", "dp": dp, "tp": 2}, {"kind": "dp_tp_hand", "dp": dp, "tp": 2},
            {"kind": "pp_dp", "pp": 2, "dp": dp}]
    global_batch_size = n_microbatches * dp  # PP x DP: dp ranks x n_microbatches micro-batches of 1 sequence
    check_runs(runs, world_size, spec, global_batch_size=global_batch_size, seq_len=seq_len,
               n_microbatches=n_microbatches)
    check_fits_in_memory(spec, world_size, copies=2, what="chapter 09's composed runs (and the reference)")
    return {"runs": runs, "dp": dp, "global_batch_size": global_batch_size,
            "loop": _check_loop(world_size, emulate, my_prediction, loop_model,
                                plan_seq_len if loop_seq_len is None else loop_seq_len, loop_global_batch,
                                loop_meshes, tolerance)}


def _check_loop(world_size, emulate, my_prediction, loop_model, loop_seq_len, loop_global_batch, loop_meshes,
                tolerance) -> dict | None:

    from labkit.experiments import mesh_loop
    from labkit.runtime.emulate import resolve

    check_prediction(my_prediction, what="a number of seconds (your guess for one emulated step of the deepest "
                                    "pipeline)")
    tolerance = positive_float("tolerance", tolerance)
    if tolerance >= 1:
        raise ValueError(f"tolerance={tolerance} must be a fraction below 1, e.g. 0.05 (5 %)")
    get_spec(loop_model)
    positive_int("loop_seq_len", loop_seq_len)
    if emulate is None:
        return None
    if not isinstance(emulate, str):
        raise ValueError(f"emulate={emulate!r}: chapter 09 takes a cluster profile name (e.g. 'dgx-h100') or None; "
                         "the loop charges its runs as loop_model itself")
    resolve(emulate, world_size)  # ValueError: unknown profile, or world_size not a whole number of its nodes
    gbs = (mesh_loop.default_global_batch(world_size) if loop_global_batch is None
           else positive_int("loop_global_batch", loop_global_batch))
    valid = mesh_loop.candidate_meshes(world_size, preset=loop_model, global_batch_size=gbs)
    if loop_meshes is None:
        meshes = mesh_loop.default_meshes(world_size, preset=loop_model, global_batch_size=gbs)
    else:
        meshes = [tuple(int(x) for x in m) for m in loop_meshes]
        bad = [m for m in meshes if m not in valid]
        if bad or not meshes:
            raise ValueError(f"loop_meshes={loop_meshes!r}: {bad or 'empty'} not valid (dp, tp, pp) meshes of "
                             f"{world_size} GPUs with a global batch of {gbs}; valid: {valid}")
    return {"cluster": emulate, "meshes": meshes, "global_batch_size": gbs, "model": loop_model,
            "seq_len": loop_seq_len, "tolerance": tolerance}


# ------------------------------------------------------------------------------------------------------
# figures
# ------------------------------------------------------------------------------------------------------
def memory_figure(memory, ranks):
    """Bars of model-state bytes per category, measured (live tensors) beside predicted
    (labkit.theory.memory), one panel per run and rank of ``ranks``, from ``ComposedResult.memory``."""
    import plotly.express as px

    from labkit.style import label_color

    mem_long = memory.melt(id_vars=["run", "rank", "stage", "category"],
                           value_vars=["measured_bytes", "predicted_bytes"], var_name="source", value_name="bytes")
    mem_long = mem_long[mem_long["rank"].isin(list(ranks))]
    mem_long["where"] = mem_long["run"] + "<br>rank " + mem_long["rank"].astype(str)  # two lines: panels are narrow
    names = {"measured_bytes": "measured", "predicted_bytes": "predicted (labkit.theory.memory)"}
    mem_long["source"] = mem_long["source"].map(names)
    fig = px.bar(mem_long, x="category", y="bytes", color="source", barmode="group", facet_col="where",
                 facet_col_wrap=3, facet_col_spacing=0.09, facet_row_spacing=0.2, height=560,
                 color_discrete_map={n: label_color(n) for n in names.values()},
                 title="Model states per rank (measured: live tensors)")
    fig.update_yaxes(matches=None, showticklabels=True)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))  # "where=dp_tp ..." -> "dp_tp ..."
    fig.update_layout(legend={"orientation": "h", "y": -0.22, "title": None}, margin={"t": 90})
    return fig


# ------------------------------------------------------------------------------------------------------
# published runs: the planner and the calculator beside them
# ------------------------------------------------------------------------------------------------------
#: the columns the chapter's table shows, in order
COLUMNS = ("model", "gpus", "gpu", "tp", "pp", "dp", "cp", "accepted", "fits", "peak_gib", "layers_per_stage",
           "schedule", "recompute", "planner_rank", "n_ranked", "predicted_mfu", "published_mfu", "ratio", "flops",
           "source")


def validation_rows(**kwargs) -> list[dict]:
    """:func:`labkit.theory.published.validate_published` (``kwargs``: the planner's assumptions), validated
    runs only."""
    return [r for r in validate_published(**kwargs) if not r.get("skipped")]


def validation_frame(rows: list[dict] | None = None):
    """The validation as a pandas DataFrame (one row per published run, :data:`COLUMNS`), MFU columns labelled
    ``predicted`` and ``published``."""
    import pandas as pd

    rows = validation_rows() if rows is None else rows
    df = pd.DataFrame([{c: r.get(c) for c in COLUMNS} for r in rows])
    return df.rename(columns={"predicted_mfu": "MFU predicted", "published_mfu": "MFU published (source)"})


def validation_text(rows: list[dict] | None = None) -> str:
    """The table as text (what ``labkit plan --validate`` prints)."""
    return validation_table(rows)


def validation_findings(rows: list[dict] | None = None) -> str:
    """Sentences computed from the rows: how many published meshes the calculator accepts and fits, how the
    predicted MFU compares (median and worst ratio), and where the planner ranks the published meshes."""
    rows = validation_rows() if rows is None else rows
    n = len(rows)
    accepted = sum(bool(r["accepted"]) for r in rows)
    fits = sum(bool(r.get("fits")) for r in rows)
    ratios = sorted(r["ratio"] for r in rows if r.get("ratio") is not None)
    if not ratios:
        return f"{accepted} of {n} published meshes accepted, {fits} fit; no MFU to compare."
    med = ratios[len(ratios) // 2]
    worst = max(ratios, key=lambda x: abs(x - 1))
    top10 = sum(1 for r in rows if r.get("planner_rank") and r["planner_rank"] <= 10)
    lo, hi = MFU_BAND
    inside = sum(lo <= x <= hi for x in ratios)
    return (f"The calculator accepts {accepted} of {n} published meshes and finds {fits} of them fit. Predicted "
            f"MFU / published MFU: median {med:.2f}, furthest from 1 {worst:.2f}; {inside} of {len(ratios)} within "
            f"the band {lo:.2f}-{hi:.2f}. The planner ranks {top10} of the published meshes in its top 10.")


def check_validation(rows: list[dict] | None = None) -> None:
    """Raise AssertionError unless every validated published mesh is accepted and its predicted MFU is within
    :data:`MFU_BAND` of the published one (the chapter's check cell)."""
    rows = validation_rows() if rows is None else rows
    assert len(rows) >= 6, f"only {len(rows)} published runs validated"
    for r in rows:
        assert r["accepted"], f"{r['model']} on {r['gpus']}: refused: {r['error']}"
        lo, hi = MFU_BAND
        assert r.get("ratio") is not None and lo <= r["ratio"] <= hi, (
            f"{r['model']} on {r['gpus']}: predicted/published MFU {r.get('ratio')} outside {lo}-{hi}")


# ------------------------------------------------------------------------------------------------------
# section 1: the rules, and the exercise on a grid the chapter never prints
# ------------------------------------------------------------------------------------------------------
#: meshes that each break (or keep) the rules, for the rules table
RULE_TRIES = {"world size 64, dp=4 tp=8": dict(world_size=64, dp=4, tp=8),
              "tp=16 (8 kv heads)": dict(world_size=64, dp=4, tp=16),
              "tp=3": dict(world_size=48, dp=2, tp=3, pp=8),
              "pp=16, batch 8 per dp": dict(world_size=64, dp=4, pp=16)}


def rule_table(spec, *, seq_len: int, gpus_per_node: int, global_batch_size: int = 32, tries=None):
    """One row per mesh of ``tries`` (default :data:`RULE_TRIES`): the rules it breaks for ``spec`` (by name,
    :meth:`ParallelDims.violations`) and the first message."""
    import pandas as pd

    from labkit.theory import mesh

    rows = []
    for label, kw in (tries or RULE_TRIES).items():
        try:
            bad = mesh.ParallelDims(**kw).violations(spec, seq_len=seq_len, global_batch_size=global_batch_size,
                                                     gpus_per_node=gpus_per_node)
            rows.append({"mesh": label, "rules broken": [v.rule for v in bad] or "none (valid)",
                         "first message": bad[0].message if bad else ""})
        except mesh.MeshError as e:
            rows.append({"mesh": label, "rules broken": e.rules, "first message": e.violations[0].message})
    return pd.DataFrame(rows)


#: the exercise's mesh: not the one section 1 prints
EXERCISE = {"gpus": 64, "dp": 4, "tp": 2, "pp": 8, "gpus_per_node": 8, "rank": 21}


def exercise_reference() -> tuple[list, str]:
    """The exercise's reference answers (never printed): ``rank``'s PP group (its ranks, sorted) and the link
    its DP group crosses ("intra-node" or "inter-node")."""
    from labkit.theory import mesh

    e = EXERCISE
    d = mesh.ParallelDims(e["gpus"], dp=e["dp"], tp=e["tp"], pp=e["pp"])
    ref_pp = next(sorted(g) for g in d.groups("pp") if e["rank"] in g)
    ref_link = next(r["link"] for r in d.group_table(gpus_per_node=e["gpus_per_node"])
                    if r["dim"] == "dp" and e["rank"] in r["ranks"])
    return ref_pp, ref_link


def check_grid_exercise(answer_pp_group, answer_dp_link) -> None:
    """The exercise's self-check: "not attempted" and a hint when either answer is None, AssertionError with a
    hint (never the answer) when one is wrong, "correct" otherwise."""
    ref_pp, ref_link = exercise_reference()
    if answer_pp_group is None or answer_dp_link is None:
        print("Exercise not attempted yet. Hint: a PP group strides tp*cp*dp ranks; a DP group strides tp*cp "
              "ranks, and a node holds gpus_per_node consecutive ranks.")
        return
    assert sorted(int(r) for r in answer_pp_group) == ref_pp, (
        f"{answer_pp_group} is not it: start from the rank's stage-0 twin (rank mod tp*cp*dp) and add tp*cp*dp")
    assert answer_dp_link == ref_link, (f"{answer_dp_link!r} is not it: list the DP group (stride tp*cp) and "
                                        "divide each rank by gpus_per_node")
    print("correct")


# ------------------------------------------------------------------------------------------------------
# section 3: what the real runs show, in sentences computed from them
# ------------------------------------------------------------------------------------------------------
def run_findings(parity, timing) -> str:
    """Sentences from ``ComposedResult.parity`` and ``.timing``: how far the composed runs are from the single
    process (the largest difference, per kind), and whether their measured steps are slower or faster."""
    worst = parity.groupby("what")["max_abs_diff"].max()
    parts = [f"{w} {worst[w]:.1e}" for w in ("losses", "grads", "params") if w in worst]
    ok = bool(parity["ok"].all())
    out = [f"Parity: the composed runs {'match' if ok else 'do NOT match'} the single process within tolerance "
           f"(largest absolute difference: {', '.join(parts)})."]
    ref = timing[timing["run"].str.startswith("reference")]["step_s"]
    runs = timing[~timing["run"].str.startswith("reference")]
    if len(ref):
        r = float(ref.iloc[0])
        slower = runs[runs["step_s"] > r]["run"].tolist()
        faster = runs[runs["step_s"] <= r]["run"].tolist()
        if slower and not faster:
            out.append(f"Measured on this machine every composed step is slower than the single process "
                       f"({runs['step_s'].min() / r:.1f}x to {runs['step_s'].max() / r:.1f}x its {r * 1e3:.1f} ms): "
                       "the tiny model computes for microseconds per layer while every collective pays gloo's "
                       "loopback latency and the ranks share the cores.")
        elif faster and not slower:
            out.append(f"Measured on this machine every composed step is faster than the single process "
                       f"({runs['step_s'].max() / r:.2f}x of its {r * 1e3:.1f} ms or less): the model is large "
                       "enough that splitting its compute pays for the collectives.")
        else:
            out.append(f"Measured on this machine {', '.join(faster)} beat the single process ({r * 1e3:.1f} ms) "
                       f"and {', '.join(slower)} do not.")
    return " ".join(out)


# ------------------------------------------------------------------------------------------------------
# section 4: estimate, then measure — the planner beside an emulated run of the same mesh
# ------------------------------------------------------------------------------------------------------
def run_real(world_size: int, runs, *, timeout_s: float = 300.0, **kwargs):
    """:func:`labkit.experiments.composed.run_composed` on the shared warm pool of ``world_size`` gloo ranks
    (opened here), so that section 4's emulated launches reuse the same ranks instead of starting new ones."""
    from labkit.experiments.composed import run_composed
    from labkit.runtime.pool import shared_pool

    shared_pool(world_size, "gloo", timeout_s=timeout_s)
    return run_composed(world_size, runs, timeout_s=timeout_s, **kwargs)


def loop_timeline(df, title: str | None = None):
    """:func:`labkit.plots.timeline_figure` of the deepest pipeline's emulated step (communication on its own
    lane; None when emulation is off)."""
    from labkit.plots import timeline_figure

    if df is None:
        return None
    row = deepest(df)
    frame = df.attrs["timelines"][row["mesh"]]
    return timeline_figure(frame, title=title or f"{row['mesh']}: one step, {df.attrs['label']}")


def estimate_then_measure(loop: dict | None, world_size: int, *, timeout_s: float = 300.0):
    """The loop's emulated runs (:func:`labkit.experiments.mesh_loop.run_loop`) with the planner beside each;
    None (and one printed line) when emulation is off. Closes the warm pool of ``world_size`` ranks after."""
    from labkit.experiments import mesh_loop
    from labkit.runtime.pool import pool_for

    try:
        if loop is None:
            print("emulate=None: no emulated run, so the planner's estimate is not compared with a step of the "
                  "same mesh (set emulate='dgx-h100').")
            return None
        return mesh_loop.run_loop(world_size, loop["meshes"], cluster=loop["cluster"], preset=loop["model"],
                                  seq_len=loop["seq_len"], global_batch_size=loop["global_batch_size"],
                                  timeout_s=timeout_s)
    finally:  # the rest of the chapter runs nothing: give the cores back (re-pricing needs no ranks)
        pool = pool_for(world_size, "gloo")
        if pool is not None:
            pool.close()


def loop_question(loop: dict | None) -> str:
    """What the reader predicts (the setup only, no number from the run or the planner)."""
    if loop is None:
        return "emulate=None: section 4 runs nothing emulated, so there is no step to predict."
    dp, tp, pp = max(loop["meshes"], key=lambda m: (m[2], m[0]))
    n = dp * tp * pp
    return (f"you predict: one training step of {loop['model']} ({loop['seq_len']}-token sequences) on {n} GPUs of "
            f"{loop['cluster']} as dp={dp} tp={tp} pp={pp}: {loop['global_batch_size'] // dp} micro-batches of one "
            f"sequence per dp rank, 1F1B; emulated meshes: {', '.join(map(str, loop['meshes']))}")


def deepest(df):
    """The row of the deepest pipeline (the one the reader predicts)."""
    return df.sort_values(["pp", "dp"], ascending=False).iloc[0]


def prediction_kwargs(df) -> dict:
    """The keyword arguments of :func:`labkit.chapters.common.compare_prediction` for the reader's guess of the
    deepest pipeline's step: the emulated step (``measured``, labelled as emulated) and the planner's."""
    if df is None:
        return {"what": "one step of the deepest pipeline", "unit": "s"}
    row = deepest(df)
    return {"measured": float(row["emulated_s"]), "predicted": float(row["planner_s"]),
            "what": f"one step on {row['mesh']}", "unit": "s", "measured_label": df.attrs["label"],
            "predicted_label": "predicted (planner)"}


def loop_table(df):
    """The loop's key columns (<= 8): mesh, micro-batches, emulated, planner, ratio, stage imbalance (None
    when emulation is off)."""
    if df is None:
        return None
    return df[["mesh", "m", "emulated_s", "planner_s", "ratio", "imbalance", "simulated_s"]].round(4)


def loop_findings(df, tolerance: float = 0.05) -> str:
    """Sentences computed from the loop: for each mesh, whether the planner's estimate is within ``tolerance``
    of the emulated step and, for each gap, its split into the stage imbalance (simulated with the emulated
    per-stage costs vs with balanced stages) and the rest (balanced vs the planner: the emulator's
    per-operation charges vs the planner's FLOP formula); then whether the planner ranks the meshes as the
    emulated runs do."""
    if df is None:
        return "Emulation is off (emulate=None): the planner's estimate stands alone, unchecked."
    label = df.attrs.get("label", "emulated")
    out = []
    for _, r in df.iterrows():
        head = f"{r['mesh']} ({r['m']} micro-batches): {label} {r['emulated_s']:.3f} s, planner {r['planner_s']:.3f} s"
        imb = r["simulated_s"] / r["balanced_s"] - 1
        rest = r["balanced_s"] / r["planner_s"] - 1
        why = (f"the slowest stage (it also computes the head and the loss: {r['imbalance']:.2f}x the mean stage) "
               f"adds {imb:+.1%}, and the emulator's per-operation charges with balanced stages come to {rest:+.1%} "
               "of the planner's compute + bubble + communication")
        if abs(r["ratio"] - 1) <= tolerance:
            cancel = abs(imb) > tolerance and abs(rest) > tolerance and imb * rest < 0
            out.append(f"{head}: within {tolerance:.0%} (ratio {r['ratio']:.3f})"
                       + (f" — but only because two errors cancel: {why}." if cancel else "."))
        else:
            side = "longer" if r["ratio"] > 1 else "shorter"
            out.append(f"{head}: the emulated step is {abs(r['ratio'] - 1):.1%} {side} than the estimate, beyond "
                       f"{tolerance:.0%}: {why}.")
    out.append(ranking_sentence(df))
    return "\n".join(out)


def ranking_sentence(df) -> str:
    """Whether the planner orders the meshes (fastest first) as the emulated runs do."""
    plan = df.sort_values("planner_s")["mesh"].tolist()
    emu = df.sort_values("emulated_s")["mesh"].tolist()
    if len(df) < 2:
        return "One mesh only: nothing to rank."
    if plan == emu:
        return f"The planner ranks the meshes as the emulated runs do: {' < '.join(emu)} (fastest first)."
    return (f"The planner ranks the meshes {' < '.join(plan)}, the emulated runs {' < '.join(emu)}: the estimate "
            f"would pick {plan[0]}, the run says {emu[0]}.")


def loop_figure(df, title: str | None = None):
    """Grouped bars per mesh: the emulated step (``emulated (<profile>, as <model>)``), the planner's
    (``predicted (planner: ...)``) and the 1F1B simulator fed the emulated per-stage costs."""
    import plotly.graph_objects as go

    from labkit.style import label_color

    if df is None:
        return None
    label = df.attrs.get("label", "emulated")
    series = [(label, "emulated_s"), ("predicted (planner: FLOPs / (peak x MFU) + 1F1B bubble + alpha-beta)",
                                      "planner_s"),
              ("predicted (1F1B simulator fed the emulated stage costs)", "simulated_s")]
    fig = go.Figure()
    for i, (name, col) in enumerate(series):
        color = label_color(name) if i < 2 else "#9467BD"
        fig.add_bar(x=df["mesh"], y=df[col], name=name, marker_color=color,
                    text=[f"{v:.2f}" for v in df[col]], textposition="outside")
    fig.update_layout(barmode="group", height=430, yaxis_title="one training step (s)",
                      title=title or f"Estimate, then measure: the planner vs {label}, same mesh, same batch",
                      legend={"orientation": "h", "y": -0.2})
    return fig


def loop_panel(df, clusters=("dgx-h100", "dgx-a100", "pcie-4090", "ib-h100-1nic"), tolerance: float = 0.05):
    """A cluster Dropdown that re-prices the recorded traces (:func:`labkit.experiments.mesh_loop.reprice`,
    nothing runs again) and redraws :func:`loop_figure` and the findings. Returns the ``ipywidgets.VBox``; its
    ``.table()`` gives the table shown."""
    import html

    import ipywidgets as w

    from labkit.experiments import mesh_loop
    from labkit.widgets import headless, show_in

    if df is None:
        return None
    start = df.attrs["runs"][0]["emulation"].cluster.name
    options = list(dict.fromkeys([start, *clusters]))
    pick = w.Dropdown(options=options, value=start, description="cluster")
    out, text, state = w.Output(), w.HTML(), {}

    def redraw(change=None):
        d = df if pick.value == start else mesh_loop.reprice(df, pick.value)
        state["table"], state["fig"] = d, loop_figure(d)
        text.value = "<br>".join(html.escape(line) for line in loop_findings(d, tolerance).splitlines())
        show_in(out, state["fig"])

    pick.observe(redraw, names="value")
    redraw()
    box = w.VBox([pick, out, text])
    box.table = lambda: state["table"]
    return headless(box)  # an executed copy shows the figure, not VBox(children=...)


def check_loop(df, tolerance: float) -> None:
    """The loop's checks: every emulated run trains like one process; the 1F1B simulator fed the emulated
    per-stage costs reproduces each emulated step within 3 % (so the explanation of any gap is the stage
    costs); the planner is within 25 % of every emulated step."""
    if df is None:
        return
    assert df["losses_ok"].all(), f"an emulated mesh's losses differ from the single process:\n{df}"
    sim = (df["simulated_s"] / df["emulated_s"] - 1).abs()
    assert (sim <= 0.03).all(), f"the simulator fed the emulated stage costs misses the emulated step:\n{df}"
    assert ((df["ratio"] - 1).abs() <= 0.25).all(), f"planner vs emulated beyond 25 %:\n{df[['mesh', 'ratio']]}"


# ------------------------------------------------------------------------------------------------------
# section 5: checks on the plan
# ------------------------------------------------------------------------------------------------------
def check_plan(plan, *, plan_gpus: int, spec, seq_len: int, global_batch_size: int, gpus_per_node: int) -> None:
    """The plan is well-formed: every candidate fits and is valid, ranked by predicted step time, every entry
    has a reason, and the best mesh passes every rule."""
    from labkit.theory import mesh

    assert plan.candidates and all(c.fits and c.peak_bytes_per_gpu <= plan.assumptions["device_bytes"]
                                   for c in plan.candidates)
    assert all(c.dp * c.tp * c.pp * c.cp == plan_gpus for c in plan.candidates + plan.rejected)
    assert [c.step_time_s for c in plan.candidates] == sorted(c.step_time_s for c in plan.candidates)
    assert all(c.reason for c in plan.candidates + plan.rejected)
    b = plan.best
    mesh.ParallelDims(plan_gpus, dp=b.dp, tp=b.tp, pp=b.pp, cp=b.cp).check(
        spec, seq_len=seq_len, global_batch_size=global_batch_size, gpus_per_node=gpus_per_node)
