"""launch(): the only way the lab starts ranks.

``launch(fn, world_size, *args, **kwargs)`` starts ``world_size`` fresh Python interpreters (the spawn start
method), creates the process group in each, calls ``fn(ctx, *args, **kwargs)`` with a
:class:`~labkit.runtime.rank.RankContext`, destroys the group, and returns what every rank returned, in rank order.
The calling process (a notebook kernel, say) never holds a process group, so a launch cell can be re-run.

Failure handling (each case is in tests/test_launch.py):

* a rank raises -> every rank is ended at once and :class:`RankFailed` names the rank with its traceback;
* a rank exits or is killed by a signal -> :class:`RankFailed` with the exit code or signal name;
* nothing finishes within ``timeout_s`` -> :class:`LaunchTimeout` with each live rank's Python stack;
* Ctrl-C / kernel interrupt in the caller -> every rank is killed and KeyboardInterrupt propagates;
* the caller itself dies -> the ranks die with it, and so does everything they started.

Hardening (tests/test_hardening.py): every rank is started by a per-launch supervisor (supervisor.py) that
kills each rank's whole session and every process a rank started on every exit path, including the
caller's death; the rendezvous store and the backends listen on loopback only (rendezvous.py); ranks import
nothing from the working directory (safepath.py); more ranks than host memory holds are refused before
anything starts (limits.py); a rank SIGKILLed by the OOM killer is named so. Warm ranks: pool.py.
"""

from __future__ import annotations

import inspect
import json
import linecache
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import cloudpickle
import pandas as pd

from labkit.checks import positive_float, positive_int
from labkit.runtime import timeline as tl
from labkit.runtime import zygote
from labkit.runtime.shipping import ShipError, ship  # noqa: F401 - ShipError is part of launch's API

DEFAULT_TIMEOUT_S = 180.0
_POLL_S = 0.01
_GRACE_S = 0.3  # after the first failure, wait this long for the other ranks' error reports
_STACK_WAIT_S = 1.0
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


class LaunchError(RuntimeError):
    """A launch that did not complete. ``rank`` is the rank blamed (None when none can be)."""

    def __init__(self, message: str, *, rank: int | None = None, world_size: int | None = None,
                 exitcode: int | None = None, signal_name: str | None = None, traceback_text: str = "",
                 stacks: dict | None = None, elapsed_s: float | None = None):
        super().__init__(message)
        self.rank = rank
        self.world_size = world_size
        self.exitcode = exitcode
        self.signal_name = signal_name
        self.traceback_text = traceback_text
        self.stacks = stacks or {}
        self.elapsed_s = elapsed_s


class RankFailed(LaunchError):
    """A rank raised, exited early or was killed; ``rank`` says which, ``traceback_text`` what happened."""


class LaunchTimeout(LaunchError):
    """No result within ``timeout_s``; ``stacks`` maps rank -> the Python stack it was stuck in."""



class LaunchResult(list):
    """What ``launch`` returns: a list with one entry per rank (rank order), plus

    * ``timeline`` — every rank's timeline events in one DataFrame (see :mod:`labkit.runtime.timeline`);
    * ``world_size``, ``backend``, ``wall_s`` (seconds from first spawn to last result, measured);
    * with ``launch(..., emulate=...)``: ``emulated`` (the emulated timeline frame) and ``emulation`` (a
      :class:`labkit.runtime.emulate.Emulation`: profile, label, per-rank totals); None otherwise.
    """

    def __init__(self, results, timeline, world_size: int, backend: str, wall_s: float):
        super().__init__(results)
        self._timeline = timeline  # a DataFrame, or a function that makes it when first read (warm runs stay fast)
        self.world_size = world_size
        self.backend = backend
        self.wall_s = wall_s
        self.emulated: pd.DataFrame | None = None
        self.emulation = None

    @property
    def timeline(self) -> pd.DataFrame:
        if callable(self._timeline):
            self._timeline = self._timeline()
        return self._timeline

    @timeline.setter
    def timeline(self, df: pd.DataFrame) -> None:
        self._timeline = df

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_timeline"] = self.timeline
        return state

    def __setstate__(self, state):
        if "timeline" in state:  # pickled before the timeline became lazy
            state = dict(state)
            state["_timeline"] = state.pop("timeline")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (f"LaunchResult(world_size={self.world_size}, backend={self.backend!r}, "
                f"wall_s={self.wall_s:.2f}, results={list.__repr__(self)})")


