"""Chapters 01, 06 and 09 in a real browser: JupyterLab (headless, 127.0.0.1) driven by Playwright on Debian's
Chromium, each chapter run with Run > Run All Cells the way a reader does.

Asserted per chapter: every code cell ran and none holds an error; every plotly figure is drawn (an SVG with
at least one trace); every widget is drawn as controls (no "Error displaying widget"). Chapter 01's memory
panel and chapter 09's planner panel each get one control moved, and their output must change. Screenshots
of every figure, widget and table land in ``runs/browser/<chapter>/`` (git-ignored), with a screenshot of
the first screen of each chapter.

Run by ``make test-browser`` (LABKIT_BROWSER=1); skipped with a message when Playwright or Chromium is absent.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
from labserver import CHROMIUM_FLAGS, find_chromium, jupyter_lab

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "runs" / "browser"
CHAPTERS = ["01_memory_budgets.ipynb", "06_pipeline_parallel.ipynb", "09_composing_meshes.ipynb"]
CHAPTER_TIMEOUT_S = 420
PLOTLY = "application/vnd.plotly.v1+json"
ROOTS: dict[str, Path] = {}  # the lab's URL -> the folder it serves
WIDGET = "application/vnd.jupyter.widget-view+json"

playwright_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: "
                                     "pip install -c constraints.txt -e '.[browser]' (make test-browser does)")

_NB = "window.jupyterapp.shell.currentWidget"
_KERNEL_IDLE = (f"() => {{ const nb = window.jupyterapp && {_NB}; const k = nb && nb.sessionContext && "
                "nb.sessionContext.session && nb.sessionContext.session.kernel; return !!k && k.status === 'idle' "
                "&& nb.content && nb.content.widgets.length > 0; }")
_STATE = f"""() => {{
  const nb = {_NB};
  const prompts = [...nb.node.querySelectorAll('.jp-InputPrompt')].map(e => e.textContent || '');
  return {{kernel: nb.sessionContext.session.kernel.status, running: prompts.filter(t => t.includes('*')).length}};
}}"""
_MODEL = f"""() => {{
  const nb = {_NB};
  return nb.content.widgets.map((c, i) => ({{index: i, type: c.model.type,
     count: c.model.type === 'code' ? c.model.executionCount : null,
     outputs: c.model.type === 'code' ? c.model.outputs.toJSON().map(o => ({{type: o.output_type,
       mimes: Object.keys(o.data || {{}}), ename: o.ename || '', evalue: o.evalue || ''}})) : []}}));
}}"""
_PLOTS = """(root) => [...root.querySelectorAll('.js-plotly-plot')].map(el => ({
  svg: el.querySelectorAll('svg.main-svg').length,
  traces: el.querySelectorAll('.scatterlayer .trace, .barlayer .trace, .heatmaplayer image, .hm image, '
                              + '.imagelayer image, .pielayer .trace').length,
  title: (el.querySelector('.gtitle') || {}).textContent || ''}))"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium found (apt-get install -y chromium, or set LABKIT_CHROMIUM): browser test skipped")
    work = tmp_path_factory.mktemp("browser")
    root = work / "root"
    root.mkdir()
    for name in CHAPTERS:  # copies: the lab's autosave must never write outputs into notebooks/
        shutil.copy(ROOT / "notebooks" / name, root / name)
    SHOTS.mkdir(parents=True, exist_ok=True)
    with jupyter_lab(root, work / "settings", log=SHOTS / "jupyterlab.log") as url, \
            playwright_api.sync_playwright() as pw:
        ROOTS[url] = root
        ctx = pw.chromium.launch_persistent_context(str(work / "user-data"), executable_path=chromium, headless=True,
                                                    args=CHROMIUM_FLAGS, viewport=VIEWPORT)
        try:
            yield url, ctx
        finally:
            ctx.close()


def _run_all(page, url: str, name: str) -> float:
    """Open the chapter in a fresh workspace and click Run > Run All Cells, as a reader does; returns when the
    kernel is idle with nothing queued. Falls back to the same command through the app only if the menu click
    did not start anything within 15 s (reported in the test output)."""
    page.goto(f"{url}/lab/tree/{name}?reset")
    page.wait_for_function(_KERNEL_IDLE, timeout=90_000)
    page.wait_for_function(f"() => {_NB}.context && {_NB}.context.path === {name!r}", timeout=30_000)
    page.locator(".jp-Notebook .jp-Cell").first.click()  # focus the notebook, as a reader's first click does
    page.click("li.lm-MenuBar-item:has-text('Run')")
    page.click("li.lm-Menu-item:has-text('Run All Cells')")
    t0 = time.monotonic()
    started = (f"() => [...{_NB}.node.querySelectorAll('.jp-InputPrompt')]"
               ".some(e => (e.textContent || '').includes('*'))")
    try:
        page.wait_for_function(started, timeout=15_000)
    except playwright_api.TimeoutError:
        print(f"{name}: the menu click started nothing in 15 s; running notebook:run-all-cells through the app")
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        page.wait_for_function(started, timeout=15_000)
    quiet = 0
    while quiet < 3:  # idle, with nothing queued, three polls in a row (Run All stops at an error)
        if time.monotonic() - t0 > CHAPTER_TIMEOUT_S:
            raise AssertionError(f"{name}: still running after {CHAPTER_TIMEOUT_S} s")
        st = page.evaluate(_STATE)
        quiet = quiet + 1 if st["kernel"] == "idle" and st["running"] == 0 else 0
        time.sleep(1.0)
    return time.monotonic() - t0


