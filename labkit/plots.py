"""plotly figures of what the ranks measured (and what theory predicted). Views only: no measurement here.

Every figure says in its title or legend which numbers are measured and which predicted.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from labkit import timeline as tl

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
