"""The lab's look, decided in one place: the colour of every label and event kind, readable text (words for
snake_case, titles that wrap, whole-number axes), and the plotly defaults every chapter's figures share.

:mod:`labkit.plots` and :mod:`labkit.widgets` draw with these; importing either installs the defaults
(:func:`install_defaults`). Views only: no torch, no pandas.
"""

from __future__ import annotations

import plotly.graph_objects as go

# ======================================================================================================
# The lab's palette: the one place colours are decided (widgets.py and the chapters use these)
# ======================================================================================================
#: one colour (and line dash) per label kind, the same in every figure of the lab
LABEL_COLORS = {"measured": "#1F77B4", "predicted": "#FF7F0E", "emulated": "#2CA02C", "published": "#9467BD",
                "fit": "#8C564B"}
LABEL_DASH = {"measured": "solid", "predicted": "dash", "emulated": "longdash", "published": "dashdot", "fit": "dot"}

#: one colour per timeline event kind and per common event name; every value distinct
EVENT_COLORS = {
    # kinds (color_by="kind")
    "compute": "#4C78A8", "comm": "#F58518", "idle": "#C7C7C7", "other": "#9D755D",
    # pipeline ops (color_by="name")
    "F": "#1F77B4", "B": "#D62728", "W": "#2CA02C", "send": "#FF7F0E", "recv": "#9467BD",
    # optimizer and common compute names
    "optim": "#8C564B", "optimizer": "#5B3A29", "matmul": "#17BECF", "attention": "#AEC7E8", "work": "#393B79",
    # collectives
    "all_reduce": "#E7BA52", "all_gather": "#31A354", "reduce_scatter": "#E377C2", "all_to_all": "#843C39",
    "broadcast": "#7B4173", "barrier": "#636363",
}
#: colours for names outside EVENT_COLORS, handed out in order of first appearance (none repeats a fixed one)
_FALLBACK = ("#BCBD22", "#FF9896", "#98DF8A", "#C5B0D5", "#C49C94", "#F7B6D2", "#DBDB8D", "#9EDAE5", "#6B6ECF",
             "#B5CF6B", "#CE6DBD", "#AD494A", "#3182BD", "#E6550D")
#: a qualitative sequence for traces that are neither labels nor events (one line per op, per mode, ...)
_PALETTE = ("#1F77B4", "#FF7F0E", "#2CA02C", "#D62728", "#9467BD", "#8C564B", "#E377C2", "#17BECF", "#BCBD22",
            "#7F7F7F")


def _colors(keys) -> dict:
    return {k: _PALETTE[i % len(_PALETTE)] for i, k in enumerate(keys)}


def label_kind(label: str) -> str | None:
    """``"measured"``, ``"predicted"``, ``"emulated"``, ``"published"`` or ``"fit"`` when ``label`` (a trace name
    such as ``"predicted (alpha-beta)"`` or ``"all_reduce n=2 (gloo, measured)"``) says which, else None."""
    text = str(label).lower()
    first = text.split(" ", 1)[0].strip("(),:")
    if first in LABEL_COLORS:
        return first
    hits = [k for k in LABEL_COLORS if f"({k}" in text or f", {k})" in text or f" {k})" in text]
    return hits[0] if len(hits) == 1 else None


def label_color(label: str, default: str = "#444444") -> str:
    """The lab's fixed colour for ``label`` (see :data:`LABEL_COLORS`); ``default`` when it names none."""
    kind = label_kind(label)
    return LABEL_COLORS[kind] if kind else default


def event_colors(keys) -> dict:
    """Colour per timeline key: :data:`EVENT_COLORS` where known, else the next unused fallback colour."""
    out, spare = {}, iter(c for c in _FALLBACK if c not in EVENT_COLORS.values())
    for k in keys:
        out[k] = EVENT_COLORS.get(k) or next(spare, "#7F7F7F")
    return out


def install_defaults() -> None:
    """Make every plotly figure of a session read like the lab's (done once when labkit.plots is imported):
    a ``labkit`` template (left-aligned titles, the lab's colour sequence) added to the default one, and
    plotly express told the lab's colour for each label value (``measured``, ``predicted``, ``emulated``,
    ``published``, ``fit`` and their ``*_bytes`` column names), so ``px.bar(..., color="source")`` gives
    measured and predicted the same colours in every chapter. A caller's own ``color_discrete_map`` still wins."""
    import plotly.express as px
    import plotly.io as pio

    pio.templates["labkit"] = go.layout.Template(layout={"colorway": list(_PALETTE),
                                                         "title": {"x": 0.01, "xanchor": "left"}})
    if "labkit" not in str(pio.templates.default):
        pio.templates.default = f"{pio.templates.default}+labkit"
    px.defaults.color_discrete_map = {**{k: v for k, v in LABEL_COLORS.items()},
                                      **{f"{k}_bytes": v for k, v in LABEL_COLORS.items()},
                                      **{k.capitalize(): v for k, v in LABEL_COLORS.items()}}


# ======================================================================================================
# Readable text: words instead of snake_case, titles that wrap, whole numbers on count axes
# ======================================================================================================
_WORDS = {"busbw": "bus bandwidth", "algbw": "algorithm bandwidth", "mfu": "MFU", "tps": "tokens/s",
          "ttft": "time to first token", "kv": "KV", "dp": "DP", "tp": "TP", "pp": "PP", "cp": "CP", "ep": "EP",
          "gbps": "GB/s", "tflops": "TFLOP/s", "gpu": "GPU", "gpus": "GPUs", "s": "(s)", "ms": "(ms)",
          "ns": "(ns)", "pct": "%", "n": "n", "id": "ID"}


