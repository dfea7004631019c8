"""Execute the chapter notebooks headless with papermill (behind ``labkit run`` and the notebook tests).

Each chapter runs in its own kernel with a per-cell timeout, so a hung cell or a dead kernel fails that
notebook and the run goes on to the next one. Executed copies land in ``runs/<stamp>/`` (or ``--out``) with
a ``summary.csv`` (notebook, status, seconds, parameters, error).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

from labkit.paths import notebooks_dir, runs_dir

CHAPTER_RE = re.compile(r"^(\d\d)_[A-Za-z0-9_]+\.ipynb$")
DEFAULT_CELL_TIMEOUT_S = 600.0


def discover(chapters: list[str] | None = None, folder: str | Path | None = None) -> list[Path]:
    """Chapter notebooks ``NN_topic.ipynb`` in ``folder`` (default notebooks/), sorted; ``chapters`` keeps
    those whose number is listed, in the order listed, each once ("2" and "02" both name chapter 02).

    Raises ValueError for a chapter that does not exist (listing the ones that do).
    """
    folder = Path(folder) if folder is not None else notebooks_dir()
    found = {CHAPTER_RE.match(p.name).group(1): p for p in sorted(folder.glob("*.ipynb")) if CHAPTER_RE.match(p.name)}
    if not chapters:
        return list(found.values())
    out = []
    for c in chapters:
        key = str(c).strip().zfill(2)
        if key not in found:
            raise ValueError(f"chapter {c!r} not found in {folder}; chapters: {', '.join(found) or 'none'}")
        if found[key] not in out:  # "00,0" would run chapter 00 twice into the same executed copy
            out.append(found[key])
    return out


_PYTHON_LITERALS = {"None": None, "True": True, "False": False}


def _number_or(value):
    """YAML 1.1 reads ``1e12`` and ``5e-3`` (no dot) as strings; an unquoted value that Python reads as a
    number is that number, as it would be in the notebook."""
    if isinstance(value, str):
        try:
            return int(value) if value.strip().lstrip("+-").isdigit() else float(value)
        except ValueError:
            return value
    return value


def parse_parameters(pairs: list[str] | None) -> dict:
    """``["world_size=4", "fast=true"]`` -> ``{"world_size": 4, "fast": True}`` (values read as YAML).

    Unquoted numbers are numbers, ``1e12`` included (YAML 1.1 would read it as a string). The bare Python
    literals ``None``, ``True`` and ``False`` mean what they mean in the notebook (as papermill's own ``-p``
    reads them), so ``-p emulate=None`` turns emulation off like ``-p emulate=null``; quote a value
    (``-p 'x="None"'``) to pass it as a string.

    Raises ValueError for an item without ``=`` or a value that is not valid YAML (naming the parameter).
    """
    params = {}
    for item in pairs or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise ValueError(f"parameter {item!r} must look like name=value (e.g. world_size=4)")
        try:
            if value.strip() in _PYTHON_LITERALS:
                params[name.strip()] = _PYTHON_LITERALS[value.strip()]
            else:
                loaded = yaml.safe_load(value) if value.strip() else ""
                params[name.strip()] = loaded if value.strip()[:1] in ("'", '"') else _number_or(loaded)
        except yaml.YAMLError as e:
            why = " ".join(str(getattr(e, "problem", None) or e).split())
            raise ValueError(f"parameter {name.strip()}: value {value!r} is not valid YAML ({why}); quote it to pass "
                             f"a string, e.g. -p '{name.strip()}=\"...\"'") from None
        except RecursionError:
            raise ValueError(f"parameter {name.strip()}: value is nested too deeply") from None
    return params


def declared_parameters(path: str | Path) -> dict:
    """Names and defaults of the notebook's ``parameters`` cell (papermill.inspect_notebook)."""
    import papermill

    return papermill.inspect_notebook(str(path))


