"""ipywidgets panels over the predict modules, and the plotly figures they draw.

* :func:`memory_panel` — model, parallel degrees, batch, sequence, recompute, ZeRO stage, device: redraws a
  stacked bar of the predicted memory per rank (labkit.memory) and the verdict on every change.
* :func:`memory_bars` — stacked bars of one or more budgets (predicted, or measured: the caller labels them).
* :func:`measured_vs_predicted` — per category, measured beside predicted, grouped bars.

Other panels (the planner) are added here by their chapters. Views only: no torch import; ipywidgets is
imported when a panel is built, so the figures work without it.
"""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go

from labkit import memory as mem
from labkit.checks import check_choice

#: one colour per memory category, shared by every memory figure
CATEGORY_COLORS = {
    "parameters": "#4C78A8", "gradients": "#F58518", "optimizer": "#E45756", "activations": "#72B7B2",
    "temporary": "#54A24B", "communication": "#EECA3B", "kv_cache": "#B279A2", "workspace": "#9D755D",
    "headroom": "#BAB0AC",
}
_UNIT = {"GiB": mem.GiB, "MiB": 2**20, "KiB": 2**10, "bytes": 1}


def _unit(unit: str) -> int:
    check_choice("unit", unit, _UNIT)
    return _UNIT[unit]


def memory_bars(budgets: Mapping[str, mem.MemoryEstimate | Mapping[str, int]], *, unit: str = "GiB",
                title: str = "Predicted memory per rank", device_bytes: int | None = None,
                height: int = 420) -> go.Figure:
    """Stacked bars, one per budget (``label -> MemoryEstimate`` or ``label -> {category: bytes}``), one
    segment per category of :data:`labkit.memory.CATEGORIES`; a dashed line at ``device_bytes`` when given.
    Say in ``title`` (or the labels) whether the numbers are predicted or measured.

    Raises ValueError for an unknown unit or a category name outside CATEGORIES.
    """
    div = _unit(unit)
    labels = list(budgets)
    cats = {lab: (b.categories if isinstance(b, mem.MemoryEstimate) else dict(b)) for lab, b in budgets.items()}
    for lab, c in cats.items():
        bad = set(c) - set(mem.CATEGORIES)
        if bad:
            raise ValueError(f"budget {lab!r} has unknown categories {sorted(bad)}; valid: {', '.join(mem.CATEGORIES)}")
    fig = go.Figure()
    for cat in mem.CATEGORIES:
        ys = [cats[lab].get(cat, 0) / div for lab in labels]
        if not any(ys):
            continue
        fig.add_trace(go.Bar(name=cat, x=labels, y=ys, marker_color=CATEGORY_COLORS[cat],
                             hovertemplate=f"{cat}: %{{y:.3f}} {unit}<extra>%{{x}}</extra>"))
    if device_bytes:
        fig.add_hline(y=device_bytes / div, line_dash="dash", line_color="black",
                      annotation_text=f"device {device_bytes / div:.1f} {unit}")
    fig.update_layout(barmode="stack", title=title, yaxis_title=f"{unit} per rank", height=height,
                      legend_title="category")
    return fig


def measured_vs_predicted(measured: Mapping[str, int], predicted: Mapping[str, int], *, unit: str = "KiB",
                          title: str = "Memory per rank: measured vs predicted") -> go.Figure:
    """Grouped bars per category: ``measured`` (bytes, from labkit.measure) beside ``predicted`` (bytes,
    from labkit.memory). Categories present in either are shown; the hover gives measured/predicted."""
    div = _unit(unit)
    names = [c for c in mem.CATEGORIES if c in measured or c in predicted]
    names += [c for c in list(measured) + list(predicted) if c not in names]
    ratio = [(measured.get(c, 0) / predicted[c]) if predicted.get(c) else float("nan") for c in names]
    fig = go.Figure([
        go.Bar(name="predicted", x=names, y=[predicted.get(c, 0) / div for c in names], marker_color="#BAB0AC"),
        go.Bar(name="measured", x=names, y=[measured.get(c, 0) / div for c in names], marker_color="#4C78A8",
               customdata=ratio, hovertemplate=f"%{{x}}: %{{y:.2f}} {unit}<br>measured/predicted %{{customdata:.4f}}"
                                               "<extra>measured</extra>"),
    ])
    fig.update_layout(barmode="group", title=title, yaxis_title=f"{unit} per rank", legend_title="")
    return fig


