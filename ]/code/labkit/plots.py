"""Plotly figures. Every trace says whether it is *measured*, *predicted*, *emulated*, *fit*, *published* or
*recorded elsewhere*, and each of those labels has one colour across the lab (:data:`LABEL_COLORS`).

Functions take the plain tables labkit returns (pandas DataFrames / lists of dicts) and return a
``plotly.graph_objects.Figure``; they never run anything.

Timelines (every chapter): :func:`timeline_figure`.
Collectives (chapter 02): :func:`bandwidth_figure`, :func:`time_figure`, :func:`residual_figure`,
:func:`ring_tree_figure`, :func:`methods_figure`, :func:`overlap_figure`, :func:`bytes_figure`.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from labkit.runtime import timeline as tl
from labkit.style import (  # noqa: F401 - the palette and text helpers, re-exported for plots' callers
    _FALLBACK,
    _PALETTE,
    EVENT_COLORS,
    LABEL_COLORS,
    LABEL_DASH,
    _colors,
    _layout,
    count_axis,
    event_colors,
    install_defaults,
    label_color,
    label_kind,
    tidy,
    words,
    wrap_title,
)


def _size_axis(fig: go.Figure, title: str = "message size S (bytes, log)") -> None:
    fig.update_xaxes(type="log", title=title)


def _sync_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["timing"] == "synchronised"] if "timing" in df.columns else df


def bandwidth_figure(df: pd.DataFrame, y: str = "busbw_gbps", reference: pd.DataFrame | None = None,
                     title: str | None = None) -> go.Figure:
    """Bandwidth (``y`` = ``busbw_gbps`` or ``algbw_gbps``) vs size, one line per op of a sweep table
    (*measured*, synchronised rows); flagged rows drawn as red crosses, not joined to the line; rows of
    ``reference`` (recorded GPU runs) dashed and labelled *recorded elsewhere* with their GPU."""
    label = {"busbw_gbps": "busbw", "algbw_gbps": "algbw"}.get(y, y)
    fig = go.Figure()
    d = _sync_rows(df)
    colors = _colors(d["op"].unique())
    for op, g in d.groupby("op", sort=False):
        g = g.sort_values("bytes")
        ok = g[g["flag"] == ""] if "flag" in g.columns else g
        bad = g[g["flag"] != ""] if "flag" in g.columns else g.iloc[0:0]
        n = int(g["world_size"].iloc[0])
        fig.add_trace(go.Scatter(x=ok["bytes"], y=ok[y], mode="lines+markers", line={"color": colors[op]},
                                 name=f"{words(op)} n={n} ({g['backend'].iloc[0]}, measured)"))
        if len(bad):
            fig.add_trace(go.Scatter(x=bad["bytes"], y=bad[y], mode="markers", name=f"{words(op)}: flagged",
                                     marker={"symbol": "x", "size": 11, "color": "red"},
                                     text=bad["flag"], hovertemplate="%{text}<extra></extra>"))
    if reference is not None and len(reference):
        r = _sync_rows(reference)
        for (op, n, gpu), g in r.groupby(["op", "world_size", "gpu"], sort=False):
            g = g.sort_values("bytes")
            fig.add_trace(go.Scatter(x=g["bytes"], y=g[y], mode="lines", line={"dash": "dash",
                                     "color": colors.get(op, "#444")},
                                     name=f"{words(op)} n={n} {gpu} (recorded elsewhere)"))
    _size_axis(fig)
    fig.update_yaxes(type="log", title=f"{label} (GB/s = 1e9 B/s, log)")
    _layout(fig, title or f"{label} vs message size")
    return fig


def time_figure(df: pd.DataFrame, fits: pd.DataFrame | None = None, title: str | None = None) -> go.Figure:
    """Log-log time vs size per op (*measured* median, error bars min..max over repeats); the alpha-beta
    fits (``fit_table``) as dashed lines labelled *predicted*; flagged rows as red crosses."""
    fig = go.Figure()
    d = _sync_rows(df)
    colors = _colors(d["op"].unique())
    for op, g in d.groupby("op", sort=False):
        g = g.sort_values("bytes")
        fig.add_trace(go.Scatter(
            x=g["bytes"], y=g["time_s"] * 1e6, mode="markers", marker={"color": colors[op]},
            name=f"{words(op)} (measured)",
            error_y={"type": "data", "symmetric": False, "array": (g["time_max_s"] - g["time_s"]) * 1e6,
                     "arrayminus": (g["time_s"] - g["time_min_s"]) * 1e6}))
        bad = g[g["flag"] != ""] if "flag" in g.columns else g.iloc[0:0]
        if len(bad):
            fig.add_trace(go.Scatter(x=bad["bytes"], y=bad["time_s"] * 1e6, mode="markers",
                                     marker={"symbol": "x", "size": 12, "color": "red"},
                                     name=f"{words(op)}: flagged", text=bad["flag"],
                                     hovertemplate="%{text}<extra></extra>"))
        if fits is not None and len(fits) and op in set(fits["op"]):
            f = fits[fits["op"] == op].iloc[0]
            xs = sorted(g["bytes"])
            fig.add_trace(go.Scatter(x=xs, y=[(f["alpha_s"] + f["beta_s_per_byte"] * x) * 1e6 for x in xs],
                                     mode="lines", line={"dash": LABEL_DASH["fit"], "color": colors[op]},
                                     name=f"{words(op)} α-β fit"))
    _size_axis(fig)
    fig.update_yaxes(type="log", title="time per call (µs, log)")
    _layout(fig, title or "time vs message size")
    return fig


def residual_figure(df: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Relative residual (predicted - measured) / measured vs size per op, from ``with_fit``."""
    fig = go.Figure()
    colors = _colors(df["op"].unique())
    for op, g in df.groupby("op", sort=False):
        g = g.sort_values("bytes")
        fig.add_trace(go.Scatter(x=g["bytes"], y=g["residual"], mode="lines+markers", name=words(op),
                                 line={"color": colors[op]}))
    fig.add_hline(y=0, line={"color": "#888", "width": 1})
    _size_axis(fig)
    fig.update_yaxes(title="(α-β prediction - measured) / measured")
    _layout(fig, title or "α-β fit residuals")
    return fig


