"""ipywidgets panels over the predict modules, and the plotly figures they draw.

* :func:`memory_panel` — model, parallel degrees, batch, sequence, recompute, ZeRO stage, device: redraws a
  stacked bar of the predicted memory per rank (labkit.theory.memory) and the verdict on every change.
* :func:`memory_bars` — stacked bars of one or more budgets (predicted, or measured: the caller labels them).
* :func:`measured_vs_predicted` — per category, measured beside predicted, grouped bars.

* :func:`planner_panel` — model, GPUs, GPU kind, node size, sequence, global batch, ZeRO stage, assumed MFU:
  re-plans (labkit.theory.planner.plan) on every change and shows the ranked meshes and their predicted step times.
* :func:`plan_bars` — stacked bars of the predicted step time of the best meshes of a plan, by part.
* :func:`grid_figure` — the rank grid of a :class:`labkit.theory.mesh.ParallelDims`: one cell per rank, a row per
  pipeline stage, coloured by node.

Views only: no torch import; ipywidgets is imported when a panel is built, so the figures work without it.

The panels never capture output into their ``ipywidgets.Output`` (no ``with out:``, no ``out.clear_output``): they
replace its ``outputs`` from the kernel (:func:`show_in`). Capturing makes a headless runner (nbclient, under
papermill and ``labkit run``) play the frontend and send a ``comm_msg`` on the shell channel while it waits on
that channel for the cell's ``execute_reply``; the wake-up for the reply can be lost and the runner then sits until
the cell timeout before reading it (jupyter/nbclient#312), and reports the cell as ok.
"""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go

from labkit.checks import check_choice, positive_int
from labkit.style import LABEL_COLORS, _layout, install_defaults, words, wrap_title
from labkit.theory import memory as mem

#: one colour per memory category, shared by every memory figure
CATEGORY_COLORS = {
    "parameters": "#4C78A8", "gradients": "#F58518", "optimizer": "#E45756", "activations": "#72B7B2",
    "temporary": "#54A24B", "communication": "#EECA3B", "kv_cache": "#B279A2", "workspace": "#9D755D",
    "headroom": "#BAB0AC",
}
install_defaults()

#: memory categories as a reader names them
_CATEGORY_NAMES = {"kv_cache": "KV cache"}


def category_name(cat: str) -> str:
    """``"kv_cache"`` -> ``"KV cache"``: a memory category of :data:`labkit.theory.memory.CATEGORIES` in words."""
    return _CATEGORY_NAMES.get(cat, words(cat))


_UNIT = {"GiB": mem.GiB, "MiB": 2**20, "KiB": 2**10, "bytes": 1}


def _unit(unit: str) -> int:
    check_choice("unit", unit, _UNIT)
    return _UNIT[unit]


def mime_bundle(obj) -> dict:
    """The display data of ``obj`` as a ``{mimetype: data}`` dict: its ``_repr_mimebundle_()`` (plotly: the
    notebook's default renderer), or for a plotly figure outside a notebook plotly's own
    ``application/vnd.plotly.v1+json`` bundle, else ``{"text/plain": repr(obj)}``."""
    rep = getattr(obj, "_repr_mimebundle_", None)
    data = rep() if callable(rep) else None
    if isinstance(data, tuple):
        data = data[0]
    if not data and isinstance(obj, go.Figure):
        import plotly.io as pio

        data = pio.renderers["plotly_mimetype"].to_mimebundle(obj.to_dict())
    return dict(data) if data else {"text/plain": repr(obj)}


def show_in(out, obj=None) -> None:
    """Make the ``ipywidgets.Output`` ``out`` show ``obj`` alone (nothing when None) by setting its ``outputs``
    trait from the kernel (what ``Output.append_display_data`` does), never by capturing: see the module
    docstring for why a captured display can stall a headless run until the cell timeout."""
    out.outputs = () if obj is None else ({"output_type": "display_data", "data": mime_bundle(obj), "metadata": {}},)


