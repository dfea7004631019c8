"""The code that runs inside each rank process.

Two entries:

* ``python -m labkit.runtime.worker --spawned RUN_DIR RANK`` — started by :func:`labkit.runtime.launcher.launch`
  (one fresh
  interpreter per rank: the spawn start method). Reads the shipped function from RUN_DIR, writes its result
  or its error back there.
* ``torchrun ... -m labkit.runtime.worker MODULE:FUNCTION [--kwargs JSON] [--out DIR]`` — the same rank functions
  under torchrun (single- or multi-node). Each rank writes ``DIR/rank<r>.pkl``;
  :func:`labkit.runtime.launcher.load_results` reads them back as a LaunchResult.

In both, ``fn(ctx, *args, **kwargs)`` runs between ``init_process_group`` and ``destroy_process_group``.
"""

from __future__ import annotations

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
    """Ask Linux to SIGKILL this process when its parent dies (no orphans if the kernel is killed)."""
    if sys.platform != "linux":
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        return
    if os.getppid() != parent_pid:  # parent already gone before prctl took effect
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
    """Start recording this rank's trace for the emulator when the launch asked for it (else None)."""
    if not config:
        return None
    from labkit.runtime.emulate import rank_begin

    return rank_begin(config, rank, world_size)


# --------------------------------------------------------------------------------------------------
# spawned by labkit.launch
# --------------------------------------------------------------------------------------------------
def spawned_main(run_dir: str, rank: int) -> int:
    run = Path(run_dir)
    spec = json.loads((run / "spec.json").read_text())
    _set_parent_death_signal(spec["parent_pid"])
    stack_file = open(run / f"stack_{rank}.txt", "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    for p in reversed(spec["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    world_size, backend, timeout_s = spec["world_size"], spec["backend"], spec["timeout_s"]
    where = "importing torch"
    ctx = None
    try:
        import cloudpickle
        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec["threads"])
        where = "rendezvous"
        store = _rendezvous(run, rank, world_size, timeout_s)
        _init_group(backend, rank, world_size, rank, timeout_s, store=store)
        ctx = _make_context(rank, world_size, rank, world_size, 0, backend)
        where = "unpickling the shipped function"
        payload = cloudpickle.loads((run / "payload.pkl").read_bytes())
        where = "the rank function"
        (run / f"started_{rank}").touch()  # lets the launcher tell a slow start-up from a hang
        tracer = _emulate_begin(spec.get("emulate"), rank, world_size)  # launch(..., emulate=...) only
        try:
            result = payload["fn"](ctx, *payload["args"], **payload["kwargs"])
        finally:
            trace = tracer.stop() if tracer is not None else None
        where = "pickling the result"
        blob = _package(ctx, result, trace)
        _atomic_write(run / f"result_{rank}.pkl", blob)
        where = "destroying the process group"
        _finish_group(ctx)
        del dist
        return 0
    except SystemExit as e:
        err = RuntimeError(f"rank {rank} called sys.exit({e.code!r}) in {where} instead of returning")
        _atomic_write(run / f"error_{rank}.json", json.dumps(_error_record(rank, err, where)).encode())
        return 1
    except BaseException as e:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        _atomic_write(run / f"error_{rank}.json", json.dumps(_error_record(rank, e, where)).encode())
        return 1


def _rendezvous(run: Path, rank: int, world_size: int, timeout_s: float):
    """Rank 0 hosts a TCPStore on a free port (port 0: the OS picks one, so concurrent launches never
    collide) and publishes the port in RUN_DIR; the other ranks read it and connect."""
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout_s)
    port_file = run / "port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=td, wait_for_workers=False)
        _atomic_write(port_file, str(store.port).encode())
        return store
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 did not publish its store port within {timeout_s} s")
        time.sleep(0.005)
    return dist.TCPStore("127.0.0.1", int(port_file.read_text()), world_size, False, timeout=td)


# --------------------------------------------------------------------------------------------------
# under torchrun
# --------------------------------------------------------------------------------------------------
def torchrun_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m labkit.runtime.worker",
                                 description="Run a labkit rank function under torchrun.")
    ap.add_argument("function", help="MODULE:FUNCTION, called as fn(ctx, **kwargs)")
    ap.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments")
    ap.add_argument("--out", default=None, help="folder for rank<r>.pkl results (default runs/torchrun-<stamp>)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout in seconds")
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
        print(f"labkit.runtime.worker: {e}", file=sys.stderr)
        return 2
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    node_rank = int(os.environ.get("GROUP_RANK", 0))
    n_nodes = max(1, world_size // max(1, local_world_size))
    out = Path(args.out) if args.out else None
    import torch

    from labkit.runtime.rank import cpu_threads_per_rank, estimate_clock_offsets

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > local_rank else "gloo"
    if backend == "gloo":
        torch.set_num_threads(cpu_threads_per_rank(local_world_size))
    _init_group(backend, rank, world_size, local_rank, args.timeout_s)
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
        blob = _package(ctx, result)
    except BaseException as e:
        rec = _error_record(rank, e, "the rank function")
        _atomic_write(out / f"error_{rank}.json", json.dumps(rec).encode())
        print(f"[rank {rank}] failed:\n{rec['traceback']}", file=sys.stderr, flush=True)
        raise
    _atomic_write(out / f"rank{rank}.pkl", blob)
    if rank == 0:
        meta = {"world_size": world_size, "backend": backend, "function": args.function, "kwargs": kwargs,
                "n_nodes": n_nodes, "host": socket.gethostname()}
        _atomic_write(out / "meta.json", json.dumps(meta).encode())
        print(f"labkit.runtime.worker: results of {world_size} ranks in {out}", flush=True)
    _finish_group(ctx)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--spawned"]:
        return spawned_main(argv[1], int(argv[2]))
    return torchrun_main(argv)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: never let a stuck non-daemon thread or a collective destructor keep a finished rank alive
    os._exit(code)
