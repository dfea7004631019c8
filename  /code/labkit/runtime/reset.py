"""Between two runs on a warm rank (:class:`labkit.runtime.pool.Pool`): put the process back to the state a
fresh rank starts in, as far as a run can reach it from Python.

A pool rank takes a :class:`Baseline` once it holds its process group (after importing the modules in
:data:`PRELOAD`, so that runs find them warm), and calls :meth:`Baseline.restore` after every run, once every
rank has passed the post-run check of the group (worker.py). What a restore guarantees (tests/test_pool.py
checks each):

* **no module globals of the previous run**: a function shipped by value (notebook cell, ``__main__``, a
  helper module next to the notebook) gets fresh globals on every run anyway (cloudpickle rebuilds them), and
  so do classes defined there; every module first imported *during* a run from outside the Python
  installation (your own modules, test modules, and labkit modules a pool does not preload) is removed from
  ``sys.modules``, so the next run imports it afresh; the labkit modules loaded at the baseline get back
  every global the run rebound, added or emptied, and the contents of their top-level lists, dicts, sets and
  labkit objects (shallow: a dict inside such a dict is not copied); their ``functools`` caches are cleared;
* **no tensors of the previous run reachable** from those: the run's payload, result and context are
  dropped, process groups the run created (``dist.new_group``, a DeviceMesh) are destroyed, then
  ``gc.collect()``. Collections stay fast because what survives a reset is frozen (``gc.freeze()``): the
  next collection scans only what the next run created;
* **torch's global settings**: intra-op thread count, default dtype, grad mode, anomaly mode,
  deterministic-algorithms flags, and any attribute the run replaced on ``torch``, ``torch.distributed``,
  ``torch.nn.functional``, ``torch.Tensor`` or ``torch.nn.Module`` (a CommLog left open, a monkeypatch);
* **RNG as a fresh rank has it**: a fresh interpreter of this torch seeds its generator from OS entropy (the
  seed differs per process and per launch), so a reset reseeds torch (CPU, and CUDA when initialised) from
  entropy too — unless this torch starts every process with its fixed default seed, in which case the
  generator's state at the baseline is put back. Python's ``random`` and NumPy's global generator are
  reseeded from OS entropy, as on import. A run that must be reproducible seeds explicitly, warm or cold;
* ``os.environ``, ``sys.path``, the working directory, ``sys.stdout``/``sys.stderr``, the warnings filters
  and the recursion limit as they were before the run.

Not reset: third-party packages' own module state (their caches, registries) and modules a run imported from
the Python installation (they stay imported, as after any import), threads or subprocesses a run left
running (processes are killed with the pool), ``atexit``/signal handlers a run installed, point-to-point
messages a run sent and never received, the hash seed (``PYTHONHASHSEED``: per process). A run that destroys
the default process group, or leaves the ranks disagreeing about the group, makes the pool start afresh
(the post-run check, worker.py).
"""

from __future__ import annotations

import gc
import os
import random
import sys
import sysconfig
import types
import warnings

#: modules a pool rank imports before its baseline, so runs find them warm (a failing import is skipped)
PRELOAD = ("numpy", "pandas", "labkit.runtime.training", "labkit.runtime.commlog", "labkit.runtime.measure",
           "labkit.models", "labkit.collectives", "labkit.parallel.comm", "labkit.parallel.data",
           "labkit.parallel.zero", "labkit.parallel.tensor", "labkit.parallel.pipeline", "labkit.parallel.context",
           "labkit.parallel.expert", "labkit.parallel.composed", "labkit.experiments.common")

#: the seed torch gave every fresh process before it seeded from entropy (c10 default_rng_seed_val)
TORCH_FIXED_DEFAULT_SEED = 67280421310721


def _installed_dirs() -> tuple[str, ...]:
    dirs = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.add(os.path.realpath(p))
    for p in sys.path:  # site-packages that a venv or .pth adds
        if p and ("site-packages" in p or "dist-packages" in p):
            dirs.add(os.path.realpath(p))
    return tuple(sorted(d + os.sep for d in dirs))


def _is_labkit(name: str) -> bool:
    return name == "labkit" or name.startswith("labkit.")


def _kept_value(value) -> tuple[str, object] | None:
    """What to snapshot of a labkit module global whose contents a run may change in place."""
    if isinstance(value, list):
        return "list", list(value)
    if isinstance(value, dict):
        return "dict", dict(value)
    if isinstance(value, set):
        return "set", set(value)
    if isinstance(value, (type, types.ModuleType, types.FunctionType)) or not hasattr(value, "__dict__"):
        return None
    if _is_labkit(getattr(type(value), "__module__", "") or ""):
        return "obj", dict(vars(value))
    return None


def _put_back(kind: str, value, saved) -> None:
    if kind == "list":
        value[:] = saved
    elif kind in ("dict", "set"):
        value.clear()
        value.update(saved)
    else:
        d = vars(value)
        d.clear()
        d.update(saved)