def headless(box):
    """``box`` (an ipywidgets container, returned) displayed as its figure where no widget frontend runs: its
    display data keeps the widget view (a live notebook draws the controls) and adds the current figure's
    bundle from every ``Output`` inside it, with an empty ``text/plain`` — an executed copy (papermill,
    ``labkit run``) shows the figure, never ``VBox(children=...)``."""
    import ipywidgets as w

    original = box._repr_mimebundle_

    def outputs(widget):
        if isinstance(widget, w.Output):
            yield from widget.outputs
        for child in getattr(widget, "children", ()):
            yield from outputs(child)

    def bundle(**kwargs):
        data = original(**kwargs) or {}
        data, meta = (data if isinstance(data, tuple) else (data, None))
        data = dict(data)
        for out in outputs(box):
            for key, value in out.get("data", {}).items():
                if key != "text/plain":
                    data.setdefault(key, value)
        data["text/plain"] = ""
        return (data, meta) if meta is not None else data

    box._repr_mimebundle_ = bundle
    return box


def memory_bars(budgets: Mapping[str, mem.MemoryEstimate | Mapping[str, int]], *, unit: str = "GiB",
                title: str = "Predicted memory per rank", device_bytes: int | None = None,
                height: int = 420) -> go.Figure:
    """Stacked bars, one per budget (``label -> MemoryEstimate`` or ``label -> {category: bytes}``), one
    segment per category of :data:`labkit.theory.memory.CATEGORIES`; a dashed line at ``device_bytes`` when given.
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
        fig.add_trace(go.Bar(name=category_name(cat), x=labels, y=ys, marker_color=CATEGORY_COLORS[cat],
                             hovertemplate=f"{category_name(cat)}: %{{y:.3f}} {unit}<extra>%{{x}}</extra>"))
    if device_bytes:
        fig.add_hline(y=device_bytes / div, line_dash="dash", line_color="black",
                      annotation_text=f"device {device_bytes / div:.1f} {unit}")
    fig.update_layout(barmode="stack", yaxis_title=f"{unit} per rank", height=height)
    return _layout(fig, title)


def measured_vs_predicted(measured: Mapping[str, int], predicted: Mapping[str, int], *, unit: str = "KiB",
                          title: str = "Memory per rank: measured vs predicted") -> go.Figure:
    """Grouped bars per category: ``measured`` (bytes, from labkit.runtime.measure) beside ``predicted`` (bytes,
    from labkit.theory.memory). Categories present in either are shown; the hover gives measured/predicted."""
    div = _unit(unit)
    names = [c for c in mem.CATEGORIES if c in measured or c in predicted]
    names += [c for c in list(measured) + list(predicted) if c not in names]
    ratio = [(measured.get(c, 0) / predicted[c]) if predicted.get(c) else float("nan") for c in names]
    shown = [category_name(c) for c in names]
    fig = go.Figure([
        go.Bar(name="predicted", x=shown, y=[predicted.get(c, 0) / div for c in names],
               marker_color=LABEL_COLORS["predicted"]),
        go.Bar(name="measured", x=shown, y=[measured.get(c, 0) / div for c in names],
               marker_color=LABEL_COLORS["measured"],
               customdata=ratio, hovertemplate=f"%{{x}}: %{{y:.2f}} {unit}<br>measured/predicted %{{customdata:.4f}}"
                                               "<extra>measured</extra>"),
    ])
    fig.update_layout(barmode="group", yaxis_title=f"{unit} per rank")
    return _layout(fig, title)


def memory_panel(model: str = "llama-3-8b", *, device: str | None = "h100-80gb", **defaults):
    """An ipywidgets panel: pick the model, dp/tp/pp, ZeRO stage, micro-batch, sequence length, recompute,
    attention and device; a stacked bar of the predicted training memory per rank and the verdict redraw on
    every change (labkit.theory.memory.estimate, a few ms). Invalid combinations (tp not dividing the heads, ...)
    show the ValueError's message instead of a bar.

    ``defaults`` preset any widget (dp, tp, pp, zero, micro_batch_size, seq_len, recompute, attention).
    Returns the ``ipywidgets.VBox``; its ``.estimate()`` / ``.figure()`` give the current MemoryEstimate and
    figure (None while the input is invalid).
    """
    import html

    import ipywidgets as w

    from labkit.theory.spec import presets

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
    out = w.Output()  # plotly's FigureWidget needs anywidget; an Output (filled by show_in) does not
    verdict = w.HTML()
    state = {"est": None, "fig": None}

    def redraw(*_):
        kw = {k: c.value for k, c in ctl.items()}
        kw["n_microbatches"] = max(1, 2 * kw["pp"])
        try:
            est = mem.estimate("train", **kw)
        except ValueError as e:
            state["est"] = state["fig"] = None
            verdict.value = f"<b style='color:#b00'>invalid:</b> {html.escape(str(e))}"
            show_in(out)
            return
        state["est"] = est
        state["fig"] = memory_bars({kw["model"]: est}, device_bytes=est.device_bytes, height=380,
                                   title=f"Predicted training memory per rank, {kw['model']}")
        show_in(out, state["fig"])
        color = "#080" if est.fits or est.fits is None else "#b00"
        verdict.value = (f"<span style='color:{color}'><b>{est.verdict()}</b></span><br>world size "
                         f"{kw['dp'] * kw['tp'] * kw['pp']}, budget of pipeline stage {est.stage}, convention "
                         f"{est.assumptions['convention']}")

    for c in ctl.values():
        c.observe(redraw, names="value")
    redraw()
    box = w.VBox([w.HBox([w.VBox(list(ctl.values())[:6]), w.VBox(list(ctl.values())[6:])]), verdict, out])
    box.estimate = lambda: state["est"]
    box.figure = lambda: state["fig"]
    return headless(box)


#: one colour per part of a predicted step (labkit.theory.planner.TIME_PARTS)
TIME_COLORS = {"compute_s": "#4C78A8", "bubble_s": "#BAB0AC", "tp_s": "#F58518", "cp_s": "#72B7B2",
               "ep_s": "#B279A2", "pp_s": "#54A24B", "dp_s": "#E45756"}


def plan_bars(plan, *, top: int = 10, title: str | None = None, height: int = 420) -> go.Figure:
    """Stacked bars of the *predicted* step time of the ``top`` best meshes of ``plan`` (a
    :class:`labkit.theory.planner.Plan`), one segment per part (compute, bubble, TP, CP, EP, PP, exposed DP), the
    rank and mesh on the x axis; the hover gives the peak memory and the predicted MFU."""
    from labkit.theory.planner import PART_NAMES, TIME_PARTS

    cands = plan.candidates[:top]
    labels = [f"#{c.rank} dp{c.dp} tp{c.tp} pp{c.pp} cp{c.cp}" + (f" ep{c.ep}" if c.ep > 1 else "") for c in cands]
    extra = [[c.peak_bytes_per_gpu / mem.GiB, c.predicted_mfu, c.recompute] for c in cands]
    fig = go.Figure()
    for part in TIME_PARTS:
        ys = [c.parts[part] for c in cands]
        if not any(ys):
            continue
        fig.add_trace(go.Bar(name=PART_NAMES[part], x=labels, y=ys, marker_color=TIME_COLORS[part], customdata=extra,
                             hovertemplate=f"{PART_NAMES[part]}: %{{y:.4g}} s<br>peak %{{customdata[0]:.1f}} GiB, "
                                           "MFU %{customdata[1]:.1%}, recompute %{customdata[2]}<extra>%{x}</extra>"))
    i = plan.inputs
    fig.update_layout(barmode="stack", height=height, yaxis_title="seconds per step (predicted)")
    return _layout(fig, title or f"Predicted step time, {i['model']} on {i['gpus']} x {i['gpu']}")


def rejection_words(summary: Mapping[str, int], n_rejected: int) -> str:
    """``{"pp_layers": 56, "memory": 44}`` -> ``"120 rejected: 56 break 'pp * vpp divides n_layers', 44 do not fit
    in memory"``: a plan's rejection counts (:meth:`labkit.theory.planner.Plan.rejection_summary`) in words, each
    rule as :data:`labkit.theory.mesh.RULES` states it. A mesh may break several rules, so counts can add up to
    more than ``n_rejected``."""
    from labkit.theory.mesh import RULES

    parts = []
    for rule, n in summary.items():
        if rule == "memory":
            parts.append(f"{n} do not fit in memory")
        else:
            parts.append(f"{n} break '{RULES.get(rule, words(rule))}'")
    return f"{n_rejected} rejected" + (": " + ", ".join(parts) if parts else "")


def planner_panel(model: str = "llama-3-70b", *, gpus: int = 1024, gpu: str = "h100-80gb", top: int = 8,
                  **defaults):
    """An ipywidgets panel over :func:`labkit.theory.planner.plan`: pick the model, GPUs, GPU kind, GPUs per node,
    sequence length, global batch (sequences), ZeRO stage and assumed MFU; every change re-plans (pure Python,
    well under a second) and redraws the ranked table and :func:`plan_bars`. Bad input (a model that fits
    nowhere, a batch no mesh divides) shows the ValueError's message instead.

    ``defaults`` preset widgets: gpus_per_node, seq_len, global_batch_size, zero, mfu. Returns the
    ``ipywidgets.VBox``; its ``.plan()`` / ``.figure()`` give the current Plan and figure (None while invalid).
    """
    import html

    import ipywidgets as w

    from labkit.theory import planner
    from labkit.theory.spec import presets

    models = sorted(presets())
    check_choice("model", model, models)
    gpu_names = planner.plannable_gpus()
    check_choice("gpu", gpu, gpu_names)
    pow2 = [2**k for k in range(0, 15)]
    start = {"gpus": positive_int("gpus", gpus),
             "gpus_per_node": positive_int("gpus_per_node", defaults.get("gpus_per_node", 8)),
             "seq_len": positive_int("seq_len", defaults.get("seq_len", 8192)),
             "global_batch_size": positive_int("global_batch_size", defaults.get("global_batch_size", 1024))}

    def options(base, name):  # the slider's stops, plus the caller's value where it is not one of them
        return sorted(set(base) | {start[name]})

    style = {"description_width": "130px"}
    ctl = {
        "model": w.Dropdown(options=models, value=model, description="model", style=style),
        "gpus": w.SelectionSlider(options=options(pow2, "gpus"), value=start["gpus"], description="GPUs",
                                  style=style),
        "gpu": w.Dropdown(options=gpu_names, value=gpu, description="GPU", style=style),
        "gpus_per_node": w.SelectionSlider(options=options([1, 2, 4, 8], "gpus_per_node"),
                                           value=start["gpus_per_node"], description="GPUs per node", style=style),
        "seq_len": w.SelectionSlider(options=options([1024, 2048, 4096, 8192, 16384, 32768, 131072], "seq_len"),
                                     value=start["seq_len"], description="sequence", style=style),
        "global_batch_size": w.SelectionSlider(options=options(pow2[3:], "global_batch_size"),
                                               value=start["global_batch_size"], description="global batch (seqs)",
                                               style=style),
        "zero": w.IntSlider(min=0, max=3, value=defaults.get("zero", 1), description="ZeRO stage", style=style),
        "mfu": w.FloatSlider(min=0.1, max=0.9, step=0.05, value=defaults.get("mfu", planner.DEFAULT_MFU),
                             description="assumed kernel MFU", style=style),
    }
    out = w.Output()
    info = w.HTML()
    state = {"plan": None, "fig": None}

    def redraw(*_):
        kw = {k: c.value for k, c in ctl.items()}
        try:
            p = planner.plan(**kw)
        except ValueError as e:
            state["plan"] = state["fig"] = None
            info.value = f"<b style='color:#b00'>no plan:</b> {html.escape(str(e))}"
            show_in(out)
            return
        state["plan"] = p
        state["fig"] = plan_bars(p, top=top, height=380)
        rows = "".join(f"<tr><td>{c.rank}</td><td>{html.escape(c.mesh())}</td><td>{c.recompute}</td>"
                       f"<td>{c.peak_bytes_per_gpu / mem.GiB:.1f}</td><td>{c.step_time_s:.4g}</td>"
                       f"<td>{c.predicted_mfu:.1%}</td><td>{html.escape(c.reason)}</td></tr>"
                       for c in p.candidates[:top])
        info.value = (f"<b>PREDICTED</b>: {p.n_enumerated} meshes enumerated, {len(p.candidates)} fit, "
                      f"{html.escape(rejection_words(p.rejection_summary(), len(p.rejected)))}"
                      "<table><tr><th>#</th><th>mesh</th><th>recompute</th><th>peak GiB</th><th>step s</th>"
                      f"<th>MFU</th><th>reason</th></tr>{rows}</table>")
        show_in(out, state["fig"])

    for c in ctl.values():
        c.observe(redraw, names="value")
    redraw()
    box = w.VBox([w.HBox([w.VBox(list(ctl.values())[:4]), w.VBox(list(ctl.values())[4:])]), info, out])
    box.plan = lambda: state["plan"]
    box.figure = lambda: state["fig"]
    return headless(box)


def grid_figure(dims, gpus_per_node: int | None = None, *, title: str | None = None, height: int | None = None):
    """The rank grid of ``dims`` (a :class:`labkit.theory.mesh.ParallelDims`): a row per pipeline stage, a column per
    (dp, cp, tp) position in rank order, each cell labelled with its rank and coloured by node (with
    ``gpus_per_node``; else by dp index); the hover lists the rank's coordinates and its TP / CP / DP / PP
    groups."""
    width = dims.world_size // dims.pp
    groups = {d: {r: g for g in dims.groups(d) for r in g} for d in ("tp", "cp", "dp", "pp")}
    z, text, hover = [], [], []
    for stage in range(dims.pp):
        zr, tr, hr = [], [], []
        ranks = sorted(r for r in range(dims.world_size) if dims.coords(r)["pp"] == stage)
        for r in ranks:
            c = dims.coords(r)
            zr.append(r // gpus_per_node if gpus_per_node else c["dp"])
            tr.append(str(r))
            hr.append(f"rank {r}" + (f", node {r // gpus_per_node}" if gpus_per_node else "") + "<br>"
                      + ", ".join(f"{d}={c[d]}" for d in ("pp", "dp", "cp", "tp")) + "<br>"
                      + "<br>".join(f"{d.upper()} group {groups[d][r]}" for d in ("tp", "cp", "dp", "pp")
                                    if dims.degree(d) > 1))
        z.append(zr)
        text.append(tr)
        hover.append(hr)
    fig = go.Figure(go.Heatmap(z=z, text=text, texttemplate="%{text}", hovertext=hover, hoverinfo="text",
                               colorscale="Teal" if gpus_per_node else "Blues", showscale=False, xgap=3, ygap=3))
    fig.update_layout(title={"text": wrap_title(title or f"Rank grid: {dims} ({'-'.join(dims.order)}, innermost first)"
                                                + (f"; colour = node of {gpus_per_node}" if gpus_per_node
                                                   else "; colour = dp index"), 60), "x": 0.01},
                      xaxis_title="position in the stage (rank order: tp fastest)", yaxis_title="pipeline stage",
                      yaxis={"autorange": "reversed", "dtick": 1}, xaxis={"dtick": 1},
                      height=height or 200 + 60 * dims.pp, width=max(480, 60 * width + 160), margin={"t": 90})
    return fig