def ring_tree_figure(rows, title: str | None = None) -> go.Figure:
    """*Predicted* all-reduce time vs size, ring (solid) vs tree (dashed), one colour per world size, from
    :func:`labkit.theory.costmodel.ring_vs_tree` rows."""
    df = pd.DataFrame(rows)
    fig = go.Figure()
    colors = _colors(df["world_size"].unique())
    for n, g in df.groupby("world_size", sort=False):
        g = g.sort_values("bytes")
        nodes = int(g["nodes"].iloc[0])
        where = f"{n} GPUs ({nodes} node{'s' if nodes > 1 else ''})"
        for algo, dash in (("ring", "solid"), ("tree", "dash")):
            fig.add_trace(go.Scatter(x=g["bytes"], y=g[f"{algo}_s"] * 1e6, mode="lines",
                                     line={"dash": dash, "color": colors[n]},
                                     name=f"{algo}, {where}, predicted"))
    _size_axis(fig)
    fig.update_yaxes(type="log", title="all-reduce time (µs, log, predicted)")
    _layout(fig, title or "ring vs tree all-reduce (α-β model)")
    return fig


def methods_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Bars of *measured* median time per method (error bars min..max), e.g. the ``ar_vs_rs_ag`` table."""
    fig = go.Figure(go.Bar(
        x=table["method"], y=table["time_s"] * 1e3, name="measured", marker_color=LABEL_COLORS["measured"],
        error_y={"type": "data", "symmetric": False, "array": (table["time_max_s"] - table["time_s"]) * 1e3,
                 "arrayminus": (table["time_s"] - table["time_min_s"]) * 1e3}))
    fig.update_yaxes(title="time (ms, measured median; bars min..max)")
    _layout(fig, title or "AllReduce vs ReduceScatter + AllGather")
    return fig


def overlap_figure(summary: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Per mode (serialised, overlapped): stacked *measured* compute time and exposed communication, beside
    the step time; the hidden fraction in the hover text. From ``overlap_summary``."""
    fig = go.Figure()
    fig.add_trace(go.Bar(x=summary["mode"], y=summary["compute_s"] * 1e3, name="compute (measured)",
                         marker_color=EVENT_COLORS["compute"]))
    fig.add_trace(go.Bar(x=summary["mode"], y=summary["exposed_comm_s"] * 1e3,
                         name="exposed communication (measured)", marker_color=EVENT_COLORS["comm"],
                         text=[f"hidden {h:.0%}" for h in summary["hidden_fraction"]], textposition="inside"))
    fig.add_trace(go.Scatter(x=summary["mode"], y=summary["step_s"] * 1e3, mode="markers",
                             marker={"symbol": "line-ew-open", "size": 40, "color": "black"},
                             name="step time (measured)"))
    fig.update_layout(barmode="stack")
    _layout(fig, title or "compute / communication overlap")
    fig.update_yaxes(title="ms per step (median over ranks and steps)")
    return fig


