"""Plotly figures. Every trace says whether it is *measured*, *predicted* or *recorded elsewhere*.

Functions take the plain tables labkit returns (pandas DataFrames / lists of dicts) and return a
``plotly.graph_objects.Figure``; they never run anything.

Timelines (every chapter): :func:`timeline_figure`.
Collectives (chapter 02): :func:`bandwidth_figure`, :func:`time_figure`, :func:`residual_figure`,
:func:`ring_tree_figure`, :func:`methods_figure`, :func:`overlap_figure`, :func:`bytes_figure`.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from labkit import timeline as tl

_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _colors(keys) -> dict:
    return {k: _PALETTE[i % len(_PALETTE)] for i, k in enumerate(keys)}


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
                                 name=f"{op} n={n} ({g['backend'].iloc[0]}, measured)"))
        if len(bad):
            fig.add_trace(go.Scatter(x=bad["bytes"], y=bad[y], mode="markers", name=f"{op}: flagged",
                                     marker={"symbol": "x", "size": 11, "color": "red"},
                                     text=bad["flag"], hovertemplate="%{text}<extra></extra>"))
    if reference is not None and len(reference):
        r = _sync_rows(reference)
        for (op, n, gpu), g in r.groupby(["op", "world_size", "gpu"], sort=False):
            g = g.sort_values("bytes")
            fig.add_trace(go.Scatter(x=g["bytes"], y=g[y], mode="lines", line={"dash": "dash",
                                     "color": colors.get(op, "#444")},
                                     name=f"{op} n={n} {gpu} (recorded elsewhere)"))
    _size_axis(fig)
    fig.update_yaxes(type="log", title=f"{label} (GB/s = 1e9 B/s, log)")
    fig.update_layout(title=title or f"{label} vs message size", legend={"font": {"size": 10}})
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
            name=f"{op} (measured)",
            error_y={"type": "data", "symmetric": False, "array": (g["time_max_s"] - g["time_s"]) * 1e6,
                     "arrayminus": (g["time_s"] - g["time_min_s"]) * 1e6}))
        bad = g[g["flag"] != ""] if "flag" in g.columns else g.iloc[0:0]
        if len(bad):
            fig.add_trace(go.Scatter(x=bad["bytes"], y=bad["time_s"] * 1e6, mode="markers",
                                     marker={"symbol": "x", "size": 12, "color": "red"},
                                     name=f"{op}: flagged", text=bad["flag"],
                                     hovertemplate="%{text}<extra></extra>"))
        if fits is not None and len(fits) and op in set(fits["op"]):
            f = fits[fits["op"] == op].iloc[0]
            xs = sorted(g["bytes"])
            fig.add_trace(go.Scatter(x=xs, y=[(f["alpha_s"] + f["beta_s_per_byte"] * x) * 1e6 for x in xs],
                                     mode="lines", line={"dash": "dash", "color": colors[op]},
                                     name=f"{op} α-β fit (predicted)"))
    _size_axis(fig)
    fig.update_yaxes(type="log", title="time per call (µs, log)")
    fig.update_layout(title=title or "time vs message size", legend={"font": {"size": 10}})
    return fig


def residual_figure(df: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Relative residual (predicted - measured) / measured vs size per op, from ``with_fit``."""
    fig = go.Figure()
    colors = _colors(df["op"].unique())
    for op, g in df.groupby("op", sort=False):
        g = g.sort_values("bytes")
        fig.add_trace(go.Scatter(x=g["bytes"], y=g["residual"], mode="lines+markers", name=op,
                                 line={"color": colors[op]}))
    fig.add_hline(y=0, line={"color": "#888", "width": 1})
    _size_axis(fig)
    fig.update_yaxes(title="(α-β prediction - measured) / measured")
    fig.update_layout(title=title or "α-β fit residuals")
    return fig


def ring_tree_figure(rows, title: str | None = None) -> go.Figure:
    """*Predicted* all-reduce time vs size, ring (solid) vs tree (dashed), one colour per world size, from
    :func:`labkit.costmodel.ring_vs_tree` rows."""
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
    fig.update_layout(title=title or "ring vs tree all-reduce (α-β model)")
    return fig


