"""Warm ranks: start ``world_size`` ranks once, keep their process group, run one rank function after another.

A cold :func:`labkit.launch` pays, per rank, a fresh interpreter and ``import torch`` (about a second of CPU
each, more on a loaded machine); a warm run pays only shipping the function and its result. Three ways in::

    with labkit.Pool(4):                 # every launch(fn, 4) in the block runs on these 4 warm ranks
        for bucket_mb in (1, 4, 16):
            res = launch(fn, 4, bucket_mb)

    res = launch(fn, 4, keep_warm=True)  # chapters and widgets: open (once) and reuse the shared pool of
                                         # this shape; it stays open until close_all() or kernel exit
    pool = labkit.runtime.pool.shared_pool(4)   # the same pool, as an object: pool.run(fn, ...)

Which engine runs a launch (launcher.launch): ``pool=p`` runs on ``p`` (a ValueError if ``p`` is closed or
of another world size / backend); otherwise an open pool of the same world size and backend (a ``with`` block,
a ``Pool(...)`` not yet closed, or the shared pool) runs it; otherwise ``keep_warm=True`` opens the shared pool
of that shape and runs on it; otherwise the launch is cold (fresh ranks, ended after the call).

Between runs each rank is reset (labkit.runtime.reset says precisely what is restored and what is not: module
globals and tensors of the previous run unreachable, process groups it created destroyed, RNG reseeded as a
fresh rank's, torch thread count and global settings, ``os.environ``, ``sys.path`` and the working directory
put back). A run returns as soon as every rank has its result; the check of the group and the reset run while
the caller goes on, and the next run waits for them.

A run that breaks a rank — it raises, hangs past ``timeout_s``, is killed, or leaves the process group
destroyed or inconsistent — raises the same :class:`RankFailed` / :class:`LaunchTimeout` as a cold launch
(or, when the group only breaks after the results, returns them) and the pool's ranks are ended; the next
run starts fresh ranks (:attr:`Pool.starts` counts the starts, :attr:`Pool.restart_reason` says why the last
restart happened).

Bounded: at most one open pool per (world_size, backend) — opening another of the same shape closes the older
one, so re-running a notebook cell ``pool = labkit.Pool(4)`` never piles up ranks — and a pool is refused, like
a launch, when its ranks do not fit in host memory (limits.py). Pools are closed by :meth:`Pool.close` (or the
end of the ``with`` block), by :func:`close_all`, at interpreter exit (kernel shutdown or restart), and — when
the holding process is SIGKILLed, so that no exit hook runs — by their supervisor, which sees its control pipe
close and kills every rank and everything a rank started (supervisor.py). A process forked from the holder
never uses or closes the holder's pools. Pool ranks listen on loopback only, like a launch's (rendezvous.py).

Timeouts: ``Pool(timeout_s=...)`` is the collective timeout inside the ranks (fixed when they start) and the
default wall-clock limit of each run; ``launch(..., timeout_s=)`` / ``pool.run(..., timeout_s=)`` sets one
run's limit, counted from submission (including start-up when the pool is still starting).
"""

from __future__ import annotations

import atexit
import os
import threading
import time

from labkit.runtime.launcher import DEFAULT_TIMEOUT_S, RankSet, _check_launch_args

_POOLS: dict[tuple[int, str], Pool] = {}
_REGISTRY_LOCK = threading.Lock()
_IDLE_WAIT_S = 30.0  # a rank resets in well under a second; past this the pool is restarted
_hook_installed = False