VIEWPORT = {"width": 1280, "height": 860}


def _shot(page, el, path: Path) -> None:
    """A screenshot of one output; the window grows for the shot when the output is taller than it (a
    JupyterLab notebook scrolls inside its panel, so a tall output would otherwise be cut at the panel)."""
    el.scroll_into_view_if_needed()
    box = el.bounding_box() or {"height": 0}
    tall = box["height"] + 250 > VIEWPORT["height"]
    if tall:
        page.set_viewport_size({"width": VIEWPORT["width"], "height": int(box["height"]) + 300})
        el.scroll_into_view_if_needed()
    el.screenshot(path=str(path))
    if tall:
        page.set_viewport_size(VIEWPORT)


def _shoot(page, name: str) -> Path:
    """Screenshots of the first screen and of every figure, widget and table output; returns the folder."""
    folder = SHOTS / Path(name).stem
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    page.evaluate(f"() => {_NB}.content.scrollToItem ? {_NB}.content.scrollToItem(0) : null")
    page.screenshot(path=str(folder / "00_page.png"))
    outputs = page.locator(".jp-Notebook .jp-Cell-outputArea > .jp-OutputArea-child .jp-OutputArea-output")
    k = 0
    for i in range(outputs.count()):
        el = outputs.nth(i)
        kind = el.evaluate("e => e.classList.contains('js-plotly-plot') ? 'figure' : "
                           "(e.querySelector('.jupyter-widgets') ? 'widget' : "
                           "(e.querySelector('table') ? 'table' : ''))")
        if kind:
            k += 1
            _shot(page, el, folder / f"{k:02d}_{kind}.png")
    return folder


def _check_rendered(page, name: str) -> dict:
    cells = page.evaluate(_MODEL)
    code = [c for c in cells if c["type"] == "code"]
    not_run = [c["index"] for c in code if c["count"] is None]
    errors = [(c["index"], o["ename"], o["evalue"][:200]) for c in code for o in c["outputs"] if o["type"] == "error"]
    assert not errors, f"{name}: cell errors {errors}"
    assert not not_run, f"{name}: cells {not_run} never ran"
    n_plotly = sum(PLOTLY in o["mimes"] for c in code for o in c["outputs"])
    n_widgets = sum(WIDGET in o["mimes"] for c in code for o in c["outputs"])
    nb = page.locator(".jp-Notebook").first
    plots = nb.evaluate(_PLOTS)
    assert len(plots) >= n_plotly, f"{name}: {n_plotly} plotly outputs, {len(plots)} drawn"
    empty = [p["title"] or f"figure {i}" for i, p in enumerate(plots) if not p["svg"] or not p["traces"]]
    assert not empty, f"{name}: figures drawn without data: {empty}"
    text = nb.inner_text()
    assert "Error displaying widget" not in text, f"{name}: a widget failed to display"
    views = nb.evaluate("(root) => [...root.querySelectorAll('.jp-OutputArea-output')]"
                        ".filter(e => e.querySelector(':scope > .jupyter-widgets, :scope > .widget-box, "
                        ":scope .jupyter-widgets'))"
                        ".map(e => e.querySelectorAll('input, select, button, .widget-slider, .noUi-handle').length)")
    widget_views = [v for v in views]
    assert len(widget_views) >= n_widgets, f"{name}: {n_widgets} widget outputs, {len(widget_views)} drawn"
    assert all(v > 0 for v in widget_views[:n_widgets]), f"{name}: a widget drawn without controls: {views}"
    return {"plotly": n_plotly, "drawn": len(plots), "widgets": n_widgets}


def _panel_with(page, description: str):
    """The widget output whose panel has a control labelled ``description``."""
    panel = page.locator(".jp-OutputArea-output").filter(
        has=page.locator(".widget-label", has_text=re.compile(rf"^{re.escape(description)}$")))
    assert panel.count() >= 1, f"no widget panel with a control labelled {description!r}"
    return panel.last


def _panel_text(panel) -> str:
    return panel.evaluate("e => e.innerText + ' ' + [...e.querySelectorAll('.gtitle, .xtick, .ytick')]"
                          ".map(t => t.textContent).join(' ')")


def _wait_change(panel, before: str, what: str) -> None:
    deadline = time.monotonic() + 30
    while _panel_text(panel) == before:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: the panel's output did not change within 30 s")
        time.sleep(0.5)


