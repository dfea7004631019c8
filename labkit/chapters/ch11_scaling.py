"""Chapter 11 (strong vs weak scaling): its parameter check and the text table of a series, every speedup and
efficiency printed with its baseline and the ratio that makes it.

What it launches is :func:`labkit.experiments.scaling.run` (the series runner and its two experiments, the
data-parallel training step and a compute-only matmul); the predictions are :mod:`labkit.theory.scaling`.
"""

from __future__ import annotations

import pandas as pd

from labkit.chapters.common import check_fits_in_memory, check_prediction, check_world_size, span
from labkit.checks import positive_int
from labkit.theory.spec import get_spec


def series_sizes(world_size: int) -> list[int]:
    """The measured series: 1, 2, 4, ... below ``world_size``, then ``world_size`` itself."""
    from labkit.experiments.scaling_emulated import series_sizes as sizes

    return sizes(world_size)


def default_strong_total(sizes) -> int:
    """The strong-scaling total chosen from the series: the smallest multiple of every size that is at least
    2 x the largest (so every rank of the largest run has 2 sequences)."""
    import math

    lcm = math.lcm(*sizes)
    return lcm * max(1, -(-2 * max(sizes) // lcm))


def check_chapter(*, world_size: int, model: str, seq_len: int, strong_total, weak_per_rank: int,
                  matmul_size: int, repeats: int, threads_per_rank: int, backend: str, emulate="dgx-h100",
                  my_prediction=None, emulate_world_size: int = 8, emulate_gpus_per_node: int | None = 4) -> dict:
    """Validate chapter 11's parameters before anything is launched (the chapter's first code cell). Returns
    ``{"sizes", "strong_total", "emulated"}``: the measured series' world sizes (1, 2, 4, ... below world_size,
    then world_size), the strong total (None: :func:`default_strong_total`), and the emulated series
    (``{"cluster", "max_world_size"}``; None when ``emulate`` is None).

    Raises ValueError naming the value and the fix: world_size < 2 (a series needs two points), sizes < 1,
    ``strong_total`` that some world size of the series does not divide, an unknown model, a model this
    machine's memory cannot hold on world_size ranks, a backend the machine cannot run, an unknown ``emulate``
    profile or one whose nodes cannot hold ``emulate_world_size`` ranks evenly, a ``my_prediction`` that is not
    None or a number."""

    from labkit.experiments.scaling_emulated import cluster_of
    from labkit.runtime.emulate import resolve
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("11", world_size, why="a scaling series needs at least two world sizes")
    sizes = series_sizes(world_size)
    for name, value in (("seq_len", seq_len), ("matmul_size", matmul_size), ("repeats", repeats),
                        ("threads_per_rank", threads_per_rank), ("weak_per_rank", weak_per_rank)):
        positive_int(name, value)
    total = default_strong_total(sizes) if strong_total is None else positive_int("strong_total", strong_total)
    bad = [n for n in sizes if total % n]
    if bad:
        raise ValueError(f"strong_total={total} must split evenly over every world size of the series {sizes}: "
                         f"{bad} do not divide it; use {default_strong_total(sizes)} (or None to choose it)")
    spec = get_spec(model)
    spec.check_seq_len(seq_len)
    check_fits_in_memory(spec, max(sizes), copies=1, what="chapter 11's training series")
    resolve_backend(backend, max(sizes))
    check_prediction(my_prediction, what="a number (a fraction, e.g. 0.8)")
    emulated = None
    if emulate is not None:
        if not isinstance(emulate, str):
            raise ValueError(f"emulate={emulate!r}: chapter 11 takes a cluster profile name (e.g. 'dgx-h100') or None")
        n = positive_int("emulate_world_size", emulate_world_size)
        if n < 2:
            raise ValueError(f"emulate_world_size={n}: the emulated series needs at least 2 ranks")
        cluster = cluster_of(emulate, emulate_gpus_per_node)
        resolve(cluster, n)  # ValueError: the nodes cannot hold n ranks evenly
        emulated = {"cluster": cluster, "max_world_size": n}
    return {"sizes": sizes, "strong_total": total, "emulated": emulated}


def format_table(df: pd.DataFrame) -> str:
    """A text table: each speedup and efficiency printed with its baseline and the ratio that makes it."""
    cols = ["experiment", "mode", "world_size", "work_per_rank", "total_work", "time_s", "baseline_world_size",
            "speedup", "speedup_formula", "efficiency", "efficiency_formula", "ideal_speedup", "ideal_speedup_on_cores"]
    if "mfu" in df.columns:
        cols += ["mfu", "mfu_denominator_flops"]
    show = df[[c for c in cols if c in df.columns]].copy()
    return show.to_string(index=False, float_format=lambda v: f"{v:.4g}")




# ------------------------------------------------------------------------------------------------------
# the measured machine, in sentences from its numbers
# ------------------------------------------------------------------------------------------------------
#: the timing noise an MFU may carry on a steady core (a fraction): the check's limit is 1 + this, or the peak's
#: own spread between tries where that is larger (:func:`mfu_limit`)
MFU_TIMING_NOISE = 0.10


def peak_findings(peak: dict) -> str:
    """The measured peaks explained: one thread alone vs every core together, and which one the MFU uses."""
    one, full, cores = peak["flops_1_thread"], peak["flops_all_cores"], peak["cores"]
    ratio = full / one
    head = (f"Measured: {one / 1e9:.1f} GFLOP/s on 1 thread, {full / 1e9:.1f} GFLOP/s on all {cores} cores "
            f"together ({ratio:.2f}x one thread; {cores}x would be perfect).")
    if ratio < 1:
        why = ("All cores together came out *slower* than one thread: the cores were busy with other work while "
               "that measurement ran (the one-thread run needs one free core, the all-cores run needs all of them), "
               "or the cores slow down when all run at once. So the MFU denominator is cores x the one-thread peak.")
    elif ratio < 0.8 * cores:
        why = (f"All cores reach only {ratio / cores:.0%} of cores x one thread: other work shared the cores, or the "
               "cores slow down together (shared caches, power limits).")
    else:
        why = f"The cores scale: all together reach {ratio / cores:.0%} of cores x one thread."
    spread = float(peak.get("spread_1_thread", 1.0))
    tries = len(peak.get("tries_1_thread", ()))
    noise = ""
    if tries > 1:
        moved = ("the core's speed moved while it was measured (other work, frequency changes), so an MFU carries "
                 f"about {spread - 1:.0%} of timing noise." if spread > 1 + MFU_TIMING_NOISE else "a steady core.")
        noise = f" One thread's {tries} tries spread {spread:.2f}x (best / worst): {moved}"
    return (f"{head} {why} MFU denominator: {peak['flops_machine'] / 1e9:.1f} GFLOP/s = {peak['machine_basis']}."
            f"{noise}")


#: what does not shrink with a rank's share of the work, per built-in experiment (what each step runs:
#: labkit.experiments.scaling): the sentence names only what the experiment contains
SERIAL_PARTS = {"matmul": "its fixed costs per step (the barrier and device sync that time it, per-call overhead) "
                          "do not — it has no communication",
                "train": "the all-reduce, the optimizer and per-step overheads do not"}


def _efficiency_noise(last: pd.DataFrame) -> float:
    """How far an efficiency at the largest world size could move with this run's timing spread: the largest
    (time_max_s - time_min_s) / time_s over the strong and weak rows, times their larger efficiency (0 without
    the min / max columns)."""
    if not {"time_min_s", "time_max_s", "time_s"} <= set(last.columns):
        return 0.0
    rel = ((last["time_max_s"] - last["time_min_s"]) / last["time_s"]).max()
    return float(rel * last["efficiency"].max()) if rel == rel else 0.0


def scaling_findings(series: pd.DataFrame, label: str = "measured") -> str:
    """Sentences from a series (:func:`labkit.experiments.scaling.efficiency` rows): per experiment, strong vs
    weak efficiency at the largest world size (which is higher), and against the cores ceiling where it
    applies."""
    out = []
    for exp, g in series.groupby("experiment", sort=False):
        n = int(g["world_size"].max())
        last = g[g["world_size"] == n].set_index("mode")
        if not {"strong", "weak"} <= set(last.index):
            continue
        s, w = float(last.loc["strong", "efficiency"]), float(last.loc["weak", "efficiency"])
        n0 = int(last.loc["strong", "baseline_world_size"])
        noise = _efficiency_noise(last)
        if abs(s - w) <= 0.01:
            out.append(f"{exp} ({label}) at n={n} vs n0={n0}: strong and weak scaling are equally efficient "
                       f"({s:.2f} and {w:.2f}).")
        elif abs(s - w) <= noise:
            out.append(f"{exp} ({label}) at n={n} vs n0={n0}: strong-scaling efficiency {s:.2f} and weak scaling's "
                       f"{w:.2f} differ by less than this run's timing spread ({noise:.2f}): the order is not "
                       "measured here — re-run on a quieter machine before reading it.")
        else:
            serial = SERIAL_PARTS.get(exp, "the parts of a step that the work does not divide do not")
            if label.startswith("emulated") and exp == "train":
                serial = "the gradient all-reduce does not"
            cmp, why = (("below", f"each rank's share of the fixed batch shrinks while {serial} (Amdahl's serial "
                         "part)") if s < w else
                        ("above", "the per-step overheads did not stay fixed here: re-run, and compare time_min_s "
                         "with time_max_s before trusting the order"))
            out.append(f"{exp} ({label}) at n={n} vs n0={n0}: strong-scaling efficiency {s:.2f} is {cmp} weak "
                       f"scaling's {w:.2f}: {why}.")
        ceil = float(last.loc["strong", "ideal_speedup_on_cores"]) / (n / n0)
        if ceil < 0.999:
            out.append(f"  This machine's cores cap that efficiency at {ceil:.2f} (dotted ceiling); strong "
                       f"reaches {s / ceil:.0%} of it.")
    return "\n".join(out)


def knee_findings(emulated: pd.DataFrame) -> str:
    """Where the emulated strong-scaling efficiency falls most between two consecutive world sizes, and whether
    that step is where the group first spans two nodes."""
    g = emulated[emulated["mode"] == "strong"].sort_values("world_size")
    gpn = int(emulated.attrs.get("gpus_per_node", 8))
    sizes, eff = g["world_size"].tolist(), g["efficiency"].tolist()
    if len(sizes) < 3:
        return "Too few emulated world sizes to locate a knee."
    drops = [(eff[i] - eff[i + 1], sizes[i], sizes[i + 1]) for i in range(len(sizes) - 1)]
    drop, a, b = max(drops)
    crosses = a <= gpn < b
    label = emulated.attrs.get("label", "emulated")
    head = (f"{label}: strong-scaling efficiency falls most from n={a} to n={b} ({eff[sizes.index(a)]:.2f} -> "
            f"{eff[sizes.index(b)]:.2f}), ")
    if crosses:
        return head + (f"where the all-reduce group first spans two nodes of {gpn} GPUs: the gradients leave NVLink "
                       "for the network. That is the knee at the node boundary.")
    if sizes[-1] <= gpn:
        return head + f"inside one node of {gpn} GPUs (the series never crosses a node: no node-boundary knee)."
    return head + (f"not at the node boundary ({gpn} -> {2 * gpn}): here the shrinking compute per rank, not the "
                   "network, sets the knee.")


def prediction_kwargs(emulated: pd.DataFrame | None, predicted: pd.DataFrame | None = None) -> dict:
    """:func:`labkit.chapters.common.compare_prediction`'s arguments for the reader's guess: the emulated
    strong-scaling efficiency at the largest emulated world size (and the α-β prediction of it)."""
    if emulated is None:
        return {"what": "strong-scaling efficiency at the largest emulated world size"}
    g = emulated[emulated["mode"] == "strong"].sort_values("world_size").iloc[-1]
    out = {"measured": float(g["efficiency"]), "measured_label": emulated.attrs["label"],
           "what": f"strong-scaling efficiency at n={int(g['world_size'])} (baseline n0=1)"}
    if predicted is not None:
        p = predicted[predicted["mode"] == "strong"].sort_values("world_size").iloc[-1]
        out.update(predicted=float(p["efficiency"]), predicted_label=predicted.attrs["label"])
    return out


def predict_emulated(emulated: pd.DataFrame) -> pd.DataFrame:
    """*Predicted* step of every emulated case, by formula: compute = tokens x 6N (the preset's
    :func:`labkit.theory.spec.flops_per_token`) per rank / (bf16 peak x compute efficiency), plus one ring
    all-reduce of the preset's bf16 gradients (:func:`labkit.theory.costmodel.group_collective_time` on the
    cluster's placement); efficiency as for the runs. ``attrs["label"]`` = the formula."""
    from labkit.experiments.scaling import efficiency
    from labkit.theory.costmodel import group_collective_time
    from labkit.theory.spec import flops_per_token

    r = emulated.attrs["run"]
    cl = r["emulation"].cluster
    spec = get_spec(r["preset"])
    per_seq = flops_per_token(spec, r["seq_len"], training=True) * r["seq_len"]
    peak = cl.device.peak_flops("bf16") * cl.compute_efficiency
    rows = []
    for _, e in emulated.iterrows():
        n = int(e["world_size"])
        comm = 0.0 if n == 1 else group_collective_time(
            "all_reduce", 2 * spec.n_params(), list(range(n)), gpus_per_node=cl.gpus_per_node, intra=cl.intra,
            inter=cl.inter, nics_per_node=cl.nics_per_node, link_efficiency=cl.link_efficiency)
        t = e["work_per_rank"] * per_seq / peak + comm
        rows.append({**{k: e[k] for k in ("experiment", "mode", "world_size", "work_per_rank", "total_work",
                                          "threads_per_rank", "cores")}, "time_s": t, "source": "predicted"})
    df = efficiency(pd.DataFrame(rows))
    df.attrs["label"] = f"predicted (6N x tokens / ({cl.compute_efficiency:.0%} peak) + alpha-beta all-reduce)"
    return df


# ------------------------------------------------------------------------------------------------------
# the headline figure and its widget
# ------------------------------------------------------------------------------------------------------
def efficiency_figure(series: pd.DataFrame, emulated: pd.DataFrame | None = None,
                      predicted: pd.DataFrame | None = None, title: str | None = None):
    """Efficiency vs world size: the measured series (train and matmul, strong solid / weak dashed) with this
    machine's cores ceiling (predicted), and beside it the emulated series with its prediction and a line at
    the node boundary. Legend names follow the lab's labels (measured / emulated (...) / predicted (...))."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from labkit.style import label_color

    right = emulated is not None
    fig = make_subplots(rows=1, cols=2 if right else 1, subplot_titles=(
        "this machine (measured)", emulated.attrs["label"] if right else None)[: 2 if right else 1])
    dash = {"strong": "solid", "weak": "dash"}
    sym = {"train": "circle", "matmul": "diamond"}
    for (exp, mode), g in series.groupby(["experiment", "mode"], sort=False):
        g = g.sort_values("world_size")
        fig.add_trace(go.Scatter(x=g["world_size"], y=g["efficiency"], mode="lines+markers",
                                 name=f"measured: {exp} {mode}", text=g["efficiency_formula"],
                                 hovertemplate="%{text}<extra></extra>", marker={"symbol": sym.get(exp, "circle")},
                                 line={"color": label_color("measured"), "dash": dash[mode]}), row=1, col=1)
    first = series[series["mode"] == "strong"].drop_duplicates("world_size").sort_values("world_size")
    n0 = first["baseline_world_size"].iloc[0]
    ceil = first["ideal_speedup_on_cores"] / (first["world_size"] / n0)
    fig.add_trace(go.Scatter(x=first["world_size"], y=ceil, mode="lines",
                             name=f"predicted (cores ceiling: min(n, {int(first['cores'].iloc[0])}) / n, strong)",
                             line={"color": label_color("predicted"), "dash": "dot"}), row=1, col=1)
    if right:
        lab = emulated.attrs["label"]
        for mode, g in emulated.groupby("mode", sort=False):
            g = g.sort_values("world_size")
            fig.add_trace(go.Scatter(x=g["world_size"], y=g["efficiency"], mode="lines+markers",
                                     name=f"{lab}: {mode}", text=g["efficiency_formula"],
                                     hovertemplate="%{text}<extra></extra>",
                                     line={"color": label_color(lab), "dash": dash[mode]}), row=1, col=2)
        if predicted is not None:
            for mode, g in predicted.groupby("mode", sort=False):
                g = g.sort_values("world_size")
                fig.add_trace(go.Scatter(x=g["world_size"], y=g["efficiency"], mode="lines",
                                         name=f"{predicted.attrs['label']}: {mode}",
                                         line={"color": label_color("predicted"), "dash": dash[mode], "width": 1}),
                              row=1, col=2)
        gpn = emulated.attrs.get("gpus_per_node")
        if gpn and gpn < emulated["world_size"].max():
            x = gpn * 2**0.5  # halfway (in log) between gpn and 2 gpn: the first size that spans two nodes
            fig.add_trace(go.Scatter(x=[x, x], y=[0, 1.05], mode="lines", name=f"node boundary ({gpn} GPUs/node)",
                                     line={"color": "#888", "dash": "dot"}), row=1, col=2)
    fig.update_xaxes(type="log", dtick=0.30103, title="world size n (ranks)")
    fig.update_yaxes(title="efficiency = speedup / (n / n0)", rangemode="tozero")
    fig.update_layout(height=460, title=title or "Strong vs weak scaling efficiency, baseline n0 = 1",
                      legend={"orientation": "h", "y": -0.25})
    return fig


def emulated_panel(series: pd.DataFrame, emulated: pd.DataFrame | None,
                   profiles=("dgx-h100", "dgx-a100", "ib-h100-1nic", "pcie-4090")):
    """A cluster Dropdown and a GPUs-per-node slider that re-price the emulated series' recorded traces
    (:func:`labkit.experiments.scaling_emulated.reprice`: nothing runs again) and redraw
    :func:`efficiency_figure` and the knee sentence. Returns the ``ipywidgets.VBox`` (None when emulation is
    off); ``.emulated()`` gives the series shown."""
    import html

    import ipywidgets as w

    from labkit.experiments.scaling_emulated import cluster_of, reprice
    from labkit.widgets import headless, show_in

    if emulated is None:
        return None
    cl = emulated.attrs["run"]["emulation"].cluster
    base = cl.name.split("/")[0]
    pick = w.Dropdown(options=list(dict.fromkeys([base, *profiles])), value=base, description="cluster")
    n = int(emulated["world_size"].max())
    gpn = w.SelectionSlider(options=[g for g in (1, 2, 4, 8) if n % g == 0 or g >= n], value=cl.gpus_per_node,
                            description="GPUs per node")
    out, text, state = w.Output(), w.HTML(), {"emulated": emulated}

    def redraw(change=None):
        try:
            d = reprice(emulated, cluster_of(pick.value, gpn.value))
        except ValueError as e:
            text.value = f"<b style='color:#b00'>{html.escape(str(e))}</b>"
            return
        state["emulated"] = d
        show_in(out, efficiency_figure(series, d, predict_emulated(d)))
        text.value = html.escape(knee_findings(d))

    pick.observe(redraw, names="value")
    gpn.observe(redraw, names="value")
    redraw()
    box = w.VBox([w.HBox([pick, gpn]), out, text])
    box.emulated = lambda: state["emulated"]
    return headless(box)  # an executed copy shows the figure, not VBox(children=...)


# ------------------------------------------------------------------------------------------------------
# the emulated run and the checks
# ------------------------------------------------------------------------------------------------------
def run_emulated(emulated: dict | None, *, weak_per_rank: int, timeout_s: float = 300.0):
    """The emulated series (:func:`labkit.experiments.scaling_emulated.run_series` on ``emulated["cluster"]``,
    ``weak_per_rank`` sequences per rank in weak mode) and its prediction (:func:`predict_emulated`); (None,
    None) and one printed line when emulation is off."""
    from labkit.experiments.scaling_emulated import run_series

    if emulated is None:
        print("emulate=None: no emulated series (set emulate='dgx-h100' to see the cluster's curve).")
        return None, None
    em = run_series(emulated["max_world_size"], emulated["cluster"], weak_per_rank=weak_per_rank,
                    timeout_s=timeout_s)
    return em, predict_emulated(em)


def mfu_limit(peak: dict) -> float:
    """The highest MFU a correct run can show against ``peak`` (:func:`labkit.experiments.scaling.measure_peak`):
    1 + the timing noise, which is 10 % or, where larger, how far the core's own peak moved between tries
    (``spread_1_thread``, best / worst: a shared or throttling machine runs some steps faster than some peak
    tries)."""
    return max(1 + MFU_TIMING_NOISE, float(peak.get("spread_1_thread", 1.0)))


def check_series(series: pd.DataFrame, pred: pd.DataFrame, *, world_sizes, strong_total: int, weak_per_rank: int,
                 peak: dict) -> str:
    """The chapter's checks on the measured series (AssertionError naming what is wrong): the baseline is the
    smallest world size with speedup and efficiency 1, min <= median <= max, the work per rank and in total as
    asked, the FLOPs torch counted in the real step within 2 % under the formula's 6N term, every matmul's FLOPs
    counted, and no MFU above 1 + timing noise (10 %, or the spread of the measured peak's tries where that is
    larger: ``peak["spread_1_thread"]``, :func:`labkit.experiments.scaling.measure_peak`). Returns the line to
    print."""
    for (_exp, mode), g in series.groupby(["experiment", "mode"]):
        g = g.set_index("world_size")
        n0 = int(g["baseline_world_size"].iloc[0])
        assert n0 == min(world_sizes) and g.loc[n0, "speedup"] == 1.0 and g.loc[n0, "efficiency"] == 1.0
        assert ((g["time_min_s"] <= g["time_s"]) & (g["time_s"] <= g["time_max_s"])).all()
        if mode == "strong":
            assert (g["total_work"] == strong_total).all() and (g["work_per_rank"] * g.index == strong_total).all()
        else:
            assert (g["work_per_rank"] == weak_per_rank).all() and (g["total_work"] == weak_per_rank * g.index).all()
    tr = series[series["experiment"] == "train"].set_index(["mode", "world_size"])
    mm = series[series["experiment"] == "matmul"].set_index(["mode", "world_size"])
    p = pred.set_index(["mode", "world_size"])
    counted = []
    for key in tr.index:
        t = tr.loc[key]
        assert t["tokens"] == p.loc[key, "tokens"] and abs(t["flops"] / p.loc[key, "flops"] - 1) < 1e-9
        # torch's FlopCounterMode counted the real step's matmuls: within 2 % under 6N (norm weights are no matmul)
        counted.append(t["flops_counted_matmul"] / p.loc[key, "flops_dense"])
        assert 0.98 <= counted[-1] <= 1.0, (key, t["flops_counted_matmul"], p.loc[key, "flops_dense"])
        assert mm.loc[key, "flops_counted"] == mm.loc[key, "flops"]  # 2 size^3 per product, counted
    assert ((series["mfu"] > 0) & (series["mfu_denominator_flops"] == peak["flops_machine"])).all()
    limit = mfu_limit(peak)
    bound = series["world_size"].map(lambda n: mfu_bound(peak, int(n), int(series["threads_per_rank"].iloc[0])))
    over = series["mfu"] > bound
    assert not over.any(), (
        f"MFU above what the ranks' cores can reach (min(n x threads, cores) / cores x {limit:.2f}, 1 + the timing "
        "noise: the larger of 10 % and the peak's own spread between tries): the one-core peak was measured while "
        "something else used the cores (re-run on an idle machine), or a FLOP count is wrong:\n"
        f"{series.loc[over, ['experiment', 'mode', 'world_size', 'mfu']]}")
    if len(tr) and len(mm):  # the training step runs matmuls and more: no faster per FLOP than the matmuls alone
        ratio = tr["mfu"] / mm["mfu"].reindex(tr.index)
        assert (ratio.dropna() <= limit).all(), (
            f"the training step's MFU exceeds the matmul experiment's at the same (mode, n) by more than the timing "
            f"noise ({limit:.2f}): a FLOP count is wrong\n{ratio}")
        vs_mm = f"; train / matmul MFU at most {ratio.max():.2f}"
    else:
        vs_mm = ""
    return (f"FLOPs counted by torch / the formula's 6N term: {span(min(counted), max(counted), '.4f')}; highest MFU "
            f"{series['mfu'].max():.2f} (bound at the largest n {bound.max():.2f}: the peak's "
            f"{len(peak.get('tries_1_thread', ()))} tries, before and after the series, spread "
            f"{float(peak.get('spread_1_thread', 1.0)):.2f}x){vs_mm}; all checks passed")


def mfu_bound(peak: dict, world_size: int, threads_per_rank: int = 1) -> float:
    """The highest MFU ``world_size`` ranks of ``threads_per_rank`` threads can show against the machine's
    peak (cores x the one-thread peak, :func:`labkit.experiments.scaling.measure_peak`): they use at most
    min(world_size x threads_per_rank, cores) cores, each at most the one-thread peak, so the bound is that
    many one-thread peaks over the denominator, times :func:`mfu_limit` (1 + the timing noise). Raises ValueError
    for a world size or thread count below 1."""
    from labkit.checks import positive_int

    n, t = positive_int("world_size", world_size), positive_int("threads_per_rank", threads_per_rank)
    cores = int(peak["cores"])
    one = float(peak.get("flops_1_thread", peak["flops_machine"] / cores))
    return min(n * t, cores) * one / float(peak["flops_machine"]) * mfu_limit(peak)


def check_emulated(emulated: pd.DataFrame | None, predicted: pd.DataFrame | None) -> None:
    """The emulated series' checks: baseline n0 = 1 with efficiency 1; strong-scaling efficiency never rises
    with n (compute shrinks, the all-reduce does not); the prediction within 10 % of every emulated step."""
    if emulated is None:
        return
    for mode, g in emulated.groupby("mode"):
        g = g.sort_values("world_size")
        assert g["baseline_world_size"].iloc[0] == 1 and g["efficiency"].iloc[0] == 1.0
        if mode == "strong":
            assert (g["efficiency"].diff().dropna() <= 1e-9).all(), g[["world_size", "efficiency"]]
    r = emulated.set_index(["mode", "world_size"])["time_s"] / predicted.set_index(["mode", "world_size"])["time_s"]
    assert ((r - 1).abs() <= 0.10).all(), f"emulated / predicted step beyond 10 %:\n{r}"