# ------------------------------------------------------------------------------------------------------
# backend and device choice
# ------------------------------------------------------------------------------------------------------
def cuda_device_count() -> int:
    """GPUs visible to this process (0 without a CUDA build). Does not initialise CUDA."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def resolve_backend(backend: str, world_size: int) -> str:
    """``auto`` -> ``nccl`` when there is a GPU per rank, else ``gloo``. Raises ValueError for an unknown
    backend or ``nccl`` without enough GPUs."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not valid; choose one of: auto, gloo, nccl")
    gpus = cuda_device_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} GPU(s) "
                         "visible; use backend='gloo' or a smaller world_size")
    return backend


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001
        return False


# ------------------------------------------------------------------------------------------------------
# launch
# ------------------------------------------------------------------------------------------------------
_RUN_PREFIX = "labkit-launch-"


def remove_stale_launch_dirs(tmp: str | Path | None = None) -> list[Path]:
    """Remove ``labkit-launch-*`` temporary folders (this user's) whose owning process is gone — left by a
    caller that was SIGKILLed while its supervisor was killed too. A folder is kept while its owner runs (pid
    and start time in ``spec.json``; the pid in the name before that file exists). Returns what was removed."""
    from labkit.runtime.probes import pid_alive

    tmp = Path(tmp if tmp is not None else tempfile.gettempdir())
    removed = []
    try:
        entries = list(tmp.iterdir())
    except OSError:
        return removed
    for d in entries:
        if not d.name.startswith(_RUN_PREFIX):
            continue
        try:
            st = d.lstat()
            if not d.is_dir() or d.is_symlink() or st.st_uid != os.getuid():
                continue
            pid, start = None, None
            head = d.name[len(_RUN_PREFIX):].split("-", 1)[0]
            if head.isdigit():
                pid = int(head)
            spec = d / "spec.json"
            if spec.exists():
                info = json.loads(spec.read_text())
                pid, start = int(info.get("parent_pid", pid or 0)), info.get("parent_start")
            if pid is None:
                if time.time() - st.st_mtime < 3600:
                    continue  # an old-style folder without an owner: only when clearly abandoned
            elif pid_alive(pid, start):
                continue
        except (OSError, ValueError):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _rank_env(threads: int) -> dict:
    from labkit.runtime.rendezvous import pin_to_loopback
    from labkit.runtime.safepath import rank_pythonpath

    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV}
    pp = rank_pythonpath(env.get("PYTHONPATH"))
    if pp:
        env["PYTHONPATH"] = pp
    else:
        env.pop("PYTHONPATH", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = str(threads)
    return pin_to_loopback(env)


class RankSet:
    """``world_size`` started ranks with their process group, running one job after another (a cold launch
    runs one; a :class:`~labkit.runtime.pool.Pool` many). Internal: use :func:`launch` or ``Pool``."""

    def __init__(self, world_size: int, backend: str, timeout_s: float, threads: int, echo: bool, *,
                 warm: bool = False):
        from labkit.runtime.limits import oom_kill_counts
        from labkit.runtime.probes import process_start_ticks
        from labkit.runtime.procs import RankProcs
        from labkit.runtime.safepath import boot_argv, shipped_sys_path

        remove_stale_launch_dirs()
        self.world_size, self.backend, self.timeout_s, self.threads = world_size, backend, timeout_s, threads
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}-"))
        self.jobs = 0
        self.last_job: Path | None = None
        self.procs = None
        try:
            spec = {"world_size": world_size, "backend": backend, "timeout_s": timeout_s, "threads": threads,
                    "parent_pid": os.getpid(), "parent_start": process_start_ticks(os.getpid()),
                    "cwd": os.getcwd(), "sys_path": shipped_sys_path(), "warm": warm}
            (self.run_dir / "spec.json").write_text(json.dumps(spec))
            self.oom_before = oom_kill_counts()
            env = _rank_env(threads)
            forking = zygote.forking_enabled()
            if forking:  # the rank template's one-time start (import torch once per caller): not the launch's time
                zygote.get(env, spec["sys_path"])
            self.started = time.monotonic()
            entries = [["labkit.runtime.worker", "rank_main", [str(self.run_dir), str(r)]]
                       for r in range(world_size)]
            argvs = [boot_argv(*entry) for entry in entries]
            fork = None  # ranks forked from the template, or from a supervisor that imported the same once
            if forking:
                fork = {"sys_path": spec["sys_path"], "preload": list(zygote.PRELOAD), "entries": entries}
            self.procs = RankProcs(argvs, env, self.run_dir, self.run_dir / "supervisor.json",
                                   echo=echo, with_stdin=True, fork=fork)
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        return self.procs is not None and self.procs.alive()

    def idle(self, timeout_s: float) -> str | None:
        """Wait until every rank finished resetting after the last job. Returns None when they did, else why
        not (a rank died, the run broke the group, a reset failed, or it took longer than ``timeout_s``)."""
        if self.last_job is None:
            return None if self.alive() else "a rank ended before the first run"
        job = self.last_job
        deadline = time.monotonic() + timeout_s
        while True:
            codes = self.procs.poll()
            broken = sorted(job.glob("broken_*"))
            if broken:
                return broken[0].read_text() or "the run broke the process group"
            errors = sorted(job.glob("error_*.json"))
            if errors:
                try:
                    err = json.loads(errors[0].read_text())
                    return f"rank {err['rank']} raised {err['type']} in {err['where']}: {err['message']}"
                except (OSError, ValueError, KeyError):
                    return "a rank failed after the run"
            dead = [r for r, c in enumerate(codes) if c is not None]
            if dead:
                return f"rank {dead[0]} {_describe_exit(codes[dead[0]])[0]} after the run"
            if all((job / f"idle_{r}").exists() for r in range(self.world_size)):
                # nothing of it is read any more; removing files is slow on some /tmp: not on the run's path
                threading.Thread(target=shutil.rmtree, args=(job, True), daemon=True, name="labkit-rm").start()
                self.last_job = None
                return None
            if time.monotonic() > deadline:
                return f"the ranks did not finish resetting within {timeout_s:g} s"
            time.sleep(_POLL_S / 5)

    def run(self, fn, payload: bytes, timeout_s: float, threads: int, echo: bool, *, last: bool,
            start: float | None = None, emulation=None) -> LaunchResult:
        from labkit.runtime.limits import oom_kill_counts

        self.procs.echo = echo
        self.jobs += 1
        job = self.run_dir / f"job-{self.jobs}"
        job.mkdir()
        (job / "payload.pkl").write_bytes(payload)
        start = time.monotonic() if start is None else start
        if start != self.started:
            self.oom_before = oom_kill_counts()
        self.last_job = job
        self.procs.send(json.dumps({"job": job.name, "seq": self.jobs, "threads": threads, "last": last,
                                    "emulate": emulation.rank_config() if emulation is not None else None}))
        try:
            _wait(self, job, timeout_s, start, warm=not last)
        except LaunchError as e:
            _restore_source_lines(e, fn)
            raise
        outputs = [cloudpickle.loads((job / f"result_{r}.pkl").read_bytes()) for r in range(self.world_size)]
        wall_s = time.monotonic() - start
        events = [(r, out.get("offset_ns", 0), out["events"]) for r, out in enumerate(outputs)]
        result = LaunchResult([o["result"] for o in outputs], lambda: _timeline_frame(events), self.world_size,
                              self.backend, wall_s)
        if emulation is not None:
            from labkit.runtime import emulate as _emulate

            _emulate.attach(result, emulation, outputs)
        return result

    def close_procs(self) -> None:
        """Kill every rank and everything it started (idempotent); the private folder stays for reading."""
        if self.procs is not None:
            self.procs.kill()

    def close(self) -> None:
        """:meth:`close_procs`, then remove the private folder (idempotent)."""
        self.close_procs()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _timeline_frame(events) -> pd.DataFrame:
    """Every rank's events (``(rank, offset_ns, events)`` per rank) as one timeline frame."""
    frames = []
    for r, offset_ns, evs in events:
        t = tl.Timeline(r, offset_ns)
        t.events = evs
        frames.append(t.to_frame())
    return tl.concat(frames)