def bytes_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Bytes each rank sends, *measured* beside *predicted*, per op (``repartition_bytes`` table)."""
    fig = go.Figure()
    fig.add_trace(go.Bar(x=table["op"], y=table["measured_bytes_per_rank"], name="measured (socket bytes)",
                         marker_color=LABEL_COLORS["measured"]))
    fig.add_trace(go.Bar(x=table["op"], y=table["predicted_bytes_per_rank"], name="predicted (ring count)",
                         marker_color=LABEL_COLORS["predicted"]))
    fig.update_layout(barmode="group")
    _layout(fig, title or "bytes sent per rank: re-partition vs reduce-scatter")
    fig.update_yaxes(title="bytes per rank")
    return fig


#: kept for callers of the old names: the kind and name palettes are both :data:`EVENT_COLORS`
KIND_COLORS = {k: EVENT_COLORS[k] for k in tl.KINDS}
NAME_COLORS = {k: EVENT_COLORS[k] for k in ("F", "B", "W", "send", "recv", "idle")}

#: timeline height: TIMELINE_BASE_PX plus TIMELINE_LANE_PX per lane (a rank, or a rank's communication lane)
TIMELINE_BASE_PX, TIMELINE_LANE_PX = 300, 40


def _overlapped(g: pd.DataFrame) -> bool:
    """Whether any comm event of one rank overlaps (in time) a non-comm event of the same rank."""
    comm, rest = g[g["kind"] == "comm"], g[g["kind"] != "comm"]
    if comm.empty or rest.empty:
        return False
    starts, ends = rest["start_ns"].to_numpy(), rest["end_ns"].to_numpy()
    return any(((starts < e) & (ends > s)).any() for s, e in zip(comm["start_ns"], comm["end_ns"]))


def timeline_lanes(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with a ``lane`` column: ``"rank r"``, or ``"rank r · comm"`` for the communication events of a
    rank whose communication overlaps its compute (so hidden communication is drawn on its own lane, under the
    compute it hides behind, instead of over it)."""
    out = df.copy()
    out["lane"] = [f"rank {r}" for r in out["rank"]]
    for r, g in out.groupby("rank"):
        if _overlapped(g):
            out.loc[g.index[g["kind"] == "comm"], "lane"] = f"rank {r} · comm"
    return out


def timeline_figure(df: pd.DataFrame, *, color_by: str = "kind", title: str = "Per-rank timeline (measured)",
                    label: str | None = None, height: int | None = None) -> go.Figure:
    """A Gantt chart of a timeline frame (:mod:`labkit.runtime.timeline` columns): one lane per rank (plus a
    ``comm`` lane under a rank whose communication overlaps its compute, :func:`timeline_lanes`), one bar per
    event, time in ms from the earliest event. ``color_by``: ``"kind"`` or ``"name"`` (colours from
    :data:`EVENT_COLORS`, every legend entry distinct). ``label``: a column whose value is written on each bar (e.g.
    ``"microbatch"``). Hover shows name, kind, step, micro-batch, stage, duration and bytes. Height is
    ``TIMELINE_BASE_PX + TIMELINE_LANE_PX`` per lane; the legend is horizontal under the chart and lists every
    key; a long title wraps.

    Raises ValueError if ``color_by`` / ``label`` is not a column of ``df``.
    """
    for col in (color_by, label):
        if col is not None and col not in df.columns:
            raise ValueError(f"{col!r} is not a timeline column; columns: {', '.join(df.columns)}")
    rel = timeline_lanes(tl.relative(df))
    fig = go.Figure()
    colors = event_colors(list(dict.fromkeys(rel[color_by])) if len(rel) else [])
    for key, g in rel.groupby(color_by, sort=False):
        text = g[label].astype(str).where(g[label] >= 0, "") if label is not None else None
        fig.add_trace(go.Bar(
            y=g["lane"], x=g["dur_s"] * 1e3, base=g["start_s"] * 1e3, orientation="h",
            name=words(str(key)), marker_color=colors[key], marker_line={"width": 0.5, "color": "white"}, text=text,
            textposition="inside", insidetextanchor="middle",
            customdata=g[["name", "kind", "step", "microbatch", "stage", "nbytes"]].to_numpy(),
            hovertemplate=("%{customdata[0]} (%{customdata[1]})<br>start %{base:.3f} ms, %{x:.3f} ms<br>"
                           "step %{customdata[2]} · micro-batch %{customdata[3]} · stage %{customdata[4]}"
                           "<br>%{customdata[5]} bytes<extra></extra>"),
        ))
    lanes = []
    for r in sorted(rel["rank"].unique()) if len(rel) else []:
        lanes += [f"rank {r}"] + ([f"rank {r} · comm"] if f"rank {r} · comm" in set(rel["lane"]) else [])
    fig.update_layout(
        barmode="overlay", xaxis_title="time since first event (ms)", bargap=0.25,
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(lanes)), "automargin": True},
        height=height or TIMELINE_BASE_PX + TIMELINE_LANE_PX * max(1, len(lanes)),
    )
    _layout(fig, title)
    legend_title = {"name": "event", "kind": "kind"}.get(color_by, words(color_by))
    fig.update_layout(legend={"title": {"text": legend_title + ":  "}, "y": -0.25 if len(lanes) < 4 else -0.15,
                              "traceorder": "normal"})
    return fig


