"""Ranks never import code from the working directory.

``python -m mod`` and ``python -c`` put the current directory first on ``sys.path``, so a file named like a
module the ranks import (``cloudpickle.py``, ``torch.py``, ``json.py``) in the folder where a notebook or
``labkit doctor`` runs would run inside every rank. What labkit does instead (tests/test_hardening.py):

* ranks and the launch supervisor start as ``python -P -c BOOT`` (``-P``: no script or working directory on
  ``sys.path``, Python >= 3.11; on 3.10 the bootstrap deletes the entry itself before importing anything) in
  the launch's private temporary folder; the bootstrap imports ``labkit`` from the very folder the caller
  imported it from (not through ``sys.path``), and the rank then changes to the caller's working directory, so
  relative file paths in a rank function mean what they mean in the caller;
* the caller's ``sys.path`` travels to the ranks without ``''``, ``'.'`` and the working directory;
* a module the caller imported from its working directory (a helper file next to the notebook) is shipped
  **by value** with the function (``cloudpickle.register_pickle_by_value``), so a function defined in it still
  runs in the ranks without putting the working directory on their path (:func:`cwd_modules`);
* ``torchrun -m labkit.runtime.worker`` (torchrun starts ranks as ``python -m``) and ``python -m labkit``
  re-execute themselves with ``-P`` before importing anything else (:func:`reexec_without_cwd`). Under
  torchrun a ``MODULE:FUNCTION`` from your own folder is therefore found only through ``PYTHONPATH`` — set it
  explicitly (``PYTHONPATH=$PWD torchrun ...``).

Only ``os`` and ``sys`` at module level: :func:`reexec_without_cwd` runs before anything else is imported.
"""

from __future__ import annotations

import os
import sys

_CWD_MARKERS = ("", ".")


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.realpath(a or ".") == os.path.realpath(b)
    except (OSError, ValueError):
        return False


def is_cwd_entry(entry: str, cwd: str | None = None) -> bool:
    """True for a ``sys.path`` entry that means the working directory: ``''``, ``'.'`` or its absolute path."""
    cwd = os.getcwd() if cwd is None else cwd
    return entry in _CWD_MARKERS or _same_dir(entry, cwd)


def shipped_sys_path(path: list[str] | None = None, cwd: str | None = None) -> list[str]:
    """The caller's ``sys.path`` as ranks get it: without the working directory in any spelling."""
    cwd = os.getcwd() if cwd is None else cwd
    return [p for p in (sys.path if path is None else path) if isinstance(p, str) and not is_cwd_entry(p, cwd)]


def rank_pythonpath(value: str | None, cwd: str | None = None) -> str | None:
    """``PYTHONPATH`` for ranks: the caller's, minus entries that mean its working directory."""
    if not value:
        return None
    kept = [p for p in value.split(os.pathsep) if p and not is_cwd_entry(p, cwd)]
    return os.pathsep.join(kept) or None


def labkit_dir() -> str:
    """The folder of the ``labkit`` package this process imported."""
    import labkit

    return os.path.dirname(os.path.abspath(labkit.__file__))


def boot_argv(module: str, function: str, args: list[str]) -> list[str]:
    """``[python, -P, -c, BOOT]``: a fresh interpreter that imports ``labkit`` from :func:`labkit_dir` (never
    through ``sys.path``), then calls ``module.function(args)`` and exits with its status (``os._exit``: a stuck
    non-daemon thread or a collective's destructor must not keep a finished process alive)."""
    pkg = labkit_dir()
    boot = (
        "import sys\n"
        "if sys.path and sys.path[0] in ('', '.'): del sys.path[0]\n"  # Python 3.10: no -P
        "import importlib.util as u, os\n"
        f"s = u.spec_from_file_location('labkit', {os.path.join(pkg, '__init__.py')!r}, "
        f"submodule_search_locations=[{pkg!r}])\n"
        "m = u.module_from_spec(s); sys.modules['labkit'] = m; s.loader.exec_module(m)\n"
        f"from {module} import {function} as f\n"
        f"c = f({list(args)!r})\n"
        "sys.stdout.flush(); sys.stderr.flush(); os._exit(c)\n"
    )
    flags = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *flags, "-c", boot]


def reexec_without_cwd(module: str) -> None:
    """Called first thing by a module run as ``python -m module``: when the working directory is on
    ``sys.path`` (no ``-P``), re-execute the same command with ``-P`` (same process id: torchrun keeps tracking
    it). On Python 3.10, which has no ``-P``, drop the entry instead."""
    if getattr(sys.flags, "safe_path", False):
        return
    if not (sys.path and is_cwd_entry(sys.path[0])):
        return
    if sys.version_info >= (3, 11):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-P", "-m", module, *sys.argv[1:]])
    del sys.path[0]


def cwd_modules(kept_path: list[str], cwd: str | None = None) -> list:
    """Top-level modules this process imported from its working directory (e.g. ``helpers.py`` next to the
    notebook), which ranks cannot import because the directory is not on their path: ship them by value.
    ``labkit`` itself is never among them (ranks import it from its own folder)."""
    cwd = os.path.realpath(os.getcwd() if cwd is None else cwd)
    if not any(is_cwd_entry(p, cwd) for p in sys.path):
        return []  # nothing was importable from the working directory in the first place
    kept = {os.path.realpath(p) for p in kept_path if p}
    if cwd in kept:
        return []
    out = []
    for name, mod in list(sys.modules.items()):
        if "." in name or name in ("__main__", "labkit") or mod is None:
            continue
        f = getattr(mod, "__file__", None)
        if not f:
            continue
        f = os.path.realpath(f)
        top = os.path.dirname(os.path.dirname(f)) if os.path.basename(f) == "__init__.py" else os.path.dirname(f)
        if top == cwd:
            out.append(mod)
    return out