def _describe_exit(code: int) -> tuple[str, str | None]:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}", name
    return f"exited with code {code} without raising a Python exception", None


def _emulation_plan(emulate, world_size: int, backend: str):
    """The emulation plan of a launch (:func:`labkit.runtime.emulate.prepare`), or None; imports the emulator
    only when something is emulated (ValueError for a bad profile, before any process starts)."""
    from labkit.runtime.emulate import state

    if emulate is None and not state.AMBIENT:
        return None
    from labkit.runtime import emulate as _emulate

    return _emulate.prepare(emulate, world_size, backend)


def _check_launch_args(world_size, timeout_s, start_method, backend, threads_per_rank):
    world_size = positive_int("world_size", world_size)
    timeout_s = positive_float("timeout_s", timeout_s)
    if start_method != "spawn":
        why = ("CUDA is already initialised in this process, and a forked child cannot re-initialise it "
               "('Cannot re-initialize CUDA in forked subprocess'); " if _cuda_initialised() else
               "a forked rank would inherit this process's state (CUDA context, threads, a notebook "
               "kernel's sockets), and forking after CUDA is initialised fails; ")
        raise ValueError(f"start_method={start_method!r} is not supported: {why}labkit always starts ranks "
                         "as fresh interpreters (start_method='spawn')")
    backend = resolve_backend(backend, world_size)
    if threads_per_rank is None:
        from labkit.runtime.rank import cpu_threads_per_rank

        threads_per_rank = cpu_threads_per_rank(world_size) if backend == "gloo" else 1
    threads_per_rank = positive_int("threads_per_rank", threads_per_rank)
    return world_size, timeout_s, backend, threads_per_rank