def _move_dropdown(page, description: str, folder: Path, prefer: str | None = None) -> None:
    panel = _panel_with(page, description)
    select = panel.locator(".widget-dropdown", has=page.locator(".widget-label", has_text=description)).locator(
        "select").first
    options = select.evaluate("s => [...s.options].map(o => o.textContent)")
    current = select.evaluate("s => s.options[s.selectedIndex].textContent")
    others = [o for o in options if o != current and o.strip()]
    target = prefer if prefer in others else others[0]
    before = _panel_text(panel)
    select.select_option(label=target)
    _wait_change(panel, before, f"dropdown {description!r}: {current} -> {target}")
    _shot(page, panel, folder / f"moved_{description.replace(' ', '_')}.png")


def _move_slider(page, description: str, folder: Path) -> None:
    panel = _panel_with(page, description)
    slider = panel.locator(".widget-slider", has=page.locator(".widget-label", has_text=description)).first
    handle = slider.locator(".noUi-handle").first
    before = _panel_text(panel)
    handle.focus()
    handle.press("ArrowLeft")
    _wait_change(panel, before, f"slider {description!r}")
    _shot(page, panel, folder / f"moved_{description.replace(' ', '_')}.png")


MOVES = {"01_memory_budgets.ipynb": [(lambda page, d, f: _move_dropdown(page, d, f, prefer="llama-3-8b"), "model")],
         "09_composing_meshes.ipynb": [(_move_slider, "GPUs")]}


@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_runs_and_renders_in_a_browser(lab, name):
    url, ctx = lab
    page = ctx.new_page()
    try:
        seconds = _run_all(page, url, name)
        counts = _check_rendered(page, name)
        folder = _shoot(page, name)
        for move, description in MOVES.get(name, []):
            move(page, description, folder)
        print(f"{name}: ran in {seconds:.0f} s; {counts}; screenshots in {folder}")
    except Exception:
        page.screenshot(path=str(SHOTS / f"{Path(name).stem}_failure.png"))
        raise
    finally:
        try:  # free the kernel (and the ranks it launched) before the next chapter
            page.evaluate(f"() => {_NB} && {_NB}.sessionContext ? {_NB}.sessionContext.shutdown() : null")
        except Exception:  # noqa: BLE001 - a broken page must not hide the test's own error
            pass
        page.close()


GALLERY = [
    "import pandas as pd\nfrom labkit import plots\nfrom labkit.runtime.records import load_published",
    # an overlapped step: each rank's all-reduce runs while it computes (the comm lane shows what is hidden)
    "rows = []\nfor r in range(2):\n"
    "    for name, kind, s, e in [('forward', 'compute', 0, 40), ('backward', 'compute', 40, 120),\n"
    "                             ('all_reduce', 'comm', 60, 130), ('optim', 'other', 130, 140)]:\n"
    "        rows.append(dict(rank=r, name=name, kind=kind, start_ns=(s + 3 * r) * 10**6, end_ns=(e + 3 * r) * 10**6,\n"
    "                         step=0, microbatch=-1, stage=-1, nbytes=0))\n"
    "plots.timeline_figure(pd.DataFrame(rows), title='Overlapped step (synthetic): the all-reduce runs under the "
    "backward pass — its lane shows 50 ms hidden, 10 ms exposed')",
    "sweep = pd.DataFrame({'op': 'all_reduce', 'bytes': [2**k for k in range(10, 27, 2)], 'world_size': 2,\n"
    "                      'backend': 'gloo', 'flag': ''})\n"
    "sweep['busbw_gbps'] = sweep['bytes'] / (2e-4 + sweep['bytes'] / 2e9) / 1e9\n"
    "plots.add_published_busbw(plots.bandwidth_figure(sweep, title='busbw: a laptop (synthetic) beside published "
    "GPU clusters'), ops=['all_reduce'])",
    "plots.published_training_figure(measured=pd.DataFrame({'world_size': [1, 2, 4], 'mfu': [0.21, 0.2, 0.18]}))",
    "plots.wide_table(load_published('training'), ['label', 'model', 'gpus', 'tp', 'pp', 'dp', 'tflops_per_gpu', "
    "'mfu'], caption='Published training runs (key columns; all columns below)')",
]


def test_lab_figures_render_in_a_browser(lab):
    """The lab's own figures on synthetic and published data (the overlap lane, the published overlays, a wide
    table) run and render as a reader sees them."""
    import nbformat

    url, ctx = lab
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in GALLERY]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    name = "lab_figures.ipynb"
    nbformat.write(nb, str(ROOTS[url] / name))
    page = ctx.new_page()
    try:
        _run_all(page, url, name)
        counts = _check_rendered(page, name)
        assert counts["plotly"] == 3 and counts["drawn"] >= 3
        assert page.locator(".jp-OutputArea-output details").count() == 1  # the wide table's full view
        _shoot(page, name)
    except Exception:
        page.screenshot(path=str(SHOTS / "lab_figures_failure.png"))
        raise
    finally:
        page.close()