# ======================================================================================================
# Serving (chapter 10) and scaling (chapter 11) — labkit.serving / labkit.experiments.scaling tables
# ======================================================================================================
def _subplots(rows: int, cols: int, titles):
    from plotly.subplots import make_subplots

    return make_subplots(rows=rows, cols=cols, subplot_titles=titles, horizontal_spacing=0.1)


def serving_latency_figure(summary: pd.DataFrame, title: str | None = None) -> go.Figure:
    """From :func:`labkit.serving.summarize`: TTFT (left) and per-request decode TPS (right) vs total
    concurrency, one colour per mode; p50 solid, p95 dashed. All *measured*."""
    fig = _subplots(1, 2, ("time to first token (s)", "decode tokens/s per request"))
    colors = _colors(summary["mode"].unique())
    for mode, g in summary.groupby("mode", sort=False):
        g = g.sort_values("concurrency")
        for col, (metric, q, dash) in enumerate([("ttft", "p50", "solid"), ("ttft", "p95", "dash"),
                                                 ("tps", "p50", "solid"), ("tps", "p95", "dash")]):
            fig.add_trace(go.Scatter(x=g["concurrency"], y=g[f"{metric}_{q}" + ("_s" if metric == "ttft" else "")],
                                     mode="lines+markers", line={"color": colors[mode], "dash": dash},
                                     name=f"{mode} {metric.upper()} {q} (measured)", legendgroup=mode),
                          row=1, col=1 if col < 2 else 2)
    fig.update_xaxes(title="concurrency (requests in flight, total)", type="log")
    _layout(fig, title or "latency under a concurrency ramp: replicas vs TP (measured)")
    return fig


def serving_split_figure(summary: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Stacked bars per (mode, concurrency): *measured* prefill and decode time (summed over serving
    instances), with the time inside collectives (TP) as a marker."""
    x = [f"{m} c={c}" for m, c in zip(summary["mode"], summary["concurrency"])]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=summary["prefill_s"], name="prefill (measured)",
                         text=[f"{f:.0%}" for f in summary["prefill_fraction"]], textposition="inside"))
    fig.add_trace(go.Bar(x=x, y=summary["decode_s"], name="decode (measured)"))
    fig.add_trace(go.Scatter(x=x, y=summary["comm_s"], mode="markers", name="of which collectives (measured)",
                             marker={"symbol": "diamond", "size": 11, "color": "black"}))
    fig.update_layout(barmode="stack")
    _layout(fig, title or "where serving time goes: prefill vs decode")
    fig.update_yaxes(title="seconds (sum over serving instances)")
    return fig


def kv_trace_figure(kv: pd.DataFrame, title: str | None = None) -> go.Figure:
    """KV cache bytes over time per replica: *measured* (bytes of live cache tensors, solid) and *predicted*
    (labkit.theory.memory.kv_cache_bytes of the live requests, dashed); the cancel storm as a marker."""
    fig = go.Figure()
    colors = _colors(kv["replica"].unique())
    for rep, g in kv.groupby("replica", sort=False):
        fig.add_trace(go.Scatter(x=g["t_s"], y=g["kv_bytes_measured"], mode="lines", line={"color": colors[rep]},
                                 name=f"replica {rep}: measured", line_shape="hv"))
        fig.add_trace(go.Scatter(x=g["t_s"], y=g["kv_bytes_predicted"], mode="lines", line_shape="hv",
                                 line={"color": colors[rep], "dash": "dash"}, name=f"replica {rep}: predicted"))
        c = g[g["event"] == "cancel"]
        if len(c):
            fig.add_trace(go.Scatter(x=c["t_s"], y=c["kv_bytes_measured"], mode="markers",
                                     marker={"symbol": "x", "size": 13, "color": "red"},
                                     name=f"replica {rep}: cancel storm"))
    fig.update_xaxes(title="time since start (s)")
    fig.update_yaxes(title="KV cache bytes")
    _layout(fig, title or "KV cache memory: measured vs calculator, through a cancel storm")
    return fig


def errors_figure(errors: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Stacked bars per experiment of attempts by outcome (ok and each error type), *measured*, from
    :func:`labkit.serving.error_table`."""
    fig = go.Figure()
    outcome_colors = {"ok": "#54A24B", "cancelled": "#EECA3B", "rank_lost": "#E45756", "comm_timeout": "#B279A2"}
    for col, color in outcome_colors.items():
        if col in errors.columns:
            fig.add_trace(go.Bar(x=errors["experiment"], y=errors[col], name=words(col), marker_color=color))
    fig.update_layout(barmode="stack")
    _layout(fig, title or "attempts by outcome (measured)")
    fig.update_yaxes(title="attempts")
    return fig


def deployments_figure(pred: pd.DataFrame, title: str | None = None) -> go.Figure:
    """From :func:`labkit.serving.predict_deployments` (*predicted*): TTFT and time per output token (left,
    ms) and total throughput (right, tokens/s) for each TP degree (replicas = GPUs / tp)."""
    fig = _subplots(1, 2, ("latency (ms, predicted)", "throughput (tokens/s, predicted)"))
    x = [f"TP{t} x {r}" for t, r in zip(pred["tp"], pred["replicas"])]
    fig.add_trace(go.Bar(x=x, y=pred["ttft_s"] * 1e3, name="TTFT (predicted)"), row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=pred["tpot_s"] * 1e3, name="time per output token (predicted)"), row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=pred["throughput_tok_s"], name="tokens/s, all replicas (predicted)"), row=1, col=2)
    fig.update_layout(barmode="group")
    _layout(fig, title or "replicas vs tensor parallelism (analytic model)")
    return fig