def launch(fn, world_size: int, *args, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
           start_method: str = "spawn", threads_per_rank: int | None = None, echo: bool = True,
           max_world_size: int | None = None, pool=None, keep_warm: bool = False, emulate=None,
           fake=False, **kwargs) -> LaunchResult:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks and return each rank's result.

    Args:
        fn: a function (from a module, a notebook cell or ``__main__``; shipped by value with cloudpickle),
            or a ``"module:function"`` string.
        world_size: number of ranks (>= 1). On CPU more ranks than cores is allowed (they share the cores);
            more than host memory holds is refused (labkit.runtime.limits: 512 MiB per rank).
        backend: ``"auto"`` (NCCL with one GPU per rank when enough GPUs are visible, else gloo on CPU),
            ``"gloo"`` or ``"nccl"``.
        timeout_s: wall-clock limit for the whole launch (spawn to results; for a warm pool, submission to
            results), seconds; also each collective's timeout inside cold-started ranks (a pool's ranks keep
            the pool's ``timeout_s`` for their collectives).
        start_method: only ``"spawn"`` (fresh interpreters); anything else raises ValueError explaining why.
        threads_per_rank: torch intra-op threads per rank; default ``max(1, cores // world_size)``.
        echo: forward each rank's stdout/stderr here, prefixed ``[rank r]``.
        max_world_size: raise (or lower) the memory-derived cap on ``world_size`` explicitly (also
            ``$LABKIT_MAX_WORLD_SIZE``).
        pool: a :class:`labkit.Pool` to run on (warm ranks). Without it, an open pool of this world size and
            backend is used when there is one (``with labkit.Pool(world_size): ...``); otherwise fresh ranks are
            started and ended for this call (labkit.runtime.pool explains the choice).
        keep_warm: when no pool of this shape is open, open the shared one
            (:func:`labkit.runtime.pool.shared_pool`) and leave it open for the next launch of this shape
            (closed at interpreter exit or by ``labkit.runtime.pool.close_all()``).
        emulate: also time the run as a GPU cluster would (:mod:`labkit.runtime.emulate`): a profile name
            such as ``"dgx-h100"``, a :class:`labkit.theory.cluster.Cluster`, or a dict (profile, efficiencies,
            "as a model" charging); runs on gloo. Default: the enclosing ``emulate.emulation(...)`` block's, if any.
        fake: ``True`` (or a dict of :func:`labkit.runtime.fake.launch_fake` options: ``roles``, ``dims``,
            ``threads``) runs every rank in one child process under fake tensors and torch's fake process group, at
            full shapes with no data (:mod:`labkit.runtime.fake`); ``emulate`` then replays the fake traces.
        **kwargs: passed to ``fn``. The names above are reserved by ``launch``.

    Returns:
        :class:`LaunchResult`: a list of per-rank return values in rank order, with ``.timeline`` (a
        DataFrame of all ranks' events), ``.backend``, ``.world_size`` and ``.wall_s``.

    Raises:
        ValueError: bad ``world_size`` (or more ranks than memory holds), ``backend``, ``timeout_s`` or
            ``start_method``; a ``pool`` of another shape; with ``emulate``, an unknown profile, a world size
            its nodes cannot hold evenly, or a bad option (before any process starts); a trace that cannot be
            replayed (``labkit.theory.replay.ReplayError``, after the run).
        ShipError (a ValueError): ``fn`` or an argument cannot be pickled; raised before any process starts.
        RankFailed: a rank raised, exited or was killed (``.rank``, ``.traceback_text``, ``.signal_name``; a
            SIGKILL says whether the OOM killer did it).
        LaunchTimeout: the run exceeded ``timeout_s`` (``.stacks``: rank -> Python stack).
        KeyboardInterrupt: re-raised after every rank has been killed.
    """
    if isinstance(emulate, dict) and emulate.get("fake"):  # emulate={"fake": True, ...}: the same switch
        emulate = {k: v for k, v in emulate.items() if k != "fake"}
        fake = fake or True
    if fake:
        from labkit.runtime.fake import launch_fake

        opts = dict(fake) if isinstance(fake, dict) else {}
        return launch_fake(fn, world_size, *args, emulate=emulate, timeout_s=timeout_s, **opts, **kwargs)
    emulation = _emulation_plan(emulate, positive_int("world_size", world_size), backend)
    if emulation is not None:
        backend = "gloo"  # the emulated run itself runs on the CPU
    threads_asked = threads_per_rank
    world_size, timeout_s, backend, threads_per_rank = _check_launch_args(world_size, timeout_s, start_method,
                                                                          backend, threads_per_rank)
    if isinstance(fn, str):
        from labkit.runtime.worker import resolve_function

        fn = resolve_function(fn)
    if not callable(fn):
        raise ValueError(f"fn={fn!r} is not callable; pass a function or 'module:function'")
    from labkit.runtime import pool as _pool

    chosen = _pool.pool_for(world_size, backend, pool)
    if chosen is None:
        from labkit.runtime.limits import check_world_size

        check_world_size(world_size, max_world_size)
    payload = ship(fn, args, kwargs)
    if chosen is None and keep_warm:
        chosen = _pool.shared_pool(world_size, backend, timeout_s=timeout_s, threads_per_rank=threads_asked,
                                   echo=echo, max_world_size=max_world_size)
    if chosen is not None:
        threads = threads_per_rank if threads_asked is not None else chosen.threads
        return chosen.run_payload(fn, payload, timeout_s=timeout_s, threads=threads, echo=echo,
                                  emulation=emulation)
    ranks = RankSet(world_size, backend, timeout_s, threads_per_rank, echo)
    try:
        return ranks.run(fn, payload, timeout_s, threads_per_rank, echo, last=True, start=ranks.started,
                         emulation=emulation)
    finally:
        ranks.close()


def _read_error(dirs: list[Path], rank: int) -> dict | None:
    for d in dirs:
        path = d / f"error_{rank}.json"
        if path.exists():
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):
                return None
    return None


def _wait(ranks: RankSet, job: Path, timeout_s: float, start: float, *, warm: bool = False) -> None:
    """Until every rank's result is in; raises RankFailed / LaunchTimeout. A cold rank must also exit 0; a warm
    rank that ends after writing its result (the post-run check found the group broken) only makes the pool
    restart before the next run."""
    deadline = start + timeout_s
    first_failure_at = None
    n = ranks.world_size
    while True:
        codes = ranks.procs.poll()
        have = [(job / f"result_{r}.pkl").exists() for r in range(n)]
        failed = [r for r, c in enumerate(codes) if c is not None and not ((c == 0 or warm) and have[r])]
        if failed:
            now = time.monotonic()
            if first_failure_at is None:
                first_failure_at = now
            if now - first_failure_at >= _GRACE_S or all(c is not None for c in codes):
                _raise_failure(ranks, job, codes, now - start)
        elif all(have):
            return
        now = time.monotonic()
        if now > deadline:
            _raise_timeout(ranks, job, timeout_s, now - start)
        time.sleep(min(_POLL_S, 0.0005 + (now - start) / 50))  # a short (warm) run is noticed within a ms


def _raise_failure(ranks: RankSet, job: Path, codes, elapsed) -> None:
    """Blame one rank. ``codes`` are the exit codes seen before we killed anyone. Order: a Python
    exception that is not a peer's broken connection (earliest first), then a rank that ended on its own
    without an exception (signal, exit code, or exit 0 with no result), then communication errors."""
    from labkit.runtime.limits import describe_sigkill, oom_kill_counts

    world_size = ranks.world_size
    oom_after = oom_kill_counts()
    ranks.close_procs()
    candidates = []
    for r, code in enumerate(codes):
        err = _read_error([job, ranks.run_dir], r)
        if err is not None:
            candidates.append((2 if err.get("comm") else 0, err["time_ns"], r, code, err))
        elif code is not None and (code != 0 or not (job / f"result_{r}.pkl").exists()):
            candidates.append((1, 0, r, code, None))
    prio, _, rank, code, err = min(candidates, key=lambda c: (c[0], c[1], c[2]))
    others = sorted({c[2] for c in candidates} - {rank})
    also = f" (also failed afterwards: rank(s) {', '.join(map(str, others))})" if others else ""
    if err is not None:
        tb = err["traceback"]
        msg = (f"rank {rank} of {world_size} raised {err['type']} in {err['where']}: {err['message']}{also}\n"
               f"--- traceback of rank {rank} ---\n{tb}")
        raise RankFailed(msg, rank=rank, world_size=world_size, exitcode=code, traceback_text=tb,
                         elapsed_s=elapsed)
    if code == 0:
        what, sig = "exited with code 0 before returning a result", None
    else:
        what, sig = _describe_exit(code)
    if sig == "SIGKILL":
        what += ": " + describe_sigkill(ranks.oom_before, oom_after, ranks.procs.hwm.get(rank))
    tail = ranks.procs.stderr_tail(rank)
    msg = f"rank {rank} of {world_size} {what}{also}"
    if tail:
        msg += f"\n--- last stderr lines of rank {rank} ---\n{tail}"
    raise RankFailed(msg, rank=rank, world_size=world_size, exitcode=code, signal_name=sig,
                     traceback_text=tail, elapsed_s=elapsed)


def _raise_timeout(ranks: RankSet, job: Path, timeout_s, elapsed) -> None:
    world_size = ranks.world_size
    codes = ranks.procs.poll()
    alive = [r for r, c in enumerate(codes) if c is None]
    # snapshot what each rank had reached at the deadline: a slow start-up may finish during the stack wait below
    done = [r for r in range(world_size) if (job / f"result_{r}.pkl").exists()]
    not_started = [r for r in alive if not (job / f"started_{r}").exists()]
    ranks.procs.signal(signal.SIGUSR1)  # faulthandler dumps every thread's stack
    time.sleep(_STACK_WAIT_S)
    ranks.close_procs()
    stacks = {}
    for r in alive:
        texts = [p.read_text().strip() for p in (job / f"stack_{r}.txt", ranks.run_dir / f"stack_{r}.txt")
                 if p.exists()]
        stacks[r] = next((t for t in texts if t), "")
    head = (f"launch timed out after {timeout_s:g} s: rank(s) {', '.join(map(str, alive))} of "
            f"{world_size} still running" + (f"; rank(s) {', '.join(map(str, done))} had finished" if done else ""))
    if not_started:
        why = (f" Rank(s) {', '.join(map(str, not_started))} had not reached the rank function yet (still "
               f"starting: importing torch, rendezvous): timeout_s={timeout_s:g} is shorter than start-up "
               "takes on this machine; give it more time.")
    else:
        why = (" Every rank was inside the rank function: a hang usually means ranks issued different "
               "collectives (or one waits for a peer that never sends).")
    parts = [head + "." + why]
    for rank, st in stacks.items():
        if st:
            parts.append(f"--- stack of rank {rank} ---\n{st}")
    raise LaunchTimeout("\n".join(parts), rank=alive[0] if alive else None, world_size=world_size,
                        stacks=stacks, elapsed_s=elapsed)


_DYNAMIC_FRAME = re.compile(r'File "<dynamic-code>", line (\d+)(,?) in (\S+)\n')  # traceback or faulthandler


def _code_index(fn) -> list[tuple[str, int, int, str]]:
    """(name, first line, last line, file) of every code object reachable from ``fn`` (its nested code,
    and functions it references), so frames of by-value functions can be mapped back to their source."""
    entries, seen, stack = [], set(), [fn]
    while stack:
        f = stack.pop()
        if not inspect.isfunction(f) or id(f) in seen:
            continue
        seen.add(id(f))
        codes = [f.__code__]
        while codes:
            c = codes.pop()
            lines = [ln for _, _, ln in c.co_lines() if ln]
            entries.append((c.co_name, min(lines, default=c.co_firstlineno), max(lines, default=0), c.co_filename))
            codes += [k for k in c.co_consts if inspect.iscode(k)]
        try:
            cv = inspect.getclosurevars(f)
            stack += [v for v in (*cv.nonlocals.values(), *cv.globals.values()) if inspect.isfunction(v)]
        except (TypeError, ValueError):
            pass
    return entries


def _restore_source_lines(err: LaunchError, fn) -> None:
    """cloudpickle ships functions by value with the file name ``<dynamic-code>``, so a rank's traceback
    (or a hung rank's stack) has no source file. Put the real file name (e.g. the notebook cell) and the
    source line back, in the message, ``traceback_text`` and ``stacks``."""
    texts = [err.traceback_text, str(err), *err.stacks.values()]
    if not any("<dynamic-code>" in t for t in texts):
        return
    index = _code_index(fn)

    def repl(m):
        line, sep, name = int(m.group(1)), m.group(2), m.group(3)
        for n, first, last, filename in index:
            if n == name and first <= line <= last:
                src = linecache.getline(filename, line).strip()
                return f'File "{filename}", line {line}{sep} in {name}\n' + (f"    {src}\n" if src else "")
        return m.group(0)

    err.args = (_DYNAMIC_FRAME.sub(repl, str(err) + "\n").rstrip("\n"),)
    err.traceback_text = _DYNAMIC_FRAME.sub(repl, err.traceback_text)
    err.stacks = {r: _DYNAMIC_FRAME.sub(repl, st + "\n").rstrip("\n") for r, st in err.stacks.items()}


def load_results(out_dir: str | Path, *, allow_pickle: bool = False) -> LaunchResult:
    """Read what ``torchrun ... -m labkit.runtime.worker FN --out DIR`` wrote: a LaunchResult like ``launch``'s.

    Trust boundary: DIR may be a shared folder. Ranks store results as data (``rank<r>.pt``, read with
    ``torch.load(weights_only=True)``, which runs no code: labkit.runtime.results) and ``meta.json`` as JSON.
    Results that are not plain data were stored with pickle only if the run asked for it
    (``--pickle-results``); reading those runs code from the files, so it needs ``allow_pickle=True`` — pass it
    only for a folder you (and everyone who can write to it) trust.

    Raises ValueError when DIR holds no complete run (missing meta.json or a rank's file), or holds pickled
    results and ``allow_pickle`` is False.
    """
    from labkit.runtime.results import loads_safe

    out = Path(out_dir)
    meta_path = out / "meta.json"
    if not meta_path.exists():
        raise ValueError(f"{out} holds no torchrun results (no meta.json); did rank 0 finish?")
    meta = json.loads(meta_path.read_text())
    results, frames = [], []
    for r in range(meta["world_size"]):
        safe, pickled = out / f"rank{r}.pt", out / f"rank{r}.pkl"
        if safe.exists():
            o = loads_safe(safe.read_bytes())
        elif pickled.exists():
            if not allow_pickle:
                raise ValueError(f"{out}: rank {r}'s result is a pickle ({pickled.name}: written with "
                                 "--pickle-results); reading it runs code from the file. If you trust this folder, "
                                 "call load_results(path, allow_pickle=True)")
            o = cloudpickle.loads(pickled.read_bytes())
        else:
            raise ValueError(f"{out}: rank {r} of {meta['world_size']} wrote no result ({safe.name} missing)")
        t = tl.Timeline(r, o.get("offset_ns", 0))
        t.events = [tuple(e) for e in o["events"]]
        frames.append(t.to_frame())
        results.append(o["result"])
    return LaunchResult(results, tl.concat(frames), meta["world_size"], meta["backend"], float("nan"))
