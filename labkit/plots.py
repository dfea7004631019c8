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

from labkit.runtime import timeline as tl

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
    """A Gantt chart of a timeline frame (:mod:`labkit.runtime.timeline` columns): one row per rank, one bar per
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


# ======================================================================================================
# Serving (chapter 10) and scaling (chapter 11) — labkit.serving / labkit.scaling tables
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
    fig.update_layout(title=title or "latency under a concurrency ramp: replicas vs TP (measured)",
                      legend={"font": {"size": 10}})
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
    fig.update_layout(barmode="stack", title=title or "where serving time goes: prefill vs decode")
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
    fig.update_layout(title=title or "KV cache memory: measured vs calculator, through a cancel storm")
    return fig


def errors_figure(errors: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Stacked bars per experiment of attempts by outcome (ok and each error type), *measured*, from
    :func:`labkit.serving.error_table`."""
    fig = go.Figure()
    outcome_colors = {"ok": "#54A24B", "cancelled": "#EECA3B", "rank_lost": "#E45756", "comm_timeout": "#B279A2"}
    for col, color in outcome_colors.items():
        if col in errors.columns:
            fig.add_trace(go.Bar(x=errors["experiment"], y=errors[col], name=col, marker_color=color))
    fig.update_layout(barmode="stack", title=title or "attempts by outcome (measured)")
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
    fig.update_layout(barmode="group", title=title or "replicas vs tensor parallelism (analytic model)")
    return fig


def scaling_figure(df: pd.DataFrame, reference: pd.DataFrame | None = None, title: str | None = None) -> go.Figure:
    """Speedup (left) and efficiency (right) vs world size from :func:`labkit.scaling.efficiency`: one colour
    per (experiment, mode), *measured* lines with markers; ideal n/n0 (*predicted*, grey dashed) and the
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
    fig.update_layout(title=title or "strong vs weak scaling", legend={"font": {"size": 10}})
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
    fig.update_layout(title=title or "step time: strong (should fall) vs weak (should stay flat)")
    return fig


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