class Pool:
    """``world_size`` warm ranks (see the module docstring).

    Args:
        world_size: ranks (>= 1; refused like ``launch`` when host memory cannot hold them).
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"`` (as ``launch``).
        timeout_s: collective timeout inside the ranks, and the default wall-clock limit of each run.
        threads_per_rank: default torch threads per rank (a run may ask for others; restored after it).
        echo: default for forwarding the ranks' output (``pool.run``; ``launch`` has its own default).
        max_world_size: explicit cap override, as for ``launch``.
        start: start the ranks now (default; in the background, so the first run finds them warm or warming),
            else at the first run.

    Attributes:
        starts: how many times ranks were started (1 + restarts after broken runs).
        runs: runs completed.
        restart_reason: why the ranks were last restarted (None before any restart).

    Raises:
        ValueError: bad arguments, or more ranks than memory holds.
    """

    def __init__(self, world_size: int, backend: str = "auto", *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 threads_per_rank: int | None = None, echo: bool = True, max_world_size: int | None = None,
                 start: bool = True):
        from labkit.runtime.limits import check_world_size

        ws, timeout_s, backend, threads = _check_launch_args(world_size, timeout_s, "spawn", backend,
                                                             threads_per_rank)
        check_world_size(ws, max_world_size)
        self.world_size, self.backend, self.timeout_s, self.threads, self.echo = ws, backend, timeout_s, threads, echo
        self.starts = 0
        self.runs = 0
        self.restart_reason: str | None = None
        self._ranks: RankSet | None = None
        self._closed = False
        self._owner = os.getpid()
        self._lock = threading.RLock()
        with _REGISTRY_LOCK:
            old = _POOLS.get((ws, backend))
            _POOLS[(ws, backend)] = self
        if old is not None:
            old.close()
        _install_exit_hook()
        if start:
            try:
                with self._lock:
                    self._start()
            except BaseException:
                self.close()
                raise

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._ranks is not None else "idle")
        return (f"Pool(world_size={self.world_size}, backend={self.backend!r}, {state}, starts={self.starts}, "
                f"runs={self.runs})")

    @property
    def closed(self) -> bool:
        return self._closed or self._owner != os.getpid()

    def _start(self) -> None:
        self._ranks = RankSet(self.world_size, self.backend, self.timeout_s, self.threads, self.echo, warm=True)
        self.starts += 1

    def _teardown(self) -> None:
        ranks, self._ranks = self._ranks, None
        if ranks is not None and self._owner == os.getpid():
            ranks.close()

    def pids(self) -> list[int]:
        """Process ids of the ranks now running (empty before the first start or after a tear-down)."""
        ranks = self._ranks
        if ranks is None or ranks.procs is None:
            return []
        return [p for _, p in sorted(ranks.procs.wait_pids().items())]

    def ready(self, timeout_s: float = 120.0) -> bool:
        """Block until every rank holds its process group and is warm (starting the ranks if they are not
        running); False if one died or ``timeout_s`` passed. For benchmarks: time runs, not start-up."""
        with self._lock:
            if self.closed:
                return False
            if self._ranks is None:
                self._start()
            ranks = self._ranks
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not ranks.alive():
                return False
            if all((ranks.run_dir / f"ready_{r}").exists() for r in range(self.world_size)):
                return True
            time.sleep(0.01)
        return False

    def run_payload(self, fn, payload: bytes, *, timeout_s: float, threads: int, echo: bool, emulation=None):
        """Run an already shipped payload (launcher.launch calls this). Internal."""
        with self._lock:
            if self.closed:
                raise ValueError(f"{self!r} is closed; open a new labkit.Pool({self.world_size}) or launch cold")
            if self._ranks is None:
                self._start()
            else:
                why = self._ranks.idle(min(timeout_s, _IDLE_WAIT_S))
                if why is not None:  # broken after the previous run, or killed between runs: start afresh
                    self.restart_reason = why
                    self._teardown()
                    self._start()
            try:
                res = self._ranks.run(fn, payload, timeout_s, threads, echo, last=False, emulation=emulation)
            except BaseException as e:  # RankFailed, LaunchTimeout, KeyboardInterrupt: every rank is ended
                head = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.restart_reason = f"the previous run failed: {head}"
                self._teardown()
                raise
            self.runs += 1
            return res

    def run(self, fn, *args, **kwargs):
        """``launch(fn, self.world_size, *args, pool=self, **kwargs)``, with this pool's ``timeout_s``,
        ``threads_per_rank`` and ``echo`` as defaults."""
        from labkit.runtime.launcher import launch

        kwargs.setdefault("backend", self.backend)
        kwargs.setdefault("timeout_s", self.timeout_s)
        kwargs.setdefault("threads_per_rank", self.threads)
        kwargs.setdefault("echo", self.echo)
        return launch(fn, self.world_size, *args, pool=self, **kwargs)

    def close(self) -> None:
        """End the ranks and everything they started; the pool cannot run again (idempotent)."""
        self._closed = True
        with _REGISTRY_LOCK:
            if _POOLS.get((self.world_size, self.backend)) is self:
                del _POOLS[(self.world_size, self.backend)]
        self._teardown()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pool_for(world_size: int, backend: str, pool=None) -> Pool | None:
    """The pool a launch of this (checked) shape runs on: ``pool`` (checked), else the open one of this shape,
    else None. Raises ValueError for something that is not a Pool, a closed pool, or one of another shape."""
    if pool is not None:
        if not isinstance(pool, Pool):
            raise ValueError(f"pool={pool!r} is not a labkit.Pool")
        if pool.closed:
            raise ValueError(f"pool={pool!r} is closed")
        if (pool.world_size, pool.backend) != (world_size, backend):
            raise ValueError(f"pool={pool!r} runs world_size={pool.world_size}, backend={pool.backend!r}; this launch "
                             f"asks for world_size={world_size}, backend={backend!r}")
        return pool
    return _open_pool(world_size, backend)


def _open_pool(world_size: int, backend: str) -> Pool | None:
    with _REGISTRY_LOCK:
        found = _POOLS.get((world_size, backend))
    return found if found is not None and not found.closed else None


def shared_pool(world_size: int, backend: str = "auto", **kwargs) -> Pool:
    """The open pool of this world size and backend, or a new one, kept open until :func:`close_all`, its
    ``close()`` or interpreter exit — what ``launch(..., keep_warm=True)`` runs on. ``kwargs`` (Pool's:
    ``timeout_s``, ``threads_per_rank``, ``echo``, ``max_world_size``) apply only when it is opened here.

    Raises ValueError as :class:`Pool` does."""
    from labkit.runtime.launcher import resolve_backend

    found = _open_pool(world_size, resolve_backend(backend, world_size))
    return found if found is not None else Pool(world_size, backend, **kwargs)


def open_pools() -> list[Pool]:
    """The pools open in this process."""
    with _REGISTRY_LOCK:
        return [p for p in _POOLS.values() if not p.closed]


def close_all() -> None:
    """Close every pool of this process (also run at interpreter exit)."""
    for p in open_pools():
        p.close()


def _install_exit_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        atexit.register(close_all)
        _hook_installed = True
