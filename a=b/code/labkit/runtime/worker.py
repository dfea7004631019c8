"""The code that runs inside each rank process.

Two entries:

* ``rank_main([RUN_DIR, RANK])`` — started by :func:`labkit.runtime.launcher.launch` and
  :class:`labkit.runtime.pool.Pool` under the launch supervisor (supervisor.py), as ``python -P -c BOOT``
  (safepath.py: nothing is imported from the working directory). The rank creates its process group once,
  then runs one job per line on its stdin (``{"job": DIR, "seq": N, "threads": N, "last": bool, "emulate":
  cfg}``; the rank function itself sees /dev/null as stdin): it reads the shipped function from
  ``RUN_DIR/DIR`` and writes its result (with this rank's trace for the emulator when ``emulate``) or its
  error back there. A cold launch sends one job with ``last`` and the rank destroys its group and exits.
  A pool rank (``"warm"`` in the spec) takes a baseline once (reset.py), and after each job checks the
  group (one all_reduce that every rank must agree on, else ``broken_<rank>`` and exit), resets itself
  to the baseline, writes ``idle_<rank>`` and waits for the next job.
* ``torchrun ... -m labkit.runtime.worker MODULE:FUNCTION [--kwargs JSON] [--out DIR] [--pickle-results]`` —
  the same rank functions under torchrun (single- or multi-node). Each rank writes ``DIR/rank<r>.pt`` (data
  only, results.py); :func:`labkit.runtime.launcher.load_results` reads them back as a LaunchResult.

In both, ``fn(ctx, *args, **kwargs)`` runs between ``init_process_group`` and ``destroy_process_group``.
"""

from __future__ import annotations

if __name__ == "__main__":  # torchrun starts ranks as `python -m`: the working directory is on sys.path
    from labkit.runtime.safepath import reexec_without_cwd

    reexec_without_cwd("labkit.runtime.worker")

import argparse
import datetime
import faulthandler
import importlib
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

_COMM_ERROR_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                       "Socket Timeout", "recvBytes", "sendBytes", "Connection refused")