def memory_panel(model: str = "llama-3-8b", *, device: str | None = "h100-80gb", **defaults):
    """An ipywidgets panel: pick the model, dp/tp/pp, ZeRO stage, micro-batch, sequence length, recompute,
    attention and device; a stacked bar of the predicted training memory per rank and the verdict redraw on
    every change (labkit.memory.estimate, a few ms). Invalid combinations (tp not dividing the heads, ...)
    show the ValueError's message instead of a bar.

    ``defaults`` preset any widget (dp, tp, pp, zero, micro_batch_size, seq_len, recompute, attention).
    Returns the ``ipywidgets.VBox``; its ``.estimate()`` / ``.figure()`` give the current MemoryEstimate and
    figure (None while the input is invalid).
    """
    import ipywidgets as w
    from IPython.display import display

    from labkit.spec import presets

    models = sorted(presets())
    check_choice("model", model, models)
    devs = [None, *sorted(mem.devices())]
    if device is not None:
        check_choice("device", device, devs)
    pow2 = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    style = {"description_width": "110px"}
    ctl = {
        "model": w.Dropdown(options=models, value=model, description="model", style=style),
        "dp": w.SelectionSlider(options=pow2, value=defaults.get("dp", 8), description="dp", style=style),
        "tp": w.SelectionSlider(options=pow2[:7], value=defaults.get("tp", 1), description="tp", style=style),
        "pp": w.SelectionSlider(options=pow2[:6], value=defaults.get("pp", 1), description="pp", style=style),
        "zero": w.IntSlider(min=0, max=3, value=defaults.get("zero", 1), description="ZeRO stage", style=style),
        "micro_batch_size": w.SelectionSlider(options=pow2[:6], value=defaults.get("micro_batch_size", 1),
                                              description="micro-batch", style=style),
        "seq_len": w.SelectionSlider(options=[512, 1024, 2048, 4096, 8192, 16384, 32768],
                                     value=defaults.get("seq_len", 4096), description="sequence", style=style),
        "recompute": w.ToggleButtons(options=list(mem.RECOMPUTE), value=defaults.get("recompute", "selective"),
                                     description="recompute", style=style),
        "attention": w.ToggleButtons(options=list(mem.ATTENTION), value=defaults.get("attention", "flash"),
                                     description="attention", style=style),
        "sequence_parallel": w.Checkbox(value=defaults.get("sequence_parallel", False),
                                        description="sequence parallel"),
        "device": w.Dropdown(options=devs, value=device, description="device", style=style),
    }
    out = w.Output()  # plotly's FigureWidget needs anywidget; an Output redisplayed per change does not
    verdict = w.HTML()
    state = {"est": None, "fig": None}

    def redraw(*_):
        kw = {k: c.value for k, c in ctl.items()}
        kw["n_microbatches"] = max(1, 2 * kw["pp"])
        try:
            est = mem.estimate("train", **kw)
        except ValueError as e:
            state["est"] = state["fig"] = None
            verdict.value = f"<b style='color:#b00'>invalid:</b> {e}"
            out.clear_output(wait=True)
            return
        state["est"] = est
        state["fig"] = memory_bars({kw["model"]: est}, device_bytes=est.device_bytes, height=380,
                                   title=f"Predicted training memory per rank, {kw['model']}")
        out.clear_output(wait=True)
        with out:
            display(state["fig"])
        color = "#080" if est.fits or est.fits is None else "#b00"
        verdict.value = (f"<span style='color:{color}'><b>{est.verdict()}</b></span><br>world size "
                         f"{kw['dp'] * kw['tp'] * kw['pp']}, stage {est.stage}, convention "
                         f"{est.assumptions['convention']}")

    for c in ctl.values():
        c.observe(redraw, names="value")
    redraw()
    box = w.VBox([w.HBox([w.VBox(list(ctl.values())[:6]), w.VBox(list(ctl.values())[6:])]), verdict, out])
    box.estimate = lambda: state["est"]
    box.figure = lambda: state["fig"]
    return box