def methods_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Bars of *measured* median time per method (error bars min..max), e.g. the ``ar_vs_rs_ag`` table."""
    fig = go.Figure(go.Bar(
        x=table["method"], y=table["time_s"] * 1e3, name="measured",
        error_y={"type": "data", "symmetric": False, "array": (table["time_max_s"] - table["time_s"]) * 1e3,
                 "arrayminus": (table["time_s"] - table["time_min_s"]) * 1e3}))
    fig.update_yaxes(title="time (ms, measured median; bars min..max)")
    fig.update_layout(title=title or "AllReduce vs ReduceScatter + AllGather")
    return fig


def overlap_figure(summary: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Per mode (serialised, overlapped): stacked *measured* compute time and exposed communication, beside
    the step time; the hidden fraction in the hover text. From ``overlap_summary``."""
    fig = go.Figure()
    fig.add_trace(go.Bar(x=summary["mode"], y=summary["compute_s"] * 1e3, name="compute (measured)"))
    fig.add_trace(go.Bar(x=summary["mode"], y=summary["exposed_comm_s"] * 1e3,
                         name="exposed communication (measured)",
                         text=[f"hidden {h:.0%}" for h in summary["hidden_fraction"]], textposition="inside"))
    fig.add_trace(go.Scatter(x=summary["mode"], y=summary["step_s"] * 1e3, mode="markers",
                             marker={"symbol": "line-ew-open", "size": 40, "color": "black"},
                             name="step time (measured)"))
    fig.update_layout(barmode="stack", title=title or "compute / communication overlap")
    fig.update_yaxes(title="ms per step (median over ranks and steps)")
    return fig


def bytes_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Bytes each rank sends, *measured* beside *predicted*, per op (``repartition_bytes`` table)."""
    fig = go.Figure()
    fig.add_trace(go.Bar(x=table["op"], y=table["measured_bytes_per_rank"], name="measured (socket bytes)"))
    fig.add_trace(go.Bar(x=table["op"], y=table["predicted_bytes_per_rank"], name="predicted (ring count)"))
    fig.update_layout(barmode="group", title=title or "bytes sent per rank: re-partition vs reduce-scatter")
    fig.update_yaxes(title="bytes per rank")
    return fig


#: colours per event kind, and per common event name (pipeline F/B/W, collectives)
KIND_COLORS = {"compute": "#4C78A8", "comm": "#F58518", "idle": "#BAB0AC", "other": "#72B7B2"}
NAME_COLORS = {"F": "#4C78A8", "B": "#E45756", "W": "#54A24B", "send": "#F58518", "recv": "#FF9DA6",
               "idle": "#BAB0AC"}


def timeline_figure(df: pd.DataFrame, *, color_by: str = "kind", title: str = "Per-rank timeline (measured)",
                    label: str | None = None, height: int | None = None) -> go.Figure:
    """A Gantt chart of a timeline frame (:mod:`labkit.timeline` columns): one row per rank, one bar per
    event, time in ms from the earliest event. ``color_by``: ``"kind"`` or ``"name"``. ``label``: a column
    whose value is written on each bar (e.g. ``"microbatch"``). Hover shows name, kind, step, micro-batch,
    stage, duration and bytes.

    Raises ValueError if ``color_by`` / ``label`` is not a column of ``df``.
    """
    for col in (color_by, label):
        if col is not None and col not in df.columns:
            raise ValueError(f"{col!r} is not a timeline column; columns: {', '.join(df.columns)}")
    rel = tl.relative(df)
    fig = go.Figure()
    palette = KIND_COLORS if color_by == "kind" else NAME_COLORS
    fallback = ["#9D755D", "#B279A2", "#EECA3B", "#76B7B2", "#FF9DA6", "#79706E"]
    for i, (key, g) in enumerate(rel.groupby(color_by, sort=False)):
        color = palette.get(key, fallback[i % len(fallback)])
        text = g[label].astype(str).where(g[label] >= 0, "") if label is not None else None
        fig.add_trace(go.Bar(
            y=[f"rank {r}" for r in g["rank"]], x=g["dur_s"] * 1e3, base=g["start_s"] * 1e3, orientation="h",
            name=str(key), marker_color=color, text=text, textposition="inside", insidetextanchor="middle",
            customdata=g[["name", "kind", "step", "microbatch", "stage", "nbytes"]].to_numpy(),
            hovertemplate=("%{customdata[0]} (%{customdata[1]})<br>start %{base:.3f} ms, %{x:.3f} ms<br>"
                           "step %{customdata[2]} · micro-batch %{customdata[3]} · stage %{customdata[4]}"
                           "<br>%{customdata[5]} bytes<extra></extra>"),
        ))
    ranks = sorted(rel["rank"].unique()) if len(rel) else []
    fig.update_layout(
        title=title, barmode="overlay", xaxis_title="time since first event (ms)",
        yaxis={"categoryorder": "array", "categoryarray": [f"rank {r}" for r in reversed(ranks)]},
        height=height or 120 + 45 * max(1, len(ranks)), legend_title=color_by, bargap=0.25,
    )
    return fig