def _set_parent_death_signal(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent (the launch supervisor) dies."""
    if sys.platform != "linux":
        return
    from labkit.runtime.supervisor import PR_SET_PDEATHSIG, prctl

    if not prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL)):
        return
    if parent_pid and os.getppid() != parent_pid:  # parent already gone before prctl took effect
        os._exit(1)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resolve_function(target):
    """``"package.module:function"`` -> the function; a callable is returned as is.

    Raises ValueError when the string is malformed, the module cannot be imported, or it has no such
    attribute (naming which part failed)."""
    if callable(target):
        return target
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"function {target!r} must be a callable or 'module:function'")
    mod, _, name = target.partition(":")
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise ValueError(f"function {target!r}: cannot import module {mod!r} ({e})") from e
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"function {target!r}: {getattr(obj, '__name__', mod)!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"function {target!r} is a {type(obj).__name__}, not a function")
    return obj


def _is_comm_error(exc: BaseException) -> bool:
    """True for errors a rank gets because a peer died (secondary failures)."""
    names = {t.__name__ for t in type(exc).__mro__}
    text = str(exc)
    return bool(names & {"DistNetworkError"}) or any(m in text for m in _COMM_ERROR_MARKERS)


def _error_record(rank: int, exc: BaseException, where: str) -> dict:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # the rank's own frames are the story; the worker's call into them is noise
    return {
        "rank": rank,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
        "where": where,
        "comm": _is_comm_error(exc),
        "time_ns": time.time_ns(),
    }


def _make_context(rank, world_size, local_rank, local_world_size, node_rank, backend):
    import torch

    from labkit.runtime.rank import RankContext

    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return RankContext(rank=rank, world_size=world_size, local_rank=local_rank,
                       local_world_size=local_world_size, node_rank=node_rank, backend=backend, device=device)


def _init_group(backend: str, rank: int, world_size: int, local_rank: int, timeout_s: float, store=None):
    import torch
    import torch.distributed as dist

    kw = {"backend": backend, "rank": rank, "world_size": world_size,
          "timeout": datetime.timedelta(seconds=timeout_s)}
    if store is not None:
        kw["store"] = store
    else:
        kw["init_method"] = "env://"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        kw["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(**kw)


def _finish_group(ctx) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            ctx.barrier()
        finally:
            dist.destroy_process_group()


def _package(ctx, result, trace=None) -> bytes:
    import cloudpickle

    try:
        out = {"result": result, "events": ctx.timeline.events, "offset_ns": ctx.timeline.offset_ns}
        if trace is not None:  # launch(..., emulate=...): this rank's trace for the replay
            out["trace"] = trace
        return cloudpickle.dumps(out)
    except Exception as e:  # noqa: BLE001 - any pickling failure is reported the same way
        raise TypeError(
            f"rank {ctx.rank} returned a value of type {type(result).__name__} that cannot be pickled "
            f"({type(e).__name__}: {e}); return plain data (dicts, lists, numbers, tensors, DataFrames)"
        ) from e


def _emulate_begin(config, rank: int, world_size: int):
    """Start recording this rank's trace for the emulator when the job asked for it (else None)."""
    if not config:
        return None
    from labkit.runtime.emulate import rank_begin

    return rank_begin(config, rank, world_size)


# --------------------------------------------------------------------------------------------------
# started by labkit.launch / labkit.Pool (through the supervisor)
# --------------------------------------------------------------------------------------------------
def _write_error(path: Path, rank: int, exc: BaseException, where: str) -> None:
    if isinstance(exc, SystemExit):
        exc = RuntimeError(f"rank {rank} called sys.exit({exc.code!r}) in {where} instead of returning")
    _atomic_write(path / f"error_{rank}.json", json.dumps(_error_record(rank, exc, where)).encode())


def _enter_caller_path(spec: dict) -> None:
    """The caller's sys.path (the working directory already removed, safepath.py) and working directory."""
    for p in reversed(spec["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        os.chdir(spec["cwd"])
    except (OSError, KeyError):
        pass


def _job_lines():
    """The job lines from the launcher, on a private copy of stdin; fd 0 becomes /dev/null, so a rank function
    that reads stdin (``input()``) gets EOF instead of eating the next job."""
    fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return os.fdopen(fd, "r")


def rank_main(argv: list[str]) -> int:
    run, rank = Path(argv[0]), int(argv[1])
    spec = json.loads((run / "spec.json").read_text())
    _set_parent_death_signal(int(os.environ.get("LABKIT_SUPERVISOR_PID") or 0))
    stack_file = open(run / f"stack_{rank}.txt", "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    jobs = _job_lines()
    _enter_caller_path(spec)
    world_size, backend, timeout_s = spec["world_size"], spec["backend"], spec["timeout_s"]
    where = "importing torch"
    try:
        import torch

        torch.set_num_threads(spec["threads"])
        where = "rendezvous"
        store = _rendezvous(run, rank, world_size, timeout_s)
        _init_group(backend, rank, world_size, rank, timeout_s, store=store)
        baseline = None
        if spec.get("warm"):  # a pool rank: warm up and take the state every run starts from (reset.py)
            where = "preparing the warm rank"
            from labkit.runtime.reset import Baseline

            baseline = Baseline(spec["threads"])
        (run / f"ready_{rank}").touch()
    except BaseException as e:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        _write_error(run, rank, e, where)
        return 1
    for line in jobs:
        try:
            job = json.loads(line)
        except ValueError:
            continue
        if job.get("exit"):
            break
        status = _run_job(run / job["job"], rank, world_size, backend, job, baseline, spec["threads"])
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)  # the job's file is closed
        if status is not None:
            return status
    _destroy_group()
    return 0


def _group_agrees(ctx, seq: int) -> bool:
    """The post-run check of a warm rank: one all_reduce of ``[1, seq]`` must give ``[world_size,
    world_size * seq]`` on every rank (a rank left inside a collective of the run, or one that paired its
    collectives differently, breaks it)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([1, seq], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist() == [ctx.world_size, ctx.world_size * seq]


def _run_job(job_dir: Path, rank: int, world_size: int, backend: str, job: dict, baseline,
             threads: int) -> int | None:
    """One run. Returns None to wait for the next job, else this process's exit status."""
    import cloudpickle
    import torch
    import torch.distributed as dist

    where = "unpickling the shipped function"
    stack_file = open(job_dir / f"stack_{rank}.txt", "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        torch.set_num_threads(int(job.get("threads") or threads))
        ctx = _make_context(rank, world_size, rank, world_size, 0, backend)
        payload = cloudpickle.loads((job_dir / "payload.pkl").read_bytes())
        where = "the rank function"
        (job_dir / f"started_{rank}").touch()  # lets the launcher tell a slow start-up from a hang
        tracer = _emulate_begin(job.get("emulate"), rank, world_size)  # launch(..., emulate=...) only
        try:
            result = payload["fn"](ctx, *payload["args"], **payload["kwargs"])
        finally:
            trace = tracer.stop() if tracer is not None else None
        where = "pickling the result"
        blob = _package(ctx, result, trace)
        _atomic_write(job_dir / f"result_{rank}.pkl", blob)
        del payload, result, blob
        if job.get("last") or baseline is None:
            where = "destroying the process group"
            _finish_group(ctx)
            return 0
        where = "checking the process group after the run"
        if not dist.is_initialized():
            (job_dir / f"broken_{rank}").write_text("the run destroyed the default process group")
            return 0
        if not _group_agrees(ctx, int(job.get("seq") or 0)):
            (job_dir / f"broken_{rank}").write_text("the ranks disagree about the process group after the run")
            return 0
        del ctx
        where = "resetting the rank for the next run"
        baseline.restore()
        (job_dir / f"idle_{rank}").touch()
        return None
    except BaseException as e:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        _write_error(job_dir, rank, e, where)
        return 1
    finally:
        stack_file.close()


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _rendezvous(run: Path, rank: int, world_size: int, timeout_s: float):
    """Rank 0 hosts a TCPStore on a loopback socket it bound itself (port 0: the OS picks one, so concurrent
    launches never collide; rendezvous.py says why torch must be handed the socket) and publishes the port in
    RUN_DIR; the other ranks read it and connect."""
    from labkit.runtime.rendezvous import client_store, master_store

    port_file = run / "port"
    if rank == 0:
        store, port = master_store("127.0.0.1", 0, world_size, timeout_s)
        _atomic_write(port_file, str(port).encode())
        return store
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 did not publish its store port within {timeout_s} s")
        time.sleep(0.005)
    return client_store("127.0.0.1", int(port_file.read_text()), world_size, timeout_s)


# --------------------------------------------------------------------------------------------------
# under torchrun
# --------------------------------------------------------------------------------------------------
def _torchrun_store(rank: int, world_size: int, timeout_s: float):
    """None under torchrun (its agent hosts the store); otherwise (``MASTER_ADDR``/``MASTER_PORT`` set by hand
    or by srun) a store whose server, on rank 0, listens on ``MASTER_ADDR`` only (rendezvous.py)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    from labkit.runtime.rendezvous import client_store, master_store

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        return master_store(host, port, world_size, timeout_s)[0]
    return client_store(host, port, world_size, timeout_s)


def _write_torchrun_result(out: Path, rank: int, ctx, result, allow_pickle: bool) -> str:
    """``rank<r>.pt`` (data only, results.py), or ``rank<r>.pkl`` with ``--pickle-results``. Returns the format."""
    from labkit.runtime.results import PICKLE_FORMAT, SAFE_FORMAT, dumps_safe

    record = {"result": result, "events": ctx.timeline.events, "offset_ns": ctx.timeline.offset_ns}
    try:
        blob = dumps_safe(record)
    except TypeError as e:
        if not allow_pickle:
            raise TypeError(
                f"rank {rank} returned a value of type {type(result).__name__} that is {e}: torchrun results are "
                "stored as data (torch.save, read back with weights_only=True, so reading a shared folder runs no "
                "code). Return dicts, lists, numbers, strings, tensors or NumPy arrays, or pass --pickle-results "
                "(then read with load_results(DIR, allow_pickle=True), only for folders you trust)") from None
        _atomic_write(out / f"rank{rank}.pkl", _package(ctx, result))
        return PICKLE_FORMAT
    _atomic_write(out / f"rank{rank}.pt", blob)
    return SAFE_FORMAT


def torchrun_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m labkit.runtime.worker",
                                 description="Run a labkit rank function under torchrun.")
    ap.add_argument("function", help="MODULE:FUNCTION, called as fn(ctx, **kwargs)")
    ap.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments")
    ap.add_argument("--out", default=None, help="folder for rank<r>.pt results (default runs/torchrun-<stamp>)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout in seconds")
    ap.add_argument("--pickle-results", action="store_true",
                    help="allow results that are not plain data (DataFrames, your classes): stored with pickle, "
                         "read with load_results(DIR, allow_pickle=True) — only for folders you trust")
    args = ap.parse_args(argv)
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        print(f"labkit.runtime.worker: not under torchrun (missing {', '.join(missing)}); use labkit.launch() "
              "or `torchrun --nproc-per-node N -m labkit.runtime.worker MODULE:FUNCTION`", file=sys.stderr)
        return 2
    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError(f"--kwargs must be a JSON object like '{{\"steps\": 2}}', got {args.kwargs!r}")
        fn = resolve_function(args.function)
    except ValueError as e:
        hint = ""
        if "cannot import module" in str(e):
            hint = ("; the working directory is not on the ranks' path (a planted file there must not run): put "
                    "your module's folder on PYTHONPATH, e.g. PYTHONPATH=$PWD torchrun ...")
        print(f"labkit.runtime.worker: {e}{hint}", file=sys.stderr)
        return 2
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    node_rank = int(os.environ.get("GROUP_RANK", 0))
    n_nodes = max(1, world_size // max(1, local_world_size))
    out = Path(args.out) if args.out else None
    import torch

    from labkit.runtime.rank import cpu_threads_per_rank, estimate_clock_offsets

    if n_nodes == 1:  # one host: the backends need nothing beyond loopback (rendezvous.py)
        from labkit.runtime.rendezvous import loopback_interface

        lo = loopback_interface()
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if lo and var not in os.environ:
                os.environ[var] = lo
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > local_rank else "gloo"
    if backend == "gloo":
        torch.set_num_threads(cpu_threads_per_rank(local_world_size))
    _init_group(backend, rank, world_size, local_rank, args.timeout_s,
                store=_torchrun_store(rank, world_size, args.timeout_s))
    ctx = _make_context(rank, world_size, local_rank, local_world_size, node_rank, backend)
    if n_nodes > 1 or os.environ.get("LABKIT_CLOCK_SYNC") == "1":
        ctx.clock_offset_ns = estimate_clock_offsets(ctx)
        ctx.timeline.offset_ns = ctx.clock_offset_ns
    if out is None:
        import torch.distributed as dist

        from labkit.paths import runs_dir

        stamp = [datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")]
        dist.broadcast_object_list(stamp, src=0)
        out = runs_dir() / f"torchrun-{stamp[0]}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = fn(ctx, **kwargs)
        fmt = _write_torchrun_result(out, rank, ctx, result, args.pickle_results)
    except BaseException as e:
        rec = _error_record(rank, e, "the rank function")
        _atomic_write(out / f"error_{rank}.json", json.dumps(rec).encode())
        print(f"[rank {rank}] failed:\n{rec['traceback']}", file=sys.stderr, flush=True)
        raise
    if rank == 0:
        meta = {"world_size": world_size, "backend": backend, "function": args.function, "kwargs": kwargs,
                "n_nodes": n_nodes, "host": socket.gethostname(), "format": fmt}
        _atomic_write(out / "meta.json", json.dumps(meta).encode())
        print(f"labkit.runtime.worker: results of {world_size} ranks in {out}", flush=True)
    _finish_group(ctx)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return torchrun_main(argv)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: never let a stuck non-daemon thread or a collective destructor keep a finished rank alive
    os._exit(code)