def scaling_figure(df: pd.DataFrame, reference: pd.DataFrame | None = None, title: str | None = None) -> go.Figure:
    """Speedup (left) and efficiency (right) vs world size from :func:`labkit.experiments.scaling.efficiency`:
    one colour per (experiment, mode), *measured* lines with markers; ideal n/n0 (*predicted*, grey dashed) and the
    cores-limited ideal (*predicted*, dotted); rows of ``reference`` (recorded GPU series) dashed and
    labelled *recorded elsewhere* with their GPU."""
    fig = _subplots(1, 2, ("speedup = throughput(n) / throughput(n0)", "efficiency = speedup / (n / n0)"))
    keys = list(dict.fromkeys(zip(df["experiment"], df["mode"])))
    colors = _colors(keys)
    for key in keys:
        g = df[(df["experiment"] == key[0]) & (df["mode"] == key[1])].sort_values("world_size")
        n0 = int(g["baseline_world_size"].iloc[0])
        label = f"{key[0]} {key[1]} (measured, baseline n0={n0})"
        fig.add_trace(go.Scatter(x=g["world_size"], y=g["speedup"], mode="lines+markers", name=label,
                                 line={"color": colors[key]}, legendgroup=str(key),
                                 text=g["speedup_formula"], hovertemplate="%{text}<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Scatter(x=g["world_size"], y=g["efficiency"], mode="lines+markers", showlegend=False,
                                 line={"color": colors[key]}, legendgroup=str(key),
                                 text=g["efficiency_formula"], hovertemplate="%{text}<extra></extra>"), row=1, col=2)
    sizes = sorted(df["world_size"].unique())
    n0 = int(df["baseline_world_size"].min())
    fig.add_trace(go.Scatter(x=sizes, y=[n / n0 for n in sizes], mode="lines", name="ideal n/n0 (predicted)",
                             line={"color": "#888", "dash": "dash"}), row=1, col=1)
    if "ideal_speedup_on_cores" in df.columns:
        first = df[df["mode"] == df["mode"].iloc[0]].drop_duplicates("world_size").sort_values("world_size")
        fig.add_trace(go.Scatter(x=first["world_size"], y=first["ideal_speedup_on_cores"], mode="lines",
                                 name=f"ideal on {int(first['cores'].iloc[0])} cores (predicted)",
                                 line={"color": "#444", "dash": "dot"}), row=1, col=1)
    fig.add_trace(go.Scatter(x=sizes, y=[1.0] * len(sizes), mode="lines", showlegend=False,
                             line={"color": "#888", "dash": "dash"}), row=1, col=2)
    if reference is not None and len(reference):
        for (gpu, exp, mode), g in reference.groupby(["gpu", "experiment", "mode"], sort=False):
            g = g.sort_values("world_size")
            name = f"{exp} {mode}, {gpu} (recorded elsewhere)"
            fig.add_trace(go.Scatter(x=g["world_size"], y=g["speedup"], mode="lines+markers", name=name,
                                     line={"dash": "dashdot"}), row=1, col=1)
            fig.add_trace(go.Scatter(x=g["world_size"], y=g["efficiency"], mode="lines+markers", name=name,
                                     line={"dash": "dashdot"}, showlegend=False), row=1, col=2)
    fig.update_xaxes(title="world size n (ranks)", type="log", dtick=0.30103)
    _layout(fig, title or "strong vs weak scaling")
    return fig


