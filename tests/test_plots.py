"""Readable figures: sizes, legends, colours, words and the published overlays (labkit.plots, labkit.style)."""

from __future__ import annotations

import re

import pandas as pd
import plotly.graph_objects as go
import pytest

from labkit import plots, style

SNAKE = re.compile(r"\b[a-z]+_[a-z_]+\b")


def _timeline(ranks=2, overlap=True):
    rows = []
    for r in range(ranks):
        comm = (5, 15) if overlap else (10, 20)
        for name, kind, (s, e), mb in [("F", "compute", (0, 10), 0), ("all_reduce", "comm", comm, -1),
                                       ("B", "compute", (20, 30), 0), ("recv", "comm", (30, 32), 0),
                                       ("idle", "idle", (32, 34), -1), ("optim", "other", (34, 36), -1)]:
            rows.append(dict(rank=r, name=name, kind=kind, start_ns=s * 10**6, end_ns=e * 10**6, step=0,
                             microbatch=mb, stage=r, nbytes=0))
    return pd.DataFrame(rows)


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_timeline_is_tall_enough_with_a_horizontal_legend_of_every_key(ranks):
    fig = plots.timeline_figure(_timeline(ranks, overlap=False), color_by="name")
    assert fig.layout.height >= 300 + 40 * ranks
    assert fig.layout.legend.orientation == "h"
    names = [t.name for t in fig.data]
    assert sorted(names) == sorted({"F", "B", "all reduce", "recv", "idle", "optim"})
    colors = [t.marker.color for t in fig.data]
    assert len(set(colors)) == len(colors), "every event name needs its own colour"


def test_overlapped_communication_gets_its_own_lane():
    fig = plots.timeline_figure(_timeline(2, overlap=True))
    lanes = list(fig.layout.yaxis.categoryarray)
    assert lanes == ["rank 1 · comm", "rank 1", "rank 0 · comm", "rank 0"]
    comm = next(t for t in fig.data if t.name == "comm")
    assert set(comm.y) == {"rank 0 · comm", "rank 1 · comm"}  # both comm events of a rank that overlaps
    assert fig.layout.height >= 300 + 40 * 4
    serial = plots.timeline_figure(_timeline(2, overlap=False))
    assert list(serial.layout.yaxis.categoryarray) == ["rank 1", "rank 0"]


def test_every_fixed_colour_is_distinct():
    for palette in (style.EVENT_COLORS, style.LABEL_COLORS):
        assert len(set(palette.values())) == len(palette)
    assert not set(style._FALLBACK) & set(style.EVENT_COLORS.values())
    got = style.event_colors(["F", "mystery", "other_thing", "B"])
    assert len(set(got.values())) == 4


@pytest.mark.parametrize("label, kind", [
    ("measured", "measured"), ("predicted (alpha-beta)", "predicted"),
    ("emulated (h100-ib, as llama-3-70b)", "emulated"),
    ("published (nccl-tests#290)", "published"), ("fit", "fit"), ("all_reduce n=2 (gloo, measured)", "measured"),
    ("ideal n/n0 (predicted)", "predicted"), ("compute", None)])
def test_one_colour_per_label_kind(label, kind):
    assert style.label_kind(label) == kind
    assert style.label_color(label) == (style.LABEL_COLORS[kind] if kind else "#444444")


def test_plotly_express_uses_the_label_colours():
    import plotly.express as px

    df = pd.DataFrame({"x": ["a", "a"], "y": [1, 2], "source": ["predicted", "measured"]})
    fig = px.bar(df, x="x", y="y", color="source")
    assert {t.name: t.marker.color for t in fig.data} == {"predicted": style.LABEL_COLORS["predicted"],
                                                         "measured": style.LABEL_COLORS["measured"]}


def test_long_titles_wrap_and_keep_their_numbers():
    title = "1f1b pp=2 m=4 — measured (fixed compute, 20 ms per op); bubble 0.2143 of the step, simulated 0.2000"
    text = style.wrap_title(title, width=60)
    assert "<br>" in text and "0.2143" in text and "0.2000" in text
    assert max(len(re.sub("<[^>]+>", "", line)) for line in text.split("<br>")) <= 72
    assert style.wrap_title("short") == "short"
    fig = plots.timeline_figure(_timeline(2), title=title)
    shown = fig.layout.title.text + str(fig.layout.title.subtitle.text or "")
    assert "0.2143" in shown and "0.2000" in shown and fig.layout.margin.t >= 60
    assert fig.layout.title.automargin and len(fig.layout.title.text) <= 72


