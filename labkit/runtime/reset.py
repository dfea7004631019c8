"""Between two runs on a warm rank (:class:`labkit.runtime.pool.Pool`): put the process back to the state a
fresh rank starts in, as far as a run can reach it from Python.

What :meth:`Baseline.restore` guarantees after every run (tests/test_pool.py checks each):

* **no module globals of the previous run**: a function shipped by value (notebook cell, ``__main__``, a
  helper module next to the notebook) gets fresh globals on every run anyway (cloudpickle rebuilds them);
  every module first imported *during* a run from outside the Python installation and outside labkit (your
  own modules, test modules) is removed from ``sys.modules``, so the next run imports it afresh;
* **no tensors of the previous run reachable** from those: the run's payload, result and context are
  dropped, labkit's ``functools`` caches are cleared, then ``gc.collect()``;
* **torch's global settings**: intra-op thread count, default dtype, grad mode, deterministic-algorithms
  flag, and any function the run replaced on ``torch``, ``torch.distributed``, ``torch.nn.functional``,
  ``torch.Tensor`` or ``torch.nn.Module`` (a CommLog left open, a monkeypatch);
* **RNG reseeded as a fresh interpreter would be**: torch (CPU and CUDA) from a new random seed, Python's
  ``random`` and NumPy's global generator from OS entropy — the same as ``launch``, whose fresh ranks start
  unseeded: seed explicitly inside the rank function when a run must be reproducible;
* ``os.environ``, ``sys.path`` and the working directory as they were before the run.

Not reset: third-party packages' own module state (their caches, registries), threads or subprocesses a run
left running (processes: killed with the pool), ``atexit``/signal handlers a run installed, process groups a
run created with ``dist.new_group`` (they stay valid). A run that destroys the default process group makes
the pool start afresh (the post-run health check, worker.py).
"""

from __future__ import annotations

import gc
import os
import random
import sys
import sysconfig


def _installed_dirs() -> tuple[str, ...]:
    dirs = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.add(os.path.realpath(p))
    for p in sys.path:  # site-packages that a venv or .pth adds
        if p and ("site-packages" in p or "dist-packages" in p):
            dirs.add(os.path.realpath(p))
    return tuple(sorted(dirs))


class Baseline:
    """A snapshot taken once the rank is up (torch imported, process group created)."""

    def __init__(self, threads: int):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        self.modules = set(sys.modules)
        self.threads = int(threads)
        self.dtype = torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.watched = [torch, dist, F, torch.Tensor, torch.nn.Module]
        self.attrs = [dict(vars(obj)) for obj in self.watched]
        self.environ = dict(os.environ)
        self.path = list(sys.path)
        self.cwd = os.getcwd()
        self.installed = _installed_dirs()
        self.labkit_dir = os.path.dirname(os.path.realpath(sys.modules["labkit"].__file__))

    def _purgeable(self, name: str) -> bool:
        mod = sys.modules.get(name)
        f = getattr(mod, "__file__", None)
        if name.split(".")[0] == "labkit":
            return False
        if not f:  # namespace packages, by-value modules, builtins
            return getattr(mod, "__spec__", None) is None or getattr(mod.__spec__, "origin", None) is None
        f = os.path.realpath(f)
        return not f.startswith(self.installed) and not f.startswith(self.labkit_dir + os.sep)

    def restore(self) -> None:
        import torch

        for name in sorted(set(sys.modules) - self.modules):
            if name in sys.modules and self._purgeable(name):
                del sys.modules[name]
        for obj, saved in zip(self.watched, self.attrs):
            current = vars(obj)
            for key, value in saved.items():
                if current.get(key, _MISSING) is not value:
                    try:
                        setattr(obj, key, value)
                    except (AttributeError, TypeError):
                        pass
        for name, mod in list(sys.modules.items()):
            if name.split(".")[0] == "labkit" and mod is not None:
                for value in list(vars(mod).values()):
                    clear = getattr(value, "cache_clear", None)
                    if callable(clear) and getattr(value, "__module__", None) == name:
                        clear()
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.seed()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.seed_all()
        random.seed()
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed()
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        sys.path[:] = self.path
        try:
            os.chdir(self.cwd)
        except OSError:
            pass
        gc.collect()


_MISSING = object()
