"""Where the lab's folders are: the repository root, data/, notebooks/, runs/.

The root is ``$LABKIT_HOME`` if set, else the folder above the installed ``labkit`` package when it holds
``notebooks/`` or ``data/`` (a source checkout or editable install), else the current directory.
"""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    env = os.environ.get("LABKIT_HOME")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parent.parent
    if (here / "data").is_dir() or (here / "notebooks").is_dir():
        return here
    return Path.cwd()


def data_dir() -> Path:
    return repo_root() / "data"


def notebooks_dir() -> Path:
    return repo_root() / "notebooks"


def runs_dir() -> Path:
    """Where runs write (git-ignored). ``$LABKIT_RUNS`` overrides."""
    env = os.environ.get("LABKIT_RUNS")
    return Path(env).resolve() if env else repo_root() / "runs"