class Baseline:
    """A snapshot taken once the rank is up (torch imported, process group created)."""

    def __init__(self, threads: int, preload: tuple[str, ...] = PRELOAD):
        import importlib

        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        rng = torch.get_rng_state()
        for name in preload:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a module that does not import here is simply not warm
                pass
        torch.set_rng_state(rng)  # importing must not move the generator a run starts with
        self.fixed_seed = torch.initial_seed() == TORCH_FIXED_DEFAULT_SEED
        self.rng = rng
        self.threads = int(threads)
        self.dtype = torch.get_default_dtype()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.anomaly = torch.is_anomaly_enabled()
        self.watched = [torch, dist, F, torch.Tensor, torch.nn.Module]
        self.attrs = [dict(vars(obj)) for obj in self.watched]
        self.environ = dict(os.environ)
        self.path = list(sys.path)
        self.cwd = os.getcwd()
        self.streams = (sys.stdout, sys.stderr)
        self.filters = list(warnings.filters)
        self.recursion = sys.getrecursionlimit()
        self.installed = _installed_dirs()
        self.groups = self._groups()
        self.labkit = {}
        for name, mod in list(sys.modules.items()):
            if _is_labkit(name) and mod is not None:
                d = vars(mod)
                kept = {k: s for k, v in d.items() if not k.startswith("__") and (s := _kept_value(v)) is not None}
                self.labkit[name] = (mod, dict(d), kept)
        self.modules = set(sys.modules)
        gc.collect()
        gc.freeze()  # what exists now (torch, labkit) is never garbage: later collections scan only run objects

    @staticmethod
    def _groups() -> set:
        try:
            from torch.distributed.distributed_c10d import _world

            return set(_world.pg_map)
        except Exception:  # noqa: BLE001 - private API: without it no group is destroyed
            return set()

    def _purgeable(self, name: str) -> bool:
        """True for a module a run imported that the next run must import afresh: anything not from the Python
        installation (labkit's own modules included: the ones loaded at the baseline are restored instead)."""
        mod = sys.modules.get(name)
        f = getattr(mod, "__file__", None)
        if not f:  # namespace packages, by-value modules, builtins
            spec = getattr(mod, "__spec__", None)
            return spec is None or spec.origin is None or _is_labkit(name)
        return not os.path.realpath(f).startswith(self.installed)

    def _restore_labkit(self) -> None:
        for name, (mod, saved, kept) in self.labkit.items():
            d = vars(mod)
            for key in [k for k in d if k not in saved and not isinstance(d[k], types.ModuleType)]:
                del d[key]  # a global the run added (a submodule imported since stays: its parent needs it)
            for key, value in saved.items():
                if d.get(key, _MISSING) is not value:
                    d[key] = value
            for key, (kind, contents) in kept.items():
                _put_back(kind, saved[key], contents)
            for value in saved.values():
                clear = getattr(value, "cache_clear", None)
                if callable(clear) and getattr(value, "__module__", None) == name:
                    clear()  # a functools cache of this module

    def _destroy_new_groups(self) -> None:
        import torch.distributed as dist

        for pg in [pg for pg in self._groups() if pg not in self.groups]:
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def restore(self) -> None:
        import torch

        for name in sorted(set(sys.modules) - self.modules):
            if name in sys.modules and self._purgeable(name):
                del sys.modules[name]
        self.modules = set(sys.modules)  # what stays (from the installation) is part of the baseline now
        for obj, saved in zip(self.watched, self.attrs):
            current = vars(obj)
            for key, value in saved.items():
                if current.get(key, _MISSING) is not value:
                    try:
                        setattr(obj, key, value)
                    except (AttributeError, TypeError):
                        pass
        self._restore_labkit()
        self._destroy_new_groups()
        torch.set_num_threads(self.threads)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        if torch.is_anomaly_enabled() != self.anomaly:
            torch.autograd.set_detect_anomaly(self.anomaly)
        det = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        if det != self.deterministic:  # only when changed: the call imports torch._dynamo (seconds) the first time
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        if self.fixed_seed:
            torch.manual_seed(TORCH_FIXED_DEFAULT_SEED)
            torch.set_rng_state(self.rng)
        else:
            torch.seed()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            if self.fixed_seed:
                torch.cuda.manual_seed_all(TORCH_FIXED_DEFAULT_SEED)
            else:
                torch.cuda.seed_all()
        random.seed()
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed()
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        sys.path[:] = self.path
        sys.stdout, sys.stderr = self.streams
        if warnings.filters != self.filters:
            warnings.filters[:] = self.filters
            getattr(warnings, "_filters_mutated", lambda: None)()  # drop the per-module "already warned" caches
        sys.setrecursionlimit(self.recursion)
        try:
            os.chdir(self.cwd)
        except OSError:
            pass
        gc.collect()
        gc.freeze()  # what survived is reachable from the baseline: never scan it again


_MISSING = object()


def reseed_as_fresh_process() -> None:
    """Give a process forked from the rank template (zygote.py) the random state a fresh interpreter has:
    torch's generator seeded from OS entropy, or with its fixed default seed where this torch starts every
    process with it; Python's ``random`` and NumPy's global generator from OS entropy (a forked child otherwise
    draws the very numbers its parent and its siblings draw)."""
    import torch

    if torch.initial_seed() == TORCH_FIXED_DEFAULT_SEED:
        torch.manual_seed(TORCH_FIXED_DEFAULT_SEED)
    else:
        torch.seed()
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