def check_parameters(paths: list[Path], parameters: dict) -> None:
    """Raise ValueError for a parameter that none of ``paths`` declares (a typo would otherwise be ignored
    silently), listing the names they do declare."""
    declared: set[str] = set()
    for p in paths:
        declared |= set(declared_parameters(p))
    unknown = sorted(set(parameters) - declared)
    if unknown:
        raise ValueError(f"parameter(s) {', '.join(unknown)} declared by none of the chosen chapters; "
                         f"they declare: {', '.join(sorted(declared)) or 'nothing'}")


def refused_chapters(paths: list[Path], parameters: dict) -> dict[Path, str]:
    """Run each chapter's own parameter check here, before any kernel starts: the ``ch.check_chapter(name=name,
    ...)`` call of the code cell after its ``parameters`` cell, with the cell's defaults and ``parameters``
    applied as papermill applies them. Returns ``{path: "chapter NN: <its ValueError>"}`` for the chapters
    that refuse (``world_size=3`` where a strategy needs an even one). A chapter whose check is not such a
    call (or needs a value computed in the notebook) is left to its first cell."""
    import ast
    import importlib

    import nbformat

    refused: dict[Path, str] = {}

    for path in paths:
        cells = nbformat.read(str(path), as_version=4).cells
        at = next((i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", [])), None)
        first = next((c for c in cells[at + 1:] if c.cell_type == "code"), None) if at is not None else None
        if first is None:
            continue
        try:
            tree = ast.parse(first.source)
        except SyntaxError:
            continue
        modules = {a.asname or a.name: f"labkit.chapters.{a.name}" for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and node.module == "labkit.chapters" for a in node.names}
        call = next((n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     and n.func.attr == "check_chapter" and isinstance(n.func.value, ast.Name)
                     and n.func.value.id in modules), None)
        if call is None or call.args or not all(isinstance(k.value, (ast.Name, ast.Constant)) for k in call.keywords):
            continue
        names: dict = {}
        exec(compile(cells[at].source, str(path), "exec"), {}, names)  # the chapter's own defaults cell
        names.update({k: v for k, v in parameters.items() if k in names})
        if not all(isinstance(k.value, ast.Constant) or k.value.id in names for k in call.keywords):
            continue
        kwargs = {k.arg: k.value.value if isinstance(k.value, ast.Constant) else names[k.value.id]
                  for k in call.keywords}
        try:
            importlib.import_module(modules[call.func.value.id]).check_chapter(**kwargs)
        except ValueError as e:
            why, nn = (str(e).splitlines() or [type(e).__name__])[0], f"chapter {path.name[:2]}"
            refused[path] = why if why.startswith(nn) else f"{nn}: {why}"
    return refused


def run_notebook(path: str | Path, output: str | Path, parameters: dict | None = None,
                 cell_timeout_s: float = DEFAULT_CELL_TIMEOUT_S, kernel_name: str = "python3",
                 kernel_manager_class=None) -> dict:
    """Execute one notebook; return a summary row (never raises for a failing notebook).

    Only the ``parameters`` the notebook declares are passed to it. Status is ``ok``, ``failed`` (a cell
    raised: its error is in ``error``), or ``timeout`` (a cell exceeded ``cell_timeout_s``, or the kernel
    died). ``kernel_manager_class``: jupyter_client's manager for its kernel (what
    ``runtime.kernels.kernel_template()`` yields: a kernel forked from the template), default a fresh kernel.
    """
    import papermill
    from papermill.exceptions import PapermillExecutionError

    path, output = Path(path), Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    declared = declared_parameters(path)
    applied = {k: v for k, v in (parameters or {}).items() if k in declared}
    t0 = time.perf_counter()
    status, error = "ok", ""
    try:
        papermill.execute_notebook(str(path), str(output), parameters=applied, kernel_name=kernel_name,
                                   execution_timeout=cell_timeout_s, cwd=str(path.parent), progress_bar=False,
                                   log_output=False,
                                   # kernel chatter is noise here: ipykernel 7's TCP warning at start-up, and
                                   # "KeyboardInterrupt caught in kernel" when jupyter_client interrupts the
                                   # kernel before every shutdown; a cell's errors reach its outputs anyway
                                   extra_arguments=["--IPKernelApp.log_level=CRITICAL"],
                                   **({"kernel_manager_class": kernel_manager_class} if kernel_manager_class else {}))
    except PapermillExecutionError as e:
        status = "failed"
        error = f"cell {e.exec_count}: {e.ename}: {e.evalue}".strip()
    except Exception as e:  # noqa: BLE001 - timeouts, dead kernels: any failure fails this notebook only
        name = type(e).__name__
        status = "timeout" if "Timeout" in name or "DeadKernel" in name else "failed"
        error = f"{name}: {e}".splitlines()[0]
        cell = last_started_cell(output) if output.exists() else None
        if cell is not None:
            index, first = cell
            what = (f"did not finish within the {cell_timeout_s:g} s cell timeout" if "Timeout" in name
                    else f"was running when the kernel died ({name})" if "DeadKernel" in name else f"failed ({name})")
            error = f"cell {index} ({first!r}) {what}"
            mark_cell_failed(output, index, name, error)
    if output.exists():
        relink(output, path.parent)
    if status == "ok":
        stalled = stalled_cells(output, cell_timeout_s)
        if stalled:
            # nbclient can miss a reply and wait out the whole cell timeout, then carry on as if nothing
            # happened (jupyter/nbclient#312): a cell that lasted the timeout did not really succeed
            status = "timeout"
            firsts = {i: _first_line(output, i) for i in stalled}
            error = (f"cell(s) {', '.join(f'{i} ({firsts[i]!r})' for i in stalled)} ran for the whole "
                     f"{cell_timeout_s:g} s cell timeout (stalled)")
            for i in stalled:
                mark_cell_failed(output, i, "CellTimeoutError", error)
    return {"notebook": path.name, "status": status, "seconds": round(time.perf_counter() - t0, 1),
            "parameters": applied, "error": error, "output": str(output)}


_LINK = re.compile(r"\]\((?!https?:|#|/|mailto:)([^)\s#]+)(#[^)\s]*)?\)")


def rewrite_links(notebook: str | Path, new_target) -> int:
    """Rewrite the relative links in a notebook's markdown: ``new_target(link) -> str | None`` gives the new
    target of each (None keeps it). Web links and ``#anchors`` are never touched. Returns how many changed."""
    import nbformat

    nb = nbformat.read(str(notebook), as_version=4)
    changed = 0

    def repl(m):
        nonlocal changed
        new = new_target(m.group(1))
        if new is None or new == m.group(1):
            return m.group(0)
        changed += 1
        return f"]({new}{m.group(2) or ''})"

    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = _LINK.sub(repl, cell.source)
    if changed:
        nbformat.write(nb, str(notebook))
    return changed


def relink(executed: str | Path, source_dir: str | Path) -> int:
    """Point the relative links of an executed notebook's markdown ("Code in this chapter": ``../labkit/...``)
    at the files they named from ``source_dir``, relative to where the executed copy lies (runs/<stamp>/), so
    they keep working there. A link whose file does not exist is left as it is. Returns how many changed."""
    executed, source_dir = Path(executed), Path(source_dir).resolve()

    def new_target(link: str) -> str | None:
        target = (source_dir / link).resolve()
        return os.path.relpath(target, executed.parent.resolve()).replace(os.sep, "/") if target.exists() else None

    return rewrite_links(executed, new_target)


def _first_line(executed: str | Path, index: int) -> str:
    import nbformat

    nb = nbformat.read(str(executed), as_version=4)
    return next((ln.strip() for ln in nb.cells[index].source.splitlines() if ln.strip()), "")


def last_started_cell(executed: str | Path) -> tuple[int, str] | None:
    """``(index, first line)`` of the last code cell papermill started in an executed notebook — the one that
    was running when execution stopped (a cell timeout, a dead kernel) — or None."""
    import nbformat

    try:
        nb = nbformat.read(str(executed), as_version=4)
    except Exception:  # noqa: BLE001 - an unreadable output: nothing to name
        return None
    found = None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and cell.get("metadata", {}).get("papermill", {}).get("start_time"):
            found = i
    if found is None:
        return None
    first = next((ln.strip() for ln in nb.cells[found].source.splitlines() if ln.strip()), "")
    return found, first


def mark_cell_failed(executed: str | Path, index: int, ename: str, evalue: str) -> None:
    """Mark cell ``index`` of an executed notebook failed (papermill marks a timed-out cell "completed"): its
    papermill status and exception flag, the notebook's exception flag, and an error output saying why."""
    import nbformat

    nb = nbformat.read(str(executed), as_version=4)
    cell = nb.cells[index]
    meta = cell.setdefault("metadata", {}).setdefault("papermill", {})
    meta["status"] = "failed"
    meta["exception"] = True
    nb.metadata.setdefault("papermill", {})["exception"] = True
    for later in nb.cells[index + 1:]:  # cells after it never ran
        pm = later.get("metadata", {}).get("papermill")
        if pm is not None and pm.get("status") == "completed" and not pm.get("start_time"):
            pm["status"] = "pending"
    if cell.cell_type == "code":
        cell.outputs.append(nbformat.v4.new_output("error", ename=ename, evalue=evalue,
                                                   traceback=[f"{ename}: {evalue}"]))
    nbformat.write(nb, str(executed))


def stalled_cells(executed: str | Path, cell_timeout_s: float, margin_s: float = 0.5) -> list[int]:
    """Indices of code cells of an executed notebook whose papermill duration reached the cell timeout
    (within ``margin_s``)."""
    import nbformat

    nb = nbformat.read(str(executed), as_version=4)
    out = []
    for i, cell in enumerate(nb.cells):
        duration = cell.get("metadata", {}).get("papermill", {}).get("duration")
        if cell.cell_type == "code" and duration is not None and duration >= cell_timeout_s - margin_s:
            out.append(i)
    return out


def check_kernel(kernel_name: str) -> None:
    """Raise ValueError unless ``kernel_name`` is an installed Jupyter kernel (listing the installed ones)."""
    from jupyter_client.kernelspec import KernelSpecManager

    names = sorted(KernelSpecManager().find_kernel_specs())
    if kernel_name not in names:
        raise ValueError(f"kernel={kernel_name!r} is not an installed Jupyter kernel; installed: {', '.join(names)}")


def run_chapters(chapters: list[str] | None = None, out: str | Path | None = None, parameters: dict | None = None,
                 cell_timeout_s: float = DEFAULT_CELL_TIMEOUT_S, kernel_name: str = "python3",
                 progress: bool = True, refused: dict | None = None) -> pd.DataFrame:
    """Execute chapters into ``out`` (default ``runs/<UTC stamp>/``); finish all even when one fails.
    ``refused`` (:func:`refused_chapters`): chapters not run, listed with status ``refused`` and the reason.

    Returns the summary DataFrame (also written to ``out/summary.csv``).
    """
    from tqdm.auto import tqdm

    from labkit.runtime.kernels import kernel_template

    paths = discover(chapters)
    if not paths:
        raise ValueError(f"no chapter notebooks found in {notebooks_dir()}")
    check_kernel(kernel_name)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(out) if out is not None else runs_dir() / stamp
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    bar = tqdm(paths, desc="chapters", unit="nb", disable=not progress, file=sys.stderr)
    refused = refused or {}
    todo = [p for p in paths if p not in refused]
    # each chapter's kernel is forked from one that imported torch & co once (none to start for no chapter)
    with kernel_template() if todo else contextlib.nullcontext() as manager:
        for p in bar:
            bar.set_postfix_str(p.name)
            if p in refused:
                rows.append({"notebook": p.name, "status": "refused", "seconds": 0.0, "parameters": {},
                             "error": refused[p], "output": ""})
                continue
            rows.append(run_notebook(p, out / p.name, parameters, cell_timeout_s, kernel_name, manager))
    df = pd.DataFrame(rows, columns=["notebook", "status", "seconds", "parameters", "error", "output"])
    df.to_csv(out / "summary.csv", index=False)
    return df