def scaling_time_figure(df: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Step time vs world size per (experiment, mode): *measured* median with min..max error bars; the ideal
    (*predicted*: strong T(n0)·n0/n, weak T(n0)) dashed."""
    fig = go.Figure()
    keys = list(dict.fromkeys(zip(df["experiment"], df["mode"])))
    colors = _colors(keys)
    for key in keys:
        g = df[(df["experiment"] == key[0]) & (df["mode"] == key[1])].sort_values("world_size")
        fig.add_trace(go.Scatter(
            x=g["world_size"], y=g["time_s"] * 1e3, mode="lines+markers", name=f"{key[0]} {key[1]} (measured)",
            line={"color": colors[key]},
            error_y={"type": "data", "symmetric": False, "array": (g["time_max_s"] - g["time_s"]) * 1e3,
                     "arrayminus": (g["time_s"] - g["time_min_s"]) * 1e3}))
        n0, t0 = g["baseline_world_size"].iloc[0], g["baseline_time_s"].iloc[0]
        ideal = [t0 * n0 / n if key[1] == "strong" else t0 for n in g["world_size"]]
        fig.add_trace(go.Scatter(x=g["world_size"], y=[v * 1e3 for v in ideal], mode="lines",
                                 line={"color": colors[key], "dash": "dash"},
                                 name=f"{key[0]} {key[1]} ideal (predicted)"))
    fig.update_xaxes(title="world size n (ranks)", type="log", dtick=0.30103)
    fig.update_yaxes(title="step time (ms): median, bars min..max")
    _layout(fig, title or "step time: strong (should fall) vs weak (should stay flat)")
    return fig


# ======================================================================================================
# Published references (data/reference/published, labkit.runtime.records.load_published)
# ===============================================================================================

_SYMBOLS = ("diamond", "square", "triangle-up", "cross", "star", "triangle-down", "pentagon", "hexagon", "x")


def add_published_busbw(fig: go.Figure, rows: pd.DataFrame | None = None, *, ops=None, metric: str = "busbw",
                        peaks: bool = True) -> go.Figure:
    """Overlay published collective measurements on a bandwidth-vs-size figure (e.g. :func:`bandwidth_figure`):
    one dash-dot line per (source, op, GPUs, interconnect) for rows with a size, and, with ``peaks``, a dotted
    horizontal line for each figure a source gives without a size. All in the lab's *published* colour, one
    marker symbol per source, named ``published (<source>)`` with the hardware. ``rows`` default:
    ``load_published("collectives")``; ``ops`` keeps those ops (e.g. ``["all_reduce"]``). Returns ``fig``.

    Raises ValueError for an op no published row has.
    """
    if rows is None:
        from labkit.runtime.records import load_published

        rows = load_published("collectives")
    r = rows[rows["metric"] == metric]
    if ops is not None:
        missing = sorted(set(ops) - set(r["op"]))
        if missing:
            raise ValueError(f"ops {missing} have no published {metric} rows; "
                             f"published: {', '.join(sorted(set(r['op'])))}")
        r = r[r["op"].isin(list(ops))]
    symbols = {src: _SYMBOLS[i % len(_SYMBOLS)] for i, src in enumerate(dict.fromkeys(r["source"]))}
    color = LABEL_COLORS["published"]
    sized = r[r["bytes"].notna()]
    keys = ["source", "op", "world_size", "interconnect"]
    for (src, op, n, _link), g in sized.groupby(keys, sort=False, dropna=False):
        g = g.sort_values("bytes")
        where = f"{int(n)} x {g['gpu'].iloc[0]}" if pd.notna(n) else g["gpu"].iloc[0]
        fig.add_trace(go.Scatter(
            x=g["bytes"].astype(float), y=g["value"], mode="lines+markers",
            name=f"{g['label'].iloc[0]}: {words(op)}, {where}",
            line={"color": color, "dash": LABEL_DASH["published"], "width": 1.5},
            marker={"symbol": symbols[src], "size": 7, "color": color},
            customdata=g[["interconnect", "url", "note"]].to_numpy(),
            hovertemplate=("%{x:.3s} B: %{y:.1f} GB/s<br>%{customdata[0]}<br>%{customdata[1]}"
                           f"<extra>published ({src})</extra>")))
    if peaks:  # a figure given without a size: a short level mark right of every size on the figure
        xs = [float(v) for tr in fig.data for v in (tr.x if tr.x is not None else ()) if isinstance(v, (int, float))]
        right = max(xs) if xs else 2.0**34
        for (src, op), g in r[r["bytes"].isna()].groupby(["source", "op"], sort=False):
            for i, (_, row) in enumerate(g.iterrows()):
                fig.add_trace(go.Scatter(
                    x=[right * 2, right * 8], y=[row["value"]] * 2, mode="lines+markers",
                    name=f"{row['label']}: {words(op)} peak, size not stated", legendgroup=f"{src}{op}",
                    showlegend=i == 0, line={"color": color, "dash": "dot", "width": 2},
                    marker={"symbol": symbols[src], "size": 7, "color": color},
                    hovertemplate=(f"{words(op)} {row['value']:g} GB/s, {row['gpu']}, {row['interconnect']}<br>"
                                   f"{row['what']}<br>{row['url']}<extra>{row['label']}</extra>")))
    fig.update_layout(height=max(fig.layout.height or 450, 380 + 22 * len(fig.data)))
    return fig


def _mesh_text(row) -> str:
    dims = [f"{d}{int(row[d])}" for d in ("dp", "tp", "pp", "cp") if d in row and pd.notna(row[d]) and row[d] > 1]
    return " ".join(dims) or "mesh not stated"


def add_published_training(fig: go.Figure, rows: pd.DataFrame | None = None, *, y: str = "mfu",
                           row: int | None = None, col: int | None = None) -> go.Figure:
    """Add published training runs to a scaling / MFU figure: one marker per run at x = GPUs, y = ``y`` (``mfu``
    as a fraction, or ``tflops_per_gpu``), in the *published* colour with one symbol per source, the model and
    mesh in the hover (and the full configuration: sequence, batch, schedule, interconnect, URL). Rows without
    ``y`` are skipped. ``row``/``col`` pick a subplot. ``rows`` default: ``load_published("training")``.

    Raises ValueError for a ``y`` that is not ``mfu`` or ``tflops_per_gpu``.
    """
    if y not in ("mfu", "tflops_per_gpu"):
        raise ValueError(f"y={y!r} is not valid; valid: mfu, tflops_per_gpu")
    if rows is None:
        from labkit.runtime.records import load_published

        rows = load_published("training")
    r = rows[rows[y].notna()]
    symbols = {src: _SYMBOLS[i % len(_SYMBOLS)] for i, src in enumerate(dict.fromkeys(r["source"]))}
    for src, g in r.groupby("source", sort=False):
        info = [[m, _mesh_text(x), x["gpu"], x.get("seq_len"), x.get("global_batch_size"), x.get("schedule"),
                 x.get("interconnect"), x["url"]] for m, (_, x) in zip(g["model"], g.iterrows())]
        trace = go.Scatter(
            x=g["gpus"].astype(float), y=g[y], mode="markers", name=g["label"].iloc[0],
            marker={"symbol": symbols[src], "size": 10, "color": LABEL_COLORS["published"],
                    "line": {"width": 1, "color": "white"}},
            customdata=info,
            hovertemplate=("%{customdata[0]} on %{x:,} x %{customdata[2]}<br>%{customdata[1]}, seq %{customdata[3]},"
                           " global batch %{customdata[4]}<br>schedule %{customdata[5]}<br>%{customdata[6]}<br>"
                           "%{customdata[7]}<extra>" + f"published ({src})" + "</extra>"))
        if row is not None:
            fig.add_trace(trace, row=row, col=col or 1)
        else:
            fig.add_trace(trace)
    return fig


def published_training_figure(rows: pd.DataFrame | None = None, *, y: str = "mfu", measured: pd.DataFrame | None = None,
                              title: str | None = None) -> go.Figure:
    """Published training runs (:func:`add_published_training`) on a log GPU axis, with the lab's own runs
    beside them when given: ``measured`` with columns ``world_size`` and ``y`` (e.g. chapter 11's MFU against
    the measured matmul peak), drawn in the *measured* colour."""
    fig = go.Figure()
    add_published_training(fig, rows, y=y)
    if measured is not None and len(measured):
        m = measured.sort_values("world_size")
        fig.add_trace(go.Scatter(x=m["world_size"], y=m[y], mode="lines+markers", name="measured (this machine)",
                                 line={"color": LABEL_COLORS["measured"]}, marker={"size": 9}))
    fig.update_xaxes(type="log", title="GPUs (log)")
    fig.update_yaxes(title="MFU (fraction of peak)" if y == "mfu" else "TFLOP/s per GPU",
                     tickformat=".0%" if y == "mfu" else None, rangemode="tozero")
    return _layout(fig, title or ("Model FLOPs utilisation of published training runs — each marker one run; "
                                  "hover for its mesh, batch and network"))


# ======================================================================================================
# Wide tables: a few key columns, the full table one call (or one click) away
# ======================================================================================================
class WideTable:
    """A DataFrame shown as its key columns, with every column one click away (an HTML ``<details>``) and one
    call away (``.full``). Column names are shown as words (:func:`words`); the data are not changed."""

    def __init__(self, df: pd.DataFrame, key: list[str], caption: str = ""):
        self.full, self.key, self.caption = df, key, caption

    @property
    def brief(self) -> pd.DataFrame:
        return self.full[self.key]

    def _html(self, df: pd.DataFrame) -> str:
        return df.rename(columns=words).to_html(float_format=lambda v: f"{v:,.4g}", border=0, na_rep="—")

    def _repr_html_(self) -> str:
        n_more = self.full.shape[1] - len(self.key)
        cap = f"<p><b>{self.caption}</b></p>" if self.caption else ""
        more = (f"<details><summary>all {self.full.shape[1]} columns ({n_more} more; "
                f"or <code>.full</code>)</summary>{self._html(self.full)}</details>") if n_more > 0 else ""
        return cap + self._html(self.brief) + more

    def __repr__(self) -> str:
        return repr(self.brief) + (f"\n[{self.full.shape[1] - len(self.key)} more columns: .full]"
                                   if self.full.shape[1] > len(self.key) else "")


def wide_table(df: pd.DataFrame, key: list[str] | None = None, *, max_columns: int = 7, caption: str = "") -> WideTable:
    """Show ``df`` by its ``key`` columns (default: the first ``max_columns``) with the full table one call
    (``.full``) or one click away. Raises ValueError for a key that is not a column."""
    cols = list(df.columns)
    key = list(key) if key is not None else cols[:max_columns]
    missing = [k for k in key if k not in cols]
    if missing:
        raise ValueError(f"key columns {missing} are not columns of the table; columns: {', '.join(map(str, cols))}")
    return WideTable(df, key, caption)


# ======================================================================================================
# Serving under load (chapter 12) — labkit.parallel.serving.Engine's time series
# ======================================================================================================
def serving_dashboard_figure(series: pd.DataFrame, title: str | None = None, by: str = "instance") -> go.Figure:
    """A server's own monitoring over time, from the engine's series (one row per step and event,
    :class:`labkit.parallel.serving.Engine`; labelled frames from
    :func:`labkit.experiments.serving_metrics.series_frame`), one colour per value of ``by``: queue length,
    requests in flight (solid) and of them prefilling (dotted), tokens per step (prefill + decode), KV cache
    bytes reserved (measured: live cache tensors, solid; predicted: the calculator, dashed) and written
    (dotted), outcomes so far by type, and the time each forward pass took. All *measured* except the
    predicted KV line; vertical lines mark drains, swaps and cancel storms."""
    from plotly.subplots import make_subplots

    titles = ("queue length (requests waiting)", "in flight (dotted: prefilling)", "tokens per step",
              "KV cache bytes: reserved measured / predicted (dashed), written (dotted)",
              "outcomes so far, by type", "forward pass time (ms)")
    fig = make_subplots(rows=3, cols=2, subplot_titles=titles, vertical_spacing=0.09, horizontal_spacing=0.08)
    keys = list(dict.fromkeys(series[by])) if by in series else [0]
    colors = _colors(keys)
    outcome_cols = [c for c in series.columns if c.startswith("n_") and series[c].max() > 0]
    dashes = ("solid", "dash", "dot", "dashdot", "longdash")
    shapes = []
    for key in keys:
        g = series[series[by] == key] if by in series else series
        c, name = colors[key], f"{by} {key}"

        def line(y, row, col, dash="solid", label="", show=False, g=g, c=c, name=name, key=key):
            fig.add_trace(go.Scatter(x=g["t_s"], y=y, mode="lines", line={"color": c, "dash": dash}, line_shape="hv",
                                     name=f"{name}{label}", legendgroup=str(key), showlegend=show), row=row, col=col)

        line(g["queue"], 1, 1, show=True)
        line(g["in_flight"], 1, 2)
        line(g["prefilling"], 1, 2, "dot", ": prefilling")
        steps = g[g["event"].isin(["step", "admit"])]
        fig.add_trace(go.Scatter(x=steps["t_s"], y=steps["tokens"], mode="markers", marker={"color": c, "size": 4},
                                 name=f"{name}: tokens", legendgroup=str(key), showlegend=False), row=2, col=1)
        line(g["kv_bytes_measured"], 2, 2)
        line(g["kv_bytes_predicted"], 2, 2, "dash", ": predicted")
        line(g["kv_bytes_used"], 2, 2, "dot", ": written")
        for i, col in enumerate(outcome_cols):
            line(g[col], 3, 1, dashes[i % len(dashes)], f": {col[2:]}", show=True)
        fig.add_trace(go.Scatter(x=steps["t_s"], y=steps["step_s"] * 1e3, mode="markers",
                                 marker={"color": c, "size": 4}, name=f"{name}: step", legendgroup=str(key),
                                 showlegend=False), row=3, col=2)
        for ev, color in (("drain", "#999"), ("swap", "#2ca02c"), ("cancel", "#d62728")):
            for t in g.loc[g["event"] == ev, "t_s"]:  # one shape per panel (add_vline per panel is slow)
                shapes += [{"type": "line", "x0": t, "x1": t, "y0": 0, "y1": 1, "xref": f"x{i}",
                            "yref": f"y{i} domain", "line": {"color": color, "dash": "dot", "width": 1}}
                           for i in ("", "2", "4", "5")]
    fig.update_xaxes(title="time since the run started (s)", row=3)
    fig.update_layout(shapes=shapes)
    fig.update_layout(title=title or "the server's own monitoring (measured)", height=820,
                      legend={"font": {"size": 10}})
    return fig


install_defaults()
