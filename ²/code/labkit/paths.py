"""Where the lab's folders are: data/, notebooks/ and runs/ — the one place that decides.

The lab's *home* is the first of

1. ``$LABKIT_HOME`` (a folder holding ``data/`` and ``notebooks/``), when set;
2. a lab folder written by ``labkit notebooks DEST`` (it holds :data:`HOME_MARKER`): the current directory or
   the nearest folder above it that has the marker, so a kernel started in ``DEST/notebooks/`` finds it too;
3. the source checkout the package was imported from (the folder above ``labkit/`` holds ``data/`` or
   ``notebooks/``: a clone or an editable install);
4. none: an installed wheel. ``data/`` and ``notebooks/`` are then the copies shipped inside the package
   (``labkit/_data``, ``labkit/_notebooks``, found with :mod:`importlib.resources`; see setup.py), and runs go
   to ``./runs`` in the current directory.

``$LABKIT_RUNS`` overrides where runs are written in every case.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

#: the file ``labkit notebooks DEST`` writes into DEST; its presence makes DEST a lab home
HOME_MARKER = "labkit-home.json"
_PACKAGED = {"data": "_data", "notebooks": "_notebooks", "docs": "_docs", "examples": "_examples"}


def _checkout() -> Path | None:
    here = Path(__file__).resolve().parent.parent
    return here if (here / "data").is_dir() or (here / "notebooks").is_dir() else None


def _marked_home(start: Path | None = None) -> Path | None:
    start = (start or Path.cwd()).resolve()
    for d in (start, *start.parents):
        if (d / HOME_MARKER).is_file():
            return d
    return None


def home() -> tuple[Path | None, str]:
    """``(folder, how)``: the lab home and which rule chose it (``"LABKIT_HOME"``, ``"lab folder"``,
    ``"source checkout"``), or ``(None, "installed package")`` when the package's own copies are used."""
    env = os.environ.get("LABKIT_HOME")
    if env:
        return Path(env).resolve(), "LABKIT_HOME"
    marked = _marked_home()
    if marked is not None:
        return marked, "lab folder"
    checkout = _checkout()
    if checkout is not None:
        return checkout, "source checkout"
    return None, "installed package"


def repo_root() -> Path:
    """The lab home's folder; with an installed package and no home, the current directory."""
    root, _ = home()
    return root if root is not None else Path.cwd()


def packaged(name: str) -> Path:
    """The copy of ``data``, ``notebooks``, ``docs`` or ``examples`` shipped inside the installed package (a
    folder on disk; a zip-imported labkit is not supported). Raises ValueError for another name."""
    if name not in _PACKAGED:
        raise ValueError(f"name={name!r} is not a packaged folder; valid: {', '.join(_PACKAGED)}")
    return Path(str(resources.files("labkit") / _PACKAGED[name]))


def _folder(name: str) -> Path:
    root, _ = home()
    return root / name if root is not None else packaged(name)


def data_dir() -> Path:
    """``<home>/data``, or the package's ``labkit/_data`` when there is no home."""
    return _folder("data")


def notebooks_dir() -> Path:
    """``<home>/notebooks``, or the package's ``labkit/_notebooks`` when there is no home."""
    return _folder("notebooks")


def guide_dir(name: str) -> Path:
    """``<home>/<name>`` for ``docs`` (the guides the chapters link to) or ``examples`` (multi-node scripts) when
    the home has one (a checkout; a lab folder written by ``labkit notebooks``), else the package's copy."""
    root, _ = home()
    return root / name if root is not None and (root / name).is_dir() else packaged(name)


def runs_dir() -> Path:
    """Where runs write (git-ignored): ``$LABKIT_RUNS``, else ``<home>/runs`` (``./runs`` with no home)."""
    env = os.environ.get("LABKIT_RUNS")
    return Path(env).resolve() if env else repo_root() / "runs"


def describe() -> str:
    """One line: which home is used and why, and where data/, notebooks/ and runs/ are."""
    root, how = home()
    return (f"labkit home: {root if root is not None else '(none)'} ({how}); data {data_dir()}, "
            f"notebooks {notebooks_dir()}, runs {runs_dir()}")