def test_words_and_tidy_remove_snake_case():
    assert style.words("bubble_fraction") == "bubble fraction"
    assert style.words("busbw_gbps") == "bus bandwidth GB/s"
    assert style.words("step time (s)") == "step time (s)"
    fig = go.Figure(go.Scatter(x=[1, 2], y=[0.1, 0.2], name="bubble_measured"))
    fig.update_layout(xaxis_title="n_microbatches", yaxis_title="bubble_fraction", legend_title="kind_of_run")
    style.tidy(fig)
    texts = [fig.layout.xaxis.title.text, fig.layout.yaxis.title.text, fig.data[0].name, fig.layout.legend.title.text]
    assert not [t for t in texts if SNAKE.search(t)], texts


def test_count_axis_ticks_whole_numbers_only():
    fig = go.Figure(go.Scatter(x=[2, 4, 8], y=[0.3, 0.2, 0.1]))
    fig.update_xaxes(type="log")
    style.count_axis(fig, "x")
    assert list(fig.layout.xaxis.tickvals) == [2, 4, 8] and fig.layout.xaxis.tickformat == "d"


def test_published_busbw_overlay():
    sweep = pd.DataFrame({"op": ["all_reduce"] * 2, "bytes": [2**20, 2**22], "busbw_gbps": [1.0, 2.0],
                          "world_size": [2, 2], "backend": ["gloo"] * 2, "flag": ["", ""]})
    fig = plots.bandwidth_figure(sweep)
    n = len(fig.data)
    plots.add_published_busbw(fig, ops=["all_reduce"])
    added = fig.data[n:]
    assert added and all(t.name.startswith("published (") for t in added)
    assert {t.line.color for t in added} == {style.LABEL_COLORS["published"]}
    assert any("peak, size not stated" in t.name for t in added), "figures given without a size get a level mark"
    assert not SNAKE.search(fig.data[0].name)  # "all reduce n=2 (gloo, measured)"
    with pytest.raises(ValueError, match="no published busbw rows"):
        plots.add_published_busbw(go.Figure(), ops=["scatter"])


def test_published_training_figure_beside_measured():
    measured = pd.DataFrame({"world_size": [1, 2, 4], "mfu": [0.2, 0.19, 0.17]})
    fig = plots.published_training_figure(measured=measured)
    names = [t.name for t in fig.data]
    assert any(n.startswith("published (Llama 3") for n in names) and "measured (this machine)" in names
    pub = [t for t in fig.data if t.name.startswith("published")]
    assert all(t.marker.color == style.LABEL_COLORS["published"] for t in pub)
    assert fig.layout.xaxis.type == "log" and fig.layout.legend.orientation == "h"
    with pytest.raises(ValueError, match="valid: mfu, tflops_per_gpu"):
        plots.add_published_training(go.Figure(), y="speed")


def test_wide_table_shows_key_columns_and_keeps_the_rest():
    df = pd.DataFrame({f"col_{i}": range(3) for i in range(20)})
    t = plots.wide_table(df, ["col_0", "col_5"], caption="big")
    assert list(t.brief.columns) == ["col_0", "col_5"] and t.full is df
    html = t._repr_html_()
    assert "<details>" in html and "all 20 columns" in html and "col 5" in html
    assert "more columns: .full" in repr(t)
    assert list(plots.wide_table(df).brief.columns) == [f"col_{i}" for i in range(7)]
    with pytest.raises(ValueError, match="not columns"):
        plots.wide_table(df, ["nope"])


def test_planner_rejections_in_words():
    from labkit.widgets import rejection_words

    text = rejection_words({"pp_layers": 56, "memory": 44}, 90)
    assert text.startswith("90 rejected: 56 break '") and "44 do not fit in memory" in text
    assert "{" not in text and "pp_layers" not in text
    assert rejection_words({}, 0) == "0 rejected"


def test_memory_bars_name_categories_in_words():
    from labkit.widgets import memory_bars

    fig = memory_bars({"a": {"parameters": 2**30, "kv_cache": 2**30}}, title="x")
    assert [t.name for t in fig.data] == ["parameters", "KV cache"]


def test_split_title_never_splits_inside_a_parenthesis():
    main, sub = style.split_title("Predicted training memory per GPU, llama-3-70b, seq 8192 (line: h100-80gb)")
    assert "(line: h100-80gb)" in sub and main.count("(") == main.count(")")
    main, sub = style.split_title("A title long enough to split [a: b] with more words after it: the subtitle here")
    assert main.count("[") == main.count("]") and sub.startswith("the subtitle")