def words(name: str) -> str:
    """``"bubble_fraction"`` -> ``"bubble fraction"``, ``"busbw_gbps"`` -> ``"bus bandwidth GB/s"``: a column or
    key name as words for a reader. Text that is not one snake_case word is returned unchanged."""
    text = str(name)
    if " " in text or "_" not in text:
        return _WORDS.get(text, text)
    return " ".join(_WORDS.get(part, part) for part in text.split("_") if part)


def _find_top_level(text: str, sep: str, start: int) -> int:
    """Index of the first ``sep`` in ``text`` at or after ``start`` that is outside every ``(...)`` / ``[...]``,
    or -1."""
    depth = 0
    for i, ch in enumerate(text):
        if i >= start and depth == 0 and text.startswith(sep, i):
            return i
        if ch in "([":
            depth += 1
        elif ch in ")]" and depth:
            depth -= 1
    return -1


def split_title(text: str, width: int = 72) -> tuple[str, str]:
    """``(title, subtitle)`` of a long title: what follows its first " — ", "; ", ": ", " (" or ", " (past the first
    15 characters, and never inside a parenthesis or bracket: "(line: h100)" stays whole) becomes the subtitle;
    each part is wrapped at word boundaries (``<br>``), the subtitle's "; "-separated parts on lines of their own.
    A title up to ``width`` characters stays whole."""
    import textwrap

    if len(text) <= width or "<br>" in text:
        return text, ""
    head, rest = text, ""
    for sep in (" — ", "; ", ": ", " (", ", "):
        i = _find_top_level(text, sep, 15)
        if 0 < i <= width:
            head, rest = text[:i], text[i + len(sep):] if sep != " (" else text[i + 1:]
            break
    main = "<br>".join(textwrap.wrap(head, width) or [head])
    sub = "<br>".join(ln for part in rest.split("; ") for ln in (textwrap.wrap(part, int(width * 1.2)) or [part]))
    return main, sub


def wrap_title(text: str, width: int = 72) -> str:
    """A title that fits, as one string: :func:`split_title`'s title, then its subtitle in a smaller font on the
    lines below (plotly draws ``<br>``). Key numbers are never cut off."""
    main, sub = split_title(text, width)
    return main + (f"<br><span style='font-size:0.8em'>{sub}</span>" if sub else "")


def _has_subtitle() -> bool:
    return "subtitle" in go.layout.Title()._valid_props


def _layout(fig: go.Figure, title: str | None, *, n_title_lines: int | None = None,
            legend_below: bool = True) -> go.Figure:
    """The lab's layout: a left-aligned wrapped title with room above the plot, a horizontal legend under it."""
    if title is not None:
        main, sub = split_title(title)
        layout = {"x": 0.01, "xanchor": "left", "xref": "container", "y": 0.98, "yanchor": "top",
                  "yref": "container", "automargin": True}
        if sub and _has_subtitle():  # plotly >= 5.24 draws a subtitle under the title, both above the plot
            fig.update_layout(title={"text": main, "subtitle": {"text": sub, "font": {"size": 12}}, **layout})
        else:
            fig.update_layout(title={"text": wrap_title(title), **layout})
        lines = (main + "<br>" + sub).count("<br>") + 1 if sub else main.count("<br>") + 1
        fig.update_layout(margin={"t": 40 + 20 * (n_title_lines or lines)})
    if legend_below:
        fig.update_layout(legend={"orientation": "h", "yanchor": "top", "y": -0.18, "x": 0, "xanchor": "left",
                                  "font": {"size": 11}, "title": {"text": ""}}, margin={"b": 90})
    return fig


def count_axis(fig: go.Figure, axis: str = "x", values=None) -> go.Figure:
    """Make ``axis`` (``"x"`` or ``"y"``) of ``fig`` show whole numbers only: ticks at ``values`` (default: every
    distinct whole value the traces put on that axis, when there are at most 12), else integer tick format."""
    if values is None:
        seen = set()
        for tr in fig.data:
            for v in (getattr(tr, axis, None) or ()):
                if isinstance(v, (int, float)) and float(v).is_integer():
                    seen.add(int(v))
        values = sorted(seen) if 0 < len(seen) <= 12 else None
    upd = {"tickformat": "d"}
    if values is not None:
        upd.update(tickmode="array", tickvals=list(values), ticktext=[str(v) for v in values])
    (fig.update_xaxes if axis == "x" else fig.update_yaxes)(**upd)
    return fig


def tidy(fig: go.Figure) -> go.Figure:
    """Readable text on any figure: snake_case axis titles, legend names and legend titles as words
    (:func:`words`), a long title wrapped (:func:`wrap_title`). Returns ``fig`` (changed in place)."""
    for key in fig.layout:
        if key.startswith(("xaxis", "yaxis")) and fig.layout[key].title.text:
            fig.layout[key].title.text = words(fig.layout[key].title.text)
    for tr in fig.data:
        if tr.name:
            tr.name = words(tr.name)
    if fig.layout.legend.title.text:
        fig.layout.legend.title.text = words(fig.layout.legend.title.text)
    if fig.layout.title.text:
        fig.layout.title.text = wrap_title(fig.layout.title.text)
    return fig
