"""The ipywidgets panels never capture output into an ``ipywidgets.Output``.

Capturing (``with out:`` / ``out.clear_output``) makes a headless runner (nbclient under papermill) mimic the
frontend and send ``comm_msg`` on the shell channel while it waits there for the cell's ``execute_reply``;
the wake-up can be lost and the cell then waits for the full cell timeout (jupyter/nbclient#312; tester
report item 1). The panels set ``Output.outputs`` from the kernel instead.
"""

from __future__ import annotations

import os

import pytest

ipywidgets = pytest.importorskip("ipywidgets")

PLOTLY_MIME = "application/vnd.plotly.v1+json"


@pytest.fixture
def no_capture(monkeypatch):
    """Any capture into an Output widget fails the test."""

    def refuse(*_a, **_k):
        raise AssertionError("a panel captured output into its ipywidgets.Output (with out: / out.clear_output)")

    monkeypatch.setattr(ipywidgets.Output, "__enter__", refuse)
    monkeypatch.setattr(ipywidgets.Output, "clear_output", refuse)


def _controls(panel):
    return {c.description: c for box in panel.children[0].children for c in box.children}


def _shown(panel) -> list[dict]:
    out = panel.children[-1]
    assert isinstance(out, ipywidgets.Output)
    return list(out.outputs)


def test_memory_panel_fills_its_output_without_capturing(no_capture):
    from labkit.widgets import memory_panel

    panel = memory_panel("llama-3-8b", dp=8, tp=1)
    shown = _shown(panel)
    assert len(shown) == 1 and PLOTLY_MIME in shown[0]["data"] and shown[0]["output_type"] == "display_data"
    ctl = _controls(panel)
    ctl["tp"].value = 2  # a redraw replaces the figure, it does not append
    assert len(_shown(panel)) == 1
    ctl["tp"].value = 64  # invalid: the Output is emptied and the message shown
    assert _shown(panel) == [] and panel.estimate() is None
    assert "tp=64 does not divide n_heads=32" in panel.children[1].value
    ctl["tp"].value = 1
    assert len(_shown(panel)) == 1


def test_planner_panel_fills_its_output_without_capturing(no_capture):
    from labkit.widgets import planner_panel

    panel = planner_panel("llama-3-70b", gpus=1024)
    assert len(_shown(panel)) == 1 and PLOTLY_MIME in _shown(panel)[0]["data"]
    _controls(panel)["GPUs"].value = 1  # 70B on one GPU: no plan, the Output empties
    assert _shown(panel) == [] and panel.plan() is None


def test_mime_bundle_of_a_figure_and_of_anything_else():
    import plotly.graph_objects as go

    from labkit.widgets import mime_bundle

    assert PLOTLY_MIME in mime_bundle(go.Figure(go.Bar(x=[1], y=[2])))
    assert mime_bundle(3) == {"text/plain": "3"}


@pytest.mark.slow
def test_panels_under_nbclient_register_no_output_hook(tmp_path):
    """Executed headless (nbclient, as papermill does), the panels' Output widgets never ask the runner to
    capture (no output hook registered: the path that sends on the shell channel), and the executed notebook's
    widget state holds the figures."""
    import nbformat
    from nbclient import NotebookClient

    from labkit.paths import repo_root

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "from labkit import widgets",
        "panel = widgets.memory_panel('llama-3-70b', dp=8, tp=8, zero=1, seq_len=8192, sequence_parallel=True)\n"
        "panel",
        "[setattr(c, 'value', v) for c, v in ((panel.children[0].children[0].children[2], 4),"
        " (panel.children[0].children[0].children[3], 2))]",
        "widgets.planner_panel('llama-3-70b', gpus=1024)",
    )]
    hooks = []

    class Client(NotebookClient):
        def register_output_hook(self, msg_id, hook):
            hooks.append(msg_id)
            super().register_output_hook(msg_id, hook)

    client = Client(nb, timeout=120, kernel_name="python3",
                    resources={"metadata": {"path": str(repo_root())}})
    client.execute(env={**os.environ, "PYTHONPATH": str(repo_root())})
    assert hooks == [], "a panel captured output (the path that can stall nbclient until the cell timeout)"
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    outs = [m["state"].get("outputs", []) for m in state.values() if m["model_name"] == "OutputModel"]
    assert len(outs) == 2 and all(len(o) == 1 and PLOTLY_MIME in o[0]["data"] for o in outs)


def test_panels_display_as_their_figure_where_no_widget_frontend_runs():
    """A headless run (papermill, labkit run) printed 'VBox(children=(HBox(...' for every panel: its display
    data now carries the current figure beside the widget view, and no repr text."""
    from labkit import widgets

    panel = widgets.memory_panel("llama-3-8b", device="h100-80gb", dp=8, tp=1)
    data = panel._repr_mimebundle_()
    data = data[0] if isinstance(data, tuple) else data
    assert data["text/plain"] == "" and "VBox" not in str(data.get("text/plain"))
    assert "application/vnd.jupyter.widget-view+json" in data
    assert "application/vnd.plotly.v1+json" in data or "text/html" in data, sorted(data)
